"""`Layout`: how one training job is split over its processes, in one record.

The degrees (pp, dp = dp_replicate x dp_shard, ep, cp, tp), the ZeRO stage, sequence parallelism,
the pipeline schedule, gradient compression and offload: everything `plait.apply.parallelize`
needs to turn a model part into an engine, and everything the planner enumerates. What can be
derived from the degrees is derived here (the axes the batch is split over, the axis ZeRO shards
over, a pipeline's micro-batches), never stored twice.

Which features combine is a table, as data (`plait.combinations.COMBINATIONS`); `check` reads it
for a layout and the job around it (`Job`: the optimizer, the model, the parameter server, ...).
Config validation, the planner's enumeration, `plait.parallelize` and run-time guards all call
`check` (or `refusal`), and docs/compose.md's matrix is generated from the same table.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from plait.combinations import COMBINATIONS, Rule
from plait.errors import ConfigError
from plait.mesh import AXES
from plait.models.source import source_kind
from plait.pipeline.schedules import default_virtual_stages
from plait.zero import MIXED_PRECISION, STAGES
from plait.zero.sharded import OFFLOADS

ZERO_STAGES = STAGES
PRECISIONS = tuple(MIXED_PRECISION)
__all__ = ["OFFLOADS", "PRECISIONS", "ZERO_STAGES", "Job", "Layout", "check", "features", "refusal"]
EF_COMPRESSORS = ("onebit", "topk", "powersgd")  # the compressors 1-bit Adam can compress the momentum with


@dataclasses.dataclass(frozen=True)
class Layout:
    """The split of one job (see the module doc). Degrees are sizes of the mesh's axes, outermost
    first: pp, dp, ep, cp, tp; `dp_shard` > 0 splits dp into replicate x shard (hybrid sharding)."""

    pp: int = 1
    dp: int = 1
    ep: int = 1
    cp: int = 1
    tp: int = 1
    dp_shard: int = 0  # hybrid sharding: shard within groups of this many dp ranks (0: all of dp)
    zero_stage: int = 0
    sequence_parallel: bool = False
    cp_style: str = "ring"  # context parallelism's attention: "ring" or "ulysses"
    schedule: str = "1f1b"
    microbatches: int = 0  # a pipeline's micro-batches per step; 0: 2 x pp
    virtual_stages: int = 0  # stages per pipeline rank; 0: the schedule's own
    activation_checkpointing: bool = False
    mixed_precision: str = "fp32"  # ZeRO 1-3: "bf16" parameters and gradients, fp32 master
    offload: str = "none"  # ZeRO 1-3: where the optimizer state and step live
    delayed_update: bool = False  # ZeRO-Offload's one-step delayed parameter update
    offload_path: str = ""  # disk offload's directory
    compression: str = "none"  # the gradient exchange's compressor (plait.comm.compress)
    comm_target: str = "gradient"  # "momentum": 1-bit Adam compresses the momentum instead
    bucket_mb: float = 25.0

    # --- derived from the degrees -------------------------------------------------------------

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.ep * self.cp * self.tp

    @property
    def sizes(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in AXES}

    @property
    def dp_replicate(self) -> int:
        return self.dp // self.dp_shard if self.dp_shard else 1

    @property
    def hybrid(self) -> bool:
        return bool(self.dp_shard)

    @property
    def data_axes(self) -> tuple[str, ...]:
        """The axes the tokens are split over, which the gradients are averaged (or ZeRO's
        shards reduce-scattered) over: dp, ep under expert parallelism (each ep rank routes its
        own tokens) and cp under context parallelism (each cp rank holds a part of every
        sequence; the weights are replicated over cp, their gradients partial)."""
        return ("dp",) + (("ep",) if self.ep > 1 else ()) + (("cp",) if self.cp > 1 else ())

    @property
    def shard_axis(self) -> str:
        """The axis ZeRO shards over: dp, or its shard groups under hybrid sharding."""
        return "dp_shard" if self.hybrid else "dp"

    @property
    def replicate_axis(self) -> str | None:
        return "dp_replicate" if self.hybrid else None

    @property
    def pipeline_microbatches(self) -> int:
        return self.microbatches or 2 * self.pp

    @property
    def stages_per_rank(self) -> int:
        return self.virtual_stages or default_virtual_stages(self.schedule)

    @property
    def n_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def combined_axes(self) -> list[tuple[str, ...]]:
        """Every combination of two or more axes larger than one: the combined process groups a
        mesh of these degrees builds (a quantity reduced over several axes takes one collective)."""
        wide = [a for a in AXES if self.sizes[a] > 1]
        return [
            tuple(a for a in wide if mask >> wide.index(a) & 1)
            for mask in range(1, 2 ** len(wide))
            if bin(mask).count("1") >= 2
        ]

    def describe(self) -> str:
        """`pp=1 x dp=2 x ep=1 x tp=1`, the degrees as the mesh prints them."""
        return " x ".join(f"{a}={self.sizes[a]}" for a in AXES)

    def check_degrees(self, world: int | None = None) -> None:
        """Each degree a positive integer and their product the world size (when given)."""
        for name in (*AXES, "dp_shard", "zero_stage", "microbatches", "virtual_stages"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < (1 if name in AXES else 0):
                low = 1 if name in AXES else 0
                raise ConfigError(f"layout {name} must be an integer >= {low}, got {v!r}")
        if world is not None and self.world != world:
            raise ConfigError(
                f"layout {self.describe()} covers {self.world} ranks but there are {world} processes: "
                f"make pp x dp x ep x cp x tp = {world}"
            )
        if self.dp_shard and self.dp % self.dp_shard:
            raise ConfigError(f"hybrid shard {self.dp_shard} must divide dp = {self.dp}")
        assert math.prod(self.sizes.values()) == self.world

    @classmethod
    def from_config(cls, cfg) -> Layout:
        """The layout of a parsed plait configuration (`plait.train.config.Config`: its
        [parallel], [offload], [comm] and the train keys that shape the split)."""
        p, o, c, t = cfg.parallel, cfg.offload, cfg.comm, cfg.train
        return cls(
            pp=p.pp,
            dp=p.dp,
            ep=p.ep,
            cp=p.cp,
            tp=p.tp,
            cp_style=p.cp_style,
            dp_shard=p.hybrid_shard,
            zero_stage=p.zero_stage,
            sequence_parallel=p.sequence_parallel,
            schedule=p.schedule,
            microbatches=p.microbatches,
            virtual_stages=p.virtual_stages,
            activation_checkpointing=t.activation_checkpointing,
            mixed_precision="bf16" if t.bf16 and p.zero_stage > 0 else "fp32",
            offload=o.optimizer,
            delayed_update=o.delayed_update,
            offload_path=o.path,
            compression=c.compression,
            comm_target=c.target,
            bucket_mb=p.bucket_mb,
        )


@dataclasses.dataclass(frozen=True)
class Job:
    """What a job adds to its layout that the combination rules read: the optimizer, the model,
    the data and the runtime around the engines (none of them a field of `Layout`)."""

    optimizer: str = "adamw"
    experts: int = 0  # experts per MoE layer; 0: a dense model
    dropout: float = 0.0
    micro_batches: int = 1  # gradient accumulation per step (pipelines split the batch themselves)
    tokenizer: str = "bytes"
    source: str = "plait"  # model.source
    servers: int = 0  # parameter servers (plait.async_training); 0: none
    plan: str = "manual"
    api: bool = False  # plait.parallelize, the custom-loop API
    runtime: str = "spmd"  # runtime.kind: spmd, or controller (one driver program)
    eval_island: bool = False  # runtime.eval_island: evaluations on a process mesh of their own
    inner_steps: int = 0  # diloco.inner_steps: DiLoCo's H (0: off)
    outer_compression: str = "none"  # diloco.compression
    fault_tolerant: bool = False  # diloco.fault_tolerant
    overlap_steps: int = 0  # diloco.overlap_steps (Streaming DiLoCo's tau)

    @classmethod
    def from_config(cls, cfg, api: bool = False) -> Job:
        """The job of a parsed plait configuration (`plait.train.config.Config`)."""
        m = cfg.model
        return cls(
            optimizer=cfg.optim.name,
            experts=m.experts,
            dropout=m.dropout,
            micro_batches=cfg.train.micro_batches,
            tokenizer=cfg.data.tokenizer,
            source=m.source,
            servers=cfg.ps.servers,
            plan=cfg.parallel.plan,
            api=api,
            runtime=cfg.runtime.kind,
            eval_island=cfg.runtime.eval_island,
            inner_steps=cfg.diloco.inner_steps,
            outer_compression=cfg.diloco.compression,
            fault_tolerant=cfg.diloco.fault_tolerant,
            overlap_steps=cfg.diloco.overlap_steps,
        )


def features(layout: Layout, job: Job = Job()) -> frozenset[str]:
    """The names of `plait.combinations.FEATURES` that `layout` and `job` turn on."""
    on = {axis for axis in AXES if getattr(layout, axis) > 1}
    flags = {
        "sp": layout.sequence_parallel,
        "cp-ring": layout.cp > 1 and layout.cp_style == "ring",
        "zero": layout.zero_stage >= 1,
        "zero3": layout.zero_stage == 3,
        "hybrid": layout.hybrid,
        "offload": layout.offload != "none",
        "offload-disk": layout.offload == "disk",
        "delayed": layout.delayed_update,
        "compression": layout.compression != "none",
        "ef-compressor": layout.compression in EF_COMPRESSORS,
        "1-bit-adam": layout.comm_target == "momentum",
        "bf16": layout.mixed_precision == "bf16",
        "recompute": layout.activation_checkpointing,
        "grad-accum": job.micro_batches > 1,
        "adamw": job.optimizer == "adamw",
        "lamb/lars": job.optimizer in ("lamb", "lars"),
        "moe": job.experts > 0,
        "dropout": job.dropout > 0,
        "tokenizer": job.tokenizer != "bytes",
        "ps": job.servers > 0,
        "auto": job.plan == "auto",
        "api": job.api,
        "controller": job.runtime == "controller",
        "eval-island": job.eval_island,
        "diloco": job.inner_steps > 0,
        "diloco-ef": job.inner_steps > 0 and job.outer_compression in EF_COMPRESSORS,
        "diloco-ft": job.inner_steps > 0 and job.fault_tolerant,
        "diloco-overlap": job.inner_steps > 0 and job.overlap_steps > 0,
    }
    on |= {name for name, value in flags.items() if value}
    kind = source_kind(job.source)
    if kind != "plait":
        on.add(kind)
    return frozenset(on)


def refusal(layout: Layout, job: Job = Job()) -> Rule | None:
    """The first refused row of the table that applies to `layout` with `job`, or None."""
    return _first_refused(features(layout, job))


@functools.lru_cache(maxsize=4096)
def _first_refused(on: frozenset[str]) -> Rule | None:
    # cached: the planner asks for thousands of layouts, which share a few hundred feature sets
    return next((r for r in COMBINATIONS if not r.supported and r.applies(on)), None)


def check(layout: Layout, job: Job = Job()) -> None:
    """Raise the ConfigError of the first refused combination of `layout` with `job` (its message
    names the keys, says why and what to change); return when the table refuses none."""
    rule = refusal(layout, job)
    if rule is not None:
        raise ConfigError(rule.message(message_values(layout, job)))


def message_values(layout: Layout, job: Job) -> dict:
    """The values the table's message templates name (the fields of both, and the config's
    name for the hybrid shard)."""
    return dataclasses.asdict(layout) | dataclasses.asdict(job) | {"hybrid_shard": layout.dp_shard}

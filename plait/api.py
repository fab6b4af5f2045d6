"""`plait.parallelize`: plait's parallel training in a training loop the user writes (the audience
of Hugging Face Accelerate).

    engine = plait.parallelize(model, lambda params: torch.optim.AdamW(params, lr=1e-3), {"zero_stage": 3})
    for batch in batches:                              # this rank's rows (engine.shard splits a global batch)
        loss = engine.forward_backward(batch)          # the mean loss over the global batch
        engine.step()
    engine.save("ckpt")                                # DCP; loads at any number of ranks

It applies the one parallelize path of `plait.train.build` in the same order and with the same
functions (docs/compose.md): tensor parallel from the user's layout rules (`apply_tp`) ->
activation checkpointing of the user's blocks -> data parallel or ZeRO 1-3 (`plait.zero.wrap`)
-> the optimizer, built by the user's factory after wrapping. Checkpoints go through
`plait.train.checkpoint` (layout-free, so a checkpoint saved at 2 ranks loads at 1). Pipelines
and expert parallelism are not offered here (see docs/your-model.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait import comm, zero
from plait.data.batch import map_tensors, split_batch
from plait.errors import ConfigError
from plait.mesh import Mesh, backend_for, default_device, init_distributed

# The keys `mesh_or_config` may hold, with their defaults (dp = None: every rank not used by tp).
KEYS: dict[str, Any] = {
    "dp": None,
    "tp": 1,
    "zero_stage": 0,
    "hybrid_shard": 0,
    "sequence_parallel": False,
    "bucket_mb": 25.0,
    "mixed_precision": None,
    "activation_checkpointing": False,
    "pp": 1,
    "ep": 1,
    "device": None,
    "timeout_s": 300.0,
}
NOT_YET = {"pp": "pipelines", "ep": "expert parallelism"}
# What a Mesh already fixes; the other keys are `options` beside a Mesh.
SHAPE_KEYS = ("dp", "tp", "pp", "ep", "hybrid_shard", "device", "timeout_s")


def _settings(spec) -> dict:
    """The keys of a dict or of a ParallelConfig-like object, checked: unknown keys are errors
    naming the nearest valid one; pp > 1 and ep > 1 are refused (not offered by this API)."""
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        # a plait ParallelConfig: take the keys this API knows, refuse what it cannot do
        raw = {k: v for k, v in dataclasses.asdict(spec).items() if k in KEYS}
    elif isinstance(spec, Mapping):
        raw = dict(spec)
        unknown = [k for k in raw if k not in KEYS]
        if unknown:
            near = difflib.get_close_matches(unknown[0], list(KEYS), n=1, cutoff=0.5)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(
                f"parallelize: unknown key {unknown[0]!r} in mesh_or_config{hint}; "
                f"valid keys: {', '.join(KEYS)}"
            )
    else:
        raise ConfigError(
            "parallelize: mesh_or_config must be a plait Mesh, a dict (e.g. {'dp': 2, 'zero_stage': 3}) "
            f"or a ParallelConfig, not {type(spec).__name__}"
        )
    out = {**KEYS, **raw}
    for key, what in NOT_YET.items():
        if out[key] != 1:
            raise ConfigError(
                f"parallelize: {key} = {out[key]!r}: {what} are not offered by plait.parallelize yet; "
                f"use `plait train` for them, or set {key} = 1"
            )
    if out["zero_stage"] not in zero.STAGES:
        raise ConfigError(f"parallelize: zero_stage = {out['zero_stage']!r}; valid: 0, 1, 2, 3")
    for key in ("dp", "tp", "hybrid_shard"):
        v = out[key]
        if v is not None and (
            not isinstance(v, int) or isinstance(v, bool) or v < (0 if key == "hybrid_shard" else 1)
        ):
            raise ConfigError(f"parallelize: {key} must be a positive integer, got {v!r}")
    return out


def _init_group(device) -> tuple[torch.device, bool]:
    """The default process group: the launcher's (torchrun, `plait launch`) when its environment
    is set, else a group of one process (a plain `python script.py`). Returns the device and
    whether this call created the group."""
    if dist.is_initialized():
        return (torch.device(device) if device is not None else default_device()), False
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if device is None and torch.cuda.is_available():  # one GPU per local rank
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        return init_distributed(device), True
    dev = torch.device(device) if device is not None else default_device()
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group(backend_for(dev), store=dist.HashStore(), rank=0, world_size=1)
    return dev, True


class _NoState:
    """Stands for the scheduler or sampler a checkpoint holds when the loop has none."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class ParallelModel:
    """What `parallelize` returns: the model wrapped for its layout, its optimizer, and one
    training step as `forward_backward(batch)` then `step()`.

    Attributes:
        model: the module to call (wrapped: data parallel's `DataParallel`, or the user's module
            with ZeRO-3's gather hooks; under ZeRO-3 its parameters hold nothing between
            forwards, so read them with `full_parameters()`).
        unwrapped: the user's module (tensor-parallel layers replaced where a plan split them).
        optimizer: the torch optimizer the factory built (over this rank's shards from stage 1).
        scheduler: the learning-rate scheduler built by `scheduler`, or None.
        mesh: the plait Mesh (named axes, ranks, the communication ledger).
        engine: the plait engine underneath (plait.engine's contract).
        rank, world: this process's global rank and the number of processes.
        dp_rank, dp: this rank's coordinate on the data-parallel axis and its size (the batch
            is split dp ways; tp peers see the same rows).
        is_main: global rank 0 (print and write files there).
        device: the device this rank computes on.
        steps: optimizer steps taken (restored by `load`).
    """

    def __init__(self, engine, mesh, raw, *, loss_fn, grad_clip, scheduler, owns):
        self.engine = engine
        self.mesh = mesh
        self.model = engine.module
        self.unwrapped = raw
        self.optimizer = engine.optimizer
        self.scheduler = scheduler(self.optimizer) if scheduler is not None else None
        self.loss_fn = loss_fn
        self.grad_clip = grad_clip
        self.rank, self.world = mesh.global_rank, mesh.world_size
        self.dp_rank, self.dp = mesh.rank("dp"), mesh.size("dp")
        self.is_main = mesh.is_rank0
        self.steps = 0
        self.device = mesh.device
        self._owns_group, self._owns_mesh = owns

    # --- one step ---------------------------------------------------------------------------

    def shard(self, batch):
        """This rank's rows of a global batch (every rank passes the same one): dp rank r takes
        rows [r * B / dp, (r + 1) * B / dp). B must be a multiple of dp."""
        return split_batch(batch, self.dp, self.dp_rank)

    def _loss(self, batch) -> torch.Tensor:
        if self.loss_fn is not None:
            loss = self.loss_fn(self.model, batch)
        elif isinstance(batch, Mapping):
            loss = self.model(**batch)
        elif isinstance(batch, (tuple, list)):
            loss = self.model(*batch)
        else:
            loss = self.model(batch)
        if not (torch.is_tensor(loss) and loss.dim() == 0):
            shape = tuple(loss.shape) if torch.is_tensor(loss) else type(loss).__name__
            raise ConfigError(
                f"forward_backward needs a scalar loss, got {shape}: pass loss_fn(model, batch) -> the "
                "mean loss over the batch's rows to parallelize, or make the model return it"
            )
        return loss

    def forward_backward(self, batch, *, micro_batches: int = 1, average: bool = True) -> float:
        """Forward and backward of this rank's rows; gradients synchronised over dp.

        Args:
            batch: this rank's part of the global batch (a tensor, or a tuple, list or dict of
                tensors sharing their first dimension; moved to the rank's device, `device`);
                every dp rank must hold the same number
                of rows (use `shard` to cut a global batch). The loss must be the *mean* over the
                rows it is given: the engine averages gradients over dp, so the gradient is then
                exactly one process's on the global batch.
            micro_batches: cut the rows into this many equal micro-batches and accumulate their
                gradients (communication after the last one only, where the layout allows),
                each weighted by its share of the rows, so the gradient is unchanged.
            average: return the loss averaged over dp (one scalar all-reduce); False returns
                this rank's own mean loss without communicating.

        Call `step()` before the next `forward_backward`: the gradients of one step are
        synchronised once, so accumulate with `micro_batches`, not with repeated calls.

        Returns the mean loss over the global batch (with average=True) as a float.
        """
        batch = map_tensors(batch, lambda t: t.to(self.device, non_blocking=True))
        parts = (
            [batch]
            if micro_batches == 1
            else [split_batch(batch, micro_batches, i) for i in range(micro_batches)]
        )
        total = 0.0
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            with contextlib.nullcontext() if last else self.engine.no_sync():
                loss = self._loss(part)
                (loss / len(parts)).backward()
            total += float(loss.detach()) / len(parts)
        if not average:
            return total
        return comm.all_reduce_scalar(total, self.mesh, ("dp",)) / self.dp

    def step(self) -> float | None:
        """Clip the gradients' global norm to `grad_clip` (when set), take the optimizer step,
        step the scheduler, and zero the gradients. Returns the norm before clipping (None
        without clipping: `grad_norm()` computes it on request)."""
        norm = self.engine.clip_grad_norm_(self.grad_clip) if self.grad_clip else None
        self.engine.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.engine.zero_grad()
        self.steps += 1
        return norm

    def grad_norm(self) -> float:
        """The global gradient norm over every rank's shards (a collective: call on every rank)."""
        return self.engine.grad_norm()

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter, whole, on the CPU, by the user's names (a collective)."""
        return self.engine.full_parameters()

    # --- checkpoints --------------------------------------------------------------------------

    def save(self, directory: str | Path, keep: int = 2) -> Path:
        """Save model, optimizer, scheduler and step as `directory/step_N` (DCP, every rank writing
        its own shards; `latest` names it) and keep the `keep` newest; returns its path. Call on
        every rank. The checkpoint loads at any number of ranks and any ZeRO stage."""
        from plait.train.checkpoint import save_checkpoint

        sched = self.scheduler if self.scheduler is not None else _NoState()
        return save_checkpoint(directory, self.steps, self.mesh, self.engine, sched, _NoState(), keep=keep)

    def load(self, path: str | Path) -> int:
        """Restore a checkpoint written by `save` (a `step_N` directory, or the directory given
        to `save`: its `latest`), resharded to this layout; returns and restores `steps`."""
        from plait.train.checkpoint import MANIFEST, choose_checkpoint, load_checkpoint

        path = Path(path)
        if not (path / MANIFEST).exists():
            path, _ = choose_checkpoint(path)
        sched = self.scheduler if self.scheduler is not None else _NoState()
        self.steps = load_checkpoint(path, self.mesh, self.engine, sched, _NoState())
        return self.steps

    def close(self) -> None:
        """Remove the engine's hooks; stop the mesh's watchdog and destroy the process group if
        `parallelize` created them (a Mesh passed in stays open)."""
        self.engine.close()
        if self._owns_mesh:
            self.mesh.close()
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()

    def __enter__(self) -> ParallelModel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def parallelize(
    model: nn.Module,
    optimizer_factory: Callable,
    mesh_or_config: Mesh | Mapping | Any = None,
    *,
    options: Mapping | None = None,
    loss_fn: Callable | None = None,
    tp_plan: dict | None = None,
    layout_rules: dict | None = None,
    blocks: list[nn.Module] | None = None,
    param_groups: list[dict] | None = None,
    grad_clip: float = 0.0,
    scheduler: Callable | None = None,
    seed: int = 0,
) -> ParallelModel:
    """Wrap a plain PyTorch model for the layout `mesh_or_config` asks for, and build its optimizer.

    Run on every rank (under `torchrun` or `plait launch`, or as one plain process), with the
    model built identically on every rank (the same seed): tensor parallelism cuts each rank's
    slice from the whole, and data parallelism broadcasts dp rank 0's values.

    Args:
        model: the user's nn.Module, in fp32, on the CPU or the rank's device (moved to it).
        optimizer_factory: `factory(params_or_groups) -> torch.optim.Optimizer`, e.g.
            `lambda p: torch.optim.AdamW(p, lr=1e-3)`. Called once, after wrapping, with the
            tensors this rank steps (its shards from ZeRO stage 1). An optimizer already built
            is refused: it would hold the parameters wrapping replaces.
        mesh_or_config: a plait `Mesh` (its process group already initialised), or a dict or
            plait ParallelConfig with the keys: dp (default: every rank that tp leaves), tp
            (tensor-parallel degree, needs layout rules), zero_stage (0 data parallel, 1-3
            ZeRO), hybrid_shard (ZeRO within groups of this many dp ranks, replicated across),
            sequence_parallel (with tp), bucket_mb (gradient bucket size), mixed_precision
            ("bf16" from stage 1), activation_checkpointing (recompute each of `blocks`),
            device ("cpu", "cuda:0"; default the local GPU, else the CPU), timeout_s (a
            collective pending longer is reported as a hang). pp and ep must be 1. None means
            {} (data parallel over every rank). The process group is initialised from the
            launcher's environment (RANK, WORLD_SIZE, ...) when none is, or as a group of one.
        options: the keys above that a Mesh does not fix (zero_stage, sequence_parallel,
            bucket_mb, mixed_precision, activation_checkpointing), given beside a Mesh; beside
            a dict they are merged into it.
        loss_fn: `loss_fn(model, batch) -> scalar`, the mean loss over the batch's rows;
            default: the model's own output, called as model(*batch), model(**batch) or
            model(batch), which must then be that scalar.
        tp_plan: the tensor-parallel plan, {module name pattern: style} with the styles of
            `plait.tensor_parallel` (Colwise, Rowwise, ...); default the model's `tp_plan()`.
            Required (here or on the model) when tp > 1.
        layout_rules: Mesh-TensorFlow layout rules over the plan's named dims, {dim: "tp" or
            None}; default: every named dim split.
        blocks: the model's repeated blocks: ZeRO-3's units (gathered one at a time) and what
            activation checkpointing recomputes; default the model's `plait_blocks()` and any
            torch Transformer layers (otherwise ZeRO-3 gathers the whole model as one unit).
        param_groups: torch-style groups of `model`'s parameters with per-group options (e.g.
            weight decay on matrices only); default one group.
        grad_clip: clip the global gradient norm to this in `step()` (0: no clipping).
        scheduler: `scheduler(optimizer) -> LR scheduler`, stepped after each optimizer step and
            saved in checkpoints.
        seed: seeds the per-tp-rank random stream of dropouts inside split layers.
    """
    if isinstance(optimizer_factory, torch.optim.Optimizer) or not callable(optimizer_factory):
        raise ConfigError(
            "parallelize: optimizer_factory must be a callable building the optimizer from the parameters "
            "it is given, e.g. lambda params: torch.optim.AdamW(params, lr=1e-3); an optimizer built "
            "before wrapping would hold parameters that wrapping replaces"
        )
    owns_group, owns_mesh = False, not isinstance(mesh_or_config, Mesh)
    tp = mesh_or_config.size("tp") if isinstance(mesh_or_config, Mesh) else None
    if tp is None and isinstance(mesh_or_config, Mapping):
        tp = mesh_or_config.get("tp", 1)
    elif tp is None and mesh_or_config is not None:
        tp = getattr(mesh_or_config, "tp", 1)
    if tp not in (None, 1) and tp_plan is None and not callable(getattr(model, "tp_plan", None)):
        raise ConfigError(  # before any process group or mesh is made
            f"parallelize: tp = {tp} needs layout rules for {type(model).__name__}: pass "
            "tp_plan={module name pattern: Colwise() / Rowwise() ...} (plait.tensor_parallel) and "
            "optionally layout_rules, or give the model a tp_plan() method; or set tp = 1"
        )
    options = dict(options or {})
    if isinstance(mesh_or_config, Mesh):
        mesh = mesh_or_config
        fixed = [k for k in options if k in SHAPE_KEYS]
        if fixed:
            allowed = ", ".join(k for k in KEYS if k not in SHAPE_KEYS)
            raise ConfigError(
                f"parallelize: options key {fixed[0]!r} is fixed by the Mesh given; pass a dict instead "
                f"of a Mesh to choose it, or only these options: {allowed}"
            )
        sizes = {a: mesh.size(a) for a in ("dp", "tp", "pp", "ep")}
        s = _settings({**sizes, **options})
        if mesh.has_axis("dp_shard"):
            s["hybrid_shard"] = mesh.size("dp_shard")
    else:
        spec = mesh_or_config if mesh_or_config is not None else {}
        if options:  # beside a dict or ParallelConfig: merged into it
            spec = {**(_settings(spec) if dataclasses.is_dataclass(spec) else spec), **options}
        s = _settings(spec)
        device, owns_group = _init_group(s["device"])
        world = dist.get_world_size()
        tp = s["tp"]
        dp = s["dp"] if s["dp"] is not None else world // tp
        if dp * tp != world:
            raise ConfigError(
                f"parallelize: dp = {dp} x tp = {tp} is {dp * tp} ranks but the world size is {world}: "
                "set dp and tp so that their product is the number of processes"
            )
        if s["hybrid_shard"] and dp % s["hybrid_shard"]:
            raise ConfigError(f"parallelize: hybrid_shard = {s['hybrid_shard']} must divide dp = {dp}")
        s["dp"] = dp
        mesh = Mesh(dp=dp, tp=tp, device=device, timeout_s=s["timeout_s"], dp_shard=s["hybrid_shard"] or None)
    return _wrap(model, optimizer_factory, mesh, s, loss_fn, tp_plan, layout_rules, blocks,
                 param_groups, grad_clip, scheduler, seed, (owns_group, owns_mesh))  # fmt: skip


def _wrap(model, factory, mesh, s, loss_fn, tp_plan, layout_rules, blocks, groups, clip, sched, seed, owns):
    """The parallelize path of plait.train.build, in its order, for the user's model."""
    from plait.tensor_parallel import apply_tp
    from plait.train.recompute import apply_activation_checkpointing

    model.to(mesh.device)
    if s["tp"] > 1:
        apply_tp(
            model,
            mesh,
            plan=tp_plan,
            sequence_parallel=s["sequence_parallel"],
            seed=seed + 1000 * (1 + mesh.rank("dp")),  # as plait train: one dropout stream per replica
            rules=layout_rules,
        )
    elif s["sequence_parallel"] or tp_plan is not None or layout_rules is not None:
        raise ConfigError("parallelize: sequence_parallel, tp_plan and layout_rules need tp > 1")
    ids = {id(b) for b in blocks} if blocks is not None else None
    if s["activation_checkpointing"]:
        if blocks is not None:
            for m in model.modules():  # the blocks given, as recompute.py wraps its own
                if id(m) in ids:
                    apply_activation_checkpointing(m, (type(m),))
        elif apply_activation_checkpointing(model) == 0:
            raise ConfigError(
                "parallelize: activation_checkpointing needs blocks=[...] (the modules to recompute)"
            )
    policy = None
    if ids is not None:
        policy = lambda name, module: id(module) in ids  # noqa: E731
    extra = {}
    if s["zero_stage"] > 0:
        extra = dict(mixed_precision=s["mixed_precision"], hybrid_shard=s["hybrid_shard"] or None)
        if s["zero_stage"] == 3:
            extra["wrap_policy"] = policy
    elif s["mixed_precision"] not in (None, "fp32") or s["hybrid_shard"]:
        raise ConfigError("parallelize: mixed_precision and hybrid_shard need zero_stage >= 1")
    engine = zero.wrap(
        model, mesh, s["zero_stage"], factory, param_groups=groups, bucket_mb=s["bucket_mb"], **extra
    )
    return ParallelModel(engine, mesh, model, loss_fn=loss_fn, grad_clip=clip, scheduler=sched, owns=owns)

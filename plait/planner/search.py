"""The planner's search: every runnable layout of a GPT on N devices, priced and ranked.

Alpa (Zheng et al. 2022) splits planning into an inter-operator pass (pipeline stages, by the
dynamic programme of `plait.planner.stages`) and an intra-operator pass (per stage, the sharding
of each operator). plait's GPT has one kind of layer, run with one layout per mesh, so the
intra-operator choices collapse to a handful of global ones that are enumerated outright: tp, pp,
dp, ep, ZeRO stage, hybrid sharding, sequence parallelism, micro-batch size and count, the
pipeline schedule (with interleaving and Zero Bubble), recomputation and CPU offload.

The enumeration keeps what plait can run: what the combination table (`plait.layout.check`)
accepts, with `plait.train.config.validate`'s fits (heads, d_ff and layers divisible, the batch
divisible over dp x ep and the micro-batches, the schedule's constraints, pp x m x v bounded), and
prunes, saying so in `PRUNING`:

* tp: powers of two up to the GPUs of one node (Narayanan et al. 2021 §3.3: tp across nodes
  is slow; the cost model would rank it last anyway);
* micro-batch sizes: powers of two up to ``MAX_MICROBATCH``;
* sequence parallelism is always on when tp > 1 and the sequence divides (same bytes as plain
  tp, less activation memory: the variant without it is dominated in the model);
* ZB-V only up to ``MAX_ZBV_PP`` ranks (its list scheduler is slow beyond), ZB-H2 not at all;
* branch and bound: every candidate's lower bound (no bubble, one micro-batch in flight) is
  priced first; candidates are simulated in order of that bound, and the search stops when the
  bound exceeds the top-K's slowest feasible step time.

With DiLoCo (`plan(..., diloco=spec)`, `plait.planner.diloco`) every layout whose dp splits into
the spec's M groups gets a twin per H; each family (without DiLoCo, and each H) is searched on its
own, so that the best of each is known (``"families"``) even where another family fills the top K;
each DiLoCo family's best is also priced as the same layout without DiLoCo (``"as_ddp"``).
"""

from __future__ import annotations

import copy
import dataclasses
import math

from plait import layout as plait_layout
from plait.errors import ConfigError
from plait.models.gpt import GPTConfig
from plait.pipeline.schedules import default_virtual_stages
from plait.planner.cluster import Cluster
from plait.planner.cost import Candidate, evaluate
from plait.planner.diloco import DilocoSpec, variants
from plait.planner.stages import PLANNED_SCHEDULES, balanced_stages
from plait.train.checks import MAX_PIPELINE_ACTIONS
from plait.train.config import read_config, validate

MAX_MICROBATCH = 16
MAX_ZBV_PP = 16
PRUNING = (
    "tp: powers of two <= GPUs per node; micro-batch size: powers of two <= 16; sequence parallel "
    "on whenever tp > 1; ZB-V only for pp <= 16, ZB-H2 never; branch and bound on a no-bubble lower bound"
)


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _pow2_upto(n: int) -> list[int]:
    return [2**i for i in range(int(math.log2(n)) + 1)] if n >= 1 else []


def enumerate_layouts(
    cfg: GPTConfig, global_batch: int, devices: int, cluster: Cluster, dropout: float = 0.0
):
    """Every layout the search considers for `devices` devices (a generator of `Candidate`)."""
    job = plait_layout.Job(experts=cfg.experts, dropout=dropout)
    for lay in _candidates(cfg, global_batch, devices, cluster):
        if plait_layout.refusal(as_layout(lay), job) is None:
            yield lay


def as_layout(lay: Candidate) -> plait_layout.Layout:
    """The `plait.layout.Layout` a planned layout runs (`Candidate.layout`)."""
    return lay.layout


def _candidates(cfg: GPTConfig, global_batch: int, devices: int, cluster: Cluster):
    """The layouts of the search's space (module docstring), before the combination table."""
    L = cfg.n_layer
    offloads = ("none",) if cluster.cores else ("none", "cpu")  # on a CPU the host is the device
    for tp in _pow2_upto(min(cluster.gpus_per_node, devices)):
        if devices % tp or cfg.n_head % tp or cfg.ff_dim % tp:
            continue
        for cp in _context_degrees(cfg, devices, tp, cluster):
            yield from _with_cp(cfg, global_batch, devices, cluster, tp, cp, offloads, L)


def _context_degrees(cfg: GPTConfig, devices: int, tp: int, cluster: Cluster) -> list[int]:
    """Context-parallel degrees: powers of two inside a node beside tp (cp's ring passes K and V
    every layer, as tp's all-reduces do), whose 2·cp head-tail chunks split each sequence evenly
    (and, under SP, each rank's part over tp); none for a mixture of experts (refused)."""
    if cfg.experts:
        return [1]
    return [1] + [
        cp
        for cp in _pow2_upto(max(1, cluster.gpus_per_node // tp))[1:]
        if devices % (tp * cp) == 0 and cfg.seq_len % (2 * cp * tp) == 0
    ]


def _with_cp(cfg, global_batch, devices, cluster, tp, cp, offloads, L):
    """The candidates of one (tp, cp): ep, pp, dp, micro-batching, schedule, ZeRO, recompute, offload."""
    sp = tp > 1 and (cfg.seq_len // cp) % tp == 0
    eps = [e for e in _divisors(cfg.experts) if (devices // tp) % e == 0] if cfg.experts else [1]
    for ep in eps:
        for pp in _divisors(L):
            if (devices // (tp * cp * ep)) % pp:
                continue
            dp = devices // (tp * cp * ep * pp)
            if global_batch % (dp * ep):
                continue
            rows = global_batch // (dp * ep)
            for b in _pow2_upto(min(rows, MAX_MICROBATCH)):
                if rows % b:
                    continue
                m = rows // b
                for schedule, v in _schedules(pp, m, L):
                    for zero in (0, 1, 2, 3) if dp * ep * cp > 1 else (0,):
                        hybrids = [0]
                        node = cluster.gpus_per_node // (tp * ep)
                        if zero and ep == 1 and cp == 1 and 1 < node < dp and dp % node == 0:
                            hybrids.append(node)
                        for hs in hybrids:
                            for rc in (False, True):
                                for off in offloads:
                                    yield Candidate(
                                        dp=dp, tp=tp, pp=pp, ep=ep, cp=cp, zero_stage=zero, hybrid_shard=hs,
                                        sequence_parallel=sp, microbatch_size=b, microbatches=m,
                                        schedule=schedule, virtual_stages=v, recompute=rc, offload=off,
                                    )  # fmt: skip


def _schedules(pp: int, m: int, L: int):
    if pp == 1:
        yield "none", 1
        return
    for kind in PLANNED_SCHEDULES:
        v = default_virtual_stages(kind)
        if pp * m * v > MAX_PIPELINE_ACTIONS or L % (pp * v):
            continue
        if kind == "interleaved" and m % pp:
            continue
        if kind == "zb-v" and pp > MAX_ZBV_PP:
            continue
        yield kind, v


def layout_config(base, layout: Candidate, bf16: bool = True):
    """The plait `Config` that runs `layout`: `base` with the parallel keys set, and bf16 on or off
    (the cluster's precision: bf16 on accelerators, fp32 on a CPU)."""
    cfg = copy.deepcopy(base)
    p = cfg.parallel
    p.dp, p.tp, p.pp, p.ep, p.cp = layout.dp, layout.tp, layout.pp, layout.ep, layout.cp
    p.zero_stage, p.hybrid_shard, p.sequence_parallel = (
        layout.zero_stage,
        layout.hybrid_shard,
        layout.sequence_parallel,
    )
    if layout.pp > 1:
        p.schedule, p.microbatches, p.virtual_stages = (
            layout.schedule,
            layout.microbatches,
            layout.virtual_stages,
        )
        cfg.train.micro_batches = 1
    else:
        p.microbatches, p.virtual_stages = 0, 0
        cfg.train.micro_batches = layout.microbatches
    cfg.train.activation_checkpointing = layout.recompute
    cfg.train.bf16 = bf16
    p.plan, p.world = "manual", 0  # the layout is chosen
    cfg.offload.optimizer = layout.offload
    if layout.diloco:  # a plain layout leaves [diloco] as the config has it
        d = cfg.diloco
        d.inner_steps, d.replicas = layout.diloco_inner_steps, layout.diloco_replicas
        d.fragments, d.overlap_steps = layout.diloco_fragments, layout.diloco_overlap_steps
        d.compression = layout.diloco_compression
    return cfg


def load_plan_config(path=None, overrides=()):
    """The run's `Config` (TOML <- overrides) for planning: validated by plait's rules with the
    parallel keys reset to one device (the planner chooses them) and without the check that this
    machine's corpus holds a global batch (the plan is for another machine)."""
    cfg = read_config(path, overrides)
    validate(layout_config(cfg, Candidate()), data=False)
    return cfg


def check_runnable(base, layout: Candidate, bf16: bool = True) -> str:
    """'' if plait's own config validation accepts `layout` on `base`, else its message."""
    try:
        validate(layout_config(base, layout, bf16), data=False)
    except ConfigError as exc:
        return f"not runnable: {exc}"
    return ""


def plan(
    base,
    cfg: GPTConfig,
    global_batch: int,
    devices: int,
    cluster: Cluster,
    top: int = 10,
    optimizer: str = "adamw",
    infeasible: int = 5,
    bf16: bool | None = None,
    allowed=None,
    diloco: DilocoSpec | None = None,
) -> dict:
    """Rank the layouts of `cfg` on `devices` devices of `cluster`: ``{"plans": [...], ...}``, the
    `top` fastest feasible plans first (each validated by plait's config rules when `base`, a
    plait Config, is given), then up to `infeasible` rejected ones with their reasons. ``bf16``:
    the plans' precision (default the cluster's); ``allowed``: a filter of the layouts considered;
    ``diloco``: also the DiLoCo twins of the layouts, and ``"families"``, the best plan without
    DiLoCo and with each H (module docstring)."""
    dropout = base.model.dropout if base is not None else 0.0
    bf16 = cluster.precision == "bf16" if bf16 is None else bf16
    precision = "bf16" if bf16 else "fp32"
    candidates = list(enumerate_layouts(cfg, global_batch, devices, cluster, dropout))
    if allowed is not None:
        candidates = [c for c in candidates if allowed(c)]
    plain_base = base
    if diloco is not None:
        candidates += [v for c in candidates for v in variants(c, diloco, cluster)]
        if base is not None and base.diloco.inner_steps:  # the plain layouts run without DiLoCo
            plain_base = copy.deepcopy(base)
            plain_base.diloco.inner_steps = 0
    if not candidates:
        raise ConfigError(
            f"no layout of this model fits {devices} devices with train.global_batch = {global_batch}: "
            f"dp x ep must divide the batch and tp the heads ({cfg.n_head}); try a device count that is a "
            "power of two or a batch with more factors of two"
        )
    bounds = []
    rejected = []
    for lay in candidates:
        lb = evaluate(
            cfg, global_batch, lay, cluster, optimizer=optimizer, precision=precision, lower_bound=True
        )
        if lb["feasible"]:
            bounds.append((lb["step_s"], lay))
        else:
            lb["reason"] = lb["reason"].replace("needs", "needs at least", 1)
            rejected.append(lb)
    bounds.sort(key=lambda x: x[0])
    best, evaluated, families = [], 0, []

    def runnable(lay: Candidate) -> str:
        return check_runnable(base if lay.diloco else plain_base, lay, bf16) if base is not None else ""

    for h in (0, *diloco.inner_steps) if diloco is not None else (0,):
        found, n = _branch_and_bound(
            [(b, lay) for b, lay in bounds if lay.diloco_inner_steps == h],
            lambda lay: evaluate(cfg, global_batch, lay, cluster, optimizer=optimizer, precision=precision),
            runnable,
            top,
            rejected,
        )
        best, evaluated = sorted(best + found, key=_rank_key)[:top], evaluated + n
        family = {"diloco_inner_steps": h, "best": plan_summary(found[0]) if found else None}
        if h and found:  # the same layout without DiLoCo: DDP's reduction every step over all of dp
            lay = _as_candidate(found[0])
            plain_lay = dataclasses.replace(lay, diloco_inner_steps=0, diloco_replicas=0, diloco_fragments=1)
            plain_lay = dataclasses.replace(plain_lay, diloco_overlap_steps=0, diloco_compression="none")
            ddp = evaluate(cfg, global_batch, plain_lay, cluster, optimizer=optimizer, precision=precision)
            family["as_ddp"] = plan_summary(ddp)
        families.append(family)
    for r in best:  # Alpa's inter-operator DP on the listed pipelines (plait train runs the uniform cut)
        if r["pp"] > 1:
            n = r["pp"] * r["virtual_stages"]
            r["stages"] = balanced_stages(
                r["terms"]["block_s"], r["terms"]["head_s"], cfg.n_layer, n, r["microbatches"]
            )
    rejected.sort(key=lambda r: r["step_s"])
    return {
        "plans": best + rejected[:infeasible],
        "devices": devices,
        "cluster": cluster.name,
        "candidates": len(candidates),
        "simulated": evaluated,
        "rejected": len(rejected),
        "pruning": PRUNING,
    } | ({"families": families} if diloco is not None else {})


def _branch_and_bound(bounds, price, runnable, top: int, rejected: list) -> tuple[list[dict], int]:
    """The `top` fastest feasible runnable plans of `bounds` ((lower bound, layout), fastest first)
    and how many layouts were priced; infeasible and refused ones are added to `rejected`.

    Branch and bound on the lower bounds; plait's own validation (`runnable`, which builds and
    checks each pipeline schedule, seconds for a long one) runs on the final top K only. A plan it
    refuses is rejected with plait's message and the search runs again without it (rare: the
    enumeration follows the same rules)."""
    priced: dict[Candidate, dict] = {}
    refused: set[Candidate] = set()
    while True:
        best: list[dict] = []
        for lb_step, lay in bounds:
            if len(best) >= top and _sig4(lb_step) > _sig4(best[-1]["step_s"]):
                break
            if lay in refused:
                continue
            if lay not in priced:
                priced[lay] = price(lay)
                if not priced[lay]["feasible"]:
                    rejected.append(priced[lay])
            result = priced[lay]
            if result["feasible"] and (len(best) < top or _rank_key(result) < _rank_key(best[-1])):
                best.append(result)
                best.sort(key=_rank_key)
                del best[top:]
        fresh = False
        for r in best:
            lay = next(k for k, v in priced.items() if v is r)
            reason = runnable(lay)
            if reason:
                r["feasible"], r["reason"] = False, reason
                refused.add(lay)
                rejected.append(r)
                fresh = True
        if not fresh:
            return best, len(priced)


def _as_candidate(r: dict) -> Candidate:
    return Candidate(**{f.name: r[f.name] for f in dataclasses.fields(Candidate)})


def _rank_key(r: dict):
    """Fastest first; among plans equal to 4 digits, fewer micro-batches (larger GEMMs, fewer
    passes: what the model does not price) and less memory."""
    return (_sig4(r["step_s"]), r["microbatches"], r["memory_gb"])


def _sig4(x: float) -> float:
    return float(f"{x:.4g}")


def plan_summary(result: dict) -> dict:
    """The fields of each plan that the `--json` schema promises, plus the rest of the plan."""
    keep = ("layout", "dp", "tp", "pp", "ep", "cp", "zero_stage", "hybrid_shard", "sequence_parallel")
    keep += ("microbatch_size", "microbatches", "schedule", "virtual_stages", "recompute", "offload")
    keep += ("diloco_inner_steps", "diloco_replicas", "diloco_fragments", "diloco_overlap_steps")
    keep += ("diloco_compression",)
    keep += ("feasible", "reason", "step_s", "tflops_per_device", "mfu", "memory_gb", "bubble", "comm_share")
    return (
        {k: result[k] for k in keep}
        | {"terms": result["terms"]}
        | ({"stages": result["stages"]} if "stages" in result else {})
    )

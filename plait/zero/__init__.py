"""ZeRO stages 0-3 (data parallel, sharded optimizer state, gradients, parameters), hybrid
sharding, mixed precision, CPU and disk offload, tiling and the memory estimator.

    engine = plait.zero.wrap(model, mesh, stage=3, optimizer=lambda g: torch.optim.AdamW(g, lr=1e-3))
    loss = engine.module(x, y); loss.backward()
    engine.clip_grad_norm_(1.0); engine.step(); engine.zero_grad()

See docs/zero.md.
"""

from __future__ import annotations

import torch
from torch import nn

from plait.combinations import refuse
from plait.data_parallel.engine import DataParallelEngine
from plait.errors import ConfigError
from plait.flat import FlatLayout, Segment, storage_bytes
from plait.mesh import Mesh
from plait.zero.estimate import activation_bytes, estimate_memory, model_state_bytes_formula
from plait.zero.offload_disk import DiskStateOptimizer, OffloadError
from plait.zero.optimizer import ZeroOptimizer
from plait.zero.shard import ZeroStage3, default_wrap_policy
from plait.zero.sharded import OFFLOADS, OptimizerFactory, ShardedOptimizer
from plait.zero.tiling import TiledLinear

__all__ = [
    "DiskStateOptimizer",
    "OffloadError",
    "TiledLinear",
    "FlatLayout",
    "MIXED_PRECISION",
    "OFFLOADS",
    "STAGES",
    "Segment",
    "ShardedOptimizer",
    "ZeroOptimizer",
    "ZeroStage3",
    "activation_bytes",
    "default_wrap_policy",
    "estimate_memory",
    "model_state_bytes_formula",
    "storage_bytes",
    "wrap",
]

STAGES = (0, 1, 2, 3)
MIXED_PRECISION = {"fp32": torch.float32, "bf16": torch.bfloat16}


# Over 80 lines with its docstring, which is ZeRO's reference for users; the code is ~50 lines.
def wrap(
    model: nn.Module,
    mesh: Mesh,
    stage: int,
    optimizer: OptimizerFactory,
    *,
    param_groups: list[dict] | None = None,
    bucket_mb: float = 25.0,
    mixed_precision: str | None = None,
    hybrid_shard: int | None = None,
    offload: str | None = None,
    offload_path=None,
    delayed_update: bool = False,
    wrap_policy=None,
    reshard_after_forward: bool = True,
    allow_unused: bool = False,
    comm_hook=None,
    data_axes: tuple[str, ...] = ("dp",),
    trigger: str = "hook",
    names: dict[int, str] | None = None,
    norm_axes: tuple[str, ...] = (),
):
    """Shard `model` and its optimizer over the mesh's dp axis with ZeRO stage `stage`.

    Args:
        model: an nn.Module on `mesh.device`, in fp32, identical on every rank or not (dp rank
            0's values are broadcast).
        optimizer: `optimizer(param_groups) -> torch.optim.Optimizer`, called once with groups
            of the tensors this rank steps (shards from stage 1 on).
        param_groups: torch-style groups of `model`'s parameters with per-group options (for
            example `plait.optim.param_groups(model, weight_decay)`); default one group.
        bucket_mb: bucket size for stages 0-2.
        mixed_precision: "bf16" (parameters and gradients in bf16, fp32 master and optimizer
            state; stages 1-3) or None/"fp32".
        hybrid_shard: shard within groups of this many dp ranks and replicate across them;
            the mesh must be built with `Mesh(dp=..., dp_shard=hybrid_shard)`.
        offload: None/"none", "cpu" (master, optimizer state and step on the host) or "disk"
            (optimizer state in files under `offload_path`); stages 1-3.
        delayed_update: ZeRO-Offload's one-step delayed parameter update (needs offload).
        wrap_policy: stage 3 units, `policy(name, module) -> bool` (default: transformer blocks).
        reshard_after_forward: stage 3 frees gathered parameters after each unit's forward.
        comm_hook: a compressor of `plait.comm.compress` (fp32 gradients from stage 1): it
            replaces DataParallel's bucket all-reduce (stage 0) or the bucket / unit
            reduce-scatter (stages 1-3, through its `reduce_scatter`; stage 3 not with tp).
            1-bit Adam's `MomentumHook` goes here too (stages 0-2, not under expert
            parallelism), with its `OneBitAdam` from `optimizer` (plait.optim.onebit_adam).
        data_axes: the axes the batch is split over; ("dp", "ep") under expert parallelism:
            dense gradients are averaged over dp x ep, experts' over dp (their replicas), and
            from stage 1 each is sharded over those axes (a ZeRO-3 block holding both becomes
            one unit per axis).
        trigger: "hook" (the gradient exchange starts from per-parameter hooks during backward)
            or "manual" (the owner calls `grads_ready` / `finish_grads`: a pipeline, whose
            schedule knows when a stage's gradients are complete). Under "manual", ZeRO-3 keeps
            only the parameter shards between steps and gathers them once per step
            (`gather_params`), not once per unit and micro-batch.
        names: parameter id -> the name checkpoints use (a pipeline rank's part of a model under
            the whole model's names); `norm_axes`: more axes the gradient norm sums over (pp).

    Returns an engine with `module` (call it), `optimizer` (the torch optimizer, for LR
    schedulers), `step()`, `zero_grad()`, `clip_grad_norm_(max)`, `grad_norm()`, `no_sync()`,
    `memory()` (model-state bytes per rank) and `close()`.
    """
    data_axes = (data_axes[0], *(a for a in data_axes[1:] if mesh.size(a) > 1))  # ep = 1: dp alone
    precision, offload = _check_values(stage, optimizer, mixed_precision or "fp32", offload or "none")
    if stage == 0:
        return DataParallelEngine(
            model,
            mesh,
            optimizer,
            param_groups,
            names=names,
            norm_axes=norm_axes,
            trigger=trigger,
            bucket_mb=bucket_mb,
            allow_unused=allow_unused,
            comm_hook=comm_hook,
            axes=data_axes,
        )
    shard_axis, replicate_axis = _shard_axes(mesh, hybrid_shard)
    common = dict(
        param_groups=param_groups,
        shard_axis=shard_axis,
        replicate_axis=replicate_axis,
        compute_dtype=MIXED_PRECISION[precision],
        offload=offload,
        offload_path=offload_path,
        delayed_update=delayed_update,
        data_axes=data_axes,
        comm_hook=comm_hook,
    )
    if stage == 3 and trigger == "hook":
        return ZeroStage3(
            model,
            mesh,
            optimizer,
            wrap_policy=wrap_policy,
            reshard_after_forward=reshard_after_forward,
            **common,
        )
    if param_groups is not None and not isinstance(param_groups[0], dict):
        common["param_groups"] = [{"params": param_groups}]
    # stages 1-2; and stage 3 under the manual trigger (a pipeline): parameters resharded after
    # each step and gathered once per step, not once per unit and micro-batch
    engine = ZeroOptimizer(
        model,
        mesh,
        optimizer,
        stage=min(stage, 2),
        reshard_after_step=stage == 3,
        bucket_mb=bucket_mb,
        allow_unused=allow_unused,
        trigger=trigger,
        names=names,
        **common,
    )
    engine.shards.norm_axes = norm_axes
    return engine


def _check_values(stage: int, optimizer, precision: str, offload: str) -> tuple[str, str]:
    """Each argument's own range (which features combine is plait.layout's table)."""
    if stage not in STAGES:
        raise ConfigError(f"zero_stage = {stage!r} is not valid; valid: {', '.join(map(str, STAGES))}")
    if not callable(optimizer):
        raise ConfigError("optimizer must be a callable building a torch optimizer from param groups")
    if precision not in MIXED_PRECISION:
        raise ConfigError(
            f"mixed_precision = {precision!r} is not valid; valid: {', '.join(MIXED_PRECISION)}"
        )
    if offload not in OFFLOADS:
        raise ConfigError(f"offload = {offload!r} is not valid; valid: {', '.join(OFFLOADS)}")
    if stage == 0 and precision != "fp32":
        raise refuse("bf16-zero0")
    if stage == 0 and offload != "none":
        raise refuse("offload-zero0", offload=offload)
    return precision, offload


def _shard_axes(mesh: Mesh, hybrid_shard: int | None) -> tuple[str, str | None]:
    """(the axis ZeRO shards over, the axis shards are replicated over): dp, or under hybrid
    sharding the mesh's dp_shard and dp_replicate."""
    if not hybrid_shard:
        return "dp", None
    size = mesh.size("dp_shard") if mesh.has_axis("dp_shard") else None
    if size != hybrid_shard:
        raise ConfigError(
            f"hybrid_shard = {hybrid_shard} needs a mesh built with dp_shard={hybrid_shard} "
            f"(Mesh(dp={mesh.size('dp')}, dp_shard={hybrid_shard}))"
        )
    return "dp_shard", "dp_replicate"

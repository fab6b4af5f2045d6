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

from plait.engine import AccumulatingEngine, global_grad_norm
from plait.errors import ConfigError
from plait.flat import FlatLayout, Segment, storage_bytes
from plait.mesh import Mesh
from plait.placement import gather_full, norm_parts, placement
from plait.zero.estimate import activation_bytes, estimate_memory, model_state_bytes_formula
from plait.zero.offload_disk import DiskStateOptimizer, OffloadError
from plait.zero.optimizer import ZeroOptimizer
from plait.zero.shard import ZeroStage3, default_wrap_policy
from plait.zero.sharded import OFFLOADS, OptimizerFactory, ShardedOptimizer
from plait.zero.state import plain_state
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
    "Stage0",
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


class Stage0(AccumulatingEngine):
    """Stage 0: plain data parallelism (`DataParallel`) and an unsharded optimizer, behind the
    engine contract (plait.engine) as the ZeRO stages."""

    def __init__(self, module: nn.Module, mesh: Mesh, factory: OptimizerFactory, param_groups, **ddp):
        from plait.data_parallel import DataParallel

        self.module = DataParallel(module, mesh, **ddp)
        self.raw = module
        self.mesh = mesh
        self.optimizer = factory(param_groups if param_groups is not None else list(module.parameters()))

    def grad_norm(self) -> float:
        """The global gradient norm: shards (by their placements) summed over their axes,
        replicas counted once. (Gradients partial over tp were summed there by DataParallel's
        synchroniser, by their placements.)"""
        pairs = [(placement(p), p.grad) for p in self.raw.parameters() if p.grad is not None]
        every = [placement(p) for p in self.raw.parameters()]
        return global_grad_norm(self.mesh, norm_parts(pairs, self.mesh, (), every))

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale the gradients so their global norm is at most `max_norm` (torch's rule)."""
        norm = self.grad_norm()
        params = [p for p in self.raw.parameters() if p.grad is not None]
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, torch.tensor(norm), foreach=True)
        return norm

    @property
    def comm_hook(self):
        return self.module.comm_hook

    def set_lr_scale(self, scale: float) -> None:
        self.module.set_lr_scale(scale)

    def residual_buffers(self) -> dict[str, torch.Tensor] | None:
        return self.module.residual_buffers()

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def no_sync(self):
        return self.module.no_sync()

    def memory(self) -> dict:
        params = storage_bytes(list(self.raw.parameters()))
        grads = storage_bytes([b.buffer for b in self.module.buckets])
        state = [t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        optim = storage_bytes(state)
        return {"params": params, "grads": grads, "optimizer": optim, "total": params + grads + optim}

    def finish(self) -> None:
        pass

    def checkpoint_state(self) -> tuple[dict, dict]:
        return plain_state(self.raw, self.optimizer, mesh=self.mesh)

    def checkpoint_loaded(self) -> None:
        pass  # loaded in place into the parameters and optimizer state

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter, whole (tensor- and expert-parallel shards gathered by their placements)."""
        return {n: gather_full(p, self.mesh) for n, p in self.raw.named_parameters()}

    def close(self) -> None:
        self.module.remove_hooks()


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

    Returns an engine with `module` (call it), `optimizer` (the torch optimizer, for LR
    schedulers), `step()`, `zero_grad()`, `clip_grad_norm_(max)`, `grad_norm()`, `no_sync()`,
    `memory()` (model-state bytes per rank) and `close()`.
    """
    data_axes = (data_axes[0], *(a for a in data_axes[1:] if mesh.size(a) > 1))  # ep = 1: dp alone
    from plait.optim.onebit_adam import MomentumHook

    if isinstance(comm_hook, MomentumHook) and len(data_axes) > 1:
        raise ConfigError(
            f"1-bit Adam (MomentumHook) with data_axes = {data_axes} (expert parallelism) is not "
            "available: its momentum is exchanged over dp alone; compress the gradients instead"
        )
    if stage not in STAGES:
        raise ConfigError(f"zero_stage = {stage!r} is not valid; valid: {', '.join(map(str, STAGES))}")
    if not callable(optimizer):
        raise ConfigError("optimizer must be a callable building a torch optimizer from param groups")
    precision = mixed_precision or "fp32"
    if precision not in MIXED_PRECISION:
        raise ConfigError(
            f"mixed_precision = {mixed_precision!r} is not valid; valid: {', '.join(MIXED_PRECISION)}"
        )
    offload = offload or "none"
    if offload not in OFFLOADS:
        raise ConfigError(f"offload = {offload!r} is not valid; valid: {', '.join(OFFLOADS)}")
    if stage == 0:
        if precision != "fp32" or offload != "none" or hybrid_shard or delayed_update:
            raise ConfigError(
                "zero_stage = 0 (plain data parallel) takes no mixed_precision policy, offload or "
                "hybrid_shard; use zero_stage >= 1"
            )
        return Stage0(
            model,
            mesh,
            optimizer,
            param_groups,
            bucket_mb=bucket_mb,
            allow_unused=allow_unused,
            comm_hook=comm_hook,
            axes=data_axes,
        )
    shard_axis, replicate_axis = "dp", None
    if hybrid_shard and len(data_axes) > 1:
        raise ConfigError(
            f"hybrid_shard with data_axes = {data_axes} (expert parallelism) is not available: experts "
            "are sharded over their replica group dp, dense parameters over dp x ep"
        )
    if hybrid_shard:
        try:
            size = mesh.size("dp_shard")
        except Exception:
            size = None
        if size != hybrid_shard:
            raise ConfigError(
                f"hybrid_shard = {hybrid_shard} needs a mesh built with dp_shard={hybrid_shard} "
                f"(Mesh(dp={mesh.size('dp')}, dp_shard={hybrid_shard}))"
            )
        shard_axis, replicate_axis = "dp_shard", "dp_replicate"
    common = dict(
        param_groups=param_groups,
        shard_axis=shard_axis,
        replicate_axis=replicate_axis,
        compute_dtype=MIXED_PRECISION[precision],
        offload=offload,
        offload_path=offload_path,
        delayed_update=delayed_update,
        data_axes=data_axes,
    )
    if stage in (1, 2):
        engine = ZeroOptimizer(
            model,
            mesh,
            optimizer,
            stage=stage,
            bucket_mb=bucket_mb,
            allow_unused=allow_unused,
            comm_hook=comm_hook,
            **common,
        )
    else:
        engine = ZeroStage3(
            model,
            mesh,
            optimizer,
            wrap_policy=wrap_policy,
            reshard_after_forward=reshard_after_forward,
            comm_hook=comm_hook,
            **common,
        )
    return engine

"""The interface every ZeRO engine (stages 1-3) shares, on top of its `ShardedOptimizer`."""

from __future__ import annotations

import math

import torch

from plait.combinations import refuse
from plait.engine import AccumulatingEngine, ScalesResiduals
from plait.errors import ConfigError
from plait.placement import reduce_axis
from plait.zero.sharded import ShardedOptimizer
from plait.zero.state import ShardedState


class ShardedEngine(AccumulatingEngine):
    """Methods common to `ZeroOptimizer` (stages 1, 2) and `ZeroStage3` (the engine contract of
    plait.engine); subclasses set `self.shards` (the ShardedOptimizer) and `self.optimizer`."""

    shards: ShardedOptimizer
    comm_hook = None  # a compressor of plait.comm.compress in place of the reduce-scatter

    @staticmethod
    def _check_hook(comm_hook, compute_dtype: torch.dtype, stage: int) -> None:
        if comm_hook is not None and not hasattr(comm_hook, "reduce_scatter"):
            raise ConfigError(
                f"comm_hook {type(comm_hook).__name__} has no reduce_scatter(): ZeRO takes the "
                "compressors of plait.comm.compress"
            )
        if comm_hook is not None and compute_dtype != torch.float32:
            raise refuse("compression-bf16", compression=type(comm_hook).__name__, zero_stage=stage)

    def set_lr_scale(self, scale: float) -> None:
        """The coming step's learning rate over the peak, for a compressor keeping its
        error-feedback residual in units of the step (plait.engine.ScalesResiduals)."""
        if isinstance(self.comm_hook, ScalesResiduals):
            self.comm_hook.set_lr_scale(scale)

    def residual_buffers(self) -> dict[str, torch.Tensor] | None:
        """This rank's error-feedback residuals, one per gradient bucket (zeros where none yet),
        for checkpoints; None without an error-feedback compressor."""
        if not hasattr(self.comm_hook, "state_tensors"):
            return None
        return self.comm_hook.state_tensors(self.sync.buckets)

    def _init_layout(
        self,
        module,
        mesh,
        shard_axis: str,
        replicate_axis: str | None,
        compute_dtype: torch.dtype,
        offload: str,
        delayed_update: bool,
        data_axes: tuple[str, ...] = ("dp",),
    ) -> None:
        """Where the shards live: the shard axis (N ranks, this rank's index), the data-parallel
        degree (shard x replicate, or the data axes dp x ep) that gradients are averaged over,
        the host of the masters, and whether the fp32 masters are a copy (mixed precision,
        offload to another device, or the delayed update, which steps them while the model
        computes) or the parameters themselves."""
        self.module = module
        self.mesh = mesh
        self.shard_axis = shard_axis
        self.replicate_axis = replicate_axis
        self.data_axes = tuple(data_axes)
        if len(self.data_axes) > 1 and (replicate_axis or shard_axis != self.data_axes[0]):
            raise refuse("ep-hybrid", ep=mesh.size("ep"), hybrid_shard=mesh.size(shard_axis))
        self.n = mesh.size(shard_axis)
        self.rank = mesh.rank(shard_axis)
        if len(self.data_axes) > 1:
            self.dp = math.prod(mesh.size(a) for a in self.data_axes)
        else:
            self.dp = self.n * (mesh.size(replicate_axis) if replicate_axis else 1)
        self.scale = 1.0 / self.dp
        self.compute_dtype = compute_dtype
        self.host = torch.device("cpu") if offload != "none" else mesh.device
        self.master_is_separate = compute_dtype != torch.float32 or self.host != mesh.device or delayed_update

    def axis_of(self, p: torch.Tensor) -> str:
        """The axis `p` is sharded over: the shard axis, or under expert parallelism (several
        data axes) the data axes `p` is not split on, as one axis (`plait.placement.reduce_axis`):
        dense parameters over dp x ep, experts over dp, their replica group."""
        if len(self.data_axes) == 1:
            return self.shard_axis
        return reduce_axis(p, self.mesh, self.data_axes)

    def group_axes(self) -> tuple[str, ...]:
        """Every axis `axis_of` can give (whatever parameters this rank holds)."""
        if len(self.data_axes) == 1:
            return (self.shard_axis,)
        dense = reduce_axis(torch.empty(0), self.mesh, self.data_axes)  # split over no data axis
        return tuple(dict.fromkeys((dense, self.data_axes[0])))

    @staticmethod
    def replicas_of(axis: str) -> str:
        """The axis a tensor sharded over `axis` is replicated over before sharding (what rank 0
        broadcasts over at the start): hybrid sharding's whole dp for dp_shard, else the axis."""
        return "dp" if axis == "dp_shard" else axis

    def step(self) -> None:
        """One optimizer step on this rank's shards; the new parameters are then published."""
        self.shards.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.shards.zero_grad()

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip by the global norm over every shard (as torch's clip_grad_norm_); returns it."""
        return self.shards.clip_grad_norm_(max_norm)

    def grad_norm(self) -> float:
        return self.shards.grad_norm()

    def finish(self) -> None:
        """Complete a delayed (DPU) step still in flight; call before evaluating or saving."""
        self.shards.finish()

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter, whole, in fp32, keyed by name (collective over the shard axis)."""
        return self.shards.full_parameters()

    def checkpoint_state(self) -> tuple[dict, dict]:
        """(model, optim) state for DCP: this rank's shards as chunks (see plait.zero.state)."""
        self._ckpt = ShardedState(self.shards)
        return self._ckpt.state()

    def checkpoint_loaded(self) -> None:
        self._ckpt.loaded()

    def close(self) -> None:
        self.shards.close()

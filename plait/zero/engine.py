"""The interface every ZeRO engine (stages 1-3) shares, on top of its `ShardedOptimizer`."""

from __future__ import annotations

import torch

from plait.engine import AccumulatingEngine
from plait.zero.sharded import ShardedOptimizer
from plait.zero.state import ShardedState


class ShardedEngine(AccumulatingEngine):
    """Methods common to `ZeroOptimizer` (stages 1, 2) and `ZeroStage3` (the engine contract of
    plait.engine); subclasses set `self.shards` (the ShardedOptimizer) and `self.optimizer`."""

    shards: ShardedOptimizer

    def _init_layout(
        self,
        module,
        mesh,
        shard_axis: str,
        replicate_axis: str | None,
        compute_dtype: torch.dtype,
        offload: str,
        delayed_update: bool,
    ) -> None:
        """Where the shards live: the shard axis (N ranks, this rank's index), the data-parallel
        degree (shard x replicate) that gradients are averaged over, the host of the masters, and
        whether the fp32 masters are a copy (mixed precision, offload to another device, or the
        delayed update, which steps them while the model computes) or the parameters themselves."""
        self.module = module
        self.mesh = mesh
        self.shard_axis = shard_axis
        self.replicate_axis = replicate_axis
        self.n = mesh.size(shard_axis)
        self.rank = mesh.rank(shard_axis)
        self.dp = self.n * (mesh.size(replicate_axis) if replicate_axis else 1)
        self.scale = 1.0 / self.dp
        self.compute_dtype = compute_dtype
        self.host = torch.device("cpu") if offload != "none" else mesh.device
        self.master_is_separate = compute_dtype != torch.float32 or self.host != mesh.device or delayed_update

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

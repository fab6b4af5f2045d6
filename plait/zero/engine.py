"""The interface every ZeRO engine (stages 1-3) shares, on top of its `ShardedOptimizer`."""

from __future__ import annotations

import contextlib

import torch

from plait.zero.sharded import ShardedOptimizer
from plait.zero.state import ShardedState


class ShardedEngine:
    """Methods common to `ZeroOptimizer` (stages 1, 2) and `ZeroStage3`; subclasses set
    `self.shards` (the ShardedOptimizer) and `self.optimizer` (its torch optimizer)."""

    shards: ShardedOptimizer

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

    def no_sync(self):
        """Stages 2-3 synchronise every backward (their gradients live in shards)."""
        return contextlib.nullcontext()

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

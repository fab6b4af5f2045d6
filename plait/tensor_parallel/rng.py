"""Random streams for tensor parallelism (Megatron-LM §3, "random number generation").

Dropout on an activation that every tensor-parallel rank holds whole (the residual stream
without sequence parallelism) must drop the *same* elements on every rank, or the replicas
diverge: the default generator, seeded identically across the tp group, does that. Dropout on
an activation that is split across ranks (attention probabilities of each rank's own heads; any
activation sharded along the sequence) must drop *independent* elements on each rank, or the
split model is a different model from the whole one: those regions run on a second stream,
seeded per tp rank, swapped in for the duration and swapped out again.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

_SEED_OFFSET = 2718  # the parallel stream's seed = base seed + offset + tp rank


class ParallelRNG:
    """The per-tp-rank random stream of one device.

    >>> rng = ParallelRNG(seed=1234, tp_rank=mesh.rank("tp"), device=mesh.device)
    >>> with rng.fork():
    ...     y = F.dropout(x_split, 0.1)      # independent across tp ranks
    """

    def __init__(self, seed: int, tp_rank: int, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.seed = seed + _SEED_OFFSET + tp_rank
        saved = self._get()
        torch.manual_seed(self.seed) if self.device.type == "cpu" else torch.cuda.manual_seed(self.seed)
        self.state = self._get()
        self._set(saved)

    def _get(self) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    @contextlib.contextmanager
    def fork(self):
        """Run the body on this rank's parallel stream; the default stream is left untouched."""
        outer = self._get()
        self._set(self.state)
        try:
            yield
        finally:
            self.state = self._get()
            self._set(outer)

    def state_dict(self) -> dict:
        return {"seed": self.seed, "state": self.state.clone()}

    def load_state_dict(self, sd: dict) -> None:
        self.seed, self.state = int(sd["seed"]), sd["state"].clone()


def run_on_parallel_stream(module: nn.Module, rng: ParallelRNG) -> None:
    """Make `module`'s forward (a dropout, an attention core) draw from `rng`'s stream.

    The forward is wrapped on the instance, so the module tree and names are unchanged.
    Activation checkpointing restores only the default stream for its recomputation, so the
    trainer refuses dropout together with recomputation under tensor parallelism."""
    if getattr(module, "_plait_parallel_rng", None) is not None:
        return
    inner = module.forward

    def forward(*args, **kwargs):
        with rng.fork():
            return inner(*args, **kwargs)

    module.forward = forward
    module._plait_parallel_rng = rng

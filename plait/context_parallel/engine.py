"""`ContextParallelEngine`: the cp axis around any engine, so the step loop never knows about it.

Every micro-batch (training and held-out) arrives whole, as the data-parallel rank's rows; this
engine keeps its cp rank's tokens of every sequence (`SequenceSplit.take`: head-tail chunks for
the ring, contiguous ones for Ulysses) and runs the inner engine (data parallel, ZeRO, a
pipeline, with tp) on them inside `sequence_split`, where the model's `positions` and
`attention` see the split (plait.context_parallel.interface). What the loop sees is one data
rank per dp coordinate:

* the loss: the inner engine returns the sum of this rank's token losses; it is summed over cp
  here, so the value returned is the dp rank's, whatever cp is (the loop divides by the global
  token count as before: the printed and logged loss is the global one);
* the gradient: the loop's `loss_scale` is 1 / tokens per dp rank; the weights are replicated
  over cp and every cp rank's gradient is the part of the dp rank's that its tokens contribute,
  so the scale is multiplied by cp here and the gradient synchroniser averages over dp x cp
  (`Layout.data_axes` names cp: ZeRO shards over dp x cp, as FSDP does).

Everything else (the optimizer, norms, checkpoints, memory) is the inner engine's.
"""

from __future__ import annotations

import contextlib

import torch

from plait import comm
from plait.context_parallel.interface import calls, sequence_split, split_for
from plait.context_parallel.sequence import SequenceSplit
from plait.errors import ConfigError

AXIS = "cp"


class ContextParallelEngine:
    """The inner engine on this rank's part of every sequence (module docstring)."""

    def __init__(self, inner, mesh, style: str, axis: str = AXIS):
        self.inner, self.mesh, self.style, self.axis = inner, mesh, style, axis
        self.cp = mesh.size(axis)
        self._checked = False

    def __getattr__(self, name: str):
        if name == "inner":  # not yet set (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def rank(self) -> int:
        """This rank's coordinate on the cp axis."""
        return self.mesh.rank(self.axis)

    def split(self, T: int) -> SequenceSplit:
        """How sequences of `T` tokens lie over the cp ranks in this engine's style."""
        return split_for(T, self.cp, self.style)

    def share(self, split: SequenceSplit) -> float:
        """The fraction of every sequence this rank holds (1/cp when the chunks are equal)."""
        return split.local_len(self.rank) / split.T

    def take(self, t: torch.Tensor, split: SequenceSplit) -> torch.Tensor:
        """This rank's tokens of `t`, a whole (rows, T, ...) tensor."""
        return split.take(t, self.rank)

    @contextlib.contextmanager
    def attending(self, split: SequenceSplit):
        """The model holds this rank's part of `split` inside; after the first step, a model that
        never attended through plait's `attention` is refused (`_check_attends`)."""
        before = calls()
        with sequence_split(self.mesh, self.axis, self.style, split):
            yield
        self._check_attends(calls() - before)

    def summed(self, value, axes: tuple[str, ...] = (AXIS,)) -> float:
        """`value` summed over `axes`, outside the step's traffic (as the loop's own loss report is)."""
        ledger = self.mesh.ledger
        step = ledger.step
        ledger.set_step(-1)
        try:
            return comm.all_reduce_scalar(float(value), self.mesh, axes)
        finally:
            ledger.set_step(step)

    def forward_backward(self, micro_batches, loss_scale: float, autocast=None):
        split = self.split(micro_batches[0][0].shape[1])
        local = [(self.take(x, split), self.take(y, split)) for x, y in micro_batches]
        with self.attending(split):
            total = self.inner.forward_backward(local, loss_scale * self.cp, autocast)
        return torch.tensor(self.summed(total), dtype=torch.float64)

    def _check_attends(self, n: int) -> None:
        """After the first step: the model attended through plait's `attention` (a model that
        calls torch's attention itself would attend within its own part of each sequence only,
        silently another function)."""
        if self._checked:
            return
        self._checked = True
        if self.mesh.size("pp") > 1:  # a stage without attention (an embedding) counts its peers'
            n = self.summed(n, ("pp",))
        if n == 0:
            raise ConfigError(
                "parallel.cp: the model's attention never called plait.context_parallel.attention, so "
                "each rank would attend within its own part of every sequence only; call "
                "plait.context_parallel.attention (and positions) in the model "
                "(docs/context-parallel.md, 'Your own attention'), or set parallel.cp = 1"
            )

    @torch.no_grad()
    def eval_loss_sum(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        split = self.split(x.shape[1])
        with sequence_split(self.mesh, self.axis, self.style, split):
            total = self.inner.eval_loss_sum(self.take(x, split), self.take(y, split))
        return torch.tensor(self.summed(total), dtype=torch.float64)

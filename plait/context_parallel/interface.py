"""The one attention function and the one positions function a model calls, so that context
parallelism changes nothing in the model.

    from plait.context_parallel import attention, positions

    pos = positions(T, device)                     # instead of torch.arange(T)
    y = attention(q, k, v, scale=..., dropout_p=...)   # instead of scaled_dot_product_attention

Outside a context-parallel step both are what they replace: `positions` is ``arange(T)`` and
`attention` is causal scaled dot-product attention (grouped-query: k and v may have fewer heads,
each serving a consecutive group of query heads). Inside one (`ContextParallelEngine` opens it
around every forward and backward of a step, and around held-out evaluation), the model holds
only this rank's tokens of every sequence: `positions` returns their global positions (what a
position embedding or rotary angle must see) and `attention` attends over the whole sequence
with ring attention or Ulysses across the cp ranks.

The state is process-global, not a context variable: activation checkpointing recomputes a
block's forward inside backward, and on CUDA torch runs backward on threads of its own, which a
context variable set in the training thread would not reach.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from plait.context_parallel.ring import ring_attention
from plait.context_parallel.sequence import SequenceSplit
from plait.context_parallel.ulysses import sdpa_gqa, ulysses_attention
from plait.errors import ConfigError

STYLES = ("ring", "ulysses")
LAYOUT_OF = {"ring": "head-tail", "ulysses": "contiguous"}  # each style's sequence layout


@dataclasses.dataclass(frozen=True)
class Active:
    """The sequence split of the step in progress: over `axis` of `mesh`, in `style`."""

    mesh: object
    axis: str
    style: str
    split: SequenceSplit

    @property
    def rank(self) -> int:
        return self.mesh.rank(self.axis)


_ACTIVE: Active | None = None
_CALLS = 0  # attention calls under a split: a model that attends by other means is caught


def split_for(T: int, cp: int, style: str) -> SequenceSplit:
    """The split `style` uses for sequences of `T` tokens over `cp` ranks (Ulysses' all-to-all
    needs equal chunks: T must divide by cp)."""
    if style not in STYLES:
        raise ConfigError(f"parallel.cp_style = {style!r} is not valid; valid: {', '.join(STYLES)}")
    if style == "ulysses" and T % cp:
        raise ConfigError(
            f"parallel.cp_style = 'ulysses' needs sequences that divide by parallel.cp = {cp}, got {T} "
            "tokens: use a model.seq_len that is a multiple of cp, or parallel.cp_style = 'ring' "
            "(chunks of unequal length)"
        )
    return SequenceSplit(T, cp, LAYOUT_OF[style])


@contextlib.contextmanager
def sequence_split(mesh, axis: str, style: str, split: SequenceSplit):
    """Within this context the model holds rank `mesh.rank(axis)`'s tokens of `split`."""
    global _ACTIVE
    before, _ACTIVE = _ACTIVE, Active(mesh, axis, style, split)
    try:
        yield _ACTIVE
    finally:
        _ACTIVE = before


def calls() -> int:
    """How many times `attention` has run under a split (in this process)."""
    return _CALLS


def active() -> Active | None:
    """The split of the context-parallel step in progress, or None."""
    return _ACTIVE


def positions(T: int, device=None) -> torch.Tensor:
    """The global positions of the `T` tokens this rank holds of each sequence (int64)."""
    a = _ACTIVE
    if a is None:
        return torch.arange(T, device=device)
    if T != a.split.local_len(a.rank):
        raise ValueError(
            f"context parallelism: rank {a.rank} holds {a.split.local_len(a.rank)} tokens of each "
            f"sequence, but the model asked for the positions of {T}"
        )
    return a.split.positions(a.rank, device)


def attention(q, k, v, *, scale: float | None = None, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention of q (B, H, L, d) on k, v (B, H_kv, L, d), H a multiple of H_kv, over the
    whole sequence of which this rank holds L tokens (module docstring); returns (B, H, L, d)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    a = _ACTIVE
    if a is None:
        return sdpa_gqa(q, k, v, scale, dropout_p)
    global _CALLS
    _CALLS += 1
    if a.style == "ulysses":
        return ulysses_attention(q, k, v, a.mesh, a.axis, scale, dropout_p)
    if dropout_p:
        raise ConfigError(
            "parallel.cp_style = 'ring' has no attention dropout: set model.dropout = 0, or "
            "parallel.cp_style = 'ulysses'"
        )
    return ring_attention(q, k, v, a.mesh, a.axis, a.split, scale)

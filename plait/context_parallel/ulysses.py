"""DeepSpeed-Ulysses (Jacobs et al. 2023): attention over a sequence split across the `cp` ranks
of an axis, by trading the sequence split for a head split around the attention.

Each rank holds a contiguous 1/cp of the sequence (`SequenceSplit(T, cp, "contiguous")`) for all
heads. An all-to-all sends head group j of its tokens to rank j, so rank j holds the whole
sequence of heads j·H/cp ... (j+1)·H/cp − 1 (the chunks arrive in rank order: the sequence in
order); it computes ordinary causal attention on them, and a second all-to-all sends the output
back to the sequence split. Forward: four all-to-alls per layer (q, k, v and the output), each
moving (cp−1)/cp of the rank's tensor; backward four more, of their gradients. The query heads
and the key/value heads must each divide by cp (grouped-query attention: head group j of the
keys serves head group j of the queries).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plait.comm.autograd import all_to_all_along
from plait.errors import ConfigError


def check_heads(n_head: int, n_kv_head: int, cp: int) -> None:
    """Ulysses splits the heads over cp: both head counts must divide by it."""
    for key, n in (("model.n_head", n_head), ("model.n_kv_head", n_kv_head)):
        if n % cp:
            raise ConfigError(
                f"parallel.cp_style = 'ulysses' splits the attention heads over parallel.cp = {cp}, but "
                f"{key} = {n} does not divide by it: choose a cp that divides {n}, or "
                "parallel.cp_style = 'ring'"
            )


def sdpa_gqa(q, k, v, scale, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal scaled dot-product attention with each key/value head repeated for its query heads."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, dropout_p=dropout_p)


def ulysses_attention(q, k, v, mesh, axis: str, scale=None, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention of q (B, H, L, d) and k, v (B, H_kv, L, d), this rank's contiguous 1/cp
    of the sequence, over the whole sequence; returns (B, H, L, d), differentiable."""
    cp = mesh.size(axis)
    check_heads(q.shape[1], k.shape[1], cp)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    # heads split, sequence gathered: (B, H/cp, T, d)
    qh, kh, vh = (all_to_all_along(t.contiguous(), mesh, axis, 1, 2) for t in (q, k, v))
    y = sdpa_gqa(qh, kh, vh, scale, dropout_p)
    return all_to_all_along(y.contiguous(), mesh, axis, 2, 1)  # back: sequence split, all heads

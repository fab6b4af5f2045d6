"""Cross-entropy over a vocabulary split across the ranks of the "tp" axis.

Megatron-LM (Shoeybi et al. 2019, §3, "output embedding") fuses the output layer with the loss
so that the [tokens, V] logits, split by columns over t ranks, are never gathered: for token n
with target y_n and this rank's logit columns z_n,

    m_n  = max over ranks of max_j z_nj                          (all-reduce MAX)
    S_n  = Σ over ranks of Σ_j exp(z_nj - m_n)                   (all-reduce SUM)
    z_ny = the target's logit, picked by the one rank holding it  (all-reduce SUM)
    loss_n = log S_n - (z_ny - m_n)

so only O(tokens) numbers cross ranks (b·s per reduction instead of b·s·V for the logits). The
two sums travel together as one [2, tokens] all-reduce. The gradient with respect to this
rank's logits is local: softmax_nj - [j is y_n], times the incoming gradient.

The vocabulary is padded to V' (a multiple of t) so the shards are equal; the padding columns
j >= V are treated as -inf: they add nothing to S_n, cannot be the max, and get zero gradient.
Forgetting this is how a vocabulary not divisible by t once shifted Megatron users' loss.
Logits in half precision are reduced in fp32 and the loss is fp32 (like plait.models.gpt.cross_entropy);
the gradient comes back in the logits' dtype.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from plait.comm import ops
from plait.errors import ConfigError

if TYPE_CHECKING:
    from plait.mesh import Mesh

__all__ = ["vocab_parallel_cross_entropy"]

_REDUCTIONS = ("mean", "sum", "none")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, mesh, axis, vocab_size, ignore_index):
        part = logits.shape[-1]
        start = mesh.rank(axis) * part
        x = logits.reshape(-1, part).float()  # a view when the logits are contiguous fp32: read only
        tgt = target.reshape(-1)
        real = max(0, min(part, vocab_size - start))  # columns of this shard inside the vocabulary

        # Max over the real vocabulary; a shard of padding only offers -inf, which never wins.
        if real > 0:
            local_max = x[:, :real].max(dim=-1).values
        else:
            local_max = x.new_full((x.shape[0],), float("-inf"))
        global_max = ops.all_reduce(local_max.contiguous(), mesh, axis, op="max")
        exp = torch.exp(x - global_max.unsqueeze(-1))
        exp[:, real:] = 0.0  # padding columns are -inf logits: exp(-inf) = 0, whatever they hold

        ignored = tgt == ignore_index
        local = tgt - start
        mine = (local >= 0) & (local < real) & ~ignored
        local = local.masked_fill(~mine, 0)
        picked = x.gather(-1, local.unsqueeze(-1)).squeeze(-1) - global_max
        # where(), not a product: a masked pick may read a padding column holding inf or NaN.
        picked = torch.where(mine, picked, torch.zeros_like(picked))
        sums = torch.stack([exp.sum(dim=-1), picked])
        ops.all_reduce(sums, mesh, axis)
        sum_exp, target_logit = sums[0], sums[1]

        loss = torch.log(sum_exp) - target_logit
        loss = loss.masked_fill(ignored, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local, mine, ignored)
        ctx.logits_dtype = logits.dtype
        ctx.logits_shape = logits.shape
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local, mine, ignored = ctx.saved_tensors
        scale = grad_loss.reshape(-1).float().masked_fill(ignored, 0.0)
        grad = softmax * scale.unsqueeze(-1)
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local] -= scale * mine
        return grad.to(ctx.logits_dtype).view(ctx.logits_shape), None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits_shard: Tensor,
    target: Tensor,
    mesh: Mesh,
    axis: str = "tp",
    vocab_size: int | None = None,
    reduction: str = "mean",
    ignore_index: int = -100,
) -> Tensor:
    """Cross-entropy of logits split along the vocabulary over `axis` (Shoeybi et al. 2019, §3).

    Args:
        logits_shard: [..., V'/t], this rank's contiguous slice of the (padded) vocabulary:
            columns [r·V'/t, (r+1)·V'/t) for tp rank r, as a `ColumnParallelLinear` head with
            ``gather_output=False`` (or a head sharing a `VocabParallelEmbedding`'s table) gives.
        target: [...] integer class ids in [0, vocab_size), or `ignore_index`.
        vocab_size: the real vocabulary V; logit columns >= V are padding and never change the
            loss. Default: V' (no padding).
        reduction: "mean" over the targets that are not `ignore_index` (as F.cross_entropy),
            "sum", or "none" (per token, 0 where ignored).

    Returns the same value as ``F.cross_entropy`` on the gathered [..., V] logits; the logits
    are never gathered. Targets are not range-checked (that would cost a host sync): one in the
    padding range [V, V') matches no column and counts as a target logit of 0.
    """
    if reduction not in _REDUCTIONS:
        raise ConfigError(f"reduction must be one of {', '.join(_REDUCTIONS)}, got {reduction!r}")
    if logits_shard.shape[:-1] != target.shape:
        raise ConfigError(
            f"logits shard of shape {tuple(logits_shard.shape)} does not match targets of shape "
            f"{tuple(target.shape)}: expected logits [..., vocab shard] and targets [...]"
        )
    padded = logits_shard.shape[-1] * mesh.size(axis)
    vocab_size = padded if vocab_size is None else vocab_size
    if not 0 < vocab_size <= padded:
        raise ConfigError(
            f"vocab_size={vocab_size} does not fit {mesh.size(axis)} shards of "
            f"{logits_shard.shape[-1]} columns (padded vocabulary {padded})"
        )
    loss = _VocabParallelCrossEntropy.apply(logits_shard, target, mesh, axis, vocab_size, ignore_index)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (target != ignore_index).sum()

"""Differentiable communication over one mesh axis (default "tp").

Tensor parallelism needs collectives that sit inside the autograd graph: what a layer does to
its activations in forward, the matching collective must do to their gradients in backward.
Megatron-LM (Shoeybi et al. 2019, §3, Fig. 3) names the two basic ones

    f  (`copy_to_parallel`):     identity forward,  all-reduce (sum) backward
    g  (`reduce_from_parallel`): all-reduce forward, identity backward

and sequence parallelism (Korthikanti et al. 2022, §4.2.2, Fig. 5) replaces them, around the
LayerNorm and dropout regions that are split along the sequence, by

    g-bar (`reduce_scatter_to_sequence`): reduce-scatter forward, all-gather backward
    g     (`gather_from_sequence`):       all-gather forward,     reduce-scatter backward

(an all-reduce is a reduce-scatter followed by an all-gather, so the volume is unchanged).
`scatter_to_parallel` / `gather_from_parallel` split and reassemble a replicated tensor along a
dim, and `all_to_all_along` is the differentiable all-to-all of expert parallelism (GShard).

Every collective goes through `plait.comm` with the mesh and axis, so the ledger sees forward
and backward traffic alike. Over an axis of size 1 each function returns its input unchanged.
plait.comm gathers and scatters along dim 0 of contiguous tensors; another dim is moved to the
front (``movedim`` + ``contiguous``) and back. Gradients arriving in backward may be
non-contiguous or shared with other graph branches, so they are copied before in-place use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from plait.comm import ops
from plait.errors import ConfigError

if TYPE_CHECKING:
    from plait.mesh import Mesh

__all__ = [
    "all_to_all_along",
    "copy_to_parallel",
    "gather_from_parallel",
    "gather_from_sequence",
    "reduce_from_parallel",
    "reduce_scatter_to_sequence",
    "scatter_to_parallel",
]


# --- plain (non-differentiable) building blocks ---------------------------------------------------


def _check_divisible(x: Tensor, dim: int, n: int, what: str, axis: str) -> None:
    if x.shape[dim] % n:
        raise ConfigError(
            f"{what}: dim {dim} of a tensor of shape {tuple(x.shape)} has size {x.shape[dim]}, "
            f"not divisible by the {n} ranks of axis '{axis}'; make it a multiple of {n}"
        )


def _all_reduce(x: Tensor, mesh: Mesh, axis: str) -> Tensor:
    """Sum over the axis into a fresh contiguous tensor (never in place on the caller's tensor)."""
    out = x.clone(memory_format=torch.contiguous_format)
    return ops.all_reduce(out, mesh, axis)


def _all_gather(x: Tensor, mesh: Mesh, axis: str, dim: int) -> Tensor:
    """Concatenate every rank's `x` along `dim`, in axis order."""
    n = mesh.size(axis)
    front = x.movedim(dim, 0).contiguous()
    out = torch.empty((n * front.shape[0], *front.shape[1:]), dtype=x.dtype, device=x.device)
    ops.all_gather(out, front, mesh, axis)
    return out.movedim(0, dim)


def _reduce_scatter(x: Tensor, mesh: Mesh, axis: str, dim: int, what: str) -> Tensor:
    """Sum `x` over the axis and keep this rank's 1/n slice along `dim`."""
    n = mesh.size(axis)
    _check_divisible(x, dim, n, what, axis)
    front = x.movedim(dim, 0).contiguous()
    out = torch.empty((front.shape[0] // n, *front.shape[1:]), dtype=x.dtype, device=x.device)
    ops.reduce_scatter(out, front, mesh, axis)
    return out.movedim(0, dim)


def _split(x: Tensor, mesh: Mesh, axis: str, dim: int, what: str) -> Tensor:
    """This rank's 1/n slice of `x` along `dim` (a contiguous copy, so it owns its storage)."""
    n = mesh.size(axis)
    _check_divisible(x, dim, n, what, axis)
    size = x.shape[dim] // n
    return x.narrow(dim, mesh.rank(axis) * size, size).contiguous()


def _all_to_all(x: Tensor, mesh: Mesh, axis: str, split_dim: int, concat_dim: int) -> Tensor:
    """Send slice j of `x` along `split_dim` to rank j; concatenate what arrives along `concat_dim`.

    The send buffer is `x` as [n, slice...]: `split_dim` cut into (n, size/n) and the n moved to
    the front, which is a view of a contiguous `x` when `split_dim` is 0. What arrives is
    [n, slice...] too (block i from rank i); moving its n next to `concat_dim` and merging the two
    is the concatenation, again a view when `concat_dim` is 0. So an exchange copies at most once
    on each side, and not at all on a side whose dim is 0 (the expert dispatch receives into, and
    the combine sends from, [E_local, n·G·C, d], and so copies once each way, not twice)."""
    n = mesh.size(axis)
    _check_divisible(x, split_dim, n, "all_to_all_along", axis)
    send = x.unflatten(split_dim, (n, x.shape[split_dim] // n)).movedim(split_dim, 0).contiguous()
    out = torch.empty_like(send)
    ops.all_to_all(out, send, mesh, axis)
    return out.movedim(0, concat_dim).flatten(concat_dim, concat_dim + 1)


def _dim(x: Tensor, dim: int) -> int:
    if not -x.dim() <= dim < x.dim():
        raise ConfigError(f"dim {dim} is out of range for a tensor of {x.dim()} dims")
    return dim % x.dim()


# --- autograd functions -------------------------------------------------------------------------


class _CopyToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh, axis):
        ctx.mesh, ctx.axis = mesh, axis
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.mesh, ctx.axis), None, None


class _ReduceFromParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh, axis):
        return _all_reduce(x, mesh, axis)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _ScatterToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh, axis, dim):
        ctx.mesh, ctx.axis, ctx.dim = mesh, axis, dim
        return _split(x, mesh, axis, dim, "scatter_to_parallel")

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.mesh, ctx.axis, ctx.dim), None, None, None


class _GatherFromParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh, axis, dim):
        ctx.mesh, ctx.axis, ctx.dim = mesh, axis, dim
        return _all_gather(x, mesh, axis, dim)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.mesh, ctx.axis, ctx.dim, "gather_from_parallel (backward)"), None, None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh, axis, dim):
        ctx.mesh, ctx.axis, ctx.dim = mesh, axis, dim
        return _reduce_scatter(x, mesh, axis, dim, "reduce_scatter_to_sequence")

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.mesh, ctx.axis, ctx.dim), None, None, None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh, axis, dim):
        ctx.mesh, ctx.axis, ctx.dim = mesh, axis, dim
        return _all_gather(x, mesh, axis, dim)

    @staticmethod
    def backward(ctx, grad):
        what = "gather_from_sequence (backward)"
        return _reduce_scatter(grad, ctx.mesh, ctx.axis, ctx.dim, what), None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh, axis, split_dim, concat_dim):
        ctx.mesh, ctx.axis, ctx.split_dim, ctx.concat_dim = mesh, axis, split_dim, concat_dim
        return _all_to_all(x, mesh, axis, split_dim, concat_dim)

    @staticmethod
    def backward(ctx, grad):
        # The inverse exchange: split along the dim forward concatenated, concatenate along the
        # dim forward split; block i of our gradient goes back to rank i.
        return _all_to_all(grad, ctx.mesh, ctx.axis, ctx.concat_dim, ctx.split_dim), None, None, None, None


# --- public API -----------------------------------------------------------------------------------


def copy_to_parallel(x: Tensor, mesh: Mesh, axis: str = "tp") -> Tensor:
    """Megatron-LM's `f` (Shoeybi et al. 2019, §3, Fig. 3a): enter a tensor-parallel region.

    Forward: the identity (x is replicated over the axis). Backward: all-reduce (sum) of the
    gradient, since every rank's shard of the following layer contributed a partial gradient."""
    if mesh.size(axis) == 1:
        return x
    return _CopyToParallel.apply(x, mesh, axis)


def reduce_from_parallel(x: Tensor, mesh: Mesh, axis: str = "tp") -> Tensor:
    """Megatron-LM's `g` (Shoeybi et al. 2019, §3, Fig. 3a): leave a tensor-parallel region.

    Forward: all-reduce (sum) of the partial results of every rank. Backward: the identity."""
    if mesh.size(axis) == 1:
        return x
    return _ReduceFromParallel.apply(x, mesh, axis)


def scatter_to_parallel(x: Tensor, mesh: Mesh, axis: str = "tp", dim: int = -1) -> Tensor:
    """Keep this rank's slice of a replicated `x` along `dim` (equal slices; the size must be
    divisible by the axis size). Backward: all-gather of the gradient slices along `dim`.

    Used before a row-parallel linear layer whose input is not yet split (Shoeybi et al. 2019, §3)."""
    if mesh.size(axis) == 1:
        return x
    return _ScatterToParallel.apply(x, mesh, axis, _dim(x, dim))


def gather_from_parallel(x: Tensor, mesh: Mesh, axis: str = "tp", dim: int = -1) -> Tensor:
    """All-gather every rank's slice along `dim` into the full, replicated tensor. Backward: keep
    this rank's slice of the (replicated) gradient.

    Used after a column-parallel linear layer whose output must be whole (Shoeybi et al. 2019, §3)."""
    if mesh.size(axis) == 1:
        return x
    return _GatherFromParallel.apply(x, mesh, axis, _dim(x, dim))


def reduce_scatter_to_sequence(x: Tensor, mesh: Mesh, axis: str = "tp", dim: int = 0) -> Tensor:
    """Sequence parallelism's `g-bar` (Korthikanti et al. 2022, §4.2.2): sum the partial results
    of every rank and keep this rank's slice of the sequence along `dim`. Backward: all-gather
    of the gradient slices along `dim`."""
    if mesh.size(axis) == 1:
        return x
    return _ReduceScatterToSequence.apply(x, mesh, axis, _dim(x, dim))


def gather_from_sequence(x: Tensor, mesh: Mesh, axis: str = "tp", dim: int = 0) -> Tensor:
    """Sequence parallelism's `g` (Korthikanti et al. 2022, §4.2.2): all-gather the sequence
    slices along `dim` before a tensor-parallel region. Backward: reduce-scatter along `dim`,
    since each rank's shard of the following layer produced a partial gradient of the whole
    sequence."""
    if mesh.size(axis) == 1:
        return x
    return _GatherFromSequence.apply(x, mesh, axis, _dim(x, dim))


def all_to_all_along(x: Tensor, mesh: Mesh, axis: str, split_dim: int, concat_dim: int) -> Tensor:
    """Differentiable all-to-all (GShard, Lepikhin et al. 2020, §2.2, expert dispatch/combine).

    Forward: `x` is cut into n equal slices along `split_dim`; slice j goes to rank j, and the n
    slices a rank receives are concatenated along `concat_dim` in rank order. Backward: the
    inverse exchange (split along `concat_dim`, concatenate along `split_dim`)."""
    if mesh.size(axis) == 1:
        return x
    return _AllToAll.apply(x, mesh, axis, _dim(x, split_dim), _dim(x, concat_dim))

"""Placements: one record per parameter saying how it lies on the mesh's model axes.

A parameter is, along each mesh axis, *sharded* (this rank holds a slice along one tensor dim),
*replicated* (every rank of the axis holds the same values), or has a *partial* gradient (the
values are replicated, but each rank's gradient is only its part of the sum: a LayerNorm applied
to a sequence shard under sequence parallelism). The batch axes (dp, and dp_shard/dp_replicate
under hybrid sharding) are not recorded: every engine averages every gradient over them.

Everything that must know where a parameter lives reads its placement and nothing else:

* gradient synchronisation sums a gradient over its `grad_partial` axes, besides the batch axes;
* the global gradient norm sums squares over the `sharded` axes (a replica is counted once);
* checkpoints save a sharded parameter as chunks of the whole canonical tensor
  (`canonical_chunks`), so any layout can read what any other wrote;
* `gather_full` rebuilds the whole tensor for export and parity tests.

Tensor parallelism (`plait.tensor_parallel`) writes the placements when it splits a model;
a parameter without a record is replicated on every axis.
"""

from __future__ import annotations

import dataclasses

import torch

from plait import comm

ATTR = "_plait_placement"


@dataclasses.dataclass(frozen=True)
class Shard:
    """Split along tensor dim `dim`. `fused` blocks lie end to end along it (GPT's [q | k | v]):
    each rank holds its slice of every block. `full` is the canonical (unpadded) length of the
    dim, when the split padded it (a vocabulary padded to a multiple of tp)."""

    dim: int
    fused: int = 1
    full: int | None = None


@dataclasses.dataclass(frozen=True)
class Placement:
    """Per model axis: `sharded[axis]` a Shard; `grad_partial` the axes whose gradient is a sum of
    per-rank parts; every other axis replicated."""

    sharded: tuple[tuple[str, Shard], ...] = ()
    grad_partial: tuple[str, ...] = ()

    def shard(self, axis: str) -> Shard | None:
        return dict(self.sharded).get(axis)

    @property
    def sharded_axes(self) -> tuple[str, ...]:
        return tuple(sorted(a for a, _ in self.sharded))


REPLICATED = Placement()

MODEL_AXES = ("tp", "ep")  # the axes a parameter can be split over (tensor, expert parallelism)


def split_axis(pl: Placement, mesh=None) -> str | None:
    """The model axis `pl` splits its tensor over (of size > 1 when `mesh` is given), or None.
    plait splits a tensor over one model axis at most: experts over ep, layers over tp."""
    axes = [a for a, _ in pl.sharded if mesh is None or mesh.size(a) > 1]
    if len(axes) > 1:
        raise ValueError(f"a parameter split over several model axes {axes} is not supported")
    return axes[0] if axes else None


def placement(p: torch.Tensor) -> Placement:
    """The placement of parameter `p` (replicated when it has none)."""
    return getattr(p, ATTR, REPLICATED)


def set_shard(p: torch.Tensor, axis: str, shard: Shard) -> None:
    """Record that `p` is this rank's slice of a tensor split over `axis` as `shard`."""
    pl = placement(p)
    sharded = tuple((a, s) for a, s in pl.sharded if a != axis) + ((axis, shard),)
    setattr(p, ATTR, dataclasses.replace(pl, sharded=sharded))


def update_shard(p: torch.Tensor, axis: str, **changes) -> None:
    """Change fields of `p`'s Shard along `axis` (e.g. its canonical length)."""
    set_shard(p, axis, dataclasses.replace(placement(p).shard(axis), **changes))


def set_grad_partial(p: torch.Tensor, axis: str) -> None:
    """Record that `p`'s gradient over `axis` is a sum of per-rank parts."""
    pl = placement(p)
    if axis not in pl.grad_partial:
        setattr(p, ATTR, dataclasses.replace(pl, grad_partial=(*pl.grad_partial, axis)))


def copy_placement(src: torch.Tensor, dst: torch.Tensor) -> None:
    if hasattr(src, ATTR):
        setattr(dst, ATTR, getattr(src, ATTR))


def _fused_order(out: int, fused: int, t: int) -> torch.Tensor:
    """Row order putting each rank's slice of every fused block together."""
    block, per = out // fused, out // fused // t
    return torch.tensor([j * block + r * per + i for r in range(t) for j in range(fused) for i in range(per)])


def chunk_map(pl: Placement, local_shape, mesh, axis: str = "tp") -> tuple[torch.Size, list]:
    """Where a rank's local tensor of `local_shape` with placement `pl` sits in the whole tensor.

    Returns (full shape, [(dim, local start, global start, length), ...]) along the shard dim;
    a tensor not sharded over `axis` is one run covering it."""
    s = pl.shard(axis)
    local_shape = torch.Size(local_shape)
    if s is None or mesh.size(axis) == 1:
        n = local_shape[0] if len(local_shape) else 1
        return local_shape, [(0, 0, 0, n)]
    t, r = mesh.size(axis), mesh.rank(axis)
    local = local_shape[s.dim]
    full = s.full if s.full is not None else local * t
    per = local // s.fused  # rows of each block on this rank
    block = full // s.fused
    runs = []
    for j in range(s.fused):
        start = j * block + r * per
        end = (j + 1) * block if s.fused > 1 else full
        length = min(per, max(0, end - start))
        if length > 0:
            runs.append((s.dim, j * per, start, length))
    shape = list(local_shape)
    shape[s.dim] = full
    return torch.Size(shape), runs


def canonical_chunks(p: torch.Tensor, mesh, axis: str = "tp", pl: Placement | None = None):
    """(full shape, [(offsets, local view), ...]): where this rank's shard `p` sits in the whole
    (canonical, unpadded) tensor; a replicated tensor is one chunk at 0."""
    pl = pl or placement(p)
    shape, runs = chunk_map(pl, p.shape, mesh, axis)
    if pl.shard(axis) is None or mesh.size(axis) == 1:
        return p.shape, [((0,) * p.dim(), p)]
    chunks = []
    for dim, lo, start, length in runs:
        offsets = [0] * p.dim()
        offsets[dim] = start
        chunks.append((tuple(offsets), p.narrow(dim, lo, length)))
    return shape, chunks


def global_boxes(pl: Placement, local_shape, boxes: list, mesh, axis: str = "tp") -> list:
    """Boxes [(offsets, tensor)] in a rank's local tensor (shape `local_shape`, at most 2-D)
    moved to the whole tensor's coordinates; a box crossing a fused block's edge is cut there
    and padding rows are dropped."""
    s = pl.shard(axis)
    if s is None or mesh.size(axis) == 1:
        return boxes
    _, runs = chunk_map(pl, local_shape, mesh, axis)
    out = []
    for off, t in boxes:
        a, n = off[s.dim], t.shape[s.dim]
        for _, lo, start, length in runs:
            x, y = max(a, lo), min(a + n, lo + length)
            if x < y:
                new = list(off)
                new[s.dim] = start + (x - lo)
                out.append((tuple(new), t.narrow(s.dim, x - a, y - x)))
    return out


@torch.no_grad()
def gather_full(t: torch.Tensor, mesh, axis: str | None = None, pl: Placement | None = None) -> torch.Tensor:
    """The whole canonical tensor of this rank's shard `t` (collective over `axis`, by default
    the axis its placement splits it over), on the CPU."""
    pl = pl or placement(t)
    axis = axis or split_axis(pl) or "tp"
    s = pl.shard(axis)
    if s is None or mesh.size(axis) == 1:
        return t.detach().cpu().clone()
    shape, _ = chunk_map(pl, t.shape, mesh, axis)
    n = mesh.size(axis)
    moved = t.detach().movedim(s.dim, 0).contiguous()
    out = torch.empty((n * moved.shape[0], *moved.shape[1:]), dtype=t.dtype, device=t.device)
    comm.all_gather(out, moved, mesh, axis)
    if s.fused > 1:  # rank-major rows of each rank's fused blocks -> canonical order
        out = out[torch.argsort(_fused_order(out.shape[0], s.fused, n))]
    out = out[: shape[s.dim]]
    return out.movedim(0, s.dim).cpu().clone()


def bucket_key(p: torch.Tensor, mesh, sharding: bool = True) -> tuple:
    """What a gradient bucket must hold alike: the model axes its gradients are partial over
    (the bucket is summed there as one) and, with `sharding`, the axes the parameter is sharded
    on: a bucket of replicas then holds the same gradients on every rank of those axes, so a lossy
    compressor keeps the replicas equal. An exact all-reduce needs only the first (fewer, larger
    buckets)."""
    pl = placement(p)
    live = lambda axes: tuple(a for a in axes if mesh.size(a) > 1)  # noqa: E731
    return live(pl.grad_partial), live(pl.sharded_axes) if sharding else ()


def reduce_axis(p: torch.Tensor, mesh, data_axes: tuple[str, ...]) -> str:
    """The mesh axis `p`'s gradient is averaged over: the data axes (of size > 1) it is not
    sharded on, as one (combined) axis. A dense parameter under expert parallelism averages over
    dp x ep; an expert, sharded over ep, over dp alone (its replicas)."""
    pl = placement(p)
    axes = tuple(a for a in data_axes if mesh.size(a) > 1 and a not in pl.sharded_axes)
    if not axes:
        return data_axes[0]  # nothing to reduce over (a size-1 axis: no communication)
    axis = mesh.axis_over(axes)
    if axis is None:
        raise ValueError(f"the mesh has no combined axis over {axes} (see plait.mesh.Mesh.axis_over)")
    return axis


# one placement of each kind a parameter has: replicated, or split over one model axis
_KINDS = (REPLICATED, *(Placement(sharded=((a, Shard(0)),)) for a in MODEL_AXES))


def norm_parts(pairs, mesh, data_axes: tuple[str, ...] = (), every=()) -> list[tuple[list, tuple]]:
    """[(gradients, axes)] for `plait.engine.global_grad_norm`: each (placement, gradient) pair
    is summed over `data_axes` (where the engine splits gradients, e.g. ZeRO's shard axis) and
    over the model axes it is sharded on, so a replica is counted once.

    Every rank of the reduction must pass the same list of parts (the collectives follow it), so
    `every` names the placements of the whole model: each gets its part even where this rank's
    share of it is empty (a ZeRO shard that holds no piece of a tensor-parallel layer)."""

    def axes_of(pl):
        return (*data_axes, *(a for a in pl.sharded_axes if mesh.size(a) > 1))

    # every kind of placement has its part on every rank, also where this rank holds none of
    # that kind (a pipeline stage without experts): the collectives then match
    groups: dict[tuple, list] = {axes_of(pl): [] for pl in (*_KINDS, *every)}
    for pl, g in pairs:
        groups.setdefault(axes_of(pl), []).append(g)
    return [(groups[k], k) for k in sorted(groups)]

"""The layout-free checkpoint form of tensors, shared by every engine.

Every parameter is saved as one tensor keyed by its name, in its own shape (tensors of more
than 2 dims as 2-D: `saved_shape`); every optimizer state of the same size likewise
(`<name>.<key>`, e.g. `blocks.0.mlp.fc.weight.exp_avg`); scalar states (Adam's `step`) as 0-dim
tensors. A rank that holds part of a tensor contributes only its part, as boxes of the whole
(ShardedTensor chunks): a ZeRO shard's flat range of a parameter is at most three boxes
(`range_boxes`), a tensor-parallel slice is one box per fused block. Nothing is gathered to save,
and torch.distributed.checkpoint reads back whatever boxes the *loading* layout needs.
`plain_state` is the form of an unsharded model and optimizer (data parallel, a pipeline's
stages); plait.zero.state builds the same form from ZeRO's flat shards.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardMetadata

from plait.errors import CheckpointError
from plait.placement import canonical_chunks, placement, split_axis


def saved_shape(shape: torch.Size) -> torch.Size:
    """The shape a tensor is saved in: as is up to 2-D, else (all but the last dim, last dim).
    Every layout (a ZeRO shard's flat range, a tensor-parallel slice, a whole tensor) is a union
    of boxes of it, so every layout can read what any other wrote."""
    if len(shape) <= 2:
        return torch.Size(shape)
    return torch.Size([math.prod(shape[:-1]), shape[-1]])


def range_boxes(flat: torch.Tensor, start: int, shape: torch.Size) -> list:
    """The elements [start, start + len(flat)) of a row-major tensor of `shape` (saved_shape,
    at most 2-D), held in the 1-D `flat`, as at most three boxes [(offsets, view of flat)]."""
    n = flat.numel()
    if len(shape) < 2:
        return [((start,) if len(shape) else (), flat.view(shape) if not len(shape) else flat)]
    cols = shape[1]
    boxes, a, b = [], start, start + n
    row, col = divmod(a, cols)
    if col and a < b:  # the tail of a partly covered first row
        k = min(cols - col, b - a)
        boxes.append(((row, col), flat[:k].view(1, k)))
        a += k
    rows = (b - a) // cols
    if rows:
        boxes.append(((a // cols, 0), flat[a - start : a - start + rows * cols].view(rows, cols)))
        a += rows * cols
    if a < b:  # the head of a partly covered last row
        boxes.append(((a // cols, 0), flat[a - start :].view(1, b - a)))
    return boxes


def sharded_tensor(chunks: list, shape: torch.Size, group):
    """A tensor of `shape` of which this rank holds `chunks` [(offsets, local tensor), ...]; the
    ranks of `group` hold the rest (ShardedTensor, which DCP saves and reshards)."""
    if group is None and dist.get_world_size() > 1:
        # The shard axis has one rank (dp = 1 beside tp): this rank holds the whole tensor, as its
        # tp peers do, so it is saved as a plain (replicated) tensor, which DCP writes once. A
        # ShardedTensor over the default group would see the peers' identical boxes as overlaps.
        held = [t for _, t in chunks if t.numel()]
        if len(held) == 1 and tuple(held[0].shape) == tuple(shape):
            return held[0]
    rank = dist.get_rank()
    shards = [
        Shard(t, ShardMetadata(list(off), list(t.shape), f"rank:{rank}/{t.device}"))
        for off, t in chunks
        if t.numel()
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # ShardedTensor: see docs/zero.md
        return ShardedTensor._init_from_local_shards(shards, *shape, process_group=group)


def init_state(optimizer: torch.optim.Optimizer) -> None:
    """Create an optimizer's state (so a load has tensors to fill) with a step of learning rate
    0 on zero gradients; parameters are unchanged (decoupled decay is scaled by the rate too)."""
    if optimizer.state:
        return
    saved = []
    for g in optimizer.param_groups:
        saved.append(g["lr"])
        g["lr"] = 0.0
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, saved, strict=True):
        g["lr"] = lr
        for p in g["params"]:
            p.grad = None


def group_options(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each param group's scalar options (lr, weight_decay, betas, ...) for the JSON extra."""
    out = []
    for g in optimizer.param_groups:
        opts = {}
        for k, v in g.items():
            if k == "params":
                continue
            if isinstance(v, int | float | bool | str) or v is None:
                opts[k] = v
            elif isinstance(v, tuple | list) and all(isinstance(x, int | float) for x in v):
                opts[k] = list(v)
        out.append(opts)
    return out


def set_group_options(optimizer: torch.optim.Optimizer, options: list[dict]) -> None:
    for g, opts in zip(optimizer.param_groups, options, strict=True):
        for k, v in opts.items():
            g[k] = tuple(v) if isinstance(g.get(k), tuple) else v


def check_saved_split(pl, axis: str, shape, name: str) -> None:
    """A tensor of more than 2 dims is saved as 2-D (`saved_shape`): a split of its first dim
    (experts over ep) stays one box there; a split of another dim would not."""
    if len(shape) > 2 and pl.shard(axis).dim != 0:
        raise CheckpointError(
            f"{name}: a {len(shape)}-D tensor split over {axis} along dim {pl.shard(axis).dim} is not "
            "saved yet (only splits of dim 0 of tensors above 2-D are)"
        )


def plain_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    names: dict[int, str] | None = None,
    mesh=None,
) -> tuple[dict, dict]:
    """The same layout for an unsharded model and optimizer (replicated plain tensors).

    A parameter split over a model axis of `mesh` (its placement: tensor parallelism over tp,
    experts over ep) is saved, with its optimizer states, as chunks of the whole canonical
    tensor (in its saved shape), so DCP can load it into another tp or ep degree or one
    process. `names` (parameter id -> name) gives the whole model's names when `model` is a
    part of it (a pipeline rank's stages)."""
    init_state(optimizer)
    own = {id(p): n for n, p in model.named_parameters()}
    names = {i: (names or {}).get(i, n) for i, n in own.items()}
    if mesh is None and (tp := getattr(model, "_plait_tp", None)) is not None:
        mesh = tp[0]

    def entry(p, t):
        pl = placement(p)
        local = t.detach().view(saved_shape(t.shape))
        axis = split_axis(pl, mesh) if mesh is not None else None
        if axis is None:
            return local
        check_saved_split(pl, axis, t.shape, names[id(p)])
        shape, chunks = canonical_chunks(local, mesh, axis, pl=pl)
        return sharded_tensor(chunks, shape, mesh.group(axis))

    model_sd = {names[id(p)]: entry(p, p) for p in model.parameters()}
    optim_sd = {}
    for p, st in optimizer.state.items():
        for key, v in st.items():
            if torch.is_tensor(v):
                optim_sd[f"{names[id(p)]}.{key}"] = v if v.dim() == 0 else entry(p, v)
    return model_sd, optim_sd

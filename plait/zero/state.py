"""Checkpoint state of a sharded model and optimizer, in a layout-free form DCP can reshard.

Every parameter is saved as one tensor keyed by its name, in its own shape (tensors of more
than 2 dims as 2-D: `saved_shape`); every optimizer state of the same size likewise
(`<name>.<key>`, e.g. `blocks.0.mlp.fc.weight.exp_avg`); scalar states (Adam's `step`) as 0-dim
tensors. A rank that holds part of a tensor contributes only its part, as boxes of the whole
(ShardedTensor chunks): a ZeRO shard's flat range of a parameter is at most three boxes
(`range_boxes`), a tensor-parallel slice is one box per fused block. Nothing is gathered to save,
and torch.distributed.checkpoint reads back whatever boxes the *loading* layout needs: a
checkpoint of ZeRO-3 on 2 ranks loads into ZeRO-3 on 4 ranks, into ZeRO-1, into tensor
parallelism or into one process with plain tensors. Parameter-group options (learning rate, ...)
are returned separately as JSON.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardMetadata

from plait.errors import CheckpointError
from plait.placement import canonical_chunks, chunk_map, global_boxes, placement, split_axis
from plait.zero.sharded import ShardedOptimizer


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


def _sharded(chunks: list, shape: torch.Size, group):
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


def _init_state(optimizer: torch.optim.Optimizer) -> None:
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


class ShardedState:
    """The checkpoint view of a `ShardedOptimizer`: `state()` for DCP, `loaded()` afterwards."""

    def __init__(self, shards: ShardedOptimizer):
        self.shards = shards
        self._disk_sd = None

    def _opt_states(self) -> list[dict]:
        """For each (group, segment) in order: that segment's optimizer state dict."""
        s = self.shards
        if s.offload == "disk":
            sd = s._stepper.state_dict()
            if not sd["state"]:
                _init_state(s._stepper)
                sd = s._stepper.state_dict()
            self._disk_sd = sd
            index = {}
            i = 0
            for g in s.optimizer.param_groups:
                for p in g["params"]:
                    index[id(p)] = i
                    i += 1
            return [sd["state"][index[id(p)]] for g in s.groups for p in g.seg_params]
        _init_state(s.optimizer)
        return [s.optimizer.state[p] for g in s.groups for p in g.seg_params]

    def state(self) -> tuple[dict, dict]:
        """(model, optim) dicts of ShardedTensor chunks and scalar tensors. A parameter that is
        also split over a model axis (tp, or ep for experts: its placement) is saved as boxes of
        the whole canonical tensor, over the group of its shard axis and that axis; a replicated
        one over the shard axis alone (tp peers then write the same boxes, which DCP keeps
        once)."""
        s = self.shards
        mesh = s.mesh
        model, optim = {}, {}
        states = iter(self._opt_states())
        for g, placements in zip(s.groups, s.placements, strict=True):
            for seg, p in zip(g.segments, g.seg_params, strict=True):
                pl = placements[seg.index]
                local = saved_shape(g.layout.shapes[seg.index])
                split = split_axis(pl, mesh)
                if split is not None:
                    _check_saved_split(pl, split, g.layout.shapes[seg.index], seg.name)
                    whole, _ = chunk_map(pl, g.layout.shapes[seg.index], mesh, split)
                    shape, group = saved_shape(whole), mesh.group(s.combined_axis(s.axis_of(g), split))
                else:
                    shape, group = local, mesh.group(s.axis_of(g))

                def boxes(flat, seg=seg, pl=pl, local=local, split=split):
                    out = range_boxes(flat, seg.start, local)
                    return global_boxes(pl, local, out, mesh, split) if split else out

                model[seg.name] = _sharded(boxes(p), shape, group)
                for key, v in next(states).items():
                    if not torch.is_tensor(v):
                        continue
                    if v.dim() == 0:
                        optim[f"{seg.name}.{key}"] = v
                    elif v.numel() == seg.length:
                        optim[f"{seg.name}.{key}"] = _sharded(boxes(v.view(-1)), shape, group)
        return model, optim

    def loaded(self) -> None:
        """Make the loaded values live: disk state written back, parameters published."""
        s = self.shards
        if self._disk_sd is not None:
            s._stepper.load_state_dict(self._disk_sd)
            self._disk_sd = None
        if callable(loaded := getattr(s.optimizer, "shards_loaded", None)):
            loaded()  # 1-bit Adam: its whole momentum is re-gathered from the loaded shards
        s.on_updated()


def _check_saved_split(pl, axis: str, shape, name: str) -> None:
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
    _init_state(optimizer)
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
        _check_saved_split(pl, axis, t.shape, names[id(p)])
        shape, chunks = canonical_chunks(local, mesh, axis, pl=pl)
        return _sharded(chunks, shape, mesh.group(axis))

    model_sd = {names[id(p)]: entry(p, p) for p in model.parameters()}
    optim_sd = {}
    for p, st in optimizer.state.items():
        for key, v in st.items():
            if torch.is_tensor(v):
                optim_sd[f"{names[id(p)]}.{key}"] = v if v.dim() == 0 else entry(p, v)
    return model_sd, optim_sd

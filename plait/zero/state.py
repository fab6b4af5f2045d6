"""Checkpoint state of a sharded model and optimizer, in a layout-free form DCP can reshard.

Every parameter is saved as one 1-D tensor of its element count, keyed by its name; every
optimizer state of the same size likewise (`<name>.<key>`, e.g. `blocks.0.mlp.fc.weight.exp_avg`);
scalar states (Adam's `step`) as 0-dim tensors. Under ZeRO each rank contributes only the
segments it owns (1-D ShardedTensor chunks at their offsets), so nothing is gathered to save,
and torch.distributed.checkpoint reads back whatever segments the *loading* layout owns: a
checkpoint of ZeRO-3 on 2 ranks loads into ZeRO-3 on 4 ranks, into ZeRO-1, or into one process
with plain tensors. Parameter-group options (learning rate, ...) are returned separately as JSON.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from plait.zero.sharded import ShardedOptimizer


def _chunked(local: torch.Tensor, offset: int, total: int, group):
    """`local` as the chunk at `offset` of a 1-D tensor of `total` elements split over `group`."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardMetadata

    rank = dist.get_rank()
    shards = []
    if local.numel():
        shards = [Shard(local, ShardMetadata([offset], [local.numel()], f"rank:{rank}/{local.device}"))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # ShardedTensor: see docs/zero.md
        return ShardedTensor._init_from_local_shards(shards, total, process_group=group)


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
        """(model, optim) dicts of ShardedTensor chunks and scalar tensors."""
        s = self.shards
        group = s.mesh.group(s.shard_axis)
        model, optim = {}, {}
        states = iter(self._opt_states())
        for g in s.groups:
            for seg, p in zip(g.segments, g.seg_params, strict=True):
                total = g.layout.numels[seg.index]
                model[seg.name] = _chunked(p, seg.start, total, group)
                for key, v in next(states).items():
                    if not torch.is_tensor(v):
                        continue
                    if v.dim() == 0:
                        optim[f"{seg.name}.{key}"] = v
                    elif v.numel() == seg.length:
                        optim[f"{seg.name}.{key}"] = _chunked(v.view(-1), seg.start, total, group)
        return model, optim

    def loaded(self) -> None:
        """Make the loaded values live: disk state written back, parameters published."""
        s = self.shards
        if self._disk_sd is not None:
            s._stepper.load_state_dict(self._disk_sd)
            self._disk_sd = None
        s.on_updated()


def plain_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The same layout for an unsharded model and optimizer (replicated plain tensors)."""
    _init_state(optimizer)
    names = {id(p): n for n, p in model.named_parameters()}
    model_sd = {n: p.detach().view(-1) for n, p in model.named_parameters()}
    optim_sd = {}
    for p, st in optimizer.state.items():
        for key, v in st.items():
            if torch.is_tensor(v):
                optim_sd[f"{names[id(p)]}.{key}"] = v if v.dim() == 0 else v.view(-1)
    return model_sd, optim_sd

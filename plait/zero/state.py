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

import torch

from plait.placement import chunk_map, global_boxes, split_axis
from plait.state import check_saved_split, init_state, range_boxes, saved_shape, sharded_tensor
from plait.zero.sharded import ShardedOptimizer


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
                init_state(s._stepper)
                sd = s._stepper.state_dict()
            self._disk_sd = sd
            index = {}
            i = 0
            for g in s.optimizer.param_groups:
                for p in g["params"]:
                    index[id(p)] = i
                    i += 1
            return [sd["state"][index[id(p)]] for g in s.groups for p in g.seg_params]
        init_state(s.optimizer)
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
                    check_saved_split(pl, split, g.layout.shapes[seg.index], seg.name)
                    whole, _ = chunk_map(pl, g.layout.shapes[seg.index], mesh, split)
                    shape, group = saved_shape(whole), mesh.group(s.combined_axis(s.axis_of(g), split))
                else:
                    shape, group = local, mesh.group(s.axis_of(g))

                def boxes(flat, seg=seg, pl=pl, local=local, split=split):
                    out = range_boxes(flat, seg.start, local)
                    return global_boxes(pl, local, out, mesh, split) if split else out

                model[seg.name] = sharded_tensor(boxes(p), shape, group)
                for key, v in next(states).items():
                    if not torch.is_tensor(v):
                        continue
                    if v.dim() == 0:
                        optim[f"{seg.name}.{key}"] = v
                    elif v.numel() == seg.length:
                        optim[f"{seg.name}.{key}"] = sharded_tensor(boxes(v.view(-1)), shape, group)
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

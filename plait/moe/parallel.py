"""Putting MoE layers to work in a model: expert parallelism applied to a built model, the
objective's scale for the auxiliary losses, and the statistics a trainer logs.

* `apply_ep(model, mesh)`: every `MoE` layer of a model built whole (all E experts on every rank,
  one seed) keeps this rank's E/ep experts along the mesh's `ep` axis (their placements say so)
  and sends tokens to the other ranks' experts with all-to-alls. Like `apply_tp`, it runs after
  the model is built and before data parallelism or ZeRO wrap it.
* `objective_scale(s)`: the auxiliary losses are added to the objective where they arise, on the
  MoE layer's output (`plait.moe.attach_loss`), so that a model returning only its activations
  (a block, a pipeline stage) still trains its routers. Their weight must match the main loss's:
  an engine that backpropagates `loss_scale · Σ token losses` runs the forward inside
  `objective_scale(loss_scale)`, and each layer then adds `coef · aux · tokens · loss_scale`,
  which is `coef · aux` averaged over micro-batches, as Switch's total loss has it. Outside the
  context the scale is 1/tokens of the forward (a mean loss): `coef · aux` per forward.
* `moe_stats(model)`: the statistics accumulated by every `MoEFeedForward`-like holder of a
  `MoE` since the last call (see `StatsHolder`), reset as they are read.
"""

from __future__ import annotations

import torch
from torch import nn

from plait.combinations import refuse
from plait.engine import current_objective_scale, objective_scale
from plait.errors import ConfigError
from plait.moe.experts import EXPERT_ATTR, Experts
from plait.moe.layer import MoE, MoEStats
from plait.placement import Shard, set_shard

__all__ = ["StatsHolder", "apply_ep", "current_objective_scale", "moe_stats", "objective_scale"]


@torch.no_grad()
def apply_ep(model: nn.Module, mesh, axis: str = "ep") -> nn.Module:
    """Split the experts of every `MoE` layer of `model` over `axis` of `mesh`, in place: rank r
    keeps experts [r·E/n, (r+1)·E/n) (the model was built whole, so every layout holds the same
    experts). Returns `model`."""
    n, r = mesh.size(axis), mesh.rank(axis)
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if n > 1 and not layers:
        raise refuse("ep-dense", ep=n)
    for layer in layers:
        bank: Experts = layer.experts
        if bank.local != bank.experts:
            raise ConfigError("apply_ep: a MoE layer's experts are already split")
        if bank.experts % n:
            raise ConfigError(f"apply_ep: {bank.experts} experts do not divide over {axis} = {n}")
        local = bank.experts // n
        own = slice(r * local, (r + 1) * local)
        for name in ("w1", "b1", "w2", "b2"):
            p = getattr(bank, name)
            if p is None:
                continue
            q = nn.Parameter(p.detach()[own].clone(), requires_grad=p.requires_grad)
            setattr(q, EXPERT_ATTR, True)
            set_shard(q, axis, Shard(dim=0))
            bank.register_parameter(name, q)
        bank.local, bank.first = local, r * local
        layer.mesh, layer.axis, layer.ep = mesh, axis, n
    return model


class StatsHolder:
    """Sums a layer's `MoEStats` over the forwards since the last `take()` (training forwards
    only): claims per expert, claims dropped, claims made, and the auxiliary and z losses."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.load: torch.Tensor | None = None
        self.dropped = 0.0
        self.claims = 0.0
        self.aux = 0.0
        self.z = 0.0
        self.forwards = 0

    @torch.no_grad()
    def add(self, stats: MoEStats) -> None:
        load = stats.tokens_per_expert.detach().double().cpu()
        self.load = load if self.load is None else self.load + load
        self.claims += float(load.sum())
        self.dropped += float(stats.dropped)
        self.aux += float(stats.aux_loss.detach())
        self.z += float(stats.z_loss.detach())
        self.forwards += 1

    def take(self) -> dict | None:
        if self.forwards == 0:
            return None
        out = {
            "load": self.load,
            "dropped": self.dropped,
            "claims": self.claims,
            "aux": self.aux,
            "z": self.z,
            "forwards": self.forwards,
        }
        self.reset()
        return out


def moe_stats(model: nn.Module) -> list[tuple[int, dict | None]]:
    """(layer index, accumulated statistics) of each MoE layer `model` holds, in module order,
    reset as they are read; a layer that ran no training forward since the last call gives None.
    The index is the holder's `moe_index` (its place among the whole model's MoE layers, so a
    pipeline stage reports its layers under their global numbers), else the order here."""
    holders = [m for m in model.modules() if isinstance(getattr(m, "stats", None), StatsHolder)]
    return [(getattr(m, "moe_index", i), m.stats.take()) for i, m in enumerate(holders)]

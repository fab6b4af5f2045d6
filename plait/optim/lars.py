"""LARS: momentum SGD with a layer-wise local learning rate (You et al. 2017, Algorithm 1).

"Large Batch Training of Convolutional Networks" (You, Gitman, Ginsburg 2017). For each
parameter tensor w (a "layer") with gradient g, global learning rate γ, momentum μ, weight
decay β and trust coefficient η:

    local_lr = η · ‖w‖ / (‖g‖ + β·‖w‖ + ε)           §3; ε (not in the paper) guards 0/0
    v ← μ·v + γ · local_lr · (g + β·w)
    w ← w − v

The paper's observation (§3, measured on AlexNet) is that the ratio ‖w‖/‖∇w‖ differs by orders
of magnitude between layers, so one global rate that is safe for the most sensitive layer is
far too small for the others; scaling each layer's step by its own ratio lets the global rate,
and with it the batch, grow (AlexNet to 8K, ResNet-50 to 32K).
The local rate is 1 where ‖w‖ or ‖g‖ is zero (a zero-initialised or gradient-free layer).

Sharded layers: the norms are of the whole layer; see `plait.optim.lamb` and
`plait.optim.allreduce_norms` for the `norm_reducer` that sums the per-shard partial sums of
squares in one collective per step. Every rank must step the same ordered list of layers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from plait.optim.lamb import (
    NormReducer,
    check,
    check_lr_and_decay,
    default_no_decay_when_not_adapted,
    global_sq_norms,
    lr_value,
    sq_norm,
)


class LARS(torch.optim.Optimizer):
    """Layer-wise Adaptive Rate Scaling (You et al. 2017, Algorithm 1).

    Args:
        params: parameters or param groups. Per-group options: ``lr``, ``momentum``,
            ``weight_decay``, ``trust_coefficient``, ``eps`` and ``adapt``. A group with
            ``adapt=False`` uses local_lr = 1 (plain momentum SGD with weight decay) and its
            ``weight_decay`` defaults to 0: the group for biases and BatchNorm/LayerNorm
            parameters that `plait.optim.param_groups` builds.
        lr: γ, the global learning rate (required: LARS rates are not Adam-sized).
        momentum: μ in [0, 1).
        weight_decay: β >= 0; it enters both the local rate and the direction.
        trust_coefficient: η > 0, how far one step may move a layer relative to its norm.
        eps: ε >= 0 in the denominator of the local rate.
        norm_reducer: called once per step on a (2, n) tensor of partial sums of squares
            (‖w‖² and ‖g‖² of each of the n adapted layers, in parameter order); must return the
            sums over every shard of each layer. None: each tensor is a whole layer.

    The velocity starts at zero as in the paper (torch.optim.SGD instead starts it at g).
    """

    def __init__(
        self,
        params: Iterable,
        lr: float,
        momentum: float = 0.9,
        weight_decay: float = 5e-4,
        trust_coefficient: float = 0.001,
        eps: float = 1e-9,
        norm_reducer: NormReducer | None = None,
    ) -> None:
        check(norm_reducer is None or callable(norm_reducer), "LARS: norm_reducer must be callable or None")
        defaults = dict(
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            trust_coefficient=trust_coefficient,
            eps=eps,
            adapt=True,
        )
        self._validate(defaults)
        self.norm_reducer = norm_reducer
        super().__init__(params, defaults)

    @staticmethod
    def _validate(group: dict[str, Any]) -> None:
        check_lr_and_decay(group, "LARS")
        mu = group["momentum"]
        check(
            isinstance(mu, int | float) and 0.0 <= mu < 1.0, f"LARS: momentum must be in [0, 1), got {mu!r}"
        )
        tc = group["trust_coefficient"]
        check(isinstance(tc, int | float) and tc > 0, f"LARS: trust_coefficient must be > 0, got {tc!r}")
        eps = group["eps"]
        check(isinstance(eps, int | float) and eps >= 0, f"LARS: eps must be >= 0, got {eps!r}")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        default_no_decay_when_not_adapted(param_group)
        super().add_param_group(param_group)
        self._validate(self.param_groups[-1])

    @torch.no_grad()
    def step(self, closure=None):
        """One LARS step over every group; returns the closure's loss if one is given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        # Pass 1: local partial sums of squares of every adapted layer (zeros where a layer has
        # no gradient, so every rank stacks a tensor of the same shape for the collective).
        adapted: list[tuple[Tensor, dict]] = []
        partials: list[Tensor] = []
        for group in self.param_groups:
            if not group["adapt"]:
                continue
            for p in group["params"]:
                g_sq = sq_norm(p.grad) if p.grad is not None else torch.zeros((), device=p.device)
                adapted.append((p, group))
                partials.append(torch.stack([sq_norm(p), g_sq]))

        rates = None
        if adapted:
            device = partials[0].device
            w_norm, g_norm = global_sq_norms([t.to(device) for t in partials], self.norm_reducer).sqrt()
            beta, eta, eps = (
                torch.tensor([g[key] for _, g in adapted], device=device, dtype=w_norm.dtype)
                for key in ("weight_decay", "trust_coefficient", "eps")
            )
            rates = eta * w_norm / (g_norm + beta * w_norm + eps)
            rates = torch.where((w_norm > 0) & (g_norm > 0), rates, torch.ones_like(rates))

        # Pass 2: v ← μ·v + γ·local_lr·(g + β·w);  w ← w − v. Adapted layers are visited in the
        # order of pass 1, so the i-th one takes rates[i].
        i = 0
        for group in self.param_groups:
            for p in group["params"]:
                scale = lr_value(group)
                if group["adapt"]:
                    scale = scale * rates[i].to(p.dtype)
                    i += 1
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("LARS does not support sparse gradients")
                wd = group["weight_decay"]
                direction = p.grad.add(p, alpha=wd) if wd else p.grad
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                v = state["momentum_buffer"]
                v.mul_(group["momentum"]).add_(direction * scale)
                p.sub_(v)
        return loss

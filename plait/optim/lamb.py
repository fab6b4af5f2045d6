"""LAMB: Adam moments with a layer-wise trust ratio (You et al. 2020, Algorithm 2).

"Large Batch Optimization for Deep Learning: Training BERT in 76 minutes" (ICLR 2020). For each
parameter tensor x (a "layer") with gradient g at step t:

    m_t = β1·m_{t-1} + (1 − β1)·g                     first moment, as Adam
    v_t = β2·v_{t-1} + (1 − β2)·g²                    second moment, as Adam
    m̂_t = m_t / (1 − β1^t),  v̂_t = v_t / (1 − β2^t)   bias correction (optional)
    r_t = m̂_t / (√v̂_t + ε)
    u_t = r_t + λ·x_t                                 decoupled weight decay λ
    x_{t+1} = x_t − η · φ(‖x_t‖) / ‖u_t‖ · u_t        φ(z) = min(max(z, lo), hi)

The trust ratio φ(‖x‖)/‖u‖ makes every layer move by about η times its own norm, whatever the
scale of its gradient: with very large batches the gradient noise that keeps Adam's per-element
steps small is gone, and a single global learning rate either stalls some layers or blows up
others (You et al. 2017, the LARS paper). Where ‖x‖ or ‖u‖ is zero the ratio is 1 (the paper leaves 0/0
undefined; a zero-initialised layer must still be able to move).

Sharded layers: the norms are of the *whole* layer. When each rank holds a shard of every
layer (ZeRO-1/2 split a flattened layer over the data-parallel ranks), pass a `norm_reducer`
(see `plait.optim.allreduce_norms`) that sums the per-shard partial sums of squares across the
ranks; all of a step's partial sums travel in one stacked tensor, so that is one collective
per step. Every rank must then step the same ordered list of (shards of the) layers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

NormReducer = Callable[[Tensor], Tensor]
"""Maps a tensor of partial sums of squares to the global sums (e.g. an all-reduce over dp)."""


def check(ok: bool, message: str) -> None:
    """Raise ValueError(message) unless ok; the optimizers' one validation idiom."""
    if not ok:
        raise ValueError(message)


def check_lr_and_decay(group: dict[str, Any], who: str) -> None:
    lr, wd = group["lr"], group["weight_decay"]
    value = float(lr) if isinstance(lr, Tensor) else lr
    check(
        isinstance(value, int | float) and value >= 0 and math.isfinite(value),
        f"{who}: lr must be a finite number >= 0, got {lr!r}",
    )
    check(
        isinstance(wd, int | float) and wd >= 0 and math.isfinite(wd),
        f"{who}: weight_decay must be a finite number >= 0, got {wd!r}",
    )
    check(isinstance(group["adapt"], bool), f"{who}: adapt must be True or False, got {group['adapt']!r}")


def default_no_decay_when_not_adapted(param_group: dict[str, Any]) -> None:
    """A group marked ``adapt=False`` (biases, norms) takes no weight decay unless it says so."""
    if param_group.get("adapt", True) is False:
        param_group.setdefault("weight_decay", 0.0)


def global_sq_norms(partials: list[Tensor], reducer: NormReducer | None) -> Tensor:
    """Stack per-layer partial sums of squares (each a 1-D tensor of k values) into one (k, n)
    tensor, reduce it across ranks with ONE call of `reducer`, and return the global sums.

    Without a reducer the partial sums already are the whole layers' sums (nothing is sharded).
    """
    stacked = torch.stack(partials, dim=1)
    if reducer is None:
        return stacked
    reduced = reducer(stacked)
    if not isinstance(reduced, Tensor) or reduced.shape != stacked.shape:
        raise ValueError(
            f"norm_reducer must return a tensor of the shape it was given {tuple(stacked.shape)}, "
            f"got {getattr(reduced, 'shape', type(reduced).__name__)}"
        )
    return reduced


def sq_norm(t: Tensor) -> Tensor:
    """Sum of squares of t, accumulated in at least fp32 (bf16/fp16 sums lose the norm)."""
    return torch.linalg.vector_norm(t.detach(), dtype=torch.promote_types(t.dtype, torch.float32)).square()


def lr_value(group: dict[str, Any]) -> float:
    """The group's learning rate as a float."""
    # torch.distributed.checkpoint may set a tensor lr (0.0) while it initialises the state.
    lr = group["lr"]
    return float(lr) if isinstance(lr, Tensor) else lr


class LAMB(torch.optim.Optimizer):
    """Layer-wise Adaptive Moments for Batch training (You et al. 2020, Algorithm 2).

    Args:
        params: parameters or param groups. Per-group options: ``lr``, ``betas``, ``eps``,
            ``weight_decay``, ``clamp``, ``bias_correction`` and ``adapt``. A group with
            ``adapt=False`` skips the trust ratio (its update is plain Adam with decoupled weight
            decay) and its ``weight_decay`` defaults to 0: the group for biases and LayerNorm
            gains that `plait.optim.param_groups` builds.
        lr: η, the global learning rate.
        betas: (β1, β2), each in [0, 1).
        eps: ε > 0, added to √v̂ (the paper's default 1e-6).
        weight_decay: λ >= 0, added to the Adam direction before the trust ratio.
        clamp: (lo, hi) of φ, the clamp on ‖x‖ in the numerator (paper: γ_l, γ_u); 0 <= lo <= hi.
        bias_correction: divide the moments by (1 − β^t) as Adam does.
        norm_reducer: called once per step on a (2, n) tensor of partial sums of squares
            (‖x‖² and ‖u‖² of each of the n adapted layers, in parameter order); must return the
            sums over every shard of each layer. None: each tensor is a whole layer.

    Holds one transient copy of the update of every adapted parameter during `step`, since the
    norms of all layers must be known (and, sharded, reduced together) before any is applied.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        clamp: tuple[float, float] = (0.0, 10.0),
        bias_correction: bool = True,
        norm_reducer: NormReducer | None = None,
    ) -> None:
        check(norm_reducer is None or callable(norm_reducer), "LAMB: norm_reducer must be callable or None")
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            clamp=tuple(clamp),
            bias_correction=bias_correction,
            adapt=True,
        )
        self._validate(defaults)
        self.norm_reducer = norm_reducer
        super().__init__(params, defaults)

    @staticmethod
    def _validate(group: dict[str, Any]) -> None:
        check_lr_and_decay(group, "LAMB")
        betas = group["betas"]
        check(
            len(betas) == 2 and all(isinstance(b, int | float) and 0.0 <= b < 1.0 for b in betas),
            f"LAMB: betas must be two numbers in [0, 1), got {betas!r}",
        )
        eps = group["eps"]
        check(isinstance(eps, int | float) and eps > 0, f"LAMB: eps must be > 0, got {eps!r}")
        clamp = group["clamp"]
        check(
            len(clamp) == 2 and all(isinstance(c, int | float) and c >= 0 for c in clamp),
            f"LAMB: clamp must be two numbers >= 0 (lo, hi), got {clamp!r}",
        )
        check(clamp[0] <= clamp[1], f"LAMB: clamp lo must not exceed hi, got lo={clamp[0]} > hi={clamp[1]}")
        check(isinstance(group["bias_correction"], bool), "LAMB: bias_correction must be True or False")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        default_no_decay_when_not_adapted(param_group)
        if "betas" in param_group:
            param_group["betas"] = tuple(param_group["betas"])
        if "clamp" in param_group:
            param_group["clamp"] = tuple(param_group["clamp"])
        super().add_param_group(param_group)
        self._validate(self.param_groups[-1])

    def _adam_direction(self, p: Tensor, group: dict[str, Any]) -> Tensor:
        """Advance m and v by one step and return u = m̂/(√v̂ + ε) + λ·x (a new tensor)."""
        g = p.grad
        if g.is_sparse:
            raise RuntimeError("LAMB does not support sparse gradients")
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        beta1, beta2 = group["betas"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        state["step"] += 1
        m.mul_(beta1).add_(g, alpha=1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        if group["bias_correction"]:
            t = state["step"].item()
            bc1, bc2 = 1.0 - beta1**t, 1.0 - beta2**t
        else:
            bc1 = bc2 = 1.0
        denom = v.div(bc2).sqrt_().add_(group["eps"])
        update = m.div(bc1).div_(denom)
        if group["weight_decay"] != 0:
            update.add_(p, alpha=group["weight_decay"])
        return update

    @torch.no_grad()
    def step(self, closure=None):
        """One LAMB step over every group; returns the closure's loss if one is given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        # Pass 1: Adam directions, and the local partial sums of squares of every adapted layer.
        # Layers without a gradient still contribute (zeros), so the stacked tensor has the same
        # shape on every rank and the collective lines up even if one rank's shard got no grad.
        adapted: list[tuple[Tensor, Tensor | None, dict]] = []
        partials: list[Tensor] = []
        for group in self.param_groups:
            for p in group["params"]:
                update = self._adam_direction(p, group) if p.grad is not None else None
                if not group["adapt"]:
                    if update is not None:
                        p.add_(update, alpha=-lr_value(group))
                    continue
                adapted.append((p, update, group))
                u_sq = sq_norm(update) if update is not None else torch.zeros((), device=p.device)
                partials.append(torch.stack([sq_norm(p), u_sq]))
        if not adapted:
            return loss

        # One reduction for the whole step, then the per-layer trust ratios φ(‖x‖)/‖u‖.
        device = partials[0].device
        w_norm, u_norm = global_sq_norms([t.to(device) for t in partials], self.norm_reducer).sqrt()
        lo = torch.tensor([g["clamp"][0] for _, _, g in adapted], device=device, dtype=w_norm.dtype)
        hi = torch.tensor([g["clamp"][1] for _, _, g in adapted], device=device, dtype=w_norm.dtype)
        phi = torch.minimum(torch.maximum(w_norm, lo), hi)
        ratio = torch.where((w_norm > 0) & (u_norm > 0), phi / u_norm, torch.ones_like(w_norm))

        # Pass 2: x ← x − η·ratio·u, with the ratio kept on the device (no host sync per layer).
        for i, (p, update, group) in enumerate(adapted):
            if update is not None:
                p.add_(update.mul_(ratio[i].to(update.dtype)), alpha=-lr_value(group))
        return loss

"""Routers of a mixture-of-experts layer: Switch top-1 and GShard top-2, with expert capacity.

Tokens are routed in *groups* (GShard, Lepikhin et al. 2020, §2.2: G groups of S tokens each,
routed independently). A router scores every token against the E experts,
probs = softmax(x W_g^T), and picks

* **top-1** (Switch Transformer, Fedus et al. 2021, §2.1): the expert of highest probability,
  with combine weight p_e itself;
* **top-2** (GShard Algorithm 1): the best and second-best experts, with combine weights
  normalised by their sum, g1/(g1+g2) and g2/(g1+g2). With *random routing* the second expert
  is kept only when 2·g2 > U(0,1) (g2 normalised), so a weak second choice costs no capacity.

Each expert takes at most C = ceil(k · capacity_factor · S / E) tokens of a group
(`expert_capacity`). A token's place in its expert's buffer is the number of earlier claims on
that expert within the group, counting every top-1 choice before any top-2 choice (GShard
Algorithm 1: `position_in_expert_2` starts after the first choices' count). Claims at a position
>= C are *dropped*: their combine weight is zero, so a token whose claims are all dropped leaves
the MoE layer as zero and passes through the residual connection unchanged. capacity_factor = 0
means dropless: the caller sets C to the largest load of any expert in any group.

Two losses leave the router, the caller applies their coefficients:

* the load-balancing loss, Switch's form E · Σ_e f_e · P_e (§2.2, eq. 4-6), with f_e the
  fraction of the group's tokens whose *first* choice is e and P_e the mean router probability of
  e; it equals GShard's (1/E) Σ_e (c_e/S) · m_e times E². Computed per group, averaged over them.
* the router z-loss (ST-MoE, Zoph et al. 2022, eq. 5): the mean over tokens of
  (logsumexp of the token's logits)², which keeps the logits small.

Routing is computed in float32 whatever the activations' dtype (Switch §2.4, selective precision).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from plait.errors import ConfigError

__all__ = [
    "Choices",
    "Router",
    "Routing",
    "assign",
    "choose",
    "expert_capacity",
    "load_balancing_loss",
    "route",
    "router_z_loss",
]


def expert_capacity(tokens: int, experts: int, top_k: int, capacity_factor: float) -> int:
    """GShard's expert capacity C = ceil(k · capacity_factor · S / E) for a group of S `tokens`
    (at least 1). A product that is an integer up to rounding (2 · 1.1 · 10 / 2) is not rounded up."""
    if capacity_factor <= 0:
        raise ConfigError(f"expert_capacity: capacity_factor must be > 0, got {capacity_factor}")
    return max(1, math.ceil(top_k * capacity_factor * tokens / experts - 1e-9))


@dataclasses.dataclass
class Choices:
    """The router's picks for G groups of S tokens, before capacity.

    logits, probs: [G, S, E] float32. expert: [G, S, k] the chosen experts (column 0 the first
    choice). gate: [G, S, k] their combine weights (differentiable). active: [G, S, k] bool, False
    where random routing skipped a second choice (it claims no capacity)."""

    logits: Tensor
    probs: Tensor
    expert: Tensor
    gate: Tensor
    active: Tensor

    @property
    def experts(self) -> int:
        return self.probs.shape[-1]

    def claims(self) -> Tensor:
        """[G, k·S, E] one-hot claims in buffer order: every first choice (token order), then every
        second choice; skipped claims are zero rows."""
        g, s, k = self.expert.shape
        onehot = F.one_hot(self.expert, self.experts) * self.active.unsqueeze(-1)
        return onehot.transpose(1, 2).reshape(g, k * s, self.experts)

    def load(self) -> Tensor:
        """[G, E] claims on each expert in each group (int64), before capacity."""
        return self.claims().sum(1)


@dataclasses.dataclass
class Routing:
    """Choices placed into expert buffers of `capacity` slots.

    expert, position, kept: [G, S, k]; a claim lies in slot `position` of `expert`'s buffer of its
    group when `kept`. gate: [G, S, k] float32 combine weights, zero where not kept."""

    expert: Tensor
    position: Tensor
    kept: Tensor
    gate: Tensor
    capacity: int
    experts: int
    load: Tensor  # [G, E] claims before capacity
    dropped: Tensor  # scalar int64: active claims over capacity
    dropped_tokens: Tensor  # scalar int64: tokens none of whose claims was kept

    def slots(self) -> Tensor:
        """[G, S, k] flat slot index expert · C + position of each kept claim within its group's
        [E · C] buffer, and E · C (one past the end) for a claim that is not kept."""
        flat = self.expert * self.capacity + self.position
        return torch.where(self.kept, flat, torch.full_like(flat, self.experts * self.capacity))

    def combine_weights(self) -> Tensor:
        """GShard's dense combine tensor [G, S, E, C]: gate at (token, expert, slot) of each kept
        claim. For inspection and tests; the layer uses the indices."""
        g, s, _ = self.expert.shape
        width = self.experts * self.capacity + 1
        out = torch.zeros(g, s, width, dtype=self.gate.dtype, device=self.gate.device)
        out.scatter_add_(2, self.slots(), self.gate)
        return out[..., :-1].reshape(g, s, self.experts, self.capacity)

    def dispatch_mask(self) -> Tensor:
        """GShard's dispatch mask [G, S, E, C] (bool): True at (token, expert, slot) of each kept claim."""
        g, s, _ = self.expert.shape
        width = self.experts * self.capacity + 1
        out = torch.zeros(g, s, width, dtype=torch.bool, device=self.expert.device)
        out.scatter_(2, self.slots(), True)
        return out[..., :-1].reshape(g, s, self.experts, self.capacity)


def choose(logits: Tensor, top_k: int, uniform: Tensor | None = None) -> Choices:
    """Pick each token's experts from router `logits` [G, S, E] (Switch top-1 or GShard top-2).

    `uniform` [G, S] in [0, 1): with top-2, the second choice is kept only where 2·g2 > uniform
    (GShard's random routing); None keeps every second choice."""
    if top_k not in (1, 2):
        raise ConfigError(f"top_k must be 1 (Switch) or 2 (GShard), got {top_k}")
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    first = probs.argmax(-1, keepdim=True)
    g1 = probs.gather(-1, first)
    if top_k == 1:
        return Choices(logits, probs, first, g1, torch.ones_like(first, dtype=torch.bool))
    if probs.shape[-1] < 2:
        raise ConfigError("top_k=2 needs at least 2 experts")
    # The best expert among the others (GShard masks the first choice out of the gates).
    second = probs.scatter(-1, first, float("-inf")).argmax(-1, keepdim=True)
    g2 = probs.gather(-1, second)
    denom = g1 + g2
    g1, g2 = g1 / denom, g2 / denom
    active2 = torch.ones_like(second, dtype=torch.bool)
    if uniform is not None:
        active2 = (2 * g2.detach()) > uniform.unsqueeze(-1).to(g2.dtype)
    return Choices(
        logits,
        probs,
        torch.cat([first, second], -1),
        torch.cat([g1, g2], -1),
        torch.cat([torch.ones_like(active2), active2], -1),
    )


def assign(choices: Choices, capacity: int) -> Routing:
    """Place the claims of `choices` into expert buffers of `capacity` slots (GShard Algorithm 1).

    A claim's position is its exclusive running count among the claims on its expert in buffer
    order (first choices, then second choices); claims at position >= capacity are dropped.
    (Algorithm 1 starts the second choices after the *kept* first-choice count, min(load, C);
    counting all first claims gives the same positions whenever a second choice can fit.)"""
    if capacity < 1:
        raise ConfigError(f"expert capacity must be >= 1, got {capacity}")
    g, s, k = choices.expert.shape
    claims = choices.claims()  # [G, k·S, E]
    before = claims.cumsum(1) - claims
    position = (before * claims).sum(-1).reshape(g, k, s).transpose(1, 2)
    kept = choices.active & (position < capacity)
    gate = choices.gate * kept
    dropped = (choices.active & ~kept).sum()
    dropped_tokens = (~kept.any(-1)).sum()
    return Routing(
        choices.expert,
        position,
        kept,
        gate,
        int(capacity),
        choices.experts,
        claims.sum(1),
        dropped,
        dropped_tokens,
    )


def load_balancing_loss(choices: Choices) -> Tensor:
    """Switch's auxiliary loss E · Σ_e f_e · P_e per group, averaged over groups (Fedus et al.
    2021, eq. 4): f_e the fraction of tokens whose first choice is e (not differentiable), P_e the
    mean router probability of e. 1.0 when the load is perfectly balanced."""
    e = choices.experts
    f = F.one_hot(choices.expert[..., 0], e).float().mean(1)  # [G, E]
    p = choices.probs.mean(1)  # [G, E]
    return (e * (f * p).sum(-1)).mean()


def router_z_loss(choices: Choices) -> Tensor:
    """ST-MoE's router z-loss (Zoph et al. 2022, eq. 5): mean over tokens of logsumexp(logits)²."""
    return torch.logsumexp(choices.logits, dim=-1).square().mean()


def route(
    logits: Tensor, top_k: int, capacity_factor: float, uniform: Tensor | None = None
) -> tuple[Routing, Choices]:
    """`choose` then `assign` within one process: capacity from `capacity_factor`, or with
    capacity_factor = 0 (dropless) the largest load of any expert in any of the groups."""
    choices = choose(logits, top_k, uniform)
    s = logits.shape[1]
    if capacity_factor > 0:
        cap = expert_capacity(s, choices.experts, top_k, capacity_factor)
    else:
        cap = max(1, int(choices.load().max()))
    return assign(choices, cap), choices


class Router(nn.Module):
    """The gating network: `weight` [E, d_model] (no bias), drawn as `nn.Linear(d_model, E)` draws
    its weight. forward(x [G, S, d]) -> Choices.

    random_routing (top-2 only): keep the second choice where 2·g2 > U(0,1), U drawn from
    `generator` (torch's default generator when None, which activation checkpointing restores
    before recomputing)."""

    def __init__(
        self,
        d_model: int,
        experts: int,
        top_k: int = 2,
        random_routing: bool = False,
        generator: torch.Generator | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if top_k not in (1, 2) or top_k > experts:
            raise ConfigError(f"top_k must be 1 or 2 and at most experts={experts}, got {top_k}")
        if random_routing and top_k != 2:
            raise ConfigError("random_routing applies to the second expert of top_k=2 routing only")
        self.experts, self.top_k = experts, top_k
        self.random_routing, self.generator = random_routing, generator
        self.weight = nn.Linear(d_model, experts, bias=False, device=device, dtype=dtype).weight

    def forward(self, x: Tensor) -> Choices:
        logits = F.linear(x.float(), self.weight.float())
        uniform = None
        if self.random_routing:
            uniform = torch.rand(x.shape[:2], generator=self.generator, device=x.device)
        return choose(logits, self.top_k, uniform)

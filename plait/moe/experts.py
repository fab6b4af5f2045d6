"""A bank of feed-forward experts computed with one batched matmul.

Every expert is GPT-2's position-wise MLP, d_model -> d_ff -> d_model with biases and the tanh
GELU (as `plait.models.gpt.FeedForward`). The bank stores its E_local experts stacked,

    w1 [E_local, d_model, d_ff]   b1 [E_local, d_ff]   w2 [E_local, d_ff, d_model]   b2 [E_local, d_model]

and computes all of them at once on an [E_local, N, d_model] buffer (N tokens per expert) with two
`torch.baddbmm` calls: one kernel per matmul whatever the number of experts, instead of a Python
loop of E small matmuls (GShard's einsum "EGCM,EMH->EGCH" over the expert dim, Lepikhin et al.
2020, §2.2). Padding rows of the buffer (empty capacity slots) are computed too and ignored.

**Expert parallelism.** With a mesh the bank holds experts [r·E/ep, (r+1)·E/ep) of the E, where r
is this rank's coordinate along `axis` (default "ep"), and every parameter's placement says it is
sharded over that axis along dim 0 (`plait.placement.Shard(0)`): checkpoints, `gather_full` and
the gradient norm treat them like any sharded parameter. Initialisation draws the whole bank of E
experts (each expert as `nn.Linear` draws its layers: U(±1/sqrt(fan_in)) for weight and bias) and
keeps this rank's slice, so a bank built under one seed holds the same experts whatever ep is.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from plait.errors import ConfigError
from plait.placement import Shard, set_shard

if TYPE_CHECKING:
    from plait.mesh import Mesh

__all__ = ["Experts", "is_expert_param", "EXPERT_ATTR"]

EXPERT_ATTR = "_plait_expert"


def is_expert_param(p: Tensor) -> bool:
    """Whether `p` belongs to an expert bank (its gradient is complete over ep after backward:
    the combine all-to-all brought back every ep rank's tokens' gradients)."""
    return bool(getattr(p, EXPERT_ATTR, False))


def _uniform(shape, bound: float, device, dtype) -> Tensor:
    return torch.empty(shape, device=device, dtype=dtype).uniform_(-bound, bound)


class Experts(nn.Module):
    """E_local = experts / ep feed-forward experts (d_model -> d_ff -> d_model, GELU, biases).

    forward(x [E_local, N, d_model]) -> [E_local, N, d_model]: expert i applied to x[i].

    Args:
        experts: E, the number of experts of the whole layer (over every ep rank).
        mesh, axis: where the experts are split; None keeps all E on this rank.
        bias: biases in both layers (GPT-2's are on).
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        experts: int,
        mesh: Mesh | None = None,
        axis: str = "ep",
        bias: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        n = 1 if mesh is None else mesh.size(axis)
        if experts < 1 or experts % n:
            raise ConfigError(
                f"Experts: experts={experts} must be a positive multiple of {axis}={n} "
                f"(each rank holds experts/{axis} of them)"
            )
        self.experts, self.local = experts, experts // n
        self.first = 0 if mesh is None else mesh.rank(axis) * self.local  # global id of local expert 0
        self.d_model, self.d_ff = d_model, d_ff
        own = slice(self.first, self.first + self.local)
        b1, b2 = 1 / math.sqrt(d_model), 1 / math.sqrt(d_ff)
        # Draw the whole bank, weights then biases, and keep this rank's experts.
        full = {
            "w1": _uniform((experts, d_model, d_ff), b1, device, dtype),
            "w2": _uniform((experts, d_ff, d_model), b2, device, dtype),
        }
        if bias:
            full["b1"] = _uniform((experts, d_ff), b1, device, dtype)
            full["b2"] = _uniform((experts, d_model), b2, device, dtype)
        for name, t in full.items():
            p = nn.Parameter(t[own].clone())
            setattr(p, EXPERT_ATTR, True)
            if mesh is not None:
                set_shard(p, axis, Shard(dim=0))
            self.register_parameter(name, p)
        if not bias:
            self.register_parameter("b1", None)
            self.register_parameter("b2", None)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 3 or x.shape[0] != self.local or x.shape[2] != self.d_model:
            raise ConfigError(
                f"Experts: input of shape {tuple(x.shape)}, expected [{self.local}, tokens, {self.d_model}]"
            )
        h = torch.bmm(x, self.w1) if self.b1 is None else torch.baddbmm(self.b1.unsqueeze(1), x, self.w1)
        h = F.gelu(h, approximate="tanh")
        return torch.bmm(h, self.w2) if self.b2 is None else torch.baddbmm(self.b2.unsqueeze(1), h, self.w2)

    def extra_repr(self) -> str:
        return (
            f"experts={self.local} of {self.experts} (first {self.first}), "
            f"d_model={self.d_model}, d_ff={self.d_ff}"
        )

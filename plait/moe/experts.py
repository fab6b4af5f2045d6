"""A bank of feed-forward experts stored stacked: one batched matmul on an accelerator, one matmul
per expert on the CPU.

Every expert is GPT-2's position-wise MLP, d_model -> d_ff -> d_model with biases and the tanh
GELU (as `plait.models.gpt.FeedForward`). The bank stores its E_local experts stacked,

    w1 [E_local, d_model, d_ff]   b1 [E_local, d_ff]   w2 [E_local, d_ff, d_model]   b2 [E_local, d_model]

and computes them on an [E_local, N, d_model] buffer (N tokens per expert). Padding rows of the
buffer (empty capacity slots) are computed too and ignored.

* Off the CPU: two `torch.baddbmm` calls, one kernel per matmul whatever the number of experts,
  instead of a Python loop of E small matmuls (GShard's einsum "EGCM,EMH->EGCH" over the expert
  dim, Lepikhin et al. 2020, §2.2); kernel launches are what costs there, and the caching
  allocator reuses the [E_local, N, d_ff] intermediates.
* On the CPU: the same two calls on one expert at a time (batches of one, slices of the same
  stacked parameters). A call costs next to nothing there, and the intermediates are one
  expert's [N, d_ff], blocks the next expert's forward and backward reuse from glibc's heap. The
  batched [E_local, N, d_ff] blocks are E_local times larger, and while glibc's trim threshold
  (it grows with the largest block the process has freed) is below a step's peak, the heap
  hands them back to the OS after a step and page-faults them in again. In the ep = 2 layer of
  `benchmarks/moe.py` (E_local = 2, N = 1280, d_ff = 512), timed outside that script, the
  batched form took ~1,300-3,300 minor faults a step and this one ~150-1,100, and the step was
  6-13% shorter; where nothing faults (glibc made never to trim, or a process that already
  freed larger blocks, as that script after its capacity-4 parity pass) both take the same
  time. The arithmetic is the batched form's, entry by entry: at sizes like those outputs and
  gradients are bitwise equal. On tiny problems the two can differ in the last bit, as MKL's
  batched GEMM and the GELU's vectorised loop take other paths for small or ragged sizes
  (`tests/test_moe.py` checks both).

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
        args = (x, self.w1, self.b1, self.w2, self.b2)
        return _per_expert(*args) if x.device.type == "cpu" else _batched(*args)

    def extra_repr(self) -> str:
        return (
            f"experts={self.local} of {self.experts} (first {self.first}), "
            f"d_model={self.d_model}, d_ff={self.d_ff}"
        )


def _batched(x: Tensor, w1: Tensor, b1: Tensor | None, w2: Tensor, b2: Tensor | None) -> Tensor:
    """The bank on [E_local, N, d_model] as two batched matmuls (what the bank runs off the CPU)."""
    h = torch.bmm(x, w1) if b1 is None else torch.baddbmm(b1.unsqueeze(1), x, w1)
    h = F.gelu(h, approximate="tanh")
    return torch.bmm(h, w2) if b2 is None else torch.baddbmm(b2.unsqueeze(1), h, w2)


def _per_expert(x: Tensor, w1: Tensor, b1: Tensor | None, w2: Tensor, b2: Tensor | None) -> Tensor:
    """`_batched` one expert at a time (what the bank runs on the CPU): the same calls on batches
    of one, so the intermediates are one expert's size. The slices come from `split`, whose
    backward concatenates the experts' gradients into one tensor (indexing would give each expert
    a zero-filled gradient of the whole bank, summed afterwards)."""
    none = [None] * x.shape[0]
    parts = zip(
        x.split(1),
        w1.split(1),
        none if b1 is None else b1.split(1),
        w2.split(1),
        none if b2 is None else b2.split(1),
    )
    return torch.cat([_batched(*part) for part in parts])

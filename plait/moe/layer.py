"""The mixture-of-experts layer with expert parallelism over the mesh's `ep` axis (GShard §2.2-2.3).

    y, stats = MoE(d_model, d_ff, experts=8, top_k=2, capacity_factor=1.25, mesh=mesh)(x)

x [..., d_model] is cut into G groups of S consecutive tokens (`group_size` = S; by default one
group: all the tokens this rank's forward gets, i.e. its micro-batch). Each group is routed on
its own (`plait.moe.router`), so the result does not depend on how groups are spread over ranks.

**Dispatch, experts, combine.** The kept claims of every group are copied into a dispatch buffer
[E, G·C, d] (expert e's C slots of group g at rows g·C .. g·C+C-1 of e's block; empty slots are
zero). Without expert parallelism the bank computes it directly. With ep > 1, rank r holds experts
[r·E/ep, (r+1)·E/ep): one all-to-all over `axis` sends each rank the slices of its own experts
(GShard's dispatch), the bank computes [E/ep, ep·G·C, d], and the inverse all-to-all returns the
results to the ranks the tokens came from (combine). Backward runs the same two exchanges in
reverse (`plait.comm.autograd.all_to_all_along`), so a forward-backward pass issues four
all-to-alls, all through `plait.comm` (the ledger counts them).

**Equal shapes everywhere.** C depends only on S, E, k and the capacity factor, which every rank
of the ep axis shares, so every all-to-all has equal, known splits and no shape is exchanged. In
dropless mode (capacity_factor = 0) C is the largest load of any expert in any group of any ep
rank: one all-reduce(max) of one int64 over the axis before dispatch. A rank whose experts get no
tokens still sends, receives and computes its (zero) buffer, so no collective waits for it.

Each output token is Σ_k gate_k · expert_k(x): zero for a token all of whose claims were dropped
(the caller adds the residual).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from plait.comm import ops
from plait.comm.autograd import all_to_all_along
from plait.errors import ConfigError
from plait.moe.experts import Experts
from plait.moe.router import Choices, Router, assign, expert_capacity, load_balancing_loss, router_z_loss

if TYPE_CHECKING:
    from plait.mesh import Mesh

__all__ = ["MoE", "MoEStats", "attach_loss"]


@dataclasses.dataclass
class MoEStats:
    """What one forward of a `MoE` layer reports about this rank's groups.

    aux_loss: Switch's load-balancing loss (mean over the groups; differentiable, coefficient not
        applied). z_loss: the router z-loss (mean over tokens; differentiable, no coefficient).
    tokens_per_expert: [E] int64, claims on each of the E experts (global expert ids) summed over
        this rank's groups, before capacity.
    dropped: int64 scalar, claims over capacity. dropped_tokens: tokens none of whose claims was
        kept (their MoE output is zero). dropped_fraction: dropped / claims.
    capacity: C, the slots per expert per group (the same on every rank of the ep axis).
    The counts are detached tensors (no device sync); reduce them over the batch axes for a global
    figure."""

    aux_loss: Tensor
    z_loss: Tensor
    tokens_per_expert: Tensor
    dropped: Tensor
    dropped_tokens: Tensor
    dropped_fraction: Tensor
    capacity: int

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class _AttachLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, loss, scale):
        ctx.scale, ctx.like = scale, (loss.shape, loss.dtype, loss.device)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.like
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


def attach_loss(y: Tensor, loss: Tensor, scale: float = 1.0) -> Tensor:
    """`y` unchanged, with `loss` (a scalar, e.g. `stats.aux_loss`) riding on its backward: when
    the gradient of `y` arrives, `loss` receives gradient `scale`, as if `scale · loss` had been
    added to the objective. A model can then return only its activations (a pipeline stage, a
    plain `nn.Module` block) and still train its routers on the auxiliary losses; `scale` carries
    the coefficient and the objective's own normalisation (e.g. 1/micro-batches)."""
    if not (y.requires_grad and loss.requires_grad):
        return y
    return _AttachLoss.apply(y, loss, float(scale))


class MoE(nn.Module):
    """A mixture-of-experts feed-forward layer: router + expert bank, experts split over `axis`.

    Args:
        d_model, d_ff: sizes of every expert (d_model -> d_ff -> d_model).
        experts: E, the number of experts over all ranks; a multiple of the axis size.
        top_k: 1 (Switch) or 2 (GShard).
        capacity_factor: C = ceil(k · capacity_factor · S / E) slots per expert and group; 0 is
            dropless (C = the largest load, agreed over the axis).
        mesh, axis: the experts are split over this axis of `mesh` (None: all experts here).
        group_size: S, tokens per routing group; None: all the tokens of one forward are one group.
            The number of tokens must be a multiple of it.
        random_routing, generator: GShard's random routing of the second expert (top-2), U(0,1)
            drawn from `generator` (torch's default generator when None).
        bias: biases in the experts.
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        experts: int,
        top_k: int = 2,
        capacity_factor: float = 1.0,
        mesh: Mesh | None = None,
        axis: str = "ep",
        group_size: int | None = None,
        random_routing: bool = False,
        generator: torch.Generator | None = None,
        bias: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if capacity_factor < 0:
            raise ConfigError(f"MoE: capacity_factor must be >= 0 (0 = dropless), got {capacity_factor}")
        if group_size is not None and group_size < 1:
            raise ConfigError(f"MoE: group_size must be a positive token count or None, got {group_size}")
        self.d_model, self.experts_total, self.top_k = d_model, experts, top_k
        self.capacity_factor, self.group_size = float(capacity_factor), group_size
        self.mesh, self.axis = mesh, axis
        self.ep = 1 if mesh is None else mesh.size(axis)
        self.router = Router(d_model, experts, top_k, random_routing, generator, device=device, dtype=dtype)
        self.experts = Experts(d_model, d_ff, experts, mesh, axis, bias=bias, device=device, dtype=dtype)

    def capacity(self, tokens_per_group: int, choices: Choices) -> int:
        """C for groups of `tokens_per_group` tokens routed as `choices`: the capacity formula, or
        in dropless mode the largest load of any expert in any group of the axis (one all-reduce)."""
        if self.capacity_factor > 0:
            return expert_capacity(tokens_per_group, self.experts_total, self.top_k, self.capacity_factor)
        most = choices.load().max().reshape(1).to(torch.int64)
        if self.ep > 1:
            ops.all_reduce(most, self.mesh, self.axis, op="max")
        return max(1, int(most.item()))

    def forward(self, x: Tensor) -> tuple[Tensor, MoEStats]:
        d, e = self.d_model, self.experts_total
        if x.shape[-1] != d:
            raise ConfigError(f"MoE: input of shape {tuple(x.shape)}, expected [..., {d}]")
        tokens = x.numel() // d
        s = self.group_size or tokens
        if tokens % s:
            raise ConfigError(f"MoE: {tokens} tokens are not a whole number of groups of group_size={s}")
        g = tokens // s
        xg = x.reshape(g, s, d)
        choices = self.router(xg)
        c = self.capacity(s, choices)
        routing = assign(choices, c)

        # Dispatch: claim (group, token, k) -> row expert·G·C + group·C + position of [E·G·C (+1)];
        # claims not kept go to one spare row past the end, cut off before the exchange.
        slot = routing.slots()  # [G, S, k] within the group's [E·C]; E·C when not kept
        group = torch.arange(g, device=x.device).view(g, 1, 1)
        row = torch.where(routing.kept, (slot // c) * (g * c) + group * c + slot % c, e * g * c)
        row = row.reshape(-1)
        # The buffer is gathered, not scattered: each row names the token it holds (`tokens`, a
        # zero row past the input's end, for an empty slot), and one index_select fills it. So
        # no zeroed buffer is written and then overwritten, and no k-fold copy of the input is
        # made; backward adds each row's gradient to its token (index_add), which for a token's
        # k <= 2 claims is the same sum as before, whatever the order.
        token = torch.arange(tokens, device=x.device).view(g, s, 1).expand(g, s, self.top_k)
        source = torch.full((e * g * c + 1,), tokens, dtype=torch.long, device=x.device)
        source.scatter_(0, row, token.reshape(-1))  # kept rows are distinct; the spare is cut off
        padded = torch.cat([x.reshape(tokens, d), x.new_zeros(1, d)])
        buffer = padded.index_select(0, source[:-1]).view(e, g * c, d)

        if self.ep > 1:  # [E, G·C, d] -> this rank's experts' slots from every rank [E/ep, ep·G·C, d]
            buffer = all_to_all_along(buffer, self.mesh, self.axis, split_dim=0, concat_dim=1)
        out = self.experts(buffer)
        if self.ep > 1:  # and back to the ranks the tokens came from: [E, G·C, d]
            out = all_to_all_along(out, self.mesh, self.axis, split_dim=1, concat_dim=0)

        # Combine: y = Σ_k gate_k · out[row_k]; the spare row is zero and so is a dropped gate.
        out = torch.cat([out.reshape(e * g * c, d), out.new_zeros(1, d)])
        picked = out.index_select(0, row).view(g, s, self.top_k, d)
        y = (picked.float() * routing.gate.unsqueeze(-1)).sum(2).to(x.dtype)

        claims = choices.active.sum()
        stats = MoEStats(
            aux_loss=load_balancing_loss(choices),
            z_loss=router_z_loss(choices),
            tokens_per_expert=routing.load.sum(0).detach(),
            dropped=routing.dropped.detach(),
            dropped_tokens=routing.dropped_tokens.detach(),
            dropped_fraction=(routing.dropped / claims.clamp_min(1)).detach().float(),
            capacity=c,
        )
        return y.reshape(x.shape), stats

    def extra_repr(self) -> str:
        mode = "dropless" if self.capacity_factor == 0 else f"capacity_factor={self.capacity_factor}"
        return f"top_k={self.top_k}, {mode}, ep={self.ep} over '{self.axis}', group_size={self.group_size}"

"""Tensor-parallel layers: Megatron-LM's column/row split of linear layers and the vocab split.

Shoeybi et al. 2019 (Megatron-LM, §3) split a linear layer Y = X A^T + b over the t ranks of the
"tp" axis in one of two ways:

* **column-parallel**: A is split along its output features, A = [A_1; ...; A_t], so rank i
  computes Y_i = X A_i^T + b_i, its slice of the output features (eq. 3). X must be whole on
  every rank: Megatron's `f` (identity forward, all-reduce backward) enters the region.
* **row-parallel**: A is split along its input features, A = [A_1, ..., A_t], and the input
  arrives split the same way, so Y = Σ_i X_i A_i^T (eq. 4): the partial products are summed by
  Megatron's `g` (all-reduce forward, identity backward), then the replicated bias is added.

A column-parallel layer followed by an elementwise function and a row-parallel layer (the MLP,
eq. 3-4; attention with heads split is the same pattern) therefore costs one all-reduce forward
and one backward. With sequence parallelism (Korthikanti et al. 2022, §4.2.2) the activations
outside these regions are split along the sequence dim: `f` becomes an all-gather along the
sequence (reduce-scatter backward) and `g` a reduce-scatter (all-gather backward).

The embedding is split along the vocabulary (Shoeybi et al. 2019, §3, "input embedding"): rank i
holds rows [i·V'/t, (i+1)·V'/t) of the table padded to V' (a multiple of t), looks up the ids
that fall in its range, writes zeros for the others, and `g` sums the result.

**Replicated parameters under sequence parallelism.** A parameter that is replicated over tp but
applied to a sequence shard (the row-parallel bias here, LayerNorm weights in a model) receives
only a partial gradient on each rank. Their placement (`plait.placement`) says so
(``grad_partial`` over tp): the engines sum their gradients over tp with the batch axes (or
`allreduce_sequence_parallel_grads` does it by hand). Sharded parameters' placements record the
dim of the full tensor they are a slice of, so a global gradient norm can tell shards, which are
summed over tp, from replicas, which are counted once.

**Initialisation.** Without ``full_weight`` a layer draws the full-size weight exactly as
``nn.Linear`` / ``nn.Embedding`` would (same RNG calls, same device) and keeps its slice, so a
model built under the same seed on every rank equals the dense model built under that seed,
whatever t is. This materialises the full tensor once per layer; on the meta device nothing is
drawn.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from plait.comm.autograd import (
    copy_to_parallel,
    gather_from_parallel,
    gather_from_sequence,
    reduce_from_parallel,
    reduce_scatter_to_sequence,
    scatter_to_parallel,
)
from plait.errors import ConfigError
from plait.placement import Shard, placement, set_grad_partial, set_shard

if TYPE_CHECKING:
    from plait.mesh import Mesh

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "allreduce_sequence_parallel_grads",
    "pad_to_multiple",
    "sequence_parallel_params",
    "shard_range",
]


def pad_to_multiple(n: int, k: int) -> int:
    """The smallest multiple of `k` that is >= `n` (Megatron pads the vocabulary this way)."""
    if k < 1:
        raise ConfigError(f"pad_to_multiple: k must be >= 1, got {k}")
    return -(-n // k) * k


def shard_range(n: int, rank: int, t: int) -> tuple[int, int]:
    """[start, end) of rank `rank`'s slice when `n` items are padded to a multiple of `t` and cut
    into `t` equal slices; both ends are clipped to `n`, so the padding is never in the range
    (the last ranks' ranges may be shorter, or empty)."""
    if not 0 <= rank < t:
        raise ConfigError(f"shard_range: rank {rank} is outside [0, {t})")
    per = pad_to_multiple(n, t) // t
    return min(rank * per, n), min((rank + 1) * per, n)


def _require_divisible(cls: str, name: str, value: int, mesh: Mesh, axis: str) -> int:
    t = mesh.size(axis)
    if value % t:
        lower, upper = value - value % t, value - value % t + t
        hint = f"{lower} or {upper}" if lower > 0 else f"{upper}"
        raise ConfigError(
            f"{cls}: {name}={value} is not divisible by {axis}={t}; "
            f"choose {name} a multiple of {t} (e.g. {hint}) or a different {axis}"
        )
    return value // t


def _linear_init(out_features: int, in_features: int, bias: bool, device, dtype):
    """A full-size weight (and bias) drawn exactly as nn.Linear.reset_parameters draws them."""
    w = torch.empty(out_features, in_features, device=device, dtype=dtype)
    nn.init.kaiming_uniform_(w, a=math.sqrt(5))
    b = None
    if bias:
        bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
        b = torch.empty(out_features, device=device, dtype=dtype)
        nn.init.uniform_(b, -bound, bound)
    return w, b


def _check_full(cls: str, name: str, tensor: Tensor | None, shape: tuple[int, ...]) -> None:
    if tensor is not None and tuple(tensor.shape) != shape:
        raise ConfigError(f"{cls}: {name} has shape {tuple(tensor.shape)}, expected {shape}")


def _param(t: Tensor, device, dtype, shard_dim: int | None = None, axis: str = "tp") -> nn.Parameter:
    p = nn.Parameter(t.detach().to(device=device, dtype=dtype).clone(memory_format=torch.contiguous_format))
    if shard_dim is not None:
        set_shard(p, axis, Shard(shard_dim))
    return p


class ColumnParallelLinear(nn.Module):
    """Linear layer split along its output features (Megatron-LM, Shoeybi et al. 2019, §3, eq. 3).

    This rank holds ``weight`` [out_features/t, in_features] and ``bias`` [out_features/t], rows
    [r·out/t, (r+1)·out/t) of the full layer. ``forward(x)`` takes the full input, replicated
    over `axis` (or, with ``sequence_parallel``, this rank's slice along ``seq_dim``, all-gathered
    first: Korthikanti et al. 2022, §4.2.2) and returns this rank's slice of the output features,
    or the whole output when ``gather_output``.

    ``full_weight`` / ``full_bias``: the full [out, in] / [out] tensors to take this rank's slice
    of (identical on every rank); by default they are drawn as ``nn.Linear`` draws them.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        mesh: Mesh,
        axis: str = "tp",
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        seq_dim: int = 0,
        device=None,
        dtype=None,
        full_weight: Tensor | None = None,
        full_bias: Tensor | None = None,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        per = _require_divisible(name, "out_features", out_features, mesh, axis)
        _check_full(name, "full_weight", full_weight, (out_features, in_features))
        _check_full(name, "full_bias", full_bias, (out_features,))
        if full_bias is not None and not bias:
            raise ConfigError(f"{name}: full_bias given but bias=False")
        self.mesh, self.axis = mesh, axis
        self.in_features, self.out_features = in_features, out_features
        self.out_features_per_rank = per
        self.gather_output, self.sequence_parallel, self.seq_dim = gather_output, sequence_parallel, seq_dim
        if full_weight is None:
            full_weight, drawn_bias = _linear_init(out_features, in_features, bias, device, dtype)
            full_bias = drawn_bias if full_bias is None else full_bias
        rows = slice(mesh.rank(axis) * per, (mesh.rank(axis) + 1) * per)
        dtype = full_weight.dtype if dtype is None else dtype
        device = full_weight.device if device is None else device
        self.weight = _param(full_weight[rows], device, dtype, shard_dim=0, axis=axis)
        if bias:
            b = full_bias[rows] if full_bias is not None else torch.zeros(per, device=device, dtype=dtype)
            self.bias = _param(b, device, dtype, shard_dim=0, axis=axis)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, mesh: Mesh, axis: str = "tp", **kw) -> ColumnParallelLinear:
        """This rank's rows of `linear` (which must be identical on every rank of `axis`)."""
        kw.setdefault("device", linear.weight.device)
        kw.setdefault("dtype", linear.weight.dtype)
        return cls(
            linear.in_features,
            linear.out_features,
            mesh,
            axis,
            bias=linear.bias is not None,
            full_weight=linear.weight.detach(),
            full_bias=None if linear.bias is None else linear.bias.detach(),
            **kw,
        )

    def forward(self, x: Tensor) -> Tensor:
        if self.sequence_parallel:
            x = gather_from_sequence(x, self.mesh, self.axis, dim=self.seq_dim)
        else:
            x = copy_to_parallel(x, self.mesh, self.axis)
        y = F.linear(x, self.weight, self.bias)
        if self.gather_output:
            y = gather_from_parallel(y, self.mesh, self.axis, dim=-1)
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"({self.out_features_per_rank} per rank over '{self.axis}'), bias={self.bias is not None}, "
            f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}"
        )


class RowParallelLinear(nn.Module):
    """Linear layer split along its input features (Megatron-LM, Shoeybi et al. 2019, §3, eq. 4).

    This rank holds ``weight`` [out_features, in_features/t] (columns [r·in/t, (r+1)·in/t) of
    the full layer) and the whole ``bias`` [out_features], replicated. ``forward(x)`` takes this
    rank's slice of the input features (``input_is_parallel``; otherwise the full input, which
    is split first), sums the partial products over `axis` (all-reduce, or with
    ``sequence_parallel`` a reduce-scatter along ``seq_dim``: Korthikanti et al. 2022, §4.2.2)
    and adds the bias after the reduction, so it is added once.

    With ``sequence_parallel`` the bias sees only this rank's sequence slice, so its gradient is
    partial over `axis`: its placement says so (see `plait.placement`).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        mesh: Mesh,
        axis: str = "tp",
        bias: bool = True,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        seq_dim: int = 0,
        device=None,
        dtype=None,
        full_weight: Tensor | None = None,
        full_bias: Tensor | None = None,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        per = _require_divisible(name, "in_features", in_features, mesh, axis)
        _check_full(name, "full_weight", full_weight, (out_features, in_features))
        _check_full(name, "full_bias", full_bias, (out_features,))
        if full_bias is not None and not bias:
            raise ConfigError(f"{name}: full_bias given but bias=False")
        self.mesh, self.axis = mesh, axis
        self.in_features, self.out_features = in_features, out_features
        self.in_features_per_rank = per
        self.input_is_parallel, self.sequence_parallel, self.seq_dim = (
            input_is_parallel,
            sequence_parallel,
            seq_dim,
        )
        if full_weight is None:
            full_weight, drawn_bias = _linear_init(out_features, in_features, bias, device, dtype)
            full_bias = drawn_bias if full_bias is None else full_bias
        cols = slice(mesh.rank(axis) * per, (mesh.rank(axis) + 1) * per)
        dtype = full_weight.dtype if dtype is None else dtype
        device = full_weight.device if device is None else device
        self.weight = _param(full_weight[:, cols], device, dtype, shard_dim=1, axis=axis)
        if bias:
            b = full_bias if full_bias is not None else torch.zeros(out_features, device=device, dtype=dtype)
            self.bias = _param(b, device, dtype)
            if sequence_parallel:
                set_grad_partial(self.bias, axis)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, mesh: Mesh, axis: str = "tp", **kw) -> RowParallelLinear:
        """This rank's columns of `linear` (which must be identical on every rank of `axis`)."""
        kw.setdefault("device", linear.weight.device)
        kw.setdefault("dtype", linear.weight.dtype)
        return cls(
            linear.in_features,
            linear.out_features,
            mesh,
            axis,
            bias=linear.bias is not None,
            full_weight=linear.weight.detach(),
            full_bias=None if linear.bias is None else linear.bias.detach(),
            **kw,
        )

    def forward(self, x: Tensor) -> Tensor:
        if not self.input_is_parallel:
            x = scatter_to_parallel(x, self.mesh, self.axis, dim=-1)
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence(y, self.mesh, self.axis, dim=self.seq_dim)
        else:
            y = reduce_from_parallel(y, self.mesh, self.axis)
        if self.bias is not None:
            y = y + self.bias
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} ({self.in_features_per_rank} per rank over '{self.axis}'), "
            f"out_features={self.out_features}, bias={self.bias is not None}, "
            f"input_is_parallel={self.input_is_parallel}, sequence_parallel={self.sequence_parallel}"
        )


class VocabParallelEmbedding(nn.Module):
    """Embedding table split along the vocabulary (Megatron-LM, Shoeybi et al. 2019, §3).

    The vocabulary of ``num_embeddings`` (V) ids is padded to ``padded_vocab`` (V', a multiple of
    t); this rank holds rows [``vocab_start``, ``vocab_end``) = [r·V'/t, (r+1)·V'/t) of the
    padded table as ``weight``. Padding rows are zero and never selected. ``forward(ids)`` looks
    up the ids in this rank's range, writes zeros for the others, and sums over `axis`
    (all-reduce, or with ``sequence_parallel`` a reduce-scatter along ``seq_dim`` of the output,
    so this rank returns its sequence slice: Korthikanti et al. 2022, §4.2.2).

    Ids outside [0, V) give a zero vector instead of an error: checking would cost a host sync.
    ``full_weight``: the full [V, D] table to take this rank's rows of; by default it is drawn
    as ``nn.Embedding`` draws it (N(0, 1)).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        mesh: Mesh,
        axis: str = "tp",
        padding_idx: int | None = None,
        sequence_parallel: bool = False,
        seq_dim: int = 0,
        device=None,
        dtype=None,
        full_weight: Tensor | None = None,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        _check_full(name, "full_weight", full_weight, (num_embeddings, embedding_dim))
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ConfigError(f"{name}: padding_idx={padding_idx} is outside the vocabulary")
            padding_idx %= num_embeddings
        t, r = mesh.size(axis), mesh.rank(axis)
        self.mesh, self.axis = mesh, axis
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = padding_idx
        self.padded_vocab = pad_to_multiple(num_embeddings, t)
        self.vocab_per_rank = self.padded_vocab // t
        self.vocab_start = r * self.vocab_per_rank
        self.vocab_end = self.vocab_start + self.vocab_per_rank
        self.sequence_parallel, self.seq_dim = sequence_parallel, seq_dim
        if full_weight is None:
            full_weight = torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype)
            nn.init.normal_(full_weight)
            if padding_idx is not None:
                with torch.no_grad():
                    full_weight[padding_idx].zero_()
        dtype = full_weight.dtype if dtype is None else dtype
        device = full_weight.device if device is None else device
        real_end = min(self.vocab_end, num_embeddings)
        shard = torch.zeros(self.vocab_per_rank, embedding_dim, device=device, dtype=dtype)
        if real_end > self.vocab_start:
            shard[: real_end - self.vocab_start] = full_weight[self.vocab_start : real_end].detach()
        self.weight = _param(shard, device, dtype, shard_dim=0, axis=axis)

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, mesh: Mesh, axis: str = "tp", **kw) -> VocabParallelEmbedding:
        """This rank's rows of `emb` (which must be identical on every rank of `axis`)."""
        if emb.max_norm is not None or emb.scale_grad_by_freq or emb.sparse:
            raise ConfigError(
                "VocabParallelEmbedding.from_embedding: max_norm, scale_grad_by_freq and sparse "
                "are not supported; build the nn.Embedding without them"
            )
        kw.setdefault("device", emb.weight.device)
        kw.setdefault("dtype", emb.weight.dtype)
        kw.setdefault("padding_idx", emb.padding_idx)
        return cls(emb.num_embeddings, emb.embedding_dim, mesh, axis, full_weight=emb.weight.detach(), **kw)

    def forward(self, ids: Tensor) -> Tensor:
        # Ids of other ranks (and, on the last rank, the padding ids >= V) are masked: they look
        # up local row 0 and are zeroed, so their rows get no gradient here.
        outside = (ids < self.vocab_start) | (ids >= min(self.vocab_end, self.num_embeddings))
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        pad = self.padding_idx
        mine = pad is not None and self.vocab_start <= pad < self.vocab_end
        local_pad = pad - self.vocab_start if mine else None
        out = F.embedding(local, self.weight, padding_idx=local_pad)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(out, self.mesh, self.axis, dim=self.seq_dim)
        return reduce_from_parallel(out, self.mesh, self.axis)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start}, {self.vocab_end}) "
            f"of {self.padded_vocab} over '{self.axis}', sequence_parallel={self.sequence_parallel}"
        )


def sequence_parallel_params(module: nn.Module, axis: str = "tp") -> list[nn.Parameter]:
    """The parameters of `module` whose gradient is partial over `axis` (their placement):
    replicated over tp but applied to a sequence slice, so their gradients must be summed over tp
    (Korthikanti et al. 2022, §4.2.2). Each parameter once, in `module.parameters()` order."""
    return [p for p in module.parameters() if axis in placement(p).grad_partial]


def allreduce_sequence_parallel_grads(module: nn.Module, mesh: Mesh, axis: str = "tp") -> None:
    """Sum the gradients of `sequence_parallel_params(module)` over `axis`, in place.

    Call after backward, before clipping and the optimizer step, when no engine does it (every
    plait engine sums them in its gradient synchroniser, by their placements). Gradients of one
    dtype travel as one flat bucket of `plait.gradsync.GradSync` (all-reduce over `axis`, no
    scaling): one all-reduce per dtype, not one per parameter."""
    from plait.gradsync import GradSync, build_buckets

    params = [p for p in sequence_parallel_params(module, axis) if p.grad is not None]
    if mesh.size(axis) == 1 or not params:
        return
    sync = GradSync(build_buckets(params, 1 << 62), mesh, axis, scale=1.0, trigger="manual")
    sync.grads_ready(params)
    sync.finish()

"""Megatron-LM's column- and row-parallel linear layers (Shoeybi et al. 2019, §3, eq. 3-4), with
sequence parallelism (Korthikanti et al. 2022, §4.2.2); see `plait.tensor_parallel.layers`.

**Initialisation.** Without ``full_weight`` a layer draws the full-size weight exactly as
``nn.Linear`` would (same RNG calls, same device) and keeps its slice, so a model built under the
same seed on every rank equals the dense model built under that seed, whatever t is. This
materialises the full tensor once per layer; on the meta device nothing is drawn.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Self

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
from plait.placement import set_grad_partial
from plait.tensor_parallel.shards import check_full, require_divisible, sharded_param

if TYPE_CHECKING:
    from plait.mesh import Mesh


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


class _ParallelLinear(nn.Module):
    """What the column- and row-parallel layers share: the full tensors they take a slice of, and
    their construction from an nn.Linear."""

    def _setup(
        self,
        split: str,
        in_features: int,
        out_features: int,
        mesh: Mesh,
        axis: str,
        bias: bool,
        *,
        sequence_parallel: bool,
        seq_dim: int,
        device,
        dtype,
        full_weight: Tensor | None,
        full_bias: Tensor | None,
    ):
        """Check and record the shared settings; returns (features per rank, this rank's slice of
        the split dim, full weight, full bias, device, dtype): the given full tensors (checked),
        or drawn as nn.Linear draws them; the slices' device and dtype default to the full weight's."""
        name = type(self).__name__
        per = require_divisible(
            name, split, out_features if split == "out_features" else in_features, mesh, axis
        )
        check_full(name, "full_weight", full_weight, (out_features, in_features))
        check_full(name, "full_bias", full_bias, (out_features,))
        if full_bias is not None and not bias:
            raise ConfigError(f"{name}: full_bias given but bias=False")
        self.mesh, self.axis = mesh, axis
        self.in_features, self.out_features = in_features, out_features
        self.sequence_parallel, self.seq_dim = sequence_parallel, seq_dim
        if full_weight is None:
            full_weight, drawn_bias = _linear_init(out_features, in_features, bias, device, dtype)
            full_bias = drawn_bias if full_bias is None else full_bias
        part = slice(mesh.rank(axis) * per, (mesh.rank(axis) + 1) * per)
        dtype = full_weight.dtype if dtype is None else dtype
        device = full_weight.device if device is None else device
        return per, part, full_weight, full_bias, device, dtype

    @classmethod
    def from_linear(cls, linear: nn.Linear, mesh: Mesh, axis: str = "tp", **kw) -> Self:
        """This rank's slice of `linear` (which must be identical on every rank of `axis`): its
        rows for a column-parallel layer, its columns for a row-parallel one."""
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


class ColumnParallelLinear(_ParallelLinear):
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
        per, rows, full_weight, full_bias, device, dtype = self._setup(
            "out_features", in_features, out_features, mesh, axis, bias, sequence_parallel=sequence_parallel,
            seq_dim=seq_dim, device=device, dtype=dtype, full_weight=full_weight, full_bias=full_bias,
        )  # fmt: skip
        self.out_features_per_rank, self.gather_output = per, gather_output
        self.weight = sharded_param(full_weight[rows], device, dtype, shard_dim=0, axis=axis)
        if bias:
            b = full_bias[rows] if full_bias is not None else torch.zeros(per, device=device, dtype=dtype)
            self.bias = sharded_param(b, device, dtype, shard_dim=0, axis=axis)
        else:
            self.register_parameter("bias", None)

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


class RowParallelLinear(_ParallelLinear):
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
        per, cols, full_weight, full_bias, device, dtype = self._setup(
            "in_features", in_features, out_features, mesh, axis, bias, sequence_parallel=sequence_parallel,
            seq_dim=seq_dim, device=device, dtype=dtype, full_weight=full_weight, full_bias=full_bias,
        )  # fmt: skip
        self.in_features_per_rank, self.input_is_parallel = per, input_is_parallel
        self.weight = sharded_param(full_weight[:, cols], device, dtype, shard_dim=1, axis=axis)
        if bias:
            b = full_bias if full_bias is not None else torch.zeros(out_features, device=device, dtype=dtype)
            self.bias = sharded_param(b, device, dtype)
            if sequence_parallel:
                set_grad_partial(self.bias, axis)
        else:
            self.register_parameter("bias", None)

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

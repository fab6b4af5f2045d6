"""Memory-centric tiling (ZeRO-Infinity, Rajbhandari et al. 2021, §5.1.3).

A linear layer too large to materialise at once, even one layer at a time under ZeRO-3, is split
into tiles computed one after another. With the input features split into blocks i and the output
features into blocks j,

    y[..., j-block] = Σ_i  x[..., i-block] @ W_ij^T  (+ b_j)

so the layer's working memory is one tile's weight instead of the whole matrix. `TiledLinear`
holds each tile W_ij as its own small ``nn.Linear`` sub-module (the bias b_j sits on tile (0, j)),
so ZeRO-3, whose unit of gathering is a module, can gather one tile just before it is used and
free it right after, exactly as for any other module.

With ``recompute_tiles=True`` each tile's forward runs under activation checkpointing
(``torch.utils.checkpoint``, non-reentrant): autograd keeps only the tile's input slice, not the
tile's weight, and backward recomputes the tile, so a sharded tile's gathered weight is not held
from forward to backward (it is gathered again for the recomputation).

The result equals ``nn.Linear`` up to floating-point summation order (the partial products over
input blocks are added one after another); with ``in_splits=1`` it is the same computation.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from plait.errors import ConfigError

__all__ = ["TiledLinear", "split_sizes"]


def split_sizes(features: int, splits: int, what: str = "features") -> list[int]:
    """`features` split into `splits` contiguous blocks whose sizes differ by at most one (larger first)."""
    if not isinstance(splits, int) or isinstance(splits, bool) or splits < 1:
        raise ConfigError(f"{what} splits must be an integer >= 1, got {splits!r}")
    if splits > features:
        raise ConfigError(
            f"cannot split {features} {what} into {splits} tiles: at most {features} (one feature per tile)"
        )
    base, extra = divmod(features, splits)
    return [base + (1 if k < extra else 0) for k in range(splits)]


class TiledLinear(nn.Module):
    """``nn.Linear(in_features, out_features, bias)`` computed as `in_splits` x `out_splits` tiles.

    ``tiles[j][i]`` is an ``nn.Linear(in_sizes[i], out_sizes[j])`` holding W_ij, the block of the
    full weight at rows ``out_offsets[j]:`` and columns ``in_offsets[i]:``; only ``tiles[j][0]``
    has a bias (b_j). Initialisation draws every tile from nn.Linear's distribution for the *whole*
    layer, U(-1/√in_features, 1/√in_features), without building the whole weight.

    Example::

        layer = TiledLinear(8192, 32768, in_splits=4, out_splits=8)   # 32 tile weights of 4096 x 2048
        y = layer(x)                                                  # x: (..., 8192)
        dense = layer.to_linear()                                     # nn.Linear, same weights
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        in_splits: int = 1,
        out_splits: int = 1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        recompute_tiles: bool = False,
    ) -> None:
        super().__init__()
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"TiledLinear: {name} must be an integer >= 1, got {value!r}")
        self.in_features, self.out_features = in_features, out_features
        self.in_sizes = split_sizes(in_features, in_splits, "input features")
        self.out_sizes = split_sizes(out_features, out_splits, "output features")
        self.in_offsets = [sum(self.in_sizes[:i]) for i in range(in_splits)]
        self.out_offsets = [sum(self.out_sizes[:j]) for j in range(out_splits)]
        self.recompute_tiles = recompute_tiles
        self.tiles = nn.ModuleList(
            nn.ModuleList(
                nn.Linear(n_in, n_out, bias=bias and i == 0, device=device, dtype=dtype)
                for i, n_in in enumerate(self.in_sizes)
            )
            for n_out in self.out_sizes
        )
        self.reset_parameters()

    @property
    def in_splits(self) -> int:
        return len(self.in_sizes)

    @property
    def out_splits(self) -> int:
        return len(self.out_sizes)

    @property
    def has_bias(self) -> bool:
        return self.tiles[0][0].bias is not None

    def reset_parameters(self) -> None:
        """nn.Linear's init for the whole layer (kaiming-uniform with a=√5 gives ±1/√fan_in)."""
        bound = 1.0 / math.sqrt(self.in_features)
        with torch.no_grad():
            for row in self.tiles:
                for tile in row:
                    tile.weight.uniform_(-bound, bound)
                    if tile.bias is not None:
                        tile.bias.uniform_(-bound, bound)

    def _tile_out(self, tile: nn.Linear, x: Tensor) -> Tensor:
        if self.recompute_tiles and torch.is_grad_enabled():
            return checkpoint(tile, x, use_reentrant=False)
        return tile(x)

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"TiledLinear expects inputs with {self.in_features} features, got {tuple(x.shape)}"
            )
        blocks = [x.narrow(-1, off, n) for off, n in zip(self.in_offsets, self.in_sizes)]
        outs = []
        for row in self.tiles:
            acc = self._tile_out(row[0], blocks[0])
            for tile, block in zip(row[1:], blocks[1:]):
                acc = acc + self._tile_out(tile, block)
            outs.append(acc)
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def full_weight(self) -> Tensor:
        """The whole (out_features, in_features) weight assembled from the tiles (a new tensor)."""
        return torch.cat([torch.cat([t.weight.detach() for t in row], dim=1) for row in self.tiles], dim=0)

    def full_bias(self) -> Tensor | None:
        """The whole bias assembled from the tiles, or None."""
        if not self.has_bias:
            return None
        return torch.cat([row[0].bias.detach() for row in self.tiles])

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, in_splits: int = 1, out_splits: int = 1, recompute_tiles: bool = False
    ) -> TiledLinear:
        """A TiledLinear holding a copy of `linear`'s weight and bias, on its device and dtype."""
        w = linear.weight
        tiled = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            in_splits=in_splits,
            out_splits=out_splits,
            device=w.device,
            dtype=w.dtype,
            recompute_tiles=recompute_tiles,
        )
        with torch.no_grad():
            for j, row in enumerate(tiled.tiles):
                rows = slice(tiled.out_offsets[j], tiled.out_offsets[j] + tiled.out_sizes[j])
                for i, tile in enumerate(row):
                    cols = slice(tiled.in_offsets[i], tiled.in_offsets[i] + tiled.in_sizes[i])
                    tile.weight.copy_(w[rows, cols])
                if linear.bias is not None:
                    row[0].bias.copy_(linear.bias[rows])
        return tiled

    def to_linear(self) -> nn.Linear:
        """An nn.Linear with a copy of the assembled weight and bias."""
        w = self.tiles[0][0].weight
        linear = nn.Linear(
            self.in_features, self.out_features, bias=self.has_bias, device=w.device, dtype=w.dtype
        )
        with torch.no_grad():
            linear.weight.copy_(self.full_weight())
            if self.has_bias:
                linear.bias.copy_(self.full_bias())
        return linear

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.has_bias}, "
            f"in_splits={self.in_splits}, out_splits={self.out_splits}, "
            f"recompute_tiles={self.recompute_tiles}"
        )

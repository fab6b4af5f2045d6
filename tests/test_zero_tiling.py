"""Memory-centric tiling: TiledLinear equals nn.Linear (to 1e-6, abs and rel) forward and backward,
for even and uneven splits."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from plait.errors import ConfigError
from plait.zero.tiling import TiledLinear, split_sizes

CASES = [
    # in, out, in_splits, out_splits, bias, input shape prefix
    (16, 12, 1, 1, True, (5,)),
    (16, 12, 4, 3, True, (5,)),
    (17, 13, 3, 4, True, (2, 7)),  # uneven both ways, 3-D input
    (10, 7, 10, 7, False, (3, 4)),  # one feature per tile
    (33, 65, 2, 5, True, (2, 3, 4)),  # 4-D input
]


def reassemble_grad(tiled: TiledLinear) -> tuple[torch.Tensor, torch.Tensor | None]:
    w = torch.cat([torch.cat([t.weight.grad for t in row], dim=1) for row in tiled.tiles], dim=0)
    b = torch.cat([row[0].bias.grad for row in tiled.tiles]) if tiled.has_bias else None
    return w, b


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("n_in,n_out,si,so,bias,prefix", CASES)
def test_forward_backward_equal_linear(n_in, n_out, si, so, bias, prefix, recompute):
    torch.manual_seed(0)
    dense = nn.Linear(n_in, n_out, bias=bias)
    tiled = TiledLinear.from_linear(dense, si, so, recompute_tiles=recompute)
    assert sum(1 for _ in tiled.parameters()) == si * so + (so if bias else 0)
    x = torch.randn(*prefix, n_in)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = dense(x1), tiled(x2)
    assert y2.shape == y1.shape
    torch.testing.assert_close(y2, y1, atol=1e-6, rtol=1e-6)
    dy = torch.randn_like(y1)
    y1.backward(dy)
    y2.backward(dy)
    torch.testing.assert_close(x2.grad, x1.grad, atol=1e-6, rtol=1e-6)
    w_grad, b_grad = reassemble_grad(tiled)
    torch.testing.assert_close(w_grad, dense.weight.grad, atol=1e-6, rtol=1e-6)
    if bias:
        torch.testing.assert_close(b_grad, dense.bias.grad, atol=1e-6, rtol=1e-6)


def test_round_trip_and_layout():
    torch.manual_seed(1)
    dense = nn.Linear(11, 9)
    tiled = TiledLinear.from_linear(dense, in_splits=3, out_splits=2)
    assert tiled.in_sizes == [4, 4, 3] and tiled.out_sizes == [5, 4]
    assert tiled.tiles[1][2].weight.shape == (4, 3)
    assert torch.equal(tiled.tiles[1][2].weight, dense.weight[5:, 8:])
    assert torch.equal(tiled.tiles[1][0].bias, dense.bias[5:]) and tiled.tiles[1][1].bias is None
    back = tiled.to_linear()
    assert isinstance(back, nn.Linear)
    assert torch.equal(back.weight, dense.weight) and torch.equal(back.bias, dense.bias)
    no_bias = TiledLinear.from_linear(nn.Linear(6, 4, bias=False), 2, 2).to_linear()
    assert no_bias.bias is None
    # One tile per module: each tile can be a ZeRO-3 gathering unit of its own.
    names = [n for n, _ in tiled.named_parameters()]
    assert names[:3] == ["tiles.0.0.weight", "tiles.0.0.bias", "tiles.0.1.weight"]
    assert "in_splits=3, out_splits=2" in repr(tiled)


def test_construction_dtype_device_and_init():
    torch.manual_seed(2)
    layer = TiledLinear(400, 300, in_splits=4, out_splits=3, dtype=torch.float64)
    assert all(p.dtype == torch.float64 for p in layer.parameters())
    bound = 1 / math.sqrt(400)
    w = layer.full_weight()
    assert w.shape == (300, 400) and w.abs().max() <= bound and w.std() > 0.5 * bound
    assert layer.full_bias().abs().max() <= bound
    meta = TiledLinear(1 << 16, 1 << 16, in_splits=8, out_splits=8, device="meta")
    assert all(p.is_meta for p in meta.parameters()) and meta.tiles[7][7].weight.shape == (8192, 8192)
    with torch.no_grad():
        y = layer(torch.randn(2, 400, dtype=torch.float64))
    assert y.shape == (2, 300)


def test_bad_splits():
    with pytest.raises(ConfigError, match="cannot split 4 input features into 5 tiles"):
        TiledLinear(4, 8, in_splits=5)
    with pytest.raises(ConfigError, match="cannot split 8 output features into 9 tiles"):
        TiledLinear(4, 8, out_splits=9)
    with pytest.raises(ConfigError, match="splits must be an integer >= 1, got 0"):
        TiledLinear(4, 8, in_splits=0)
    with pytest.raises(ConfigError, match="in_features must be an integer >= 1"):
        TiledLinear(0, 8)
    with pytest.raises(ValueError, match="expects inputs with 4 features"):
        TiledLinear(4, 8)(torch.randn(2, 5))
    assert split_sizes(10, 3) == [4, 3, 3] and split_sizes(9, 3) == [3, 3, 3]


@pytest.mark.parametrize("recompute", [False, True])
def test_recompute_tiles_keeps_no_tile_weight_for_backward(recompute):
    layer = TiledLinear(8, 6, in_splits=2, out_splits=3, recompute_tiles=recompute)
    weights = {p.data_ptr() for n, p in layer.named_parameters() if n.endswith("weight")}
    saved: list[int] = []

    def pack(t):
        saved.append(t.data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(torch.randn(4, 8, requires_grad=True))
    assert bool(weights & set(saved)) is not recompute
    y.sum().backward()
    assert all(p.grad is not None for p in layer.parameters())

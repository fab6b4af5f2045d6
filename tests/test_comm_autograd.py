"""plait.comm.autograd: every differentiable collective, forward and backward, with its ledger.

Each rank builds every rank's inputs and upstream gradients from fixed seeds, so it can compute
on its own what the collective must return and which gradient must come back. Upstream
gradients are non-contiguous on purpose. One spawn of 4 ranks checks tp=4, then tp=2 inside a
dp=2 x tp=2 mesh.
"""

import pytest
import torch

from plait.comm.autograd import (
    all_to_all_along,
    copy_to_parallel,
    gather_from_parallel,
    gather_from_sequence,
    reduce_from_parallel,
    reduce_scatter_to_sequence,
    scatter_to_parallel,
)
from plait.errors import ConfigError
from plait.mesh import Mesh
from plait.testing import run_ranks

SHAPE = (4, 8, 12)  # every dim divisible by 2 and 4


def _data(seed, shape):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


def _noncontig(seed, shape):
    """Random values of `shape` in a transposed (non-contiguous) layout."""
    t = _data(seed, tuple(reversed(shape))).permute(*reversed(range(len(shape))))
    assert not t.is_contiguous() or len(shape) < 2
    return t


def _close(name, actual, expected):
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=0, msg=lambda m: f"{name}: {m}")


def _counts(mesh, step):
    return {op: row.count for (op, axis), row in mesh.ledger.rows(step).items() if axis == "tp"}


def _check(mesh, step, name, fn, x, expected_y, grad, expected_grad, fwd_ops, bwd_ops):
    """Run fn forward and backward under two ledger steps and compare values and traffic."""
    x = x.clone().requires_grad_(True)
    mesh.ledger.set_step(step)
    y = fn(x)
    mesh.ledger.set_step(step + 1)
    y.backward(grad)
    _close(f"{name} forward", y, expected_y)
    _close(f"{name} backward", x.grad, expected_grad)
    assert _counts(mesh, step) == fwd_ops, (name, "forward", _counts(mesh, step))
    assert _counts(mesh, step + 1) == bwd_ops, (name, "backward", _counts(mesh, step + 1))


def _autograd_ops(mesh):
    t, r = mesh.size("tp"), mesh.rank("tp")
    X = [_data(100 + i, SHAPE) for i in range(t)]  # rank i's input where inputs differ
    G = [_noncontig(200 + i, SHAPE) for i in range(t)]  # rank i's upstream gradient
    total_x, total_g = sum(X), sum(G)
    step = 0

    def nxt():
        nonlocal step
        step += 2
        return step

    AR, AG, RS = {"all_reduce": 1}, {"all_gather": 1}, {"reduce_scatter": 1}

    # f: identity forward, all-reduce backward.
    f = lambda x: copy_to_parallel(x, mesh)
    _check(mesh, nxt(), "copy_to_parallel", f, X[0], X[0], G[r], total_g, {}, AR)
    # g: all-reduce forward, identity backward.
    g = lambda x: reduce_from_parallel(x, mesh)
    _check(mesh, nxt(), "reduce_from_parallel", g, X[r], total_x, G[0], G[0], AR, {})

    for dim in (-1, 1, 0):
        shard = lambda full, d=dim: full.chunk(t, d)[r]
        H = [_noncontig(300 + i, shard(X[0]).shape) for i in range(t)]  # per-rank shard-shaped grads
        S = [X[i].chunk(t, dim)[0].contiguous() for i in range(t)]  # per-rank shard-shaped inputs

        fn = lambda x, d=dim: scatter_to_parallel(x, mesh, dim=d)
        _check(mesh, nxt(), f"scatter dim={dim}", fn, X[0], shard(X[0]), H[r], torch.cat(H, dim), {}, AG)

        fn = lambda x, d=dim: gather_from_parallel(x, mesh, dim=d)
        _check(mesh, nxt(), f"gather dim={dim}", fn, S[r], torch.cat(S, dim), G[0], shard(G[0]), AG, {})

        fn = lambda x, d=dim: reduce_scatter_to_sequence(x, mesh, dim=d)
        expected = shard(total_x)
        _check(mesh, nxt(), f"reduce_scatter dim={dim}", fn, X[r], expected, H[r], torch.cat(H, dim), RS, AG)

        fn = lambda x, d=dim: gather_from_sequence(x, mesh, dim=d)
        _check(
            mesh, nxt(), f"gather_seq dim={dim}", fn, S[r], torch.cat(S, dim), G[r], shard(total_g), AG, RS
        )

    for split, concat in ((0, 1), (1, 0), (2, 2), (-1, 0)):
        # Rank r receives slice r (along split) of every rank's input, concatenated along concat.
        y = torch.cat([X[i].chunk(t, split)[r] for i in range(t)], dim=concat)
        Gy = [_noncontig(400 + j, y.shape) for j in range(t)]
        # Rank r's input slice j went to rank j, at position r along concat.
        grad = torch.cat([Gy[j].chunk(t, concat)[r] for j in range(t)], dim=split)
        fn = lambda x, s=split, c=concat: all_to_all_along(x, mesh, "tp", s, c)
        a2a = {"all_to_all": 1}
        _check(mesh, nxt(), f"all_to_all {split}->{concat}", fn, X[r], y, Gy[r], grad, a2a, a2a)

    # One f and one g around a sharded product: 1 all-reduce forward, 1 backward (Megatron §3).
    w = _data(500 + r, SHAPE)
    fg = lambda x: reduce_from_parallel(copy_to_parallel(x, mesh) * w, mesh)
    expected = X[0] * sum(_data(500 + i, SHAPE) for i in range(t))
    s = nxt()
    _check(
        mesh,
        s,
        "f then g",
        fg,
        X[0],
        expected,
        G[0],
        G[0] * sum(_data(500 + i, SHAPE) for i in range(t)),
        AR,
        AR,
    )
    assert mesh.ledger.rows(s)[("all_reduce", "tp")].payload_bytes == X[0].numel() * 4

    # Over an axis of size 1 every op is the identity and sends nothing.
    mesh.ledger.set_step(1000)
    x = X[0].clone().requires_grad_(True)
    ops = [
        lambda v: copy_to_parallel(v, mesh, "ep"),
        lambda v: reduce_from_parallel(v, mesh, "ep"),
        lambda v: scatter_to_parallel(v, mesh, "ep", dim=1),
        lambda v: gather_from_parallel(v, mesh, "ep", dim=1),
        lambda v: reduce_scatter_to_sequence(v, mesh, "ep", dim=1),
        lambda v: gather_from_sequence(v, mesh, "ep", dim=1),
        lambda v: all_to_all_along(v, mesh, "ep", 0, 1),
    ]
    for op in ops:
        assert op(x) is x
    (x * 2).sum().backward()
    assert mesh.ledger.rows(1000) == {}

    # A dim that does not divide by the axis size is refused with both numbers.
    odd = torch.zeros(5, 2 * t)
    for op in (scatter_to_parallel, reduce_scatter_to_sequence):
        with pytest.raises(ConfigError, match=f"size 5, not divisible by the {t} ranks"):
            op(odd, mesh, dim=0)
    with pytest.raises(ConfigError, match="not divisible"):
        all_to_all_along(odd, mesh, "tp", 0, 1)
    with pytest.raises(ConfigError, match="out of range"):
        gather_from_parallel(odd, mesh, dim=2)
    assert all(axis == "tp" for step in mesh.ledger.steps() for _, axis in mesh.ledger.rows(step))


def _both_meshes():
    # tp=4 over the whole world, then tp=2 inside a dp=2 x tp=2 mesh (tp rank != global rank).
    for shape in (dict(tp=4), dict(dp=2, tp=2)):
        mesh = Mesh(**shape, timeout_s=60)
        _autograd_ops(mesh)
        mesh.close()
    return True


def test_every_differentiable_collective_at_tp_4_and_2():
    assert all(run_ranks(_both_meshes, 4, timeout=120))

"""plait.gradsync.GradSync on live ranks against sums and means written out by hand: the
bucketed all-reduce (manual and hook triggers, several buckets), its scale, accumulation, a
missing gradient (error or zeros), the delivery, the reduce-scatter's shards (padded), hybrid
sharding's replicate axis, and gradients partial over tp. Every rank's gradients are seeded
random tensors that the parent process draws again to compute what each rank should hold."""

import pytest
import torch
from torch import nn

from plait.errors import DataParallelError
from plait.testing import run_ranks

SHAPES = {"a": (3,), "b": (4, 2), "c": (6,)}  # 17 elements: pads at 2 and at 4 shards
NAMES = list(SHAPES)


def _grad(name: str, rank: int, step: int = 0) -> torch.Tensor:
    seed = 1000 * step + 100 * NAMES.index(name) + rank
    return torch.randn(SHAPES[name], generator=torch.Generator().manual_seed(seed))


def _flat(rank: int, step: int = 0) -> torch.Tensor:
    return torch.cat([_grad(n, rank, step).reshape(-1) for n in NAMES])


# --- what each rank runs ----------------------------------------------------------------------


def _params() -> dict[str, nn.Parameter]:
    return {n: nn.Parameter(torch.zeros(s)) for n, s in SHAPES.items()}


def _sync(mesh, params, axis="dp", capacity=1 << 20, buckets=None, **kw):
    from plait.gradsync import GradSync, build_buckets

    names = {id(p): n for n, p in params.items()}
    buckets = buckets or build_buckets(list(params.values()), capacity, name=lambda p: names[id(p)])
    return GradSync(buckets, mesh, axis, trigger=kw.pop("trigger", "manual"), **kw)


def _manual(mesh, r, names=NAMES, step=0, capacity=1 << 20, **kw) -> dict:
    """Set this rank's gradients of `names`, declare them ready, finish: the gradients after."""
    params = _params()
    sync = _sync(mesh, params, capacity=capacity, **kw)
    for n in names:
        params[n].grad = _grad(n, r, step)
    sync.grads_ready([params[n] for n in names])
    sync.finish()
    return {n: None if p.grad is None else p.grad.clone() for n, p in params.items()}


def _recorder():
    seen = []
    return seen, lambda b, reduced: seen.append((b.index, list(b.names), reduced.clone()))


def _hook_trigger(mesh, r) -> dict:
    """Backward fires the reduction: loss = sum_p <p, g_p> makes each p.grad this rank's g_p."""
    params = _params()
    _sync(mesh, params, capacity=16, trigger="hook")  # 4 floats: a bucket per parameter
    loss = sum((p * _grad(n, r)).sum() for n, p in params.items())
    loss.backward()
    return {n: p.grad.clone() for n, p in params.items()}


def _accumulated(mesh, r) -> dict:
    """Two backwards added into the buckets (the first inside no_sync): the mean of their sum."""
    params = _params()
    sync = _sync(mesh, params, accumulate=True)
    with sync.no_sync():
        for n, p in params.items():
            p.grad = _grad(n, r, step=0)
        sync.grads_ready(params.values())
    dropped = all(p.grad is None for p in params.values())  # the buckets hold them
    for n, p in params.items():
        p.grad = _grad(n, r, step=1)
    sync.grads_ready(params.values())
    sync.finish()
    return {"dropped": dropped, **{n: p.grad.clone() for n, p in params.items()}}


def _errors(mesh, r) -> dict:
    out = {}
    params = _params()
    sync = _sync(mesh, params, missing="error")
    for n in ("a", "c"):
        params[n].grad = _grad(n, r)
    sync.grads_ready([params["a"], params["c"]])
    try:
        sync.finish()
        out["missing"] = "finished"
    except DataParallelError as exc:
        out["missing"] = str(exc)
    params["a"].grad = _grad("a", r)
    sync.grad_ready(params["a"])
    try:
        sync.grad_ready(params["a"])
        out["twice"] = "accepted"
    except DataParallelError as exc:
        out["twice"] = str(exc)
    return out


def _scattered(mesh, r, axis="dp", **kw):
    from plait.gradsync import GradBucket

    params = _params()
    seen, deliver = _recorder()
    bucket = GradBucket(0, list(params.values()), NAMES, n=mesh.size(axis))
    sync = _sync(mesh, params, axis=axis, buckets=[bucket], reduce="reduce_scatter", deliver=deliver, **kw)
    for n, p in params.items():
        p.grad = _grad(n, r)
    sync.grads_ready(params.values())
    sync.finish()
    return seen


def _checks() -> dict:
    import torch.distributed as dist

    from plait.mesh import Mesh
    from plait.placement import set_grad_partial

    n, r = dist.get_world_size(), dist.get_rank()
    out = {}
    with Mesh(dp=n, watchdog=False) as mesh:
        out["mean"] = _manual(mesh, r, capacity=16)
        out["mean-one-bucket"] = _manual(mesh, r)
        out["sum"] = _manual(mesh, r, scale=1.0)
        out["scale"] = _manual(mesh, r, scale=0.25)
        out["zeros"] = _manual(mesh, r, names=("a", "c"), missing="zeros")
        out["hook"] = _hook_trigger(mesh, r)
        out["accumulate"] = _accumulated(mesh, r)
        out["errors"] = _errors(mesh, r)
        seen, deliver = _recorder()
        _manual(mesh, r, names=("c", "b", "a"), capacity=16, deliver=deliver)  # ready last to first
        out["deliver"] = seen
        out["scatter"] = _scattered(mesh, r)
    if n == 4:
        with Mesh(dp=4, dp_shard=2, watchdog=False) as mesh:
            kw = dict(axis="dp_shard", scale=0.25, replicate_axis="dp_replicate")
            out["hybrid"] = _manual(mesh, r, **kw)
            out["hybrid-scatter"] = _scattered(mesh, r, **kw)
        with Mesh(dp=2, tp=2, watchdog=False) as mesh:
            from plait.gradsync import GradBucket

            params = _params()
            set_grad_partial(params["b"], "tp")
            seen, deliver = _recorder()
            bucket = GradBucket(0, list(params.values()), NAMES, n=2)
            sync = _sync(mesh, params, buckets=[bucket], reduce="reduce_scatter", deliver=deliver)
            for name, p in params.items():
                p.grad = _grad(name, r)
            sync.grads_ready(params.values())
            sync.finish()
            out["partial-scatter"] = seen
            params = _params()
            set_grad_partial(params["b"], "tp")
            sync = _sync(mesh, params, capacity=16)
            for name, p in params.items():
                p.grad = _grad(name, r)
            sync.grads_ready(params.values())
            sync.finish()
            out["partial"] = {name: p.grad.clone() for name, p in params.items()}
    return out


@pytest.fixture(scope="module")
def ranks_2():
    return run_ranks(_checks, 2, timeout=240)


@pytest.fixture(scope="module")
def ranks_4():
    return run_ranks(_checks, 4, timeout=240)


# --- what the parent expects ------------------------------------------------------------------


def _mean(name: str, ranks, step: int = 0) -> torch.Tensor:
    return sum(_grad(name, q, step) for q in ranks) / len(ranks)


def _close(got, want, what) -> None:
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=lambda m: f"{what}: {m}")


def _padded_shard(flat: torch.Tensor, n: int, r: int) -> torch.Tensor:
    per = -(-flat.numel() // n)
    return torch.cat([flat, torch.zeros(per * n - flat.numel())])[r * per : (r + 1) * per]


@pytest.mark.parametrize("world", [2, 4])
def test_all_reduce_is_the_mean_and_the_scale_applies(world, ranks_2, ranks_4):
    res = ranks_2 if world == 2 else ranks_4
    everyone = range(world)
    for r, out in enumerate(res):
        for name in NAMES:
            total = sum(_grad(name, q) for q in everyone)
            for check in ("mean", "mean-one-bucket", "hook"):
                _close(out[check][name], total / world, f"{check} {name} rank {r}")
            _close(out["sum"][name], total, f"scale=1 {name} rank {r}")
            _close(out["scale"][name], 0.25 * total, f"scale=0.25 {name} rank {r}")


@pytest.mark.parametrize("world", [2, 4])
def test_accumulated_gradients_are_reduced_once_as_their_sum(world, ranks_2, ranks_4):
    res = ranks_2 if world == 2 else ranks_4
    for r, out in enumerate(res):
        got = out["accumulate"]
        assert got["dropped"], "accumulate=True leaves .grad to the bucket"
        for name in NAMES:
            want = _mean(name, range(world), 0) + _mean(name, range(world), 1)
            _close(got[name], want, f"accumulated {name} rank {r}")


@pytest.mark.parametrize("world", [2, 4])
def test_a_missing_gradient_is_an_error_or_zeros(world, ranks_2, ranks_4):
    res = ranks_2 if world == 2 else ranks_4
    for r, out in enumerate(res):
        msg = out["errors"]["missing"]
        assert "1 parameter(s) received no gradient" in msg and ": b." in msg, msg
        assert "parameter a received its gradient twice" in out["errors"]["twice"], out["errors"]
        zeros = out["zeros"]
        assert torch.equal(zeros["b"], torch.zeros(SHAPES["b"])), zeros["b"]
        for name in ("a", "c"):
            _close(zeros[name], _mean(name, range(world)), f"zeros {name} rank {r}")


@pytest.mark.parametrize("world", [2, 4])
def test_deliver_gets_each_reduced_bucket_in_order(world, ranks_2, ranks_4):
    res = ranks_2 if world == 2 else ranks_4
    for r, out in enumerate(res):
        seen = out["deliver"]
        assert [(i, names) for i, names, _ in seen] == [(0, ["a"]), (1, ["b"]), (2, ["c"])], seen
        for _, (name,), reduced in seen:
            _close(reduced, _mean(name, range(world)).reshape(-1), f"delivered {name} rank {r}")


@pytest.mark.parametrize("world", [2, 4])
def test_reduce_scatter_leaves_each_rank_its_shard_of_the_mean(world, ranks_2, ranks_4):
    res = ranks_2 if world == 2 else ranks_4
    mean = sum(_flat(q) for q in range(world)) / world
    for r, out in enumerate(res):
        ((index, names, shard),) = out["scatter"]
        assert (index, names) == (0, NAMES)
        assert shard.numel() == -(-17 // world)
        _close(shard, _padded_shard(mean, world, r), f"shard of rank {r}")


def test_hybrid_sharding_sums_the_shards_over_the_replicas(ranks_4):
    mean = sum(_flat(q) for q in range(4)) / 4
    for r, out in enumerate(ranks_4):
        for name in NAMES:
            _close(out["hybrid"][name], _mean(name, range(4)), f"hybrid {name} rank {r}")
        ((_, _, shard),) = out["hybrid-scatter"]
        _close(shard, _padded_shard(mean, 2, r % 2), f"hybrid shard of rank {r}")  # dp_shard index


def test_partial_gradients_are_summed_over_tp_after_the_dp_mean(ranks_4):
    """dp2 x tp2 (rank = 2 dp + tp): a and c average over the rank's dp line; b, partial over
    tp, is the sum over tp of those means."""
    for r, out in enumerate(ranks_4):
        line = (r % 2, r % 2 + 2)
        want = {n: _mean(n, line) for n in NAMES}
        want["b"] = _mean("b", (0, 2)) + _mean("b", (1, 3))
        for name in NAMES:
            _close(out["partial"][name], want[name], f"partial {name} rank {r}")
        flat = torch.cat([want[n].reshape(-1) for n in NAMES])
        ((_, _, shard),) = out["partial-scatter"]
        _close(shard, _padded_shard(flat, 2, r // 2), f"partial shard of rank {r}")

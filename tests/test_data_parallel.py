"""DataParallel: parity with one process and with torch DDP, ledger, overlap, unused parameters."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from plait import comm
from plait.data_parallel import DataParallel
from plait.errors import DataParallelError
from plait.mesh import Mesh
from plait.testing import (
    assert_close_grad_norms,
    assert_close_losses,
    assert_close_params,
    grad_norm,
    run_ranks,
    single_process_reference,
    state_of,
)

STEPS = 20
GLOBAL_BATCH = 8
BUCKETS_ACCUM = [(25.0, 1), (0.004, 1), (0.004, 2), (0.02, 2)]  # (bucket_mb, micro-batches per rank)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(16, 64),
        nn.Tanh(),
        nn.Linear(64, 64),
        nn.Tanh(),
        nn.Linear(64, 32),
        nn.Tanh(),
        nn.Linear(32, 4),
    )


def _batches(steps: int = STEPS):
    g = torch.Generator().manual_seed(1234)
    return [
        (torch.randn(GLOBAL_BATCH, 16, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g))
        for _ in range(steps)
    ]


def _optimizer(model, kind):
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    # SGD without clipping: a gradient of the wrong scale changes the trajectory at once
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _reference(kind: str):
    def build():
        model = _model()
        return model, _optimizer(model, kind), lambda m, batch: nn.functional.mse_loss(m(batch[0]), batch[1])

    return single_process_reference(build, _batches(), STEPS)


def _train(model, opt, mesh, accum: int, set_to_none: bool = True):
    """Each rank takes its slice of every global batch, split into `accum` micro-batches.
    Returns the global losses and the gradient norms (after the all-reduce, before the step).
    `set_to_none=False` keeps `.grad` as a view of the bucket, so backward accumulates into it
    in place: DataParallel's other scaling branch."""
    n, r = mesh.size("dp"), mesh.rank("dp")
    per_rank = GLOBAL_BATCH // n
    losses, norms = [], []
    for step, (x, y) in enumerate(_batches()):
        mesh.ledger.set_step(step)
        xs, ys = x[r * per_rank : (r + 1) * per_rank], y[r * per_rank : (r + 1) * per_rank]
        opt.zero_grad(set_to_none=set_to_none)
        total = 0.0
        for i, (xm, ym) in enumerate(zip(xs.chunk(accum), ys.chunk(accum))):
            ctx = model.no_sync() if i < accum - 1 and hasattr(model, "no_sync") else _null()
            with ctx:
                loss = nn.functional.mse_loss(model(xm), ym) / accum
                loss.backward()
            total += float(loss)
        norms.append(grad_norm(model.parameters()))  # replicated: every rank holds the mean
        opt.step()
        t = torch.tensor([total], dtype=torch.float64)
        mesh.ledger.set_step(-1)  # keep the loss report out of the step's ledger
        comm.all_reduce(t, mesh, "dp")
        losses.append(float(t) / n)
    return losses, norms


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def _parity_checks():
    """Runs on every rank: many configurations in one spawn."""
    n = dist.get_world_size()
    mesh = Mesh(dp=n, timeout_s=60)
    nparams = sum(p.numel() for p in _model().parameters())
    configs = [(kind, mb, accum, True) for kind in ("adamw", "sgd") for mb, accum in BUCKETS_ACCUM]
    # zero_grad(set_to_none=False): .grad stays the bucket view and backward adds into it
    configs += [("sgd", 25.0, 1, False), ("sgd", 0.004, 2, False)]
    refs = {kind: _reference(kind) for kind in ("adamw", "sgd")}
    for kind, bucket_mb, accum, set_to_none in configs:
        if (GLOBAL_BATCH // n) % accum:
            continue
        ref = refs[kind]
        model = DataParallel(_model(seed=dist.get_rank() * 7), mesh, bucket_mb=bucket_mb)  # ranks differ:
        opt = _optimizer(model, kind)  # the broadcast at wrap must fix it
        mesh.ledger.clear()
        losses, norms = _train(model, opt, mesh, accum, set_to_none)
        what = f"{kind} bucket_mb={bucket_mb} accum={accum} set_to_none={set_to_none} world={n}"
        # the norms first: a wrong gradient scale shows there as a ratio at its first step
        assert_close_grad_norms(norms, ref.grad_norms, rtol=1e-5, what=what)
        assert_close_losses(losses, ref.losses, atol=1e-6, what=what)
        # AdamW divides by sqrt(v): a near-zero gradient's summation-order rounding (1e-9)
        # becomes a ~1e-6 parameter difference on some CPUs' kernels; SGD keeps 1e-6
        assert_close_params(state_of(model), ref.params, atol=1e-5 if kind == "adamw" else 1e-6, what=what)
        # Ledger: exactly the bucket all-reduces of one step, 4 bytes x parameters in all.
        rows = mesh.ledger.rows(STEPS - 1)
        assert set(rows) == {("all_reduce", "dp")}, rows
        ar = rows[("all_reduce", "dp")]
        assert ar.count == len(model.buckets), (ar.count, len(model.buckets))
        assert ar.payload_bytes == 4 * nparams, (ar.payload_bytes, nparams)
        assert abs(ar.bus_bytes - 2 * (n - 1) / n * 4 * nparams) < 1e-6
        if bucket_mb < 0.01:
            assert len(model.buckets) > 2
        model.remove_hooks()
    mesh.close()
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_parity_with_one_process(world, request):
    if world == 2:  # in the spawn that also checks against torch DDP
        results = [r["parity"] for r in request.getfixturevalue("ranks_2")]
    else:
        results = run_ranks(_parity_checks, world, timeout=240)
    assert all(results)


def _torch_ddp_and_overlap():
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    mesh = Mesh(dp=2, timeout_s=60)
    ours = DataParallel(_model(), mesh, bucket_mb=0.004)
    theirs = TorchDDP(_model(), bucket_cap_mb=0.004)
    opt_a, opt_b = _optimizer(ours, "adamw"), _optimizer(theirs, "adamw")
    _train(ours, opt_a, mesh, 1)
    _train(theirs, opt_b, mesh, 1)
    assert_close_params(state_of(ours), state_of(theirs), atol=1e-6, what="plait vs torch DDP")

    # Overlap: with small buckets the first all-reduce starts before the last gradient is ready.
    x, y = _batches(1)[0]
    for _ in range(3):
        t0 = __import__("time").time()
        nn.functional.mse_loss(ours(x), y).backward()
        starts = [e.t_start for e in mesh.recorder.entries() if e.op == "all_reduce" and e.t_start >= t0]
        assert len(starts) == len(ours.buckets)
        assert min(starts) < ours.last_hook_time <= ours.backward_end_time, (
            min(starts),
            ours.last_hook_time,
        )

    # A backward that raises part-way leaves no stale state: the next step is normal.
    def boom(grad):
        raise RuntimeError("injected backward failure")

    def arm(module, inputs, output):
        output.register_hook(boom)  # fires after the last layers' gradients have been bucketed

    h = ours.module[4].register_forward_hook(arm)
    try:
        nn.functional.mse_loss(ours(x), y).backward()
        raise AssertionError("the injected failure did not raise")
    except RuntimeError as exc:
        assert "injected backward failure" in str(exc)
    h.remove()
    nn.functional.mse_loss(ours(x), y).backward()  # no "received its gradient twice"
    g = ours.module[6].weight.grad.clone()
    comm.all_reduce(g, mesh, "dp")
    assert torch.allclose(g / 2, ours.module[6].weight.grad)

    # Unused parameter: a clear error naming it; tolerated with allow_unused.
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.used(x)

    torch.manual_seed(0)
    bad = DataParallel(Two(), mesh)
    try:
        bad(torch.randn(2, 4)).sum().backward()
        raise AssertionError("no error for an unused parameter")
    except (DataParallelError, RuntimeError) as exc:
        assert "unused.weight" in str(exc) and "allow_unused" in str(exc), str(exc)
    ok = DataParallel(Two(), mesh, allow_unused=True)
    ok(torch.randn(2, 4) * (1 + dist.get_rank())).sum().backward()
    assert ok.module.unused.weight.grad is not None and float(ok.module.unused.weight.grad.abs().sum()) == 0
    g = ok.module.used.weight.grad.clone()
    comm.all_reduce(g, mesh, "dp")
    assert torch.allclose(g / 2, ok.module.used.weight.grad)  # identical (averaged) on both ranks
    mesh.close()
    return True


def _two_ranks():
    return {"parity": _parity_checks(), "torch_ddp": _torch_ddp_and_overlap()}


@pytest.fixture(scope="module")
def ranks_2():
    """Every check on 2 ranks in one spawn (a spawn costs seconds), one after another."""
    return run_ranks(_two_ranks, 2, timeout=420)


def test_matches_torch_ddp_overlaps_and_names_unused(ranks_2):
    assert all(r["torch_ddp"] for r in ranks_2)

"""1-bit SGD with error feedback after the momentum (plait.optim.onebit_sgd): it is torch's
momentum SGD, before and after the switch to the compressed exchange (checked with a lossless
compressor against `torch.optim.SGD` on the whole batch), and with 1-bit the error feedback
conserves the momentum that was not sent."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from plait import comm, zero
from plait.comm.compress import OneBitCompressor, TopKCompressor
from plait.data_parallel import DataParallel
from plait.errors import ConfigError
from plait.mesh import Mesh
from plait.optim.onebit_sgd import MomentumHook, OneBitSGD
from plait.testing import run_ranks

LR, MU, WD, FREEZE, STEPS = 0.05, 0.9, 0.1, 2, 6


class _OneRank:
    def size(self, axis: str) -> int:
        return 1


def test_warmup_equals_torch_sgd_and_bad_momentum_is_refused():
    torch.manual_seed(0)
    ours = [torch.randn(8, 4, requires_grad=True), torch.randn(4, requires_grad=True)]
    theirs = [t.detach().clone().requires_grad_() for t in ours]

    def groups(ps):
        return [{"params": [ps[0]], "weight_decay": WD}, {"params": [ps[1]], "weight_decay": 0.0}]

    opt = OneBitSGD(groups(ours), MomentumHook(TopKCompressor(1.0), 100), _OneRank(), lr=LR, momentum=MU)
    ref = torch.optim.SGD(groups(theirs), lr=LR, momentum=MU)
    for _ in range(6):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        opt.step()
        ref.step()
        for p, q in zip(ours, theirs):
            torch.testing.assert_close(p, q, atol=1e-6, rtol=0)
    assert "exp_avg_sq" not in opt.state[ours[0]]  # no variance
    with pytest.raises(ConfigError, match=r"optim.momentum must be in \(0, 1\), got 0"):
        hook = MomentumHook(TopKCompressor(1.0), 1)
        OneBitSGD([torch.zeros(2, requires_grad=True)], hook, _OneRank(), momentum=0)


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 3))


def _flat(ts) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in ts])


def _gather(t: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    out = torch.empty(mesh.size("dp") * t.numel())
    comm.all_gather(out, t.contiguous(), mesh, "dp")
    return out.view(mesh.size("dp"), -1)


def _run(mesh: Mesh, kind: str) -> dict:
    """STEPS steps of the MLP on per-rank data; kind: "ddp" (lossless top-k, weight decay on the
    matrices), "zero2" (lossless top-k under ZeRO-2, no decay) or "onebit" (DataParallel)."""
    n, rank = mesh.size("dp"), dist.get_rank()
    model = _net()
    wd = WD if kind == "ddp" else 0.0
    comp = OneBitCompressor(min_group=8) if kind == "onebit" else TopKCompressor(1.0)
    hook = MomentumHook(comp, FREEZE)

    def factory(groups):
        return OneBitSGD(groups, hook, mesh, lr=LR, momentum=MU)

    groups = [{"params": [p], "weight_decay": wd if p.dim() > 1 else 0.0} for p in model.parameters()]
    if kind == "zero2":
        engine = zero.wrap(model, mesh, 2, factory, comm_hook=hook)
        fwd, opt = engine.module, engine
    else:
        fwd = DataParallel(model, mesh, comm_hook=hook)
        opt = factory(groups)
    params = list(model.parameters())
    gens = [torch.Generator().manual_seed(100 + r) for r in range(n)]
    after, conserved = [], 0.0
    for step in range(STEPS):
        hook.set_lr_scale(0.5 + 0.1 * step)  # as the trainer does; a lossless run must not care
        data = [(torch.randn(8, 12, generator=g), torch.randn(8, 3, generator=g)) for g in gens]
        nn.functional.mse_loss(fwd(data[rank][0]), data[rank][1]).backward()
        compressing = hook.compressing
        if kind == "onebit" and compressing:  # sent + kept = every rank's local momentum + old residual
            local = _flat(opt.state[p]["exp_avg"] * MU + (1 - MU) * p.grad for p in params)
            before = _gather(local / n + comp.residuals.get(0, torch.zeros_like(local)) / comp.lr_scale, mesh)
        opt.step()
        opt.zero_grad()
        if kind == "onebit" and compressing:
            kept = _gather(comp.residuals[0] / comp.lr_scale, mesh)
            sent = _flat(opt.state[p]["exp_avg"] for p in params)
            conserved = max(conserved, float((sent + kept.sum(0) - before.sum(0)).abs().max()))
        if kind == "zero2":
            full = engine.full_parameters()
            flat = torch.cat([full[k].reshape(-1) for k in ("0.weight", "0.bias", "2.weight", "2.bias")])
        else:
            flat = _flat(params)
        rows = _gather(flat, mesh)
        assert all(torch.equal(rows[0], r) for r in rows), f"{kind}: replicas differ at {step}"
        after.append(flat)
    if kind == "zero2":
        engine.close()
    else:
        fwd.remove_hooks()
    return {"after": after, "conserved": conserved, "compressing": hook.compressing}


def _ranks():
    mesh = Mesh(dp=dist.get_world_size(), timeout_s=60)
    out = {kind: _run(mesh, kind) for kind in ("ddp", "zero2", "onebit")}
    mesh.close()
    return out


def _torch_sgd(n: int, wd: float) -> list[torch.Tensor]:
    """torch.optim.SGD on the whole batch of the n ranks, in one process."""
    model = _net()
    groups = [{"params": [p], "weight_decay": wd if p.dim() > 1 else 0.0} for p in model.parameters()]
    opt = torch.optim.SGD(groups, lr=LR, momentum=MU)
    gens = [torch.Generator().manual_seed(100 + r) for r in range(n)]
    after = []
    for _ in range(STEPS):
        data = [(torch.randn(8, 12, generator=g), torch.randn(8, 3, generator=g)) for g in gens]
        x, y = torch.cat([d[0] for d in data]), torch.cat([d[1] for d in data])
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        after.append(_flat(model.parameters()))
    return after


def test_onebit_sgd_is_torch_sgd_with_a_lossless_exchange_and_conserves_with_1bit():
    got = run_ranks(_ranks, 2, timeout=300)[0]
    for kind, wd in (("ddp", WD), ("zero2", 0.0)):
        assert got[kind]["compressing"]
        ref = _torch_sgd(2, wd)
        gap = max(float((a - b).abs().max()) for a, b in zip(got[kind]["after"], ref))
        moved = float((ref[-1] - ref[0]).abs().max())
        assert gap < 1e-5 < moved, (kind, gap, moved)
    onebit = got["onebit"]
    assert onebit["compressing"] and onebit["conserved"] < 1e-6, onebit["conserved"]
    ref = _torch_sgd(2, 0.0)
    assert float((onebit["after"][-1] - ref[-1]).abs().max()) > 1e-4  # the compressor took part

"""1-bit Adam (plait.optim.onebit_adam): the warm-up is AdamW, the compression stage is Tang et
al.'s rule, error feedback conserves what was not sent, and replicas stay identical."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from plait import comm, zero
from plait.comm.compress import FP16Compressor, OneBitCompressor, TopKCompressor
from plait.data_parallel import DataParallel
from plait.errors import ConfigError
from plait.mesh import Mesh
from plait.optim.onebit_adam import MomentumHook, OneBitAdam
from plait.testing import run_ranks

LR, BETAS, EPS, WD = 0.01, (0.9, 0.99), 1e-8, 0.1


class _OneRank:
    """A stand-in mesh of one rank: the warm-up never communicates."""

    def size(self, axis: str) -> int:
        return 1


def _groups(ps):
    return [{"params": [ps[0]], "weight_decay": WD}, {"params": [ps[1]], "weight_decay": 0.0}]


def test_warmup_equals_torch_adamw():
    torch.manual_seed(0)
    ours = [torch.randn(8, 4, requires_grad=True), torch.randn(4, requires_grad=True)]
    theirs = [t.detach().clone().requires_grad_() for t in ours]
    opt = OneBitAdam(_groups(ours), MomentumHook(TopKCompressor(1.0), 100), _OneRank(), lr=LR, betas=BETAS)
    ref = torch.optim.AdamW(_groups(theirs), lr=LR, betas=BETAS, eps=EPS, foreach=False)
    for _ in range(6):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        opt.step()
        ref.step()
        for p, q in zip(ours, theirs):
            torch.testing.assert_close(p, q, atol=1e-7, rtol=0)
    assert opt.steps_done == 6 and not opt.hook.compressing


def test_parameters_without_gradients():
    """A parameter never given a gradient is never stepped and does not switch compression off;
    one whose first gradient comes after the freeze has no variance and stays unchanged."""
    torch.manual_seed(0)
    idle, late, used = (torch.randn(4, requires_grad=True) for _ in range(3))
    before = [idle.detach().clone(), late.detach().clone()]
    hook = MomentumHook(TopKCompressor(1.0), freeze_step=2)
    opt = OneBitAdam([idle, late, used], hook, _OneRank(), lr=LR)  # idle first: steps_done reads all
    for step in range(1, 7):
        used.grad = torch.randn(4)
        if step > 3:
            late.grad = torch.randn(4)
        opt.step()
        assert hook.compressing == (step >= 2) and opt.steps_done == step
    assert torch.equal(idle, before[0]) and torch.equal(late, before[1]) and torch.isfinite(used).all()


def test_bad_settings():
    with pytest.raises(ConfigError, match="freeze_step must be >= 1"):
        MomentumHook(TopKCompressor(0.1), 0)
    with pytest.raises(ConfigError, match="error-feedback compressor"):
        MomentumHook(FP16Compressor(), 10)
    hook = MomentumHook(OneBitCompressor(), 10)
    OneBitAdam([torch.zeros(3, requires_grad=True)], hook, _OneRank())
    with pytest.raises(ConfigError, match="already belongs"):
        OneBitAdam([torch.zeros(3, requires_grad=True)], hook, _OneRank())
    with pytest.raises(ValueError, match="betas"):
        OneBitAdam([torch.zeros(3)], MomentumHook(OneBitCompressor(), 10), _OneRank(), betas=(1.0, 0.9))


def _reference_step(params, grads, state, t, freeze_step):
    """Tang et al. (2021), Algorithm 1, with an exact exchange, written out: AdamW on the mean
    gradient for `freeze_step` steps; then the variance and its bias correction are frozen and
    the momentum is beta1 * m + (1 - beta1) * mean gradient."""
    b1, b2 = BETAS
    for i, (p, g) in enumerate(zip(params, grads)):
        m, v = state.setdefault(i, (torch.zeros_like(p), torch.zeros_like(p)))
        p.mul_(1 - LR * (WD if p.dim() > 1 else 0.0))
        m = b1 * m + (1 - b1) * g
        if t <= freeze_step:
            v = b2 * v + (1 - b2) * g * g
        bc2 = 1 - b2 ** min(t, freeze_step)
        p.sub_(LR / (1 - b1**t) * m / ((v / bc2).sqrt() + EPS))
        state[i] = (m, v)


def _gather(t: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    out = torch.empty(mesh.size("dp") * t.numel())
    comm.all_gather(out, t.contiguous(), mesh, "dp")
    return out.view(mesh.size("dp"), -1)


def _flat(ts) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in ts])


def _onebit_adam_ddp(freeze: int, steps: int):
    n, rank = dist.get_world_size(), dist.get_rank()
    mesh = Mesh(dp=n, timeout_s=60)
    out = {}
    for name in ("exact", "onebit"):
        mesh.ledger.clear()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 3))
        ref_model = [p.detach().clone() for p in model.parameters()]
        comp = TopKCompressor(1.0) if name == "exact" else OneBitCompressor(min_group=8)
        hook = MomentumHook(comp, freeze)
        ddp = DataParallel(model, mesh, comm_hook=hook)
        params = list(model.parameters())
        groups = [{"params": [p], "weight_decay": WD if p.dim() > 1 else 0.0} for p in params]
        opt = OneBitAdam(groups, hook, mesh, lr=LR, betas=BETAS, eps=EPS)
        gens = [torch.Generator().manual_seed(100 + r) for r in range(n)]  # each rank's data
        ref_state, max_diff, conserved = {}, 0.0, 0.0
        for step in range(1, steps + 1):
            hook.set_lr_scale(0.5 + 0.1 * step)  # as the trainer does; the exact run must not care
            mesh.ledger.set_step(step)
            data = [(torch.randn(8, 12, generator=g), torch.randn(8, 3, generator=g)) for g in gens]
            x, y = data[rank]
            nn.functional.mse_loss(ddp(x), y).backward()
            if name == "exact":  # one process, the whole batch, the paper's rule written out
                ref = [p.clone().requires_grad_() for p in ref_model]
                h = torch.tanh(torch.cat([d[0] for d in data]) @ ref[0].T + ref[1])
                loss = nn.functional.mse_loss(h @ ref[2].T + ref[3], torch.cat([d[1] for d in data]))
                grads = torch.autograd.grad(loss, ref)
                with torch.no_grad():
                    _reference_step(ref_model, grads, ref_state, step, freeze)
            compressing = hook.compressing
            mesh.ledger.set_step(-1)  # the test's own gathers are not the step's traffic
            if compressing:  # what error feedback must conserve: sent + kept = local momentum + old residual
                local = _flat(opt.state[p]["exp_avg"] * BETAS[0] + (1 - BETAS[0]) * p.grad for p in params)
                before = _gather(
                    local / n + comp.residuals.get(0, torch.zeros_like(local)) / comp.lr_scale, mesh
                )
            mesh.ledger.set_step(step)
            opt.step()
            opt.zero_grad()
            mesh.ledger.set_step(-1)
            if compressing:
                kept = _gather(comp.residuals[0] / comp.lr_scale, mesh)
                sent = _flat(opt.state[p]["exp_avg"] for p in params)
                conserved = max(conserved, float((sent + kept.sum(0) - before.sum(0)).abs().max()))
            rows = _gather(_flat(params), mesh)
            assert all(torch.equal(rows[0], rows[r]) for r in range(n)), f"{name}: replicas differ at {step}"
            if name == "exact":
                max_diff = max(max_diff, float((rows[0] - _flat(ref_model)).abs().max()))
        numel = sum(p.numel() for p in params)
        ledger = mesh.ledger.rows(steps)
        out[name] = {
            "max_diff": max_diff,
            "conserved": conserved,
            "compressing": hook.compressing,
            # the last step: no all-reduce in backward, one all-gather of the momentum (4·numel
            # uncompressed bytes)
            "last_step_ops": sorted(op for op, _ in ledger),
            "logical": ledger[("all_gather", "dp")].logical_bytes,
            "gathers": ledger[("all_gather", "dp")].count,
            "numel": numel,
        }
        ddp.remove_hooks()
    mesh.close()
    return out


def _data(gens):
    return [(torch.randn(8, 12, generator=g), torch.randn(8, 3, generator=g)) for g in gens]


def _reference(n: int, freeze: int, steps: int):
    """Algorithm 1 on the whole batch of the n ranks in one process: per step, the parameters
    after it and the loss before it."""
    torch.manual_seed(0)
    ref_model = [
        p.detach().clone() for p in nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 3)).parameters()
    ]
    gens = [torch.Generator().manual_seed(100 + r) for r in range(n)]
    state, params, losses = {}, [], []
    for step in range(1, steps + 1):
        data = _data(gens)
        ref = [p.clone().requires_grad_() for p in ref_model]
        h = torch.tanh(torch.cat([d[0] for d in data]) @ ref[0].T + ref[1])
        loss = nn.functional.mse_loss(h @ ref[2].T + ref[3], torch.cat([d[1] for d in data]))
        grads = torch.autograd.grad(loss, ref)
        with torch.no_grad():
            _reference_step(ref_model, grads, state, step, freeze)
        params.append(_flat(ref_model))
        losses.append(float(loss.detach()))
    return params, losses


def _onebit_adam_zero(freeze: int, steps: int, clip: float = 0.3):
    """1-bit Adam through `plait.zero.wrap` at stages 0 (DataParallel), 1 and 2, with a lossless
    compressor (top-k keeping everything) and with 1-bit; the 1-bit runs clip at `clip` (each
    rank its own gradient after the freeze). Returns, per (compressor, stage): the parameters
    after each step, the mean loss of the ranks, this rank's gradient norms, the ledger of
    backward and of the step, and the optimizer's bytes around the freeze."""
    n, rank = dist.get_world_size(), dist.get_rank()
    mesh = Mesh(dp=n, timeout_s=60)
    out = {}
    for name in ("exact", "onebit"):
        for stage in (0, 1, 2):
            mesh.ledger.clear()
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 3))
            hook = MomentumHook(
                TopKCompressor(1.0) if name == "exact" else OneBitCompressor(min_group=8), freeze
            )
            groups = [{"params": [p], "weight_decay": WD if p.dim() > 1 else 0.0} for p in model.parameters()]
            engine = zero.wrap(
                model,
                mesh,
                stage,
                lambda g, hook=hook: OneBitAdam(g, hook, mesh, lr=LR, betas=BETAS, eps=EPS),
                param_groups=groups,
                comm_hook=hook,
                bucket_mb=0.0005,  # several buckets: W2 + both biases, then W1
            )
            gens = [torch.Generator().manual_seed(100 + r) for r in range(n)]
            params, losses, norms, backward, stepped, memory = [], [], [], {}, {}, {}
            for step in range(1, steps + 1):
                engine.set_lr_scale(0.5 + 0.1 * step)  # as the trainer does; the exact run must not care
                x, y = _data(gens)[rank]
                mesh.ledger.set_step(1000 + step)  # backward apart from the step
                loss = nn.functional.mse_loss(engine.module(x), y)
                loss.backward()
                mesh.ledger.set_step(step)
                norms.append(engine.clip_grad_norm_(clip) if name == "onebit" else engine.grad_norm())
                engine.step()
                engine.zero_grad()
                if stage and step in (freeze, freeze + 1):  # before and after the momentum's gather
                    memory[step] = engine.memory()["optimizer"]
                mesh.ledger.set_step(-1)
                losses.append(loss.detach())
                params.append(_flat(model.parameters()))
            losses = _gather(torch.stack(losses), mesh).mean(0)
            for step in range(1, steps + 1):
                backward[step] = {
                    op: (r.count, r.logical_bytes) for (op, _), r in mesh.ledger.rows(1000 + step).items()
                }
                stepped[step] = {
                    op: (r.count, r.payload_bytes, r.logical_bytes)
                    for (op, _), r in mesh.ledger.rows(step).items()
                }
            res = {
                "params": params,
                "losses": losses.tolist(),
                "norms": norms,
                "compressing": hook.compressing,
            }
            if stage:
                res.update(backward=backward, step=stepped, memory=memory)
                res["buckets"] = [m.numel for m in hook.messages.values()]
                res["segments"] = sum(p.numel() for g in engine.optimizer.param_groups for p in g["params"])
                momentum = torch.cat(engine.optimizer._momentum)
                rows = _gather(momentum, mesh)
                res["momentum_replicated"] = all(torch.equal(rows[0], rows[r]) for r in range(n))
            out[(name, stage)] = res
            engine.close()
    mesh.close()
    return out


def _both(freeze: int, steps: int):
    return {"ddp": _onebit_adam_ddp(freeze, steps), "zero": _onebit_adam_zero(freeze, steps)}


FREEZE, STEPS = 3, 8


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def runs(request):
    """One spawn per world size: the DataParallel checks and the ZeRO runs. Returns (world,
    rank 0's results, every rank's results)."""
    world = request.param
    per_rank = run_ranks(_both, world, (FREEZE, STEPS), timeout=300)
    return world, per_rank[0], per_rank


def test_onebit_adam_ddp_matches_the_papers_rule(runs):
    _, res, _ = runs
    exact, onebit = res["ddp"]["exact"], res["ddp"]["onebit"]
    assert exact["compressing"] and onebit["compressing"]
    # a lossless compressor: 3 AdamW steps, 5 frozen-variance steps equal one process on the whole batch
    assert exact["max_diff"] < 1e-6, exact
    # 1-bit: every entry not sent this step is in some rank's residual, in units of the step
    assert onebit["conserved"] < 1e-6, onebit
    for r in (exact, onebit):
        assert r["last_step_ops"] == ["all_gather"] and r["logical"] == 4 * r["numel"] and r["gathers"] == 1


def test_onebit_adam_under_zero_matches_the_papers_rule(runs):
    """ZeRO-1 and ZeRO-2 with a lossless compressor: the warm-up (sharded AdamW on the
    reduce-scattered mean) and the compression stage (whole momentum, sharded frozen variance)
    equal Algorithm 1 on the whole batch in one process, parameters and losses, within 1e-6."""
    world, res, _ = runs
    ref_params, ref_losses = _reference(world, FREEZE, STEPS)
    for stage in (0, 1, 2):
        run = res["zero"][("exact", stage)]
        assert run["compressing"]
        diffs = [float((p - q).abs().max()) for p, q in zip(run["params"], ref_params)]
        assert max(diffs) < 1e-6, (stage, diffs)
        assert max(abs(a - b) for a, b in zip(run["losses"], ref_losses)) < 1e-6, stage
        assert run["losses"][-1] < run["losses"][0]  # and it trains


def test_onebit_adam_under_zero_equals_data_parallel_with_onebit(runs):
    """With the real 1-bit compressor and clipping active, ZeRO-1/2 leave the parameters and
    losses of the DataParallel (stage 0) run, to 1e-6: the same messages (per parameter, so the
    bucket layout does not matter), the same decoding, the same local clipping after the freeze.
    (Before the freeze the two clip the mean gradient by one rounding apart: torch's float32
    coefficient under DataParallel, ZeRO's own in float64.)"""
    world, res, per_rank = runs
    base = res["zero"][("onebit", 0)]
    for stage in (1, 2):
        run = res["zero"][("onebit", stage)]
        diffs = [float((p - q).abs().max()) for p, q in zip(run["params"], base["params"])]
        assert max(diffs) < 1e-6, (stage, diffs)
        assert max(abs(a - b) for a, b in zip(run["losses"], base["losses"])) < 1e-6
        assert run["momentum_replicated"]
        for r in per_rank:  # every rank's norm: the mean's in the warm-up, its own after the freeze
            ours, theirs = r["zero"][("onebit", stage)]["norms"], r["zero"][("onebit", 0)]["norms"]
            assert all(abs(a - b) <= 1e-6 * b for a, b in zip(ours, theirs)), (stage, ours, theirs)
    warm = [r["zero"][("onebit", 1)]["norms"] for r in per_rank]
    assert all(w[:FREEZE] == warm[0][:FREEZE] for w in warm)  # the mean gradient's, on every rank
    assert len({w[-1] for w in warm}) == world  # each rank's own gradient's
    assert min(base["norms"]) > 0.3  # clipping was active at every step
    # 1-bit really compresses: not the lossless run's parameters
    assert float((base["params"][-1] - res["zero"][("exact", 0)]["params"][-1]).abs().max()) > 1e-3


def test_onebit_adam_under_zero_ledger_and_memory(runs):
    """Backward reduce-scatters every bucket during the warm-up and communicates nothing after the
    freeze; a compressed step's only collectives are one all-gather per bucket of the compressor
    (standing for the fp32 momentum) and ZeRO's all-gather of the parameters, plus, at the freeze,
    one all-gather of the momentum from its shards. The whole momentum then costs 4 bytes per
    padded entry on every rank, instead of its shard."""
    world, res, _ = runs
    for name in ("exact", "onebit"):
        for stage in (1, 2):
            run = res["zero"][(name, stage)]
            sizes = run["buckets"]
            nb, padded = len(sizes), sum(sizes)
            assert nb >= 2
            for step in range(1, STEPS + 1):
                if step <= FREEZE:
                    assert run["backward"][step] == {"reduce_scatter": (nb, 4 * padded)}, step
                else:
                    assert run["backward"][step] == {}, (name, stage, step, run["backward"][step])
            first, last = run["step"][FREEZE + 1], run["step"][STEPS]
            assert set(first) == set(last) == {"all_gather"}, (first, last)  # no reduction: clipping is local
            count, payload, logical = last["all_gather"]
            assert count == 2 * nb and logical == 2 * 4 * padded, last
            if name == "onebit":
                assert payload < logical
            assert first["all_gather"][0] == 3 * nb and first["all_gather"][2] == 3 * 4 * padded
            memory = run["memory"]
            assert memory[FREEZE + 1] - memory[FREEZE] == 4 * (padded - run["segments"]), memory

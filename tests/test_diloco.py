"""DiLoCo and Streaming DiLoCo (plait.train.diloco) against references written from the papers.

* H = 1, outer SGD at lr 1 without momentum is data parallelism (a check by construction): the
  replica groups' mean loss and the final parameters of `plait train` equal those of dp = 2.
* H > 1, M = 2 and 4: the final parameters equal `reference`, one process holding M model
  copies, each fed its shard, H inner steps each, the averaged pseudo-gradient, the Nesterov
  outer step (Douillard et al. 2023, Algorithm 1).
* Streaming (F fragments at staggered steps, the exchange overlapped by tau steps, merged with
  alpha): the same reference with the Streaming paper's schedule (Douillard et al. 2025).
* The ledger's bytes on the replica axis: 2(M-1)/M x (the fragment's fp32 bytes) at each step
  it is exchanged, none between.
* Inner layouts (ZeRO-3, tp) inside the groups follow the same reference; a run stopped between
  synchronisations, with an exchange in flight, resumes bit for bit.
* Fault tolerance: a group killed with SIGKILL is dropped, restarted, healed and rejoins.
"""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch
from conftest import SGD, TINY, fault_env, losses, metrics, plait_train, side_by_side, train_job

from plait.data import DistributedBatchSampler, load_corpus
from plait.models.source import build_model
from plait.optim import param_groups
from plait.train.config import load_config, model_config
from plait.train.diloco import block_of, due_fragments, fragment_of, outer_update
from plait.train.loop import lr_factor

BASE = [*TINY, *SGD, "--train.replica_check_every", "0", "--train.log_every", "1", "--train.steps", "7"]


def _params(run_dir):
    from plait.models import GPT
    from plait.train.export import find_checkpoint, read_model_state, run_model_config

    with torch.device("meta"):
        model = GPT(run_model_config(run_dir))
    return read_model_state(find_checkpoint(run_dir), model)


def reference(
    run_dir, groups: int, away: dict | None = None, until: int = 0
) -> list[dict[str, torch.Tensor]]:
    """The run of `run_dir`'s config on one process, written from the papers: `groups` model
    copies from one initialisation, each fed its shard of every global batch (row block g of
    groups) and stepped by its own SGD; every H steps, fragment by fragment, the pseudo-gradient
    Delta = anchor - theta averaged over the copies and the outer step (SGD with momentum, the
    Nesterov form) applied to the anchor; the copy then mixes alpha x its own + (1 - alpha) x
    anchor. A fragment's exchange started at step t is applied at the end of step t + tau. The
    last step synchronises every fragment without overlap and takes the anchor.

    `away`: {group: (first step it misses, step it rejoins at)}: a group killed before its step
    k takes no step from k on and sends nothing; the rounds average the others; at the end of
    step j, after the round, it takes a live group's whole state (model, optimizer, anchor and
    momentum are shared: one copy here; the data position and schedule) and trains from j + 1."""
    away = away or {}
    cfg = load_config(run_dir / "config.toml")
    t, d, m = cfg.train, cfg.diloco, model_config(cfg)
    corpus = load_corpus(cfg.data.corpus, cfg.data.held_out_fraction, "bytes", 256, None, False)
    torch.manual_seed(t.seed)
    init = build_model(cfg)
    models, opts, scheds, samplers = [], [], [], []
    for g in range(groups):
        model = build_model(cfg)
        model.load_state_dict(init.state_dict())
        groups_ = param_groups(model, t.weight_decay)
        if cfg.optim.name == "adamw":  # the paper's inner optimizer (torch's fused kernel, as plait's)
            opt = torch.optim.AdamW(groups_, lr=t.lr, betas=(t.beta1, t.beta2), fused=True)
        else:
            opt = torch.optim.SGD(groups_, lr=t.lr, momentum=cfg.optim.momentum)
        models.append(model)
        opts.append(opt)
        scheds.append(
            torch.optim.lr_scheduler.LambdaLR(
                opt, lambda s: lr_factor(s, t.warmup_steps, t.steps, t.min_lr / t.lr)
            )
        )
        samplers.append(DistributedBatchSampler(corpus.train, m.seq_len, t.global_batch, g, groups, t.seed))
    names = [n for n, _ in init.named_parameters()]
    n_blocks = 1 + max(b for n in names if (b := block_of(n)) is not None)
    frag = {n: fragment_of(n, n_blocks, d.fragments) for n in names}
    anchor = {n: p.detach().clone() for n, p in init.named_parameters()}
    momentum = {n: torch.zeros_like(p) for n, p in anchor.items()}
    landing: dict[int, tuple[int, dict]] = {}  # fragment -> (step it is applied, averaged Delta)

    def params(g):
        return dict(models[g].named_parameters())

    def apply(p, avg, mix):
        with torch.no_grad():
            for n in names:
                if frag[n] != p:
                    continue
                b = momentum[n].mul_(d.outer_momentum).add_(avg[n])
                step = avg[n] + d.outer_momentum * b if d.outer_optimizer == "nesterov" else b
                anchor[n] -= d.outer_lr * step
                for g in range(groups):
                    params(g)[n].copy_(mix * params(g)[n] + (1 - mix) * anchor[n])

    def gone(g, step):
        return g in away and away[g][0] <= step <= away[g][1]

    residual: dict[tuple[int, str], torch.Tensor] = {}  # (group, name): top-k's carried error

    def topk(g, p):
        """Top-k with error feedback (Aji & Heafield 2017; Stich et al. 2018) on group g's
        pseudo-gradient of fragment p, as one flat vector: C(Delta + e) sent, e <- the rest."""
        mine = [n for n in names if frag[n] == p]
        acc = torch.cat(
            [(anchor[n] - params(g)[n].detach() + residual.get((g, n), 0)).reshape(-1) for n in mine]
        )
        keep = torch.zeros_like(acc)
        idx = torch.topk(acc.abs(), math.ceil(cfg.comm.topk_ratio * acc.numel())).indices
        keep[idx] = acc[idx]
        out, off = {}, 0
        for n in mine:
            k = anchor[n].numel()
            out[n] = keep[off : off + k].view_as(anchor[n])
            residual[(g, n)] = (acc - keep)[off : off + k].view_as(anchor[n])
            off += k
        return out

    def delta(p, step):
        live = [g for g in range(groups) if not gone(g, step)]
        if d.compression == "topk":
            sent = [topk(g, p) for g in live]
            return {n: sum(m[n] for m in sent) / len(live) for n in sent[0]}
        return {
            n: sum(anchor[n] - params(g)[n].detach() for g in live) / len(live) for n in names if frag[n] == p
        }

    for step in range(1, t.steps + 1):
        for g in range(groups):
            if gone(g, step):
                continue
            micro = samplers[g].next_batch()  # (a pipeline's run takes its rows in micro-batches)
            loss = models[g](torch.cat([x for x, _ in micro]), torch.cat([y for _, y in micro]))
            loss.backward()
            opts[g].step()
            scheds[g].step()
            opts[g].zero_grad(set_to_none=True)
        last = step == t.steps
        for p in sorted(landing):
            if landing[p][0] == step or last:
                apply(p, landing.pop(p)[1], d.mix)
        due = range(d.fragments) if last else due_fragments(step, d.inner_steps, d.fragments)
        for p in due:
            if last or d.overlap_steps == 0:
                apply(p, delta(p, step), 0.0 if last else d.mix)
            else:
                landing[p] = (step + d.overlap_steps, delta(p, step))
        for g, (_, back) in away.items():
            if back == step:  # healed from the first live group
                src = min(h for h in range(groups) if not gone(h, step))
                models[g].load_state_dict(models[src].state_dict())
                # (a copy: torch's load_state_dict keeps the tensors it is given, shared with src)
                opts[g].load_state_dict(copy.deepcopy(opts[src].state_dict()))
                scheds[g].load_state_dict(scheds[src].state_dict())
                samplers[g].load_state_dict(samplers[src].state_dict())
    return [{n: q.detach().clone() for n, q in params(g).items()} for g in range(groups)]


def _close(got: dict, want: dict, tol: float, what: str) -> float:
    """The largest error of `got` against `want`, relative to each tensor's size; asserts `tol`."""
    worst = 0.0
    for n, w in want.items():
        err = float((got[n].float() - w).abs().max()) / max(1e-3, float(w.abs().max()))
        worst = max(worst, err)
    assert worst <= tol, f"{what}: worst relative error {worst:.2e} > {tol:.0e}"
    return worst


def _without_key_bias(params: dict) -> dict:
    """The parameters with the key third of each fused qkv bias left out: softmax ignores a key
    bias, so its gradient is rounding noise in any order of summation, and AdamW (eps 1e-8)
    turns noise into full-size steps (tests/conftest.py's gpt_adamw says the same)."""
    out = dict(params)
    for n, p in params.items():
        if n.endswith("qkv.bias"):
            d = p.numel() // 3
            out[n] = torch.cat([p[:d], p[2 * d :]])
    return out


def _ok(result):
    run_dir, proc = result
    assert proc.returncode == 0, f"{run_dir}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return run_dir


# --- the schedule and the outer step, without processes ----------------------------------------


def test_fragments_are_contiguous_blocks_synchronised_once_every_h_steps_at_staggered_offsets():
    assert [fragment_of(f"blocks.{b}.attn.weight", 4, 2) for b in range(4)] == [0, 0, 1, 1]
    assert [fragment_of(f"model.layers.{b}.mlp.up", 6, 3) for b in range(6)] == [0, 0, 1, 1, 2, 2]
    assert fragment_of("tok_emb.weight", 4, 2) == 0 and fragment_of("lm_head.weight", 4, 4) == 0
    assert block_of("blocks.12.ln.weight") == 12 and block_of("ln_f.weight") is None
    # each fragment exactly once every H steps; F = 1: the steps H, 2H, ...
    for h, f in ((8, 1), (8, 2), (8, 4), (6, 3), (6, 4), (4, 4)):
        due = {s: due_fragments(s, h, f) for s in range(1, 4 * h + 1)}
        for p in range(f):
            steps = [s for s, ps in due.items() if p in ps]
            assert len(steps) == 4 and all(b - a == h for a, b in zip(steps, steps[1:], strict=False)), (
                h,
                f,
                p,
            )
        assert all(len(ps) <= 1 for ps in due.values()), (h, f)  # staggered: one fragment at a time
    assert [s for s in range(1, 17) if due_fragments(s, 8, 1)] == [8, 16]
    assert [s for s in range(1, 9) if due_fragments(s, 8, 2) == [1]] == [4]
    # fragment p at the steps t with (t + p H / F) mod H = 0: H = 8, F = 4 puts fragment 1 at 6, 14
    assert [s for s in range(1, 17) if due_fragments(s, 8, 4) == [1]] == [6, 14]
    assert [s for s in range(1, 7) if due_fragments(s, 6, 4) == [1]] == [5]  # offsets floor(p H / F)


def test_the_outer_step_is_sgd_with_momentum_in_nesterovs_form():
    # written from the definitions: b_t = mu b_{t-1} + g; sgd: theta -= lr b_t;
    # nesterov: theta -= lr (g + mu b_t)
    lr, mu = 0.7, 0.9
    theta0 = torch.tensor([1.0, -2.0, 3.0])
    grads = [torch.tensor([0.5, 0.25, -1.0]), torch.tensor([-0.1, 0.3, 0.2])]
    for nesterov in (False, True):
        anchor, b = theta0.clone(), torch.zeros(3)
        want, mom = theta0.clone(), torch.zeros(3)
        for g in grads:
            outer_update(anchor, b, g, lr, mu, nesterov)
            mom = mu * mom + g
            want = want - lr * ((g + mu * mom) if nesterov else mom)
        assert torch.allclose(anchor, want, atol=1e-7, rtol=0), (nesterov, anchor, want)
        assert torch.allclose(b, mom, atol=1e-7, rtol=0)
    # H = 1 with lr 1 and no momentum: the anchor becomes anchor - mean Delta, the mean copy
    anchor = theta0.clone()
    outer_update(anchor, torch.zeros(3), theta0 - torch.tensor([0.0, 1.0, 2.0]), 1.0, 0.0, False)
    assert torch.equal(anchor, torch.tensor([0.0, 1.0, 2.0]))


# --- plait train against the references ----------------------------------------------------------

H1 = ("--diloco.inner_steps", "1", "--diloco.outer_optimizer", "sgd", "--diloco.outer_lr", "1.0")
H1 += ("--diloco.outer_momentum", "0")
ALG1 = ("--diloco.inner_steps", "3")  # outer Nesterov, lr 0.7, momentum 0.9 (the defaults)
TOPK = (*ALG1, "--diloco.compression", "topk", "--comm.topk_ratio", "0.1")  # error feedback on
STREAM = ("--diloco.inner_steps", "4", "--diloco.fragments", "2", "--diloco.overlap_steps", "1")
STREAM += ("--diloco.mix", "0.5", "--model.n_layer", "2", "--train.steps", "9")


# the paper's inner AdamW (its step count starts at the first inner step: Adam's bias correction
# sees a state made early)
ADAMW = ("--optim.name", "adamw", "--train.lr", "3e-3", "--train.min_lr", "3e-4")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("diloco")
    jobs = {
        "dp2": train_job(base / "dp2", *BASE, "--parallel.dp", "2"),
        "h1": train_job(base / "h1", *BASE, "--parallel.dp", "2", *H1),
        "alg1-m2": train_job(base / "alg1-m2", *BASE, "--parallel.dp", "2", *ALG1),
        "alg1-m4": train_job(
            base / "alg1-m4", *BASE, "--parallel.dp", "4", *ALG1, "--train.global_batch", "8"
        ),
        "stream": train_job(base / "stream", *BASE, "--parallel.dp", "2", *STREAM),
        "alg1-adamw": train_job(base / "alg1-adamw", *BASE, "--parallel.dp", "2", *ALG1, *ADAMW),
        "alg1-topk": train_job(base / "alg1-topk", *BASE, "--parallel.dp", "2", *TOPK),
    }
    return {name: _ok(r) for name, r in side_by_side(jobs).items()}


def test_h1_outer_sgd_lr1_is_data_parallelism(runs):
    """The done-when of the issue: the loss curve of --parallel.dp 2, per step, and the final
    parameters (a linear inner optimizer: SGD with momentum)."""
    dp, h1 = runs["dp2"], runs["h1"]
    want = losses(dp)
    got = {s: r["replica_loss"] for s, r in metrics(h1 / "replica0").items()}
    assert sorted(got) == sorted(want) == list(range(1, 8))
    for s in want:
        assert abs(got[s] - want[s]) <= 1e-5 * abs(want[s]), (s, got[s], want[s])
    final = _params(dp)
    for g in (0, 1):
        _close(_params(h1 / f"replica{g}"), final, 1e-5, f"H=1 group {g} vs dp=2")
    # each group's own loss is its half of the batch: not the global loss (the check can fail)
    own = losses(h1 / "replica0")
    assert max(abs(own[s] - want[s]) for s in want) > 1e-4


@pytest.mark.parametrize(
    "name,groups", [("alg1-m2", 2), ("alg1-m4", 4), ("alg1-adamw", 2), ("stream", 2), ("alg1-topk", 2)]
)
def test_parameters_follow_the_papers_algorithm(runs, name, groups):
    run = runs[name]
    want = reference(run, groups)
    for g in range(groups):
        got = _params(run / f"replica{g}")
        if name.endswith("adamw"):  # the attention key bias: a gradient of rounding noise, which
            got, want[g] = _without_key_bias(got), _without_key_bias(want[g])  # AdamW scales up
        _close(got, want[g], 1e-5, f"{name} group {g}")
    # the groups end on one model (the last step's synchronisation takes the anchor)
    assert all(torch.equal(want[0][n], want[-1][n]) for n in want[0])


def test_the_replica_axis_carries_the_formulas_bytes_on_the_steps_it_is_due(runs):
    """2(M-1)/M x the exchanged fp32 bytes on a synchronisation step, nothing between; Streaming
    sends one fragment at a time."""
    for name, groups, due in (("alg1-m2", 2, {3, 6, 7}), ("alg1-m4", 4, {3, 6, 7}), ("stream", 2, None)):
        run = runs[name] / "replica0"
        cfg = load_config(runs[name] / "config.toml")
        params = dict(build_model(cfg).named_parameters())  # (a tied weight once)
        total = sum(p.numel() for p in params.values())
        n_blocks = model_config(cfg).n_layer
        f = cfg.diloco.fragments
        sizes = [
            sum(p.numel() for n, p in params.items() if fragment_of(n, n_blocks, f) == k) for k in range(f)
        ]
        assert sum(sizes) == total and (f == 1 or min(sizes) > 0)
        for step, rec in metrics(run).items():
            sent = rec.get("comm_by_axis", {}).get("replica", 0.0)
            last = step == cfg.train.steps
            frags = range(f) if last else due_fragments(step, cfg.diloco.inner_steps, f)
            want = 2 * (groups - 1) / groups * 4 * sum(sizes[k] for k in frags)
            assert math.isclose(sent, want, rel_tol=0, abs_tol=0.5), (name, step, sent, want)
            if due is not None:
                assert (sent > 0) == (step in due), (name, step)
            if step not in (due or set()) and f == 1:
                assert "diloco" not in rec


def test_groups_with_layouts_inside_follow_the_reference(tmp_path):
    """A replica group is any layout: ZeRO-3 over its 2 ranks, tp over 2, two pipeline stages (its
    rows in micro-batches, its held-out batches too): the same model as the reference's (4 ranks,
    2 groups)."""
    args = (*BASE, *ALG1, "--model.n_head", "4", "--train.global_batch", "8")
    jobs = {
        "zero3": train_job(tmp_path / "zero3", *args, "--parallel.dp", "4", "--diloco.replicas", "2",
                           "--parallel.zero_stage", "3"),
        "tp": train_job(tmp_path / "tp", *args, "--parallel.dp", "2", "--parallel.tp", "2"),
        "pp": train_job(tmp_path / "pp", *args, "--parallel.dp", "2", "--parallel.pp", "2"),
    }  # fmt: skip
    done = {name: _ok(r) for name, r in side_by_side(jobs).items()}
    want = reference(done["tp"], 2)
    for name, run in done.items():
        for g in range(2):
            _close(_params(run / f"replica{g}"), want[g], 1e-5, f"{name} group {g}")


def test_a_run_stopped_with_an_exchange_in_flight_resumes_bit_for_bit(runs, tmp_path):
    """Stopped after step 4, whose exchange of fragment 0 is still to be merged at step 5 (tau =
    1), and with the outer momentum of fragment 1 (synchronised at step 2) in the checkpoint: the
    resumed run ends on the uninterrupted run's parameters exactly."""
    cut = tmp_path / "cut"
    first = plait_train(*BASE, "--parallel.dp", "2", *STREAM, "--train.stop_at", "4",
                        "--train.checkpoint_every", "2", "--train.run_dir", str(cut))  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    rec = metrics(cut / "replica0")[4]
    assert rec["diloco"]["fragments"] == [0], rec  # fragment 0's exchange started at step 4, lands at 5
    again = plait_train("--resume", str(cut))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming 2 replica groups from step 4" in again.stdout
    whole = runs["stream"]
    for g in range(2):
        got, want = _params(cut / f"replica{g}"), _params(whole / f"replica{g}")
        diff = max(float((got[n] - want[n]).abs().max()) for n in want)
        assert diff == 0.0, f"group {g}: the resumed run is off by up to {diff:.2e}"


def test_topk_on_the_outer_exchange_sends_k_entries_and_its_residual_survives_a_resume(runs, tmp_path):
    """Top-k (ratio 0.1) with error feedback on the outer exchange: each synchronisation gathers
    ceil(0.1 Psi) (int32 index, fp32 value) pairs from each group, (M-1) x 8k bus bytes at M = 2,
    against 2(M-1)/M x 4 Psi uncompressed; the groups differ from the uncompressed run; a run
    stopped at step 4 (after the step-3 exchange: residuals non-zero) resumes bit for bit, so
    the residual is in the checkpoint."""
    run, plain = runs["alg1-topk"], runs["alg1-m2"]
    cfg = load_config(run / "config.toml")
    total = sum(p.numel() for p in build_model(cfg).parameters())
    k = math.ceil(0.1 * total)
    for step, rec in metrics(run / "replica0").items():
        sent = rec.get("comm_by_axis", {}).get("replica", 0.0)
        assert sent == (8 * k if step in (3, 6, 7) else 0.0), (step, sent, 8 * k)
    got, unc = _params(run / "replica0"), _params(plain / "replica0")
    assert max(float((got[n] - unc[n]).abs().max()) for n in got) > 1e-3
    cut = tmp_path / "cut"
    first = plait_train(*BASE, "--parallel.dp", "2", *TOPK, "--train.stop_at", "4",
                        "--train.checkpoint_every", "2", "--train.run_dir", str(cut))  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    again = plait_train("--resume", str(cut))
    assert again.returncode == 0, again.stderr[-3000:]
    for g in range(2):
        got, want = _params(cut / f"replica{g}"), _params(run / f"replica{g}")
        diff = max(float((got[n] - want[n]).abs().max()) for n in want)
        assert diff == 0.0, f"group {g}: the resumed top-k run is off by up to {diff:.2e}"


def test_a_killed_group_is_dropped_restarted_healed_and_rejoins(tmp_path):
    """Group 1's rank is SIGKILLed as step 3 of 16 starts (H = 2; every step takes 0.4 s): group
    0 goes on alone (its rounds average 1 group), group 1 is started again, heals from group 0's
    memory at the round after it is ready and rejoins. Both end on the parameters of the
    reference with the same outage: the rounds without group 1 averaged over the live group
    only, and the healed group continued from group 0's state."""
    run = tmp_path / "ft"
    env = {**fault_env("0:3:kill"), "PLAIT_FAIL_GROUP": "1"}
    env.update(PLAIT_STEP_HOOK="plait.testing:slow_hook", PLAIT_PS_SLOW="0:0.4")
    r = plait_train(*BASE, "--parallel.dp", "2", "--diloco.inner_steps", "2", "--train.steps", "16",
                    "--diloco.fault_tolerant", "true", "--diloco.quorum_timeout_s", "60",
                    "--train.run_dir", str(run), env=env, timeout=400)  # fmt: skip
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    out = r.stdout
    assert "replica group 1 failed (exit code -9)" in out and "restarting it (rejoin 1 of" in out, out[-3000:]
    assert "averages 1 of 2 groups (dropped: 1)" in out, out[-3000:]
    back = re.search(r"step (\d+): round \d+ averages 1 of 2 groups \(rejoining: 1\)", out)
    assert back, out[-3000:]
    rejoined = int(back.group(1))
    log1 = (run / "replica1" / "stdout.log").read_text()
    assert f"healed from group 0 at step {rejoined}, its state checksum equal to the sender's" in log1, log1
    m0 = metrics(run / "replica0")
    groups = {s: rec["diloco"]["groups"] for s, rec in m0.items() if "diloco" in rec}
    assert groups[2] == 2 and groups[16] == 2, groups
    assert all(groups[s] == 1 for s in range(4, rejoined + 1, 2)), groups
    assert sorted(metrics(run / "replica1")) == [1, 2, *range(rejoined + 1, 17)]
    want = reference(run, 2, away={1: (3, rejoined)})
    for g in range(2):
        _close(_params(run / f"replica{g}"), want[g], 1e-5, f"group {g} after its outage")

"""The parameter server (plait.async_training) end to end through `plait train`.

Every independent run starts once, side by side, in the module fixture `runs` (a run is a few
seconds of start-up around a short training); the tests read their run directories:

* bsp follows plait's synchronous data parallelism (dp=2) with the same optimizer (SGD, no
  clipping), in losses, gradient norms and final parameters, with 1 server and (resumed) 2
  servers, and with 4 workers over 2 servers against dp=4; ssp with staleness 0 is bsp exactly
  (2 servers, AdamW with global-norm clipping: the servers exchange their partial norms);
* ssp (τ=1) with a slowed worker never logs a staleness above τ, and one process replaying it
  from the versions each push recorded reproduces its losses and parameters; a worker killed
  mid-push (after its part reached server 0, before its commit) leaves nothing applied on either
  server; async (Adagrad on the servers, as Downpour) goes on the same way and its loss
  decreases; under bsp a killed worker stops the job, and a killed server stops it under any
  consistency model;
* a bsp run stopped at step 4 and resumed from the servers' checkpoint continues the loss curve
  of the uninterrupted run exactly;
* bad [ps] settings are refused before any process starts, in one line naming the key.
"""

import functools
import json
import math
import time

import pytest
import torch
from conftest import SGD, TINY, losses, metrics, plait_train, side_by_side

from plait.cli import main

DP2 = [*TINY, "--parallel.dp", "2", "--train.sample_tokens", "0"]
ADAGRAD = ["--ps.server_optimizer", "adagrad", "--train.lr", "0.01"]  # Downpour's choice
SLOW = {"PLAIT_STEP_HOOK": "plait.testing:slow_hook"}


def _ps(servers, consistency, *extra):
    return ["--ps.servers", str(servers), "--ps.consistency", consistency, *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ps")
    three = ["--parallel.dp", "3", "--train.global_batch", "12"]
    plan = {
        "dp_sgd": ((*DP2, *SGD), {}),
        "bsp1_sgd": ((*DP2, *SGD, *_ps(1, "bsp", "--ps.server_optimizer", "sgd")), {}),
        "dp4_sgd": ((*DP2, *SGD, "--parallel.dp", "4"), {}),
        "bsp4x2_sgd": (
            (*DP2, *SGD, "--parallel.dp", "4", *_ps(2, "bsp", "--ps.server_optimizer", "sgd")),
            {},
        ),
        "bsp2_adamw": ((*DP2, *_ps(2, "bsp")), {}),
        "ssp0_adamw": ((*DP2, *_ps(2, "ssp", "--ps.staleness", "0")), {}),
        "bsp2_stop": (
            (*DP2, *SGD, *_ps(2, "bsp", "--ps.server_optimizer", "sgd"), "--train.stop_at", "4"),
            {},
        ),
        # worker 2 is slow; worker 1 dies at clock 3 after sending server 0 its part
        "ssp_kill": (
            (*DP2, *three, *_ps(2, "ssp", "--ps.staleness", "1")),
            {**SLOW, "PLAIT_PS_SLOW": "2:0.1", "PLAIT_PS_CUT": "1:3"},
        ),
        "async_kill": (
            (*DP2, *three, *_ps(2, "async", *ADAGRAD), "--train.steps", "12", "--train.log_every", "6"),
            {**SLOW, "PLAIT_PS_SLOW": "2:0.03", "PLAIT_PS_CUT": "1:4"},
        ),
        "bsp_kill": (
            (*DP2, *_ps(1, "bsp")),
            {**SLOW, "PLAIT_FAIL_AT": "1:3:kill"},
        ),
        # server 1 dies after applying clock 5 (its checkpoint of clock 4 is on disk)
        "server_kill": ((*DP2, *_ps(2, "ssp")), {"PLAIT_PS_KILL_SERVER": "1:5"}),
    }
    jobs = {
        name: functools.partial(_timed, *args, "--train.run_dir", str(root / name), env=env)
        for name, (args, env) in plan.items()
    }
    # a parameter-server run waits on its slowed worker and on start-up more than it computes
    done = side_by_side(jobs, lanes=3)
    print({name: f"{r.seconds:.1f}s" for name, r in done.items()})
    return root, done


def _timed(*args, env):
    t0 = time.perf_counter()
    r = plait_train(*args, env=env)
    r.seconds = time.perf_counter() - t0
    return r


def _ok(runs, name):
    root, done = runs
    r = done[name]
    assert r.returncode == 0, f"{name}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return root / name


def _params_of_ps_run(run_dir):
    from plait.async_training.ps_report import load_final_model
    from plait.train.config import load_config

    cfg = load_config(run_dir / "config.toml")
    return dict(load_final_model(cfg, run_dir, cfg.train.steps).named_parameters())


def _params_of_dp_run(run_dir):
    from plait.models import GPT
    from plait.train.export import find_checkpoint, read_model_state, run_model_config

    with torch.device("meta"):
        model = GPT(run_model_config(run_dir))
    return read_model_state(find_checkpoint(run_dir), model)


def _assert_losses_match(got, want, atol=1e-6, what=""):
    a, b = losses(got), losses(want)
    assert sorted(a) == sorted(b) == list(range(1, 9)), (what, sorted(a), sorted(b))
    for step in b:
        assert abs(a[step] - b[step]) <= atol, f"{what} step {step}: {a[step]!r} vs {b[step]!r}"


def test_bsp_equals_data_parallel_and_ssp0_equals_bsp(runs):
    """bsp with 1 server and SGD = dp=2 (losses, logged gradient norms, final parameters); the
    2-server case is the resumed run of test_resume_...; ssp τ=0 = bsp with 2 servers, AdamW and
    global-norm clipping across the servers, exactly."""
    dp_sgd, bsp1 = _ok(runs, "dp_sgd"), _ok(runs, "bsp1_sgd")
    _assert_losses_match(bsp1, dp_sgd, what="bsp, 1 server, SGD")
    _assert_params_match(bsp1, dp_sgd)
    # the logged norm is the global norm of the mean gradient, as data parallelism logs it
    m_ps, m_dp = metrics(bsp1), metrics(dp_sgd)
    for step in m_dp:
        assert math.isclose(m_ps[step]["grad_norm"], m_dp[step]["grad_norm"], rel_tol=1e-6)
    # 4 workers over 2 key ranges = dp=4
    dp4, bsp4 = _ok(runs, "dp4_sgd"), _ok(runs, "bsp4x2_sgd")
    _assert_losses_match(bsp4, dp4, what="bsp, 4 workers, 2 servers, SGD")
    _assert_params_match(bsp4, dp4)
    bsp2 = _ok(runs, "bsp2_adamw")
    _assert_losses_match(_ok(runs, "ssp0_adamw"), bsp2, atol=0.0, what="ssp tau=0 vs bsp")
    assert any(r["grad_norm"] > 1.0 for r in metrics(bsp2).values())  # the clipping acted
    from plait.models import GPT
    from plait.train.config import load_config, model_config

    n_params = sum(p.numel() for p in GPT(model_config(load_config(bsp2 / "config.toml"))).parameters())
    for r in metrics(bsp2).values():
        assert r["staleness_max"] == 0 and r["workers"] == 2
        # each worker's ledger: every fp32 parameter pulled and its gradient pushed, once a step
        assert r["push_bytes"] == r["pull_bytes"] == 2 * 4 * n_params
    assert (bsp2 / "staleness.png").stat().st_size > 0


def _assert_params_match(ps_run, dp_run, atol=1e-6):
    want = _params_of_dp_run(dp_run)
    for key, p in _params_of_ps_run(ps_run).items():
        assert torch.allclose(p, want[key], atol=atol, rtol=0), (ps_run.name, key)


def _servers(run_dir, n):
    return [json.loads((run_dir / "ps" / f"server{s}.json").read_text()) for s in range(n)]


def test_ssp_bounds_staleness_and_survives_a_worker_killed_mid_push(runs):
    run = _ok(runs, "ssp_kill")
    err = runs[1]["ssp_kill"].stderr
    assert "worker 1" in err and "SIGKILL" in err, err
    m = metrics(run)
    assert sorted(m) == list(range(1, 9))
    stale = [r["staleness_max"] for r in m.values() if r["staleness_max"] is not None]
    assert max(stale) <= 1, stale  # never beyond tau
    assert max(stale) == 1, stale  # the slowed worker let the others run one clock ahead
    assert all(r["workers"] == 2 for s, r in m.items() if s >= 3)  # worker 1 never finished clock 3
    s0, s1 = _servers(run, 2)
    assert s0["discarded"] == [[1, 3]] and s1["discarded"] == [], (s0, s1)
    # only clocks 1 and 2 of worker 1 were applied, on both servers alike (whole or nothing)
    assert s0["applied_by_worker"]["1"] == s1["applied_by_worker"]["1"] == 2
    assert s0["applied_by_worker"]["0"] == s0["applied_by_worker"]["2"] == 8
    assert s0["dead"] == s1["dead"] == [1]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["dead_workers"] == [1] and summary["staleness_max"] <= 1
    assert "dead workers: [1]" in runs[1]["ssp_kill"].stdout


def test_ssp_run_is_the_replay_of_the_reads_it_recorded(runs):
    """One process replays the ssp run with a dead worker from its logs alone: clock c's update
    is the clipped mean of the gradients of the pushes server 0 applied at c, each computed on the
    parameters of the versions that worker read from each server (a key range each). Every
    logged loss and the final parameters follow."""
    from plait.async_training.param_server import key_ranges
    from plait.async_training.ps_report import _read
    from plait.data import DistributedBatchSampler, load_corpus
    from plait.models import GPT
    from plait.optim import build_optimizer, param_groups
    from plait.train.config import load_config, model_config
    from plait.train.loop import lr_factor

    run = _ok(runs, "ssp_kill")
    cfg = load_config(run / "config.toml")
    t, n = cfg.train, cfg.parallel.dp
    mcfg = model_config(cfg)
    corpus = load_corpus(cfg.data.corpus, cfg.data.held_out_fraction)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers: the same summation order in the matmuls
    try:
        torch.manual_seed(t.seed)
        server, worker = GPT(mcfg), GPT(mcfg)
        sp, wp = list(server.parameters()), list(worker.parameters())
        ranges = key_ranges([p.numel() for p in sp], cfg.ps.servers)
        opt = build_optimizer(
            "adamw", param_groups(server, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2)
        )
        samplers = [
            DistributedBatchSampler(corpus.train, mcfg.seq_len, t.global_batch, w, n, t.seed)
            for w in range(n)
        ]
        logs = [{r["step"]: r for r in _read(run / "ps" / f"worker{w}.jsonl")} for w in range(n)]
        applied = {}
        for r in _read(run / "ps" / "server0.jsonl"):
            if "staleness" in r:
                applied.setdefault(r["clock"], []).append(r["worker"])
        history = [[p.detach().clone() for p in sp]]
        tokens = t.global_batch * mcfg.seq_len // n
        for clock in range(1, t.steps + 1):
            grads = []
            for w in sorted(applied[clock]):
                versions = logs[w][clock]["versions"]
                with torch.no_grad():
                    for (lo, hi), v in zip(ranges, versions):
                        for i in range(lo, hi):
                            wp[i].copy_(history[v][i])
                worker.zero_grad(set_to_none=True)
                ((x, y),) = samplers[w].next_batch()
                loss_sum = worker(x, y, reduction="sum")
                (loss_sum / tokens).backward()
                assert abs(float(loss_sum.detach()) / tokens - logs[w][clock]["loss"]) < 1e-6, (clock, w)
                grads.append([p.grad.clone() for p in wp])
            scale = 1.0 / len(grads)
            mean = [sum(g[i] * scale for g in grads) for i in range(len(sp))]
            norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in mean))
            factor = min(1.0, t.grad_clip / (norm + 1e-6))
            for p, g in zip(sp, mean):
                p.grad = g * factor if factor < 1.0 else g
            for group in opt.param_groups:
                group["lr"] = t.lr * lr_factor(clock - 1, t.warmup_steps, t.steps, t.min_lr / t.lr)
            opt.step()
            history.append([p.detach().clone() for p in sp])
    finally:
        torch.set_num_threads(threads)
    saved = list(_params_of_ps_run(run).values())
    for i, (got, want) in enumerate(zip(saved, history[-1], strict=True)):
        assert torch.allclose(got, want, atol=1e-5, rtol=0), i


def test_async_survives_a_killed_worker_and_its_loss_decreases(runs):
    run = _ok(runs, "async_kill")
    s0, s1 = _servers(run, 2)
    assert s0["discarded"] == [[1, 4]] and s1["discarded"] == []
    assert s0["applied_by_worker"] == s1["applied_by_worker"]
    assert s0["applied_by_worker"]["1"] == 3 and s0["updates"] == 12 + 12 + 3  # one step per push
    m = metrics(run)
    first = sum(m[s]["loss"] for s in (1, 2)) / 2
    last = sum(m[s]["loss"] for s in (11, 12)) / 2
    assert last < first - 0.5, (first, last)
    assert max(r["staleness_max"] for r in m.values()) > 0  # async: pushes land on newer parameters
    assert math.isfinite(json.loads((run / "summary.json").read_text())["val_loss"])


def test_bsp_stops_when_a_worker_dies(runs):
    r = runs[1]["bsp_kill"]
    assert r.returncode == 1
    line = [x for x in r.stderr.splitlines() if x.startswith("plait:")]
    assert len(line) == 1 and "worker 1" in line[0] and "'bsp'" in line[0], r.stderr


def test_a_dead_server_stops_the_job_with_a_clear_message(runs):
    root, done = runs
    r = done["server_kill"]
    assert r.returncode == 1
    # the one line, and nothing before it: no worker's traceback of the connection it lost
    line = r.stderr.strip().splitlines()
    assert len(line) == 1 and line[0].startswith("plait:"), r.stderr
    assert "parameter server 1" in line[0] and "SIGKILL" in line[0] and "--resume" in line[0]
    assert (root / "server_kill" / "ps_checkpoints" / "step_4" / "server1.pt").is_file()


def test_resume_from_the_server_checkpoint_continues_the_loss_curve(runs):
    run = _ok(runs, "bsp2_stop")
    assert sorted(losses(run)) == [1, 2, 3, 4]
    r = plait_train("--resume", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed at step 4" in r.stdout
    # the uninterrupted bsp run (1 server: the same arithmetic per tensor), and data parallelism
    _assert_losses_match(run, _ok(runs, "bsp1_sgd"), atol=0.0, what="resumed bsp vs uninterrupted")
    _assert_losses_match(run, _ok(runs, "dp_sgd"), what="resumed bsp, 2 servers, vs dp")
    _assert_params_match(run, _ok(runs, "dp_sgd"))


BAD = [
    (["--ps.servers", "1", "--parallel.tp", "2"], ["ps.servers = 1", "parallel.tp"]),
    (["--ps.servers", "1", "--parallel.zero_stage", "2"], ["parallel.zero_stage"]),
    (["--ps.servers", "1", "--comm.compression", "fp16"], ["comm.compression"]),
    (["--ps.staleness", "-1"], ["ps.staleness", ">= 0"]),
    (["--ps.consistency", "bounded"], ["ps.consistency", "valid: bsp, ssp, async"]),
    (["--ps.server_optimizer", "lamb"], ["ps.server_optimizer", "valid: sgd, adagrad, adamw"]),
    (["--ps.servers", "29"], ["ps.servers = 29", "28 parameter tensors"]),
]


@pytest.mark.parametrize("args,words", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_ps_config_is_refused_before_start(capsys, args, words):
    assert main(["train", "--model.name", "tiny", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("plait: config error: "), err
    for w in words:
        assert w in err, (w, err)

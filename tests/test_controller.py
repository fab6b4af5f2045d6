"""The single controller (plait.controller, Monarch actors) against plait's SPMD runtime, at the
level a user meets it: `plait train ... --runtime.kind controller` and the default runtime on
the same tiny config must log the same losses and gradient norms, bit for bit, in every layout
below; a SIGTERM to the controller checkpoints the step reached and leaves no process; without
Monarch the controller is refused in one line.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import (
    PP2,
    SHARED_LAYOUTS,
    TINY,
    assert_runs_match,
    fault_env,
    island_evals,
    live_with,
    metrics,
    resume_job,
    side_by_side,
    train_job,
)

from plait.cli import main
from plait.train.export import completed_steps

CONTROLLER = ("--runtime.kind", "controller")
# the layouts' arguments as the SPMD tests of each technique write them: their runs are shared
# (conftest's RunCache), so the SPMD side costs nothing when those files run in the same session
PP = PP2
MOE = ("--model.experts", "4", "--model.top_k", "2", "--train.log_every", "2")
LAYOUTS = {
    **SHARED_LAYOUTS,
    # every other schedule (zb-v's SPMD run is test_pipeline_train's)
    "pp2-gpipe": (*PP, "--parallel.schedule", "gpipe"),
    "pp2-interleaved": (*PP, "--parallel.schedule", "interleaved", "--parallel.microbatches", "4"),
    "pp2-zb-h1": (*PP, "--parallel.schedule", "zb-h1"),
    "pp2-zb-h2": (*PP, "--parallel.schedule", "zb-h2", "--parallel.microbatches", "4"),
    "pp2-zb-v": (*PP, "--parallel.schedule", "zb-v", "--parallel.microbatches", "4"),
    "dp1-ep2": (*MOE, "--parallel.dp", "1", "--parallel.ep", "2"),
}


@pytest.fixture(scope="module")
def runs(shared_runs, tmp_path_factory):
    """{layout/runtime: (run dir, CompletedProcess)}: each layout under both runtimes, side by side."""
    base = tmp_path_factory.mktemp("controller")
    jobs = {}
    for name, layout in LAYOUTS.items():
        jobs[f"{name}/spmd"] = shared_runs.job(*TINY, *layout, timeout=300)
        jobs[f"{name}/controller"] = train_job(base / name, *TINY, *layout, *CONTROLLER, timeout=400)
    # the controller's checkpoint of step 4 (its sampler position the controller's) resumed by SPMD
    jobs["resumed"] = resume_job(jobs["dp2/controller"], base / "resumed", "--runtime.kind", "spmd")
    # rank 1 killed (SIGKILL) at step 6: the controller spawns a fresh mesh that resumes from rank
    # 0's memory at step 5 (dp2) or from the checkpoint of step 4 (pp2: no dp peer)
    # held-out evaluations every 2 steps, in-line (SPMD) and on an island (the weights of two stages)
    evals = (*PP, "--parallel.schedule", "1f1b", "--train.eval_every", "2")
    jobs["island/spmd"] = shared_runs.job(*TINY, *evals, timeout=300)
    island = ("--runtime.eval_island", "true")
    jobs["island/controller"] = train_job(base / "island", *TINY, *evals, *CONTROLLER, *island, timeout=400)
    for name in ("dp2", "pp2-1f1b"):
        recover = (*TINY, *LAYOUTS[name], *CONTROLLER, "--train.max_restarts", "1")
        # a second into step 6: a rank killed at the very start of a step may take its previous
        # step's result with it, and the controller then rightly falls back to the checkpoint
        kill = fault_env("1:6:killlate")
        jobs[f"{name}/recovered"] = train_job(base / f"{name}-recovered", *recover, env=kill, timeout=400)
    return side_by_side(jobs)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_controller_logs_the_spmd_runs_losses_bit_for_bit(runs, layout):
    for kind in ("spmd", "controller"):
        _, r = runs[f"{layout}/{kind}"]
        assert r.returncode == 0, f"{kind}: {r.stderr[-3000:]}"
    (ctrl, r), (spmd, _) = runs[f"{layout}/controller"], runs[f"{layout}/spmd"]
    assert "single controller (Monarch)" in r.stdout
    assert sorted(metrics(ctrl)) == list(range(1, 9))
    assert_runs_match(ctrl, spmd, rtol=0, what=f"{layout}: controller vs spmd")
    # the same run directory: every rank's metrics, the checkpoints, the summary and the plot
    spmd_files = {p.name for p in spmd.glob("metrics*.jsonl")} | {"summary.json", "loss.png", "config.toml"}
    assert spmd_files <= {p.name for p in ctrl.iterdir()}
    assert completed_steps(ctrl / "checkpoints") == completed_steps(spmd / "checkpoints")


def test_a_controller_checkpoint_resumes_under_spmd_exactly(runs):
    (run, r), (spmd, _) = runs["resumed"], runs["dp2/spmd"]
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(metrics(run)) == list(range(1, 9))
    assert_runs_match(run, spmd, rtol=0, what="controller's step 4 resumed under spmd")


def test_an_evaluation_island_gives_the_in_line_held_out_losses_while_training_goes_on(runs):
    (run, r), (spmd, _) = runs["island/controller"], runs["island/spmd"]
    assert r.returncode == 0, r.stderr[-3000:]
    assert "held-out evaluations on an island of their own" in r.stdout
    assert_runs_match(run, spmd, rtol=0, what="pp2 with an evaluation island")  # training untouched
    got, want = island_evals(run), {s: m["val_loss"] for s, m in metrics(spmd).items() if "val_loss" in m}
    assert sorted(got) == [2, 4, 6], got  # the last evaluation is in-line (the summary's)
    assert "val_loss" in metrics(run)[8] and "val_loss" not in metrics(run)[2]
    for step, val in got.items():  # one process on gathered weights vs two stages: sums reordered
        assert abs(val - want[step]) <= 1e-5 * want[step], (step, val, want[step])
    assert len({round(v, 3) for v in got.values()}) == 3  # each step's own weights, not one copy


@pytest.mark.parametrize("layout", ["dp2", "pp2-1f1b"])
def test_a_killed_rank_is_recovered_on_a_fresh_mesh_and_ends_as_if_uninterrupted(runs, layout):
    (run, r), (spmd, _) = runs[f"{layout}/recovered"], runs[f"{layout}/spmd"]
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Killed(sig=9)" in r.stderr
    if layout == "dp2":  # from the surviving dp peer's memory, at the step it had finished
        assert "plait: rank 1 failed; a fresh mesh resumes at step 5 from the memory of its" in r.stderr
        assert "recovered at step 5 from rank 0's memory (a dp peer)" in r.stdout
        assert "step_00000004" not in r.stdout  # no checkpoint was read
    else:  # pp2 (dp 1): no peer holds a copy, so the newest checkpoint
        assert "no recovery from a peer's memory (dp = 1: no rank holds a copy" in r.stdout
        assert "plait: rank 1 failed; a fresh mesh resumes from the newest checkpoint" in r.stderr
        assert "restart 1 of train.max_restarts = 1 after a rank failed; resuming from" in r.stdout
        assert "step_00000004" in r.stdout
    assert sorted(metrics(run)) == list(range(1, 9))
    assert_runs_match(run, spmd, rtol=0, what=f"{layout}: killed at step 6 and recovered")


def _stopped_run(run: Path, tag: str, signum: int | None, fault: dict | None) -> subprocess.CompletedProcess:
    """A 40-step controller run in a process of its own (as a user starts it), stopped at step 5:
    by SIGTERM from the step hook (a scheduler's pre-emption), or by `signum` sent by this test
    once step 4 is logged (Ctrl-C)."""
    args = (*TINY, "--parallel.dp", "2", *CONTROLLER, "--train.steps", "40", "--train.run_dir", str(run))
    fault = fault or (fault_env("0:5:sigterm") if signum is None else {})
    env = {**os.environ, "PLAIT_TEST_TAG": tag, **fault}
    cmd = [sys.executable, "-m", "plait.cli", "train", *args]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as p:
        if signum is not None:
            deadline = time.monotonic() + 240
            while not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text().strip():
                assert time.monotonic() < deadline and p.poll() is None, "the run never logged a step"
                time.sleep(0.2)
            p.send_signal(signum)
        out, err = p.communicate(timeout=300)
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_a_stopped_controller_saves_the_step_reached_and_leaves_no_process(signals, signum):
    run, r, tag = signals[signum]
    assert r.returncode == 128 + signum, r.stderr[-3000:]
    reached = max(metrics(run))
    assert 1 <= reached < 40
    assert completed_steps(run / "checkpoints")[-1] == reached  # saved where it stopped
    assert f"stopped by {signal.Signals(signum).name} after step {reached}; checkpoint saved" in r.stdout
    assert "Traceback" not in r.stderr
    deadline = time.monotonic() + 10  # a process that is exiting has a moment to finish
    while live_with(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert live_with(tag) == {}


def _stop_job(run: Path, signum: int | None, fault: dict | None = None):
    """(run dir, CompletedProcess, the tag in the environment of the run's processes)."""
    tag = uuid.uuid4().hex
    return run, _stopped_run(run, tag, signum, fault), tag


def test_a_failing_rank_takes_the_job_down_at_once_with_its_traceback(signals):
    run, r, tag = signals["raised"]
    assert r.returncode == 1
    assert "plait: rank 1 failed; the job was stopped. Its error:" in r.stderr
    assert "RuntimeError: injected fault on rank 1 at step 3" in r.stderr
    # rank 0, waiting for rank 1 in step 3's all-reduce, is not waited for (comm.timeout_s = 60)
    assert "watchdog" not in r.stderr and max(metrics(run)) == 2
    deadline = time.monotonic() + 10
    while live_with(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert live_with(tag) == {}


def test_a_killed_rank_is_named_as_the_cause_and_no_process_is_left(signals):
    run, r, tag = signals["killed"]
    assert r.returncode == 1
    # rank 0 fails too (its all-reduce partner is gone): the dead rank is the cause reported
    assert "plait: rank 1 failed; the job was stopped." in r.stderr, r.stderr[-3000:]
    # (step 2's reply from rank 1 may be lost with its process: its record then is not written)
    assert "watchdog" not in r.stderr and max(metrics(run)) <= 2
    deadline = time.monotonic() + 10
    while live_with(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert live_with(tag) == {}


@pytest.fixture(scope="module")
def signals(tmp_path_factory):
    base = tmp_path_factory.mktemp("controller-signals")
    jobs = {}
    for signum in (signal.SIGTERM, signal.SIGINT):
        hook = None if signum == signal.SIGTERM else signum  # SIGTERM: from the step hook
        jobs[signum] = functools.partial(_stop_job, base / signal.Signals(signum).name, hook)
    jobs["raised"] = functools.partial(_stop_job, base / "raised", None, fault_env("1:3"))
    jobs["killed"] = functools.partial(_stop_job, base / "killed", None, fault_env("1:3:kill"))
    return side_by_side(jobs)


def test_the_controller_without_monarch_is_refused_in_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "monarch.actor", None)  # import monarch.actor raises ImportError
    code = main(["train", *TINY, *CONTROLLER, "--train.run_dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "runtime.kind = 'controller' needs Monarch" in err and "--no-deps torchmonarch==0.7.0" in err
    assert not (tmp_path / "run").exists()  # refused before anything was made


@pytest.mark.parametrize(
    "args, said",
    [
        (("--runtime.kind", "ctrl"), "runtime.kind = 'ctrl' is unknown; valid: spmd, controller"),
        ((*CONTROLLER, "--runtime.run_ahead", "0"), "runtime.run_ahead must be >= 1, got 0"),
        ((*CONTROLLER, "--parallel.tp", "3"), "not divisible by parallel.tp = 3"),  # before any spawn
        ((*CONTROLLER, "--ps.servers", "1"), "the parameter server is a runtime of its own"),
        (("--runtime.eval_island", "true"), "runtime.eval_island = true needs runtime.kind = 'controller'"),
    ],
)
def test_bad_runtime_input_is_refused_in_one_line_before_spawning(capsys, tmp_path, args, said):
    code = main(["train", *TINY, *args, "--train.run_dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and said in err, err
    assert not (tmp_path / "run").exists()

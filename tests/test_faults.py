"""Faults during training: a killed rank restarts the job, SIGTERM saves and exits 143, Ctrl-C
exits 130 quietly, a diverging run never updates on or saves non-finite values, and a corrupted
replica is caught. Each test asserts what happened to the run, not only the exit code.

The runs are the tiny GPT at dp = 2 with SGD and no clipping (a wrong step after a restart or a
resume moves the losses at once), started side by side once for the module.
"""

from __future__ import annotations

import functools
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import SGD, TINY, assert_runs_match, fault_env, metrics, plait_train, side_by_side

from plait.models import GPT
from plait.train.export import completed_steps, read_model_state, run_model_config

DP2 = (*TINY, *SGD, "--parallel.dp", "2", "--train.log_every", "1")
# step 1 at lr 1e6 wrecks the parameters; from step 2 on the loss is not finite
DIVERGE = (
    "--train.lr",
    "1e6",
    "--train.min_lr",
    "1",
    "--train.warmup_steps",
    "0",
    "--train.checkpoint_every",
    "1",
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("faults")

    def job(name, *args, env=None):
        return base / name, plait_train(*args, "--train.run_dir", str(base / name), env=env, timeout=300)

    jobs = {
        "full": functools.partial(job, "full", *DP2),
        # rank 1 dies (SIGKILL) at the start of step 6; the job restarts from step 4's checkpoint
        "killed": functools.partial(
            job, "killed", *DP2, "--train.max_restarts", "1", env=fault_env("1:6:kill")
        ),
        # the launcher gets SIGTERM at step 3, as from a scheduler
        "preempted": functools.partial(job, "preempted", *DP2, env=fault_env("0:3:sigterm")),
        "diverged-skip": functools.partial(
            job, "diverged-skip", *DP2, *DIVERGE, "--train.max_nonfinite", "3"
        ),
        "diverged-stop": functools.partial(job, "diverged-stop", *DP2, *DIVERGE, "--train.nonfinite", "stop"),
        # one value of rank 1's first parameter changes at step 3; checked every 2 steps
        "corrupted": functools.partial(
            job, "corrupted", *DP2, "--train.replica_check_every", "2", env=fault_env("1:3:perturb")
        ),
    }
    return side_by_side(jobs)


def test_a_killed_rank_restarts_the_job_which_ends_as_if_uninterrupted(runs):
    (full, f), (run, r) = runs["full"], runs["killed"]
    assert f.returncode == 0 and r.returncode == 0, r.stderr[-3000:]
    assert "restart 1 of train.max_restarts = 1 after a rank failed; resuming from" in r.stdout
    assert "step_00000004" in r.stdout
    assert sorted(metrics(run)) == list(range(1, 9))
    assert_runs_match(run, full, what="killed at step 6 and restarted", rtol=0)


def test_sigterm_saves_at_the_step_reached_and_exits_143_and_resume_is_exact(runs):
    (full, _), (run, r) = runs["full"], runs["preempted"]
    assert r.returncode == 143, r.stderr[-3000:]
    reached = max(metrics(run))
    assert 3 <= reached < 8
    assert completed_steps(run / "checkpoints")[-1] == reached  # saved where it stopped
    assert f"stopped by SIGTERM after step {reached}; checkpoint saved" in r.stdout
    assert "Traceback" not in r.stderr
    again = plait_train("--resume", str(run), timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert_runs_match(run, full, what="pre-empted and resumed", rtol=0)


def _finite_checkpoints(run) -> list[int]:
    steps = completed_steps(run / "checkpoints")
    model = GPT(run_model_config(run))
    for step in steps:
        state = read_model_state(run / "checkpoints" / f"step_{step:08d}", model)
        assert all(torch.isfinite(t).all() for t in state.values()), f"step {step} is not finite"
    return steps


def test_a_diverging_run_skips_then_stops_and_never_saves_non_finite_values(runs):
    run, r = runs["diverged-skip"]
    assert r.returncode == 1
    assert "DivergedError: training diverged at step" in r.stderr and "Traceback" not in r.stderr
    m = metrics(run)
    skipped = [s for s in sorted(m) if m[s].get("skipped")]
    first = skipped[0]
    assert first >= 2 and all(math.isfinite(m[s]["loss"]) for s in range(1, first))
    # 3 in a row (train.max_nonfinite), the third one the stop
    assert skipped == [first, first + 1, first + 2] and max(m) == first + 2, m
    assert all(not math.isfinite(m[s]["loss"]) or not math.isfinite(m[s]["grad_norm"]) for s in skipped)
    assert f"step {first} skipped: non-finite loss" in r.stdout
    # a checkpoint every step, but none while skipping: the newest is the last good step's,
    # every kept one is read back finite, and the message names it
    assert _finite_checkpoints(run)[-1] == first - 1
    assert "the last checkpoint" in r.stderr and f"step_{first - 1:08d}" in r.stderr


def test_nonfinite_stop_ends_the_run_at_the_first_bad_step(runs):
    run, r = runs["diverged-stop"]
    assert r.returncode == 1 and "train.nonfinite = 'stop'" in r.stderr, r.stderr[-2000:]
    m = metrics(run)
    last = max(m)
    assert m[last]["skipped"] and not any(m[s].get("skipped") for s in range(1, last))
    assert _finite_checkpoints(run)[-1] == last - 1


def test_a_corrupted_replica_is_caught_and_named(runs):
    run, r = runs["corrupted"]
    assert r.returncode == 1
    assert "ReplicaMismatchError: step 4: replicas over dp differ: wte.weight on rank(s) [1]" in r.stderr
    assert max(metrics(run)) == 3  # steps 2 (checked, equal) and 3 written; step 4 stopped
    assert metrics(run)[2]["replicas_checked"] > 0


def test_ctrl_c_stops_every_rank_with_130_and_one_line(tmp_path):
    run = tmp_path / "run"
    args = (*TINY, "--train.steps", "1000", "--parallel.dp", "2", "--train.log_every", "1")
    p = subprocess.Popen(
        [sys.executable, "-m", "plait.cli", "train", *args, "--train.run_dir", str(run)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: Ctrl-C reaches the launcher and every rank
        env={**os.environ},
    )
    deadline = time.time() + 120
    while time.time() < deadline and not ((run / "metrics.jsonl").exists() and metrics(run)):
        time.sleep(0.2)
    os.killpg(p.pid, signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130, err[-3000:]
    # plait's one line, and no traceback from the launcher or any rank (Python's own
    # resource-tracker warning about the killed ranks' semaphores may follow on a loaded machine)
    assert "plait: interrupted" in err.splitlines() and "Traceback" not in err, err[-3000:]
    assert [line for line in err.splitlines() if line.startswith("plait")] == ["plait: interrupted"]
    assert 1 <= max(metrics(run)) < 1000

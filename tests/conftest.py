"""Helpers shared by the test files that run `plait train` end to end.

`plait_train(*args)` runs the CLI in a subprocess (`fault_env` makes a rank fail in it);
`plait_train_all({name: args})` runs independent ones side by side (`side_by_side`: any jobs);
`TINY` is a few-second configuration; `losses(run)` and `metrics(run)` read rank 0's metrics.jsonl;
`assert_runs_match` is the parity check between two runs: per step, the loss and the gradient
norm before clipping. The gradient norm is what sees a gradient of the wrong scale that AdamW
(invariant to a constant factor) and clipping hide from the losses.
"""

import functools
import os
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from plait.train.metrics import read_metrics

TINY = [
    "--model.name",
    "tiny",
    "--train.steps",
    "8",
    "--train.global_batch",
    "8",
    "--train.log_every",
    "4",
    "--train.eval_every",
    "0",
    "--train.eval_batches",
    "2",
    "--train.checkpoint_every",
    "4",
    "--train.warmup_steps",
    "2",
    "--train.sample_tokens",
    "16",
    "--train.progress",
    "false",
    "--comm.timeout_s",
    "60",
    # every run compares its replicas (over dp, ep, tp) at steps 4 and 8
    "--train.replica_check_every",
    "4",
]

# SGD with momentum and no clipping: every layout must follow one process's trajectory, and a
# gradient k times too large moves the parameters k times too far from the first step on.
SGD = ["--optim.name", "sgd", "--train.grad_clip", "0", "--train.lr", "0.5", "--train.min_lr", "0.05"]


def plait_train(*args, env=None, timeout=180):
    return subprocess.run(
        [sys.executable, "-m", "plait.cli", "train", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def side_by_side(jobs: dict[str, Callable], lanes: int = 2) -> dict:
    """Call independent jobs (each starting processes and waiting for them), `lanes` at a time:
    {name: job} -> {name: its result}. A `plait train` run is seconds of single-threaded
    start-up (imports, spawn, rendezvous) around a short training; two side by side keep both
    cores of a small machine busy."""
    with ThreadPoolExecutor(lanes) as pool:
        started = {name: pool.submit(job) for name, job in jobs.items()}
        return {name: future.result() for name, future in started.items()}


def plait_train_all(runs: dict[str, tuple], lanes: int = 2, env=None, timeout=180) -> dict:
    """Independent `plait train` runs side by side: {name: args} -> {name: CompletedProcess}."""
    jobs = {
        name: functools.partial(plait_train, *args, env=env, timeout=timeout) for name, args in runs.items()
    }
    return side_by_side(jobs, lanes)


def fault_env(spec: str) -> dict[str, str]:
    """The environment that makes `plait train` fail as `spec` says (plait.testing.inject_fault):
    RANK:STEP raises, RANK:STEP:hang hangs, RANK:STEP:enospc fills the disk."""
    return {"PLAIT_STEP_HOOK": "plait.testing:inject_fault", "PLAIT_FAIL_AT": spec}


def metrics(run_dir: Path) -> dict[int, dict]:
    """Rank 0's metric record of every step, by step."""
    return {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl")}


def losses(run_dir: Path) -> dict[int, float]:
    return {step: r["loss"] for step, r in metrics(run_dir).items()}


def assert_runs_match(got: Path, want: Path, steps=None, rtol: float = 1e-5, what: str = "") -> None:
    """Per step (all of `want`'s, or `steps`), the loss and the global gradient norm of `got`
    within `rtol` of `want`'s."""
    a, b = metrics(got), metrics(want)
    steps = sorted(b) if steps is None else list(steps)
    assert set(steps) <= set(a), f"{what}: steps {sorted(set(steps) - set(a))} missing from {got}"
    for step in steps:
        for key in ("loss", "grad_norm"):
            x, y = a[step][key], b[step][key]
            ratio = x / y if y else float("nan")
            assert abs(x - y) <= rtol * abs(y), f"{what} step {step} {key}: {x!r} vs {y!r} (x{ratio:.6g})"

"""Helpers shared by the test files that run `plait train` end to end.

`plait_train(*args)` runs the CLI in a subprocess (`fault_env` makes a rank fail in it);
`plait_train_all({name: args})` runs independent ones side by side (`side_by_side`: any jobs);
`TINY` is a few-second configuration; `losses(run)` and `metrics(run)` read rank 0's metrics.jsonl;
`assert_runs_match` is the parity check between two runs: per step, the loss and the gradient
norm before clipping. The gradient norm is what sees a gradient of the wrong scale that AdamW
(invariant to a constant factor) and clipping hide from the losses.

The last section holds what the parity tests of plait's tiny GPT share: `tiny_gpt`,
`token_batches`, the optimizers `gpt_adamw` and `gpt_sgd`, and `gpt_reference`, the run on one
process they are compared with.
"""

import contextlib
import functools
import json
import multiprocessing
import multiprocessing.forkserver
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from plait.models import GPT, gpt_config
from plait.optim import param_groups
from plait.testing import single_process_reference
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


# The four layouts whose synchronous `plait train` runs several files share (RunCache keys them
# by their arguments): test_controller.py (each under the controller too) and
# test_train_checkpoint_async.py (each with asynchronous checkpoints).
TP_HEADS = ("--model.n_head", "4")
PP2 = ("--model.n_layer", "4", "--parallel.dp", "1", "--parallel.pp", "2")
SHARED_LAYOUTS = {
    "dp2": TP_HEADS,
    "dp2-zero3": ("--parallel.zero_stage", "3"),
    "tp2-sp": (*TP_HEADS, "--parallel.tp", "2", "--parallel.dp", "1", "--parallel.sequence_parallel", "true"),
    "pp2-1f1b": (*PP2, "--parallel.schedule", "1f1b"),
}


def plait_train(*args, env=None, timeout=180):
    return run_cli("train", *args, env=env, timeout=timeout)


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
    """Rank 0's metric record of every step, by step (an evaluation island's records, which hold
    a held-out loss only, are not steps': `island_evals`)."""
    return {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("eval") != "island"}


def island_evals(run_dir: Path) -> dict[int, float]:
    """The held-out losses an evaluation island (runtime.eval_island) wrote, by step."""
    return {
        r["step"]: r["val_loss"] for r in read_metrics(run_dir / "metrics.jsonl") if r.get("eval") == "island"
    }


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


# ==== Fewer and cheaper `plait train` launches for the same checks ===========================
# (docs/testing.md, "Keeping the suite fast". Other helpers above this line; this section is one
# piece: `run_cli` (the process of `plait_train`), `Once`, `train_job`, `RunCache` and its
# fixture `shared_runs`, `resume_job`, `cut_copy`.)


# what the fork server imports once; a superset of plait.testing.run_ranks's list (the two share it)
_PRELOAD = [
    "torch",
    "torch.distributed",
    "plait",
    "plait.cli",
    "plait.cli.train",
    "plait.train.launch",
    "plait.train.loop",
    "cli_child",
]
_CLI_START = threading.Lock()


def pytest_configure(config):
    """Start multiprocessing's fork server before any test, importing _PRELOAD in the background
    while pytest collects: the first starter sets what it imports, and `run_ranks` would start it
    with less (its children, and `run_cli`'s, would then import plait's trainer each time)."""
    multiprocessing.set_forkserver_preload(_PRELOAD)
    multiprocessing.forkserver.ensure_running()


def run_cli(*argv, env=None, timeout=180) -> subprocess.CompletedProcess:
    """`plait ARGV` in a process of its own, as `subprocess.run(capture_output=True, text=True)`
    returns it (exit code, stdout, stderr; subprocess.TimeoutExpired after `timeout` seconds),
    with this process's environment updated by `env`, in its working directory.

    The process is forked from multiprocessing's fork server (the one `plait.testing.run_ranks`
    uses), which imported torch and plait once, and runs the `plait` console script's
    `plait.cli:main`: a launch does not import torch again in its launching process (seconds of
    CPU each). What the launcher does from there (its own fork server, the ranks) is unchanged.
    PLAIT_TEST_SUBPROCESS=1 runs `python -m plait.cli` instead. Tests that need the module entry
    itself, signals or pipes (Ctrl-C, torchrun, the run-ownership pair) start their own."""
    cmd = [sys.executable, "-m", "plait.cli", *map(str, argv)]
    if os.environ.get("PLAIT_TEST_SUBPROCESS"):
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
        )
    from cli_child import cli_child

    ctx = multiprocessing.get_context("forkserver")
    with tempfile.TemporaryDirectory(prefix="plait-cli-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        args = (cmd[3:], {**os.environ, **(env or {})}, os.getcwd(), str(out), str(err))
        with _CLI_START:  # (a fork server is started once; the first call may start it)
            ctx.set_forkserver_preload(_PRELOAD)
            child = ctx.Process(target=cli_child, args=args, name="plait")
            child.start()
        child.join(timeout)

        def read(path):
            return path.read_text(errors="replace") if path.exists() else ""

        if child.exitcode is None:
            child.kill()
            child.join()
            raise subprocess.TimeoutExpired(cmd, timeout, read(out), read(err))
        return subprocess.CompletedProcess(cmd, child.exitcode, read(out), read(err))


class Once:
    """A job run at most once, however many threads call it: the first caller runs it, the
    others wait for its result. A job that needs another's run calls it (`resume_job`), so both
    go into one `side_by_side` and each starts as soon as it can."""

    def __init__(self, job: Callable):
        self.job, self.lock, self.result = job, threading.Lock(), None

    def __call__(self):
        with self.lock:
            if self.result is None:
                self.result = self.job()
            return self.result


def train_job(run_dir: Path, *args, env=None, timeout=180) -> Once:
    """`plait train ARGS --train.run_dir RUN_DIR` as a job returning (run dir, CompletedProcess)."""
    train = functools.partial(plait_train, *args, "--train.run_dir", str(run_dir), env=env, timeout=timeout)
    return Once(lambda: (run_dir, train()))


class RunCache:
    """`plait train` runs shared by every test file of a session, keyed by their arguments (and
    environment): a file that needs a run another file has already trained reads that one. A run
    starts at most once.

    The run directories are shared: read them, or resume a copy (`resume_job`), never resume or
    damage them in place."""

    def __init__(self, base: Path):
        self.base = base
        self.jobs: dict[tuple, Once] = {}

    def job(self, *args, env=None, timeout=180) -> Once:
        """`plait train ARGS` (without train.run_dir): a job returning (run dir, CompletedProcess)."""
        key = (tuple(map(str, args)), tuple(sorted((env or {}).items())))
        if key not in self.jobs:
            self.jobs[key] = train_job(self.base / f"run{len(self.jobs)}", *args, env=env, timeout=timeout)
        return self.jobs[key]

    def get(self, runs: dict, lanes: int = 2, env=None, timeout=180) -> dict:
        """{name: args} -> {name: (run dir, CompletedProcess)}, the missing ones side by side."""
        return side_by_side(
            {name: self.job(*args, env=env, timeout=timeout) for name, args in runs.items()}, lanes
        )


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory) -> RunCache:
    return RunCache(tmp_path_factory.mktemp("shared-runs"))


def resume_job(source: Callable, dst: Path, *args, step: int = 4, timeout=180) -> Callable:
    """A job: wait for `source` (a job returning (run dir, CompletedProcess)), copy its run as a
    stop after `step` leaves it (`cut_copy`) to `dst`, and `plait train --resume dst ARGS`.
    Returns (dst, CompletedProcess); the source's failure, named, if it failed."""

    def job():
        run, r = source()
        if r.returncode != 0:
            return dst, subprocess.CompletedProcess(
                r.args, r.returncode, r.stdout, f"{run} failed:\n{r.stderr}"
            )
        cut_copy(run, dst, step)
        return dst, plait_train("--resume", str(dst), *args, timeout=timeout)

    return job


def cut_copy(run: Path, dst: Path, step: int = 4) -> Path:
    """A copy of the finished run `run` as it stood once it had saved its checkpoint of `step`,
    as a run stopped there by `--train.stop_at step` leaves it: the later checkpoints and the
    metric lines of later steps dropped, `latest` naming step_N. `plait train --resume dst` then
    does what it does after such a stop (the checkpoint is the same one: the loop saves at
    `stop_at` and at `checkpoint_every` through one function), without training the first steps
    in a run of their own. The stop itself is tested on its own (test_train_run.py's bit-exact
    resume under torchrun, the cross-layout resumes of test_compose.py)."""
    shutil.copytree(run, dst, ignore=shutil.ignore_patterns("run.lock", "*.safetensors"))
    root = dst / "checkpoints"
    name = f"step_{step:08d}"
    assert (root / name).is_dir(), f"{run} saved no checkpoint at step {step}"
    for ckpt in root.glob("step_*"):
        if int(ckpt.name.split("_")[1].split(".")[0]) > step:
            shutil.rmtree(ckpt)
    (root / "latest").write_text(name)
    for path in dst.glob("metrics*.jsonl"):
        lines = path.read_text().splitlines(keepends=True)
        path.write_text("".join(x for x in lines if json.loads(x).get("step", 0) <= step))
    return dst


# ==== Runs in a session of their own, signalled as an operator or a scheduler does ==========
# (`start_train`, `cleaned_up`, `wait_for_step`, `session_pids`, `ranks_of`: the launcher and
# checkpoint fault tests; the processes of a run are those of its session, a process alive until
# it is a zombie)


def start_train(run: Path, *args, env=None, **popen) -> subprocess.Popen:
    """`plait train ARGS --train.run_dir RUN` in a session (and process group) of its own."""
    cmd = [sys.executable, "-m", "plait.cli", "train", *map(str, args), "--train.run_dir", str(run)]
    popen.setdefault("stdout", subprocess.PIPE)
    popen.setdefault("stderr", subprocess.PIPE)
    return subprocess.Popen(
        cmd, text=True, start_new_session=True, env={**os.environ, **(env or {})}, **popen
    )


@pytest.fixture
def ctrl_c_reaches_children():
    """Children started in this test get Ctrl-C as a terminal's foreground job does. A suite run
    as a background job of a shell script (`make test &`, `nohup`) inherits SIGINT ignored, and
    so would every child exec'd from it, so that a Ctrl-C test sees nothing happen. A handler set
    here (not SIG_IGN) becomes SIG_DFL across exec: Python's KeyboardInterrupt in the child."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def cleaned_up(*procs: subprocess.Popen):
    """Whatever the test finds, no process of these sessions outlives it."""
    try:
        yield
    finally:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            for pid in session_pids(proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def wait_for_step(run: Path, step: int, proc: subprocess.Popen, timeout: float = 240) -> int:
    deadline = time.time() + timeout
    while time.time() < deadline:
        done = metrics(run) if (run / "metrics.jsonl").exists() else {}
        if done and max(done) >= step:
            return max(done)
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError(f"{run} did not reach step {step} in {timeout}s")


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()  # state, ppid, pgrp, session, ...


def session_pids(sid: int) -> list[int]:
    """The live (not zombie) processes of session `sid`."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st and int(st[3]) == sid and st[0] not in "ZX":
                found.append(int(entry))
    return found


def ranks_of(launcher: int) -> list[int]:
    """The ranks a launcher started: the children of its fork server."""
    pids = session_pids(launcher)
    servers = [p for p in pids if int(_stat(p)[1]) == launcher and b"forkserver" in _cmdline(p)]
    return [p for p in pids if _stat(p) and int(_stat(p)[1]) in servers]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


# ==== Tiny models, data and single-process references of the parity tests ====================
# (one definition for the test files that train plait's tiny GPT against one process; each file
# keeps its own sizes, seeds and tolerances and passes them in)


def tiny_gpt(seed: int = 0, **overrides) -> GPT:
    """plait's "tiny" GPT with `overrides`, its weights drawn after seeding torch with `seed`."""
    torch.manual_seed(seed)
    return GPT(gpt_config("tiny", **overrides))


def token_batches(steps: int, batch: int, seq: int, vocab: int = 256, seed: int = 3) -> list:
    """`steps` global batches of random (inputs, targets) token ids, from one seeded generator."""
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, vocab, (batch, seq), generator=g),
            torch.randint(0, vocab, (batch, seq), generator=g),
        )
        for _ in range(steps)
    ]


def gpt_adamw(groups, eps: float = 1e-5) -> torch.optim.Optimizer:
    """The parity tests' AdamW. eps 1e-5: a coordinate whose gradient is rounding noise (the
    attention key bias) would take full-size steps with 1e-8, in any order of summation."""
    return torch.optim.AdamW(groups, lr=3e-3, weight_decay=0.1, eps=eps)


def gpt_sgd(groups) -> torch.optim.Optimizer:
    """SGD with momentum, run without clipping: a gradient of the wrong scale changes the
    trajectory from the first step."""
    return torch.optim.SGD(groups, lr=0.5, momentum=0.9)


def gpt_reference(
    build: Callable, make_optimizer: Callable, batches: list, clip: float = 0.0, weight_decay=0.1
):
    """One process, plain torch: `build()` a model taking (x, y), `make_optimizer` over its
    `param_groups(model, weight_decay)`, one step per batch, clipping at `clip` when positive.
    Returns `plait.testing.Reference` (losses, gradient norms before clipping, final parameters)."""

    def setup():
        model = build()
        return model, make_optimizer(param_groups(model, weight_decay)), lambda m, batch: m(*batch)

    return single_process_reference(setup, batches, len(batches), clip=clip)


def live_with(tag: str) -> dict[int, str]:
    """The live processes whose environment holds `tag` (a run's own processes inherit it): their
    command lines, by pid. An empty dict: nothing of that run is left."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if tag.encode() in (entry / "environ").read_bytes():
                    found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                pass
    return found


def run_python(script: str, *args: str, tag: str, timeout: int = 240) -> subprocess.CompletedProcess:
    """`python SCRIPT ARGS` from the repository root, with the repository and examples/ on
    PYTHONPATH (a driver program's ranks import the example's functions by name) and `tag` in its
    environment (`live_with(tag)` then finds what it left)."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{root}:{root / 'examples'}", "PLAIT_TEST_TAG": tag}
    cmd = [sys.executable, script, *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=root)

"""Run a function on N CPU ranks from a test, and compare parallel runs with a single process.

`run_ranks(fn, world_size)` starts one process per rank, initialises a gloo process group in
each, calls `fn(*args)` and returns the per-rank return values. A rank that raises, exits or
hangs fails the whole call quickly: the other ranks are killed and the error lists each failed
rank with its own traceback (or the watchdog's report). Group several checks into one call:
the ranks fork from a server that imported torch once, but the rendezvous and the gloo groups
still cost a fraction of a second per call.
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import gc
import json
import math
import multiprocessing as mp
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.distributed as dist

from plait.comm.ports import free_port
from plait.comm.recorder import write_error_file
from plait.zero import offload_disk


class RankFailure(AssertionError):
    """One or more ranks failed; `failures` maps rank -> its traceback or report."""

    def __init__(self, message: str, failures: dict[int, str], exitcodes: dict[int, int | None]):
        super().__init__(message)
        self.failures = failures
        self.exitcodes = exitcodes


def _child(fn: Callable, rank: int, world_size: int, port: int, workdir: str, args: tuple, env: dict) -> None:
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        TORCHELASTIC_ERROR_FILE=os.path.join(workdir, f"error-{rank}.json"),
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
        result = fn(*args)
        with open(os.path.join(workdir, f"result-{rank}.pkl"), "wb") as fh:
            pickle.dump(result, fh)
        del result
        gc.collect()  # free wrappers (DDP, FSDP) holding the group before it is destroyed
        dist.barrier()  # leave together: a peer tearing down gloo under a live one can abort it
        dist.destroy_process_group()
    except BaseException as exc:
        write_error_file(f"{type(exc).__name__}: {exc}", traceback.format_exc())
        os._exit(1)  # skip atexit hooks that could block on a dead peer
    # The result is on disk. Skip the interpreter's teardown: destructors of torch's C++ threads
    # at exit were seen (rarely) to abort a finished rank with "terminate called without an
    # active exception".
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _failure_text(workdir: Path, rank: int, exitcode: int | None) -> str:
    path = workdir / f"error-{rank}.json"
    if path.exists():
        try:
            info = json.loads(path.read_text())["message"]
            return info["extraInfo"].get("py_callstack") or info["message"]
        except (ValueError, KeyError):
            pass
    return f"exited with code {exitcode} and left no traceback"


def run_ranks(
    fn: Callable,
    world_size: int,
    args: Iterable = (),
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    grace: float = 2.0,
) -> list:
    """Run `fn(*args)` on `world_size` gloo ranks (processes); return each rank's result.

    `fn` must be importable (defined at module level). Raises `RankFailure` naming every rank
    that failed, with its traceback, as soon as one fails (after `grace` seconds for the others
    to report their own errors), or when `timeout` seconds pass.
    """
    # Ranks fork from a server that imported torch and plait once (spawn would import them in
    # every rank: seconds per call); each gets this process's environment of now.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "plait"])
    env = {**os.environ, **(env or {})}
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="plait-ranks-") as tmp:
        workdir = Path(tmp)
        procs = [
            ctx.Process(target=_child, args=(fn, r, world_size, port, tmp, tuple(args), env))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        first_failure = None
        while any(p.is_alive() for p in procs):
            now = time.monotonic()
            if first_failure is None and any(p.exitcode not in (None, 0) for p in procs):
                first_failure = now
            if now > deadline or (first_failure is not None and now - first_failure > grace):
                break
            time.sleep(0.05)
        timed_out = any(p.is_alive() for p in procs) and first_failure is None
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        codes = {r: p.exitcode for r, p in enumerate(procs)}
        failures = {}
        for r, code in codes.items():
            reported = (workdir / f"error-{r}.json").exists()
            if code != 0 and (reported or code != -9):  # -9 without a report: killed by us
                failures[r] = _failure_text(workdir, r, code)
        if timed_out or failures or any(c != 0 for c in codes.values()):
            head = f"timed out after {timeout:g}s" if timed_out else "ranks failed"
            parts = [
                f"--- rank {r} (exit code {codes[r]}) ---\n{text}" for r, text in sorted(failures.items())
            ]
            killed = [r for r, c in codes.items() if c == -9 and r not in failures]
            if killed:
                parts.append(f"(ranks {killed} were killed after the failure)")
            raise RankFailure(
                f"run_ranks({getattr(fn, '__name__', fn)}, {world_size}): {head}\n" + "\n".join(parts),
                failures,
                codes,
            )
        results = []
        for r in range(world_size):
            with open(workdir / f"result-{r}.pkl", "rb") as fh:
                results.append(pickle.load(fh))
        return results


# --- parity helpers ---------------------------------------------------------------------------


@dataclasses.dataclass
class Mismatch:
    name: str
    max_abs: float
    max_rel: float


def state_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached CPU copy of a module's parameters, keyed by name (wrappers' prefixes removed)."""
    return {_strip(n): p.detach().to("cpu", copy=True) for n, p in module.named_parameters()}


def _strip(name: str) -> str:
    for prefix in ("module.", "_orig_mod."):
        while name.startswith(prefix):
            name = name[len(prefix) :]
    return name


def compare_tensors(
    actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], atol: float = 1e-6, rtol: float = 0.0
) -> list[Mismatch]:
    """Every entry whose max abs difference exceeds atol + rtol * |expected|; missing keys too."""
    out = []
    if set(actual) != set(expected):
        diff = sorted(set(actual) ^ set(expected))
        return [Mismatch(f"key set differs: {diff[:5]}", float("inf"), float("inf"))]
    for name, e in expected.items():
        a = actual[name].to(e.dtype)
        if a.shape != e.shape:
            out.append(
                Mismatch(f"{name} shape {tuple(a.shape)} != {tuple(e.shape)}", float("inf"), float("inf"))
            )
            continue
        d = (a - e).abs()
        if not bool((d <= atol + rtol * e.abs()).all()):  # written so that NaN fails
            out.append(Mismatch(name, float(d.max()), float((d / e.abs().clamp_min(1e-12)).max())))
    return out


def assert_close_params(
    actual: dict, expected: dict, atol: float = 1e-6, rtol: float = 0.0, what: str = ""
) -> None:
    bad = compare_tensors(actual, expected, atol, rtol)
    if bad:
        lines = "\n".join(f"  {m.name}: max abs {m.max_abs:.3e}, max rel {m.max_rel:.3e}" for m in bad[:10])
        raise AssertionError(f"{what} parameters differ beyond atol={atol}, rtol={rtol}:\n{lines}")


def assert_close_losses(
    actual: list[float], expected: list[float], atol: float = 1e-6, rtol: float = 0.0, what: str = ""
) -> None:
    """Per step, |actual - expected| <= atol + rtol * |expected| (NaN fails)."""
    assert_close_series(actual, expected, atol, rtol, what, quantity="loss")


def assert_close_grad_norms(
    actual: list[float], expected: list[float], atol: float = 0.0, rtol: float = 1e-5, what: str = ""
) -> None:
    """The global gradient norm of every step, before clipping: the check that sees a gradient of
    the wrong scale even where the optimizer hides it (Adam is invariant to a constant factor,
    and clipping caps the step), relative by default since norms range over orders of magnitude."""
    assert_close_series(actual, expected, atol, rtol, what, quantity="gradient norm")


def assert_close_series(
    actual: list[float],
    expected: list[float],
    atol: float,
    rtol: float,
    what: str = "",
    quantity: str = "value",
) -> None:
    if len(actual) != len(expected):
        raise AssertionError(f"{what} {len(actual)} {quantity} values vs {len(expected)} expected")
    for i, (a, e) in enumerate(zip(actual, expected)):
        if not abs(a - e) <= atol + rtol * abs(e):  # written so that NaN fails
            raise AssertionError(
                f"{what} {quantity} at step {i}: {a!r} vs reference {e!r} (|diff| {abs(a - e):.3e}, "
                f"ratio {a / e if e else float('nan'):.6g})"
            )


def assert_clipped(after: float, before: float, max_norm: float, rtol: float = 1e-5) -> None:
    """The gradient norm after clipping to `max_norm` is torch's rule applied to the norm before
    it: before * min(1, max_norm / (before + 1e-6))."""
    want = before * min(1.0, max_norm / (before + 1e-6))
    if not abs(after - want) <= rtol * want:
        raise AssertionError(
            f"gradient norm after clipping to {max_norm}: {after!r}, torch's rule gives {want!r} "
            f"(norm before {before!r})"
        )


def grad_norm(params: Iterable[torch.nn.Parameter]) -> float:
    """The L2 norm over every gradient of `params`, in float64 (None gradients count as zero)."""
    sq = sum(float(p.grad.detach().double().pow(2).sum()) for p in params if p.grad is not None)
    return math.sqrt(sq)


@dataclasses.dataclass
class Reference:
    """What a single-process run gives a parity test: per step the loss and the global gradient
    norm before clipping, then the final parameters."""

    losses: list[float]
    grad_norms: list[float]
    params: dict[str, torch.Tensor]


def single_process_reference(
    build: Callable[[], tuple],
    batches: list,
    steps: int,
    clip: float = 0.0,
    set_to_none: bool = True,
) -> Reference:
    """Train on one process: `build()` -> (model, optimizer, loss_fn); each step consumes one
    entry of `batches` (the global batch) as `loss_fn(model, batch)`, clipping the gradient norm
    to `clip` when it is positive. Returns the losses, gradient norms and final parameters."""
    model, optimizer, loss_fn = build()
    losses, norms = [], []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=set_to_none)
        loss = loss_fn(model, batches[step])
        loss.backward()
        norms.append(grad_norm(model.parameters()))
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        losses.append(float(loss.detach()))
    return Reference(losses, norms, state_of(model))


# --- fault injection --------------------------------------------------------------------------


def inject_fault(step: int, rank: int, cfg, engine=None) -> None:
    """A trainer step hook for the failure tests: run `plait train` with
    PLAIT_STEP_HOOK=plait.testing:inject_fault and PLAIT_FAIL_AT=RANK:STEP[:MODE], and at that
    step that rank raises (no MODE), hangs (`hang`: the others then wait for it in a
    collective), finds its disk full (`enospc`: every disk-offload write from then on fails),
    dies at once (`kill`: SIGKILL, no traceback, no cleanup), sends SIGTERM to the launcher
    that started it (`sigterm`: a scheduler's pre-emption), or changes one value of its first
    parameter (`perturb`: silent corruption of one replica). Only in the job's first attempt: a
    job restarted by the launcher (train.max_restarts) runs clean."""
    spec = os.environ.get("PLAIT_FAIL_AT")
    if not spec or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0):
        return
    at_rank, at_step, *mode = spec.split(":")
    if (int(at_rank), int(at_step)) != (rank, step):
        return
    mode = mode[0] if mode else "raise"
    if mode == "hang":
        time.sleep(10 * cfg.comm.timeout_s)
    elif mode == "enospc":
        _fill_disk()
    elif mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif mode == "sigterm":
        os.kill(int(os.environ.get("PLAIT_LAUNCHER_PID", os.getppid())), signal.SIGTERM)
    elif mode == "perturb":
        # the trainer only here: run_ranks's children import this module and need none of it
        from plait.train.replicas import held_parameters

        with torch.no_grad():
            held_parameters(engine)[0][1].view(-1)[0] += 1e-3
    else:
        raise RuntimeError(f"injected fault on rank {rank} at step {step} (PLAIT_FAIL_AT)")


def _fill_disk() -> None:
    def full(path, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    offload_disk._write_file = full

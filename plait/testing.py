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
import errno
import functools
import json
import math
import os
import signal
import time
from collections.abc import Callable, Iterable

import torch
from torch.distributed.checkpoint import filesystem as dcp_filesystem

from plait.comm.spawn import RankFailure, run_ranks  # noqa: F401  (the tests' launcher)
from plait.state import group_options
from plait.zero import offload_disk

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
    collective), finds its disk full (`enospc`: every disk-offload and checkpoint write from then on fails),
    dies at once (`kill`: SIGKILL, no traceback, no cleanup) or a second into the step
    (`killlate`: its previous step's results have surely left it), sends SIGTERM to the launcher
    that started it (`sigterm`: a scheduler's pre-emption), or changes one value of its first
    parameter (`perturb`: silent corruption of one replica), or sees for this step only a
    non-finite loss (`nanloss`: its own loss sum is NaN, as an overflow in its forward gives) or
    gradient norm (`nangrad`: a NaN gradient that no exchange spreads to the other ranks, e.g.
    one replica's own). Several faults: RANK:STEP[:MODE],RANK:STEP[:MODE]. Only in the job's
    first attempt: a job restarted by the launcher (train.max_restarts) runs clean.
    PLAIT_FAIL_GROUP=G: only in DiLoCo's replica group G (first start only)."""
    spec = os.environ.get("PLAIT_FAIL_AT")
    if not spec or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0):
        return
    # DiLoCo (plait.train.diloco_launch): PLAIT_FAIL_GROUP=G limits the faults to replica group G
    # (every group has a rank 0), and a group started again runs clean
    group = os.environ.get("PLAIT_FAIL_GROUP")
    if group is not None and (
        os.environ.get("PLAIT_DILOCO_GROUP") != group or int(os.environ.get("PLAIT_DILOCO_GENERATION", "0"))
    ):
        return
    for one in spec.split(","):
        at_rank, at_step, *mode = one.split(":")
        if (int(at_rank), int(at_step)) == (rank, step):
            _fault(mode[0] if mode else "raise", step, rank, cfg, engine)


def _fault(mode: str, step: int, rank: int, cfg, engine) -> None:
    if mode in ("nanloss", "nangrad"):
        _poison_once(engine, mode)
    elif mode == "hang":
        time.sleep(10 * cfg.comm.timeout_s)
    elif mode == "enospc":
        _fill_disk()
    elif mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif mode == "killlate":  # its peers are waiting for it in the step by then
        time.sleep(1.0)
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


def slow_checkpoint_write(step: int, rank: int, path) -> None:
    """A checkpoint writer hook for the failure tests (`plait train` with
    PLAIT_CHECKPOINT_HOOK=plait.testing:slow_checkpoint_write, train.checkpoint_async true): with
    PLAIT_SLOW_WRITE=RANK:STEP:SECONDS[,...] (STEP `*`: every checkpoint), that rank's background
    write of that step's checkpoint starts SECONDS late; with PLAIT_SLOW_WRITE_FLAG=DIR, it first
    writes DIR/writing-STEP-RANK holding its PID, so a test knows the write is under way."""
    for one in os.environ.get("PLAIT_SLOW_WRITE", "").split(","):
        if not one:
            continue
        at_rank, at_step, seconds = one.split(":")
        if int(at_rank) == rank and at_step in ("*", str(step)):
            if flags := os.environ.get("PLAIT_SLOW_WRITE_FLAG"):
                flag = os.path.join(flags, f"writing-{step}-{rank}")
                with open(flag + ".tmp", "w") as fh:
                    json.dump({"pid": os.getpid(), "path": str(path)}, fh)
                os.replace(flag + ".tmp", flag)
            time.sleep(float(seconds))


def _poison_once(engine, mode: str) -> None:
    """For the coming step only, this rank's engine reports a NaN loss sum (`nanloss`) or a NaN
    gradient norm before clipping (`nangrad`); the other ranks' values stay finite."""
    name = "forward_backward" if mode == "nanloss" else "clip_grad_norm_"
    names = (name,) if mode == "nanloss" else (name, "grad_norm")

    def poisoned(*args, original, **kwargs):
        for n in names:  # one step only: the engine's own methods again
            engine.__dict__.pop(n, None)
        value = original(*args, **kwargs)
        return value * math.nan if torch.is_tensor(value) else math.nan

    for n in names:
        setattr(engine, n, functools.partial(poisoned, original=getattr(engine, n)))


def _fill_disk() -> None:
    def full(path, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    def full_item(transforms, stream, *args, **kwargs):  # a checkpoint shard: part of it fits
        stream.write(b"\0" * 4096)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), getattr(stream, "name", None))

    offload_disk._write_file = full
    dcp_filesystem._write_item = full_item  # DCP's writer looks it up when it writes


def slow_hook(step: int, rank: int, cfg, engine=None) -> None:
    """A step hook (PLAIT_STEP_HOOK=plait.testing:slow_hook) for tests and the
    benchmark: PLAIT_PS_SLOW=WORKER:SECONDS makes that worker sleep this long every clock, and
    PLAIT_FAIL_AT (`inject_fault`) still applies."""
    spec = os.environ.get("PLAIT_PS_SLOW")
    if spec:
        w, seconds = spec.split(":")
        if int(w) == rank:
            time.sleep(float(seconds))
    inject_fault(step, rank, cfg, engine)


def record_optimizer(step: int, rank: int, cfg, engine=None) -> None:
    """A step hook (PLAIT_STEP_HOOK=plait.testing:record_optimizer) for the resume tests: rank 0
    writes the optimizer's parameter-group options (lr, weight_decay, betas, ...) as the run's
    first step starts to the JSON file PLAIT_RECORD_TO, once; PLAIT_FAIL_AT still applies."""
    path = os.environ.get("PLAIT_RECORD_TO")
    if path and rank == 0 and not os.path.exists(path):
        with open(path, "w") as fh:
            json.dump({"step": step, "groups": group_options(engine.optimizer)}, fh)
    inject_fault(step, rank, cfg, engine)

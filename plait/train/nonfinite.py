"""Steps whose loss or gradient norm is not finite (train.nonfinite): the step is skipped (the
parameters never see the gradient), and the run stops as diverged on "stop", after
train.max_nonfinite skipped steps in a row, or when its last step is skipped (a run does not end
as if it had trained); a diverged run is marked so that a restart does not train it again. Every
rank takes the same decision: `agree_finite` combines what each rank saw."""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import torch

from plait import comm
from plait.errors import CheckpointError, DivergedError
from plait.mesh import Mesh
from plait.train.checkpoint import latest_checkpoint
from plait.train.report import say
from plait.train.run_state import Run


def clear_nonfinite_residuals(engine) -> None:
    """A skipped step's non-finite gradient may have reached a compressor's error-feedback
    residual; such a residual would poison every later step, so it starts again from zero."""
    buffers = getattr(engine, "residual_buffers", lambda: None)() or {}
    for t in buffers.values():
        if not bool(torch.isfinite(t).all()):
            t.zero_()


def agree_finite(mesh: Mesh, loss: float, grad_norm: float) -> tuple[float, float]:
    """The step's loss and gradient norm as every rank must judge them: a quantity non-finite on
    any rank (one replica's own gradient, a pipeline stage's part of the norm) is NaN on all of
    them, so that all skip the step or none does. One all-reduce of two flags over the world."""
    bad = torch.tensor(
        [not math.isfinite(loss), not math.isfinite(grad_norm)],
        dtype=torch.float64,
        device=mesh.device if mesh.device.type == "cuda" else "cpu",
    )
    comm.all_reduce(bad, mesh, "world", op="max")
    bad_loss, bad_norm = (bool(b) for b in bad.tolist())
    return (math.nan if bad_loss and math.isfinite(loss) else loss), (
        math.nan if bad_norm and math.isfinite(grad_norm) else grad_norm
    )


def describe(record: dict) -> str:
    """Which quantity of a skipped step is not finite, with the other's value."""
    loss, norm = record["loss"], record["grad_norm"]
    if not math.isfinite(loss) and not math.isfinite(norm):
        return f"non-finite loss ({loss:.4g}) and gradient norm ({norm:.4g})"
    if not math.isfinite(loss):
        return f"non-finite loss ({loss:.4g}; gradient norm {norm:.4g})"
    return f"non-finite gradient norm ({norm:.4g}; loss {loss:.4g})"


def guard_nonfinite(run: Run, step: int, record: dict) -> None:
    """Count a skipped step, say so, and stop the run (every rank alike) when train.nonfinite
    is "stop" or too many steps in a row were skipped."""
    t = run.cfg.train
    if not record.get("skipped"):
        run.skipped_in_a_row = 0
        return
    run.skipped += 1
    run.skipped_in_a_row += 1
    record["skipped_steps"] = run.skipped
    what = describe(record)
    if t.nonfinite == "skip" and run.skipped_in_a_row < t.max_nonfinite:
        say(
            run.mesh,
            f"plait: step {step} skipped: {what} (the parameters were not updated; "
            f"{run.skipped_in_a_row} in a row, the run stops at train.max_nonfinite = {t.max_nonfinite})",
        )
        return
    why = (
        f"{run.skipped_in_a_row} steps in a row (train.max_nonfinite = {t.max_nonfinite})"
        if t.nonfinite == "skip"
        else "train.nonfinite = 'stop'"
    )
    _stop(run, step, record, f"training diverged at step {step}: {what}, {why}")


def guard_last_step(run: Run, step: int, record: dict) -> None:
    """A run whose last step was skipped ends as diverged (exit code 1), not as trained: its
    parameters are those of the last step that was not skipped."""
    if step != run.last or not run.skipped_in_a_row:
        return
    n, good = run.skipped_in_a_row, step - run.skipped_in_a_row
    _stop(
        run,
        step,
        record,
        f"training ended at step {step} while skipping steps: the last {n} had a non-finite loss or "
        f"gradient norm (step {step}: {describe(record)}), so the parameters are step {good}'s, "
        f"not trained to the end (train.max_nonfinite = {run.cfg.train.max_nonfinite} was not reached)",
    )


def _stop(run: Run, step: int, record: dict, message: str) -> None:
    run.metrics.write(**record)
    run.metrics.close()
    found = None
    with contextlib.suppress(CheckpointError):
        found = latest_checkpoint(run.run_dir / "checkpoints")
    where = (
        f"the last checkpoint, {found}, holds finite parameters: continue from it with a lower "
        f"train.lr (plait train --resume {run.run_dir} --train.lr ...)"
        if found is not None
        else "no checkpoint was saved before it"
    )
    _mark_diverged(run.run_dir, run.mesh, step)
    raise DivergedError(f"{message}; {where}")


DIVERGED = ".plait-diverged"  # in the run directory: a restarted job does not train again


def _mark_diverged(run_dir: Path, mesh: Mesh, step: int) -> None:
    if mesh.is_rank0:
        (run_dir / DIVERGED).write_text(f"{step}\n")

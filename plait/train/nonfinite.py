"""Steps whose loss or gradient norm is not finite (train.nonfinite): the step is skipped (the
parameters never see the gradient), and the run stops as diverged on "stop", or after
train.max_nonfinite skipped steps in a row; a diverged run is marked so that a restart does not
train it again."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

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
    what = f"loss {record['loss']:.4g}, gradient norm {record['grad_norm']:.4g}"
    if t.nonfinite == "skip" and run.skipped_in_a_row < t.max_nonfinite:
        say(
            run.mesh,
            f"plait: step {step} skipped: non-finite {what} (the parameters were not updated; "
            f"{run.skipped_in_a_row} in a row, the run stops at train.max_nonfinite = {t.max_nonfinite})",
        )
        return
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
    why = (
        f"{run.skipped_in_a_row} steps in a row (train.max_nonfinite = {t.max_nonfinite})"
        if t.nonfinite == "skip"
        else "train.nonfinite = 'stop'"
    )
    _mark_diverged(run.run_dir, run.mesh, step)
    raise DivergedError(f"training diverged at step {step}: non-finite {what}, {why}; {where}")


DIVERGED = ".plait-diverged"  # in the run directory: a restarted job does not train again


def _mark_diverged(run_dir: Path, mesh: Mesh, step: int) -> None:
    if mesh.is_rank0:
        (run_dir / DIVERGED).write_text(f"{step}\n")

"""The non-finite guard's bookkeeping (plait.train.nonfinite) on one process, step by step: what is
counted, said, written and raised, and which residuals are cleared. The runs that diverge for real
(dp 2, every rank alike) are in test_faults.py; these are the fast checks `make mutate
MODULE=plait/train/nonfinite.py` runs against (docs/testing.md)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from plait.errors import DivergedError
from plait.train.checkpoint import LATEST
from plait.train.nonfinite import DIVERGED, clear_nonfinite_residuals, guard_nonfinite


class _Metrics:
    def __init__(self):
        self.rows, self.closed = [], False

    def write(self, **row):
        self.rows.append(row)

    def close(self):
        self.closed = True


def _run(tmp_path, nonfinite="skip", max_nonfinite=3, rank0=True):
    train = SimpleNamespace(nonfinite=nonfinite, max_nonfinite=max_nonfinite)
    return SimpleNamespace(
        cfg=SimpleNamespace(train=train),
        mesh=SimpleNamespace(is_rank0=rank0),
        run_dir=tmp_path,
        metrics=_Metrics(),
        skipped=0,
        skipped_in_a_row=0,
    )


def _step(ok: bool, step: int) -> dict:
    if ok:
        return {"step": step, "loss": 2.5, "grad_norm": 1.25}
    return {"step": step, "loss": math.nan, "grad_norm": math.inf, "skipped": True}


def test_skipped_steps_are_counted_in_a_row_and_in_all(tmp_path, capsys):
    """skip, skip, finite, skip, skip under max_nonfinite 3: never 3 in a row, so no stop; the
    record carries the running total; each skipped step is said with its count in a row."""
    run = _run(tmp_path)
    totals = []
    for step, ok in enumerate([False, False, True, False, False], start=1):
        record = _step(ok, step)
        guard_nonfinite(run, step, record)
        totals.append(record.get("skipped_steps"))
    assert totals == [1, 2, None, 3, 4]
    assert (run.skipped, run.skipped_in_a_row) == (4, 2)
    said = capsys.readouterr().out.splitlines()
    assert len(said) == 4
    assert said[0].startswith("plait: step 1 skipped: non-finite loss (nan) and gradient norm (inf)")
    assert "1 in a row, the run stops at train.max_nonfinite = 3" in said[0]
    assert "2 in a row" in said[1] and said[2].startswith("plait: step 4 skipped") and "1 in a row" in said[2]
    assert run.metrics.rows == [] and not run.metrics.closed
    assert not (tmp_path / DIVERGED).exists()


def test_the_max_in_a_row_stops_the_run_and_marks_it(tmp_path, capsys):
    run = _run(tmp_path, max_nonfinite=2)
    guard_nonfinite(run, 7, _step(False, 7))
    record = _step(False, 8)
    with pytest.raises(DivergedError) as err:
        guard_nonfinite(run, 8, record)
    msg = str(err.value)
    assert msg.startswith("training diverged at step 8: non-finite loss (nan) and gradient norm (inf), ")
    assert "2 steps in a row (train.max_nonfinite = 2); no checkpoint was saved before it" in msg
    assert (tmp_path / DIVERGED).read_text() == "8\n"
    assert run.metrics.rows == [record] and record["skipped_steps"] == 2 and run.metrics.closed
    assert capsys.readouterr().out.count("skipped") == 1  # the stopping step is raised, not said


def test_stop_ends_at_the_first_and_names_the_checkpoint_to_resume_from(tmp_path, capsys):
    ckpt = tmp_path / "checkpoints"
    (ckpt / "step_4").mkdir(parents=True)
    (ckpt / LATEST).write_text("step_4\n")
    run = _run(tmp_path, nonfinite="stop", max_nonfinite=5)
    guard_nonfinite(run, 4, _step(True, 4))
    with pytest.raises(DivergedError) as err:
        guard_nonfinite(run, 5, _step(False, 5))
    msg = str(err.value)
    assert "train.nonfinite = 'stop'" in msg and "in a row" not in msg
    assert f"the last checkpoint, {ckpt / 'step_4'}, holds finite parameters" in msg
    assert f"plait train --resume {tmp_path} --train.lr" in msg
    assert (tmp_path / DIVERGED).read_text() == "5\n"
    assert capsys.readouterr().out == ""


def test_a_latest_pointer_to_a_removed_checkpoint_names_none(tmp_path):
    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    (ckpt / LATEST).write_text("step_9\n")  # removed by hand: latest_checkpoint raises, suppressed
    with pytest.raises(DivergedError) as err:
        guard_nonfinite(_run(tmp_path, nonfinite="stop"), 10, _step(False, 10))
    assert str(err.value).endswith("train.nonfinite = 'stop'; no checkpoint was saved before it")


def test_a_finite_step_resets_the_count_and_other_ranks_stay_quiet(tmp_path, capsys):
    run = _run(tmp_path, max_nonfinite=2, rank0=False)
    run.skipped_in_a_row = 1
    guard_nonfinite(run, 3, _step(True, 3))
    assert (run.skipped, run.skipped_in_a_row) == (0, 0)
    guard_nonfinite(run, 4, _step(False, 4))  # 1 in a row again: skipped, not stopped
    with pytest.raises(DivergedError):
        guard_nonfinite(run, 5, _step(False, 5))
    assert not (tmp_path / DIVERGED).exists()  # rank 0 writes the mark
    assert capsys.readouterr().out == ""


def test_only_non_finite_residuals_are_cleared():
    good = torch.tensor([1.0, -2.0])
    bad = torch.tensor([3.0, math.nan, 4.0])
    worse = torch.tensor([math.inf, 5.0])
    engine = SimpleNamespace(residual_buffers=lambda: {"a": good, "b": bad, "c": worse})
    clear_nonfinite_residuals(engine)
    assert good.tolist() == [1.0, -2.0]
    assert bad.tolist() == [0.0, 0.0, 0.0] and worse.tolist() == [0.0, 0.0]
    clear_nonfinite_residuals(SimpleNamespace())  # an engine without a compressor
    clear_nonfinite_residuals(SimpleNamespace(residual_buffers=lambda: None))

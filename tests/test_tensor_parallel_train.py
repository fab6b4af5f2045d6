"""`plait train` with tensor parallelism: runs with and without sequence parallelism, next to data
parallelism; a tp=2 checkpoint resumes with dp=2 (and the reverse) with the same losses."""

import shutil

import pytest
from conftest import TINY, assert_runs_match, losses, plait_train_all

from plait.zero.state import range_boxes, saved_shape

TP = ("--model.n_head", "4")
TP2 = ("--parallel.tp", "2", "--parallel.dp", "1")
RUNS = {  # independent runs, trained side by side
    "full": TP2,
    "cut": (*TP2, "--train.stop_at", "4"),
    "dp": (),
    "sp": (*TP2, "--parallel.sequence_parallel", "true"),
}
LAYOUTS = {
    "dp2": ("--parallel.tp", "1", "--parallel.dp", "2"),
    "dp2xtp2-sp": ("--parallel.tp", "2", "--parallel.dp", "2", "--parallel.sequence_parallel", "true"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: (run dir, CompletedProcess)} for RUNS (the job on tp=2, stopped after step 4 too;
    on dp=2; on tp=2 with sequence parallelism), then the stopped run resumed on each of LAYOUTS
    (in copies, side by side)."""
    base = tmp_path_factory.mktemp("tp")
    done = plait_train_all(
        {name: (*TINY, *TP, *extra, "--train.run_dir", str(base / name)) for name, extra in RUNS.items()}
    )
    if done["cut"].returncode == 0:  # (else tp2_runs reports it)
        for name in LAYOUTS:
            shutil.copytree(base / "cut", base / f"resumed-{name}")
        resumes = {
            f"resumed-{name}": ("--resume", str(base / f"resumed-{name}"), *layout)
            for name, layout in LAYOUTS.items()
        }
        done.update(plait_train_all(resumes))
    return {name: (base / name, r) for name, r in done.items()}


@pytest.fixture(scope="module")
def tp2_runs(runs):
    for name in ("full", "cut"):
        _, r = runs[name]
        assert r.returncode == 0, r.stderr
        assert "tensor parallel over 2" in r.stdout
    return runs["full"][0], runs["cut"][0]


@pytest.mark.parametrize("name", LAYOUTS)
def test_tp_checkpoint_resumes_on_another_layout(tp2_runs, runs, name):
    full, _ = tp2_runs
    run, r = runs[f"resumed-{name}"]
    assert r.returncode == 0, r.stderr
    assert_runs_match(run, full, steps=range(5, 9), what=f"resumed on {LAYOUTS[name]}")


def test_tp_runs_match_data_parallel(tp2_runs, runs):
    """The same job on dp=2 and on tp=2 (and tp=2 with sequence parallelism) has the same losses."""
    full, _ = tp2_runs
    dp_run, r = runs["dp"]
    assert r.returncode == 0, r.stderr
    sp_run, r = runs["sp"]
    assert r.returncode == 0, r.stderr
    assert "sequence parallel" in r.stdout
    for other, what in ((full, "tp2"), (sp_run, "tp2 + sp")):
        assert sorted(losses(other)) == sorted(losses(dp_run))
        assert_runs_match(other, dp_run, what=what)


def test_range_boxes_cover_exactly_the_range():
    import torch

    shape = saved_shape(torch.Size([5, 7]))
    full = torch.arange(35.0).view(5, 7)
    for start, n in ((0, 35), (3, 4), (3, 20), (7, 14), (30, 5), (6, 1), (13, 0)):
        flat = full.view(-1)[start : start + n].clone()
        seen = torch.zeros(5, 7)
        for (r, c), box in range_boxes(flat, start, shape):
            assert torch.equal(full[r : r + box.shape[0], c : c + box.shape[1]], box)
            seen[r : r + box.shape[0], c : c + box.shape[1]] += 1
        assert int(seen.sum()) == n and int(seen.max()) <= 1
    assert saved_shape(torch.Size([2, 3, 4])) == torch.Size([6, 4])

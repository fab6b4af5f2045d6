"""`plait train` with tensor parallelism: runs with and without sequence parallelism, next to data
parallelism; a tp=2 checkpoint resumes with dp=2 and with dp2 x tp2 + sequence parallelism, with the
same losses as the uninterrupted run."""

import pytest
from conftest import TINY, assert_runs_match, losses, resume_job, side_by_side

from plait.state import range_boxes, saved_shape

TP = ("--model.n_head", "4")
TP2 = ("--parallel.tp", "2", "--parallel.dp", "1")
RUNS = {  # independent runs, trained side by side
    "full": TP2,
    "dp": (),
    "sp": (*TP2, "--parallel.sequence_parallel", "true"),
}
LAYOUTS = {
    "dp2": ("--parallel.tp", "1", "--parallel.dp", "2"),
    "dp2xtp2-sp": ("--parallel.tp", "2", "--parallel.dp", "2", "--parallel.sequence_parallel", "true"),
}


@pytest.fixture(scope="module")
def runs(shared_runs, tmp_path_factory):
    """{name: (run dir, CompletedProcess)} for RUNS (the job on tp=2; on dp=2; on tp=2 with
    sequence parallelism; shared with other files), and the tp=2 run as stopped after step 4
    (`cut_copy`) resumed on each of LAYOUTS; side by side."""
    base = tmp_path_factory.mktemp("tp")
    jobs = {name: shared_runs.job(*TINY, *TP, *extra) for name, extra in RUNS.items()}
    for name, layout in LAYOUTS.items():
        jobs[f"resumed-{name}"] = resume_job(jobs["full"], base / f"resumed-{name}", *layout)
    return side_by_side(jobs)


@pytest.fixture(scope="module")
def tp2_runs(runs):
    _, r = runs["full"]
    assert r.returncode == 0, r.stderr
    assert "tensor parallel over 2" in r.stdout
    return runs["full"][0]


@pytest.mark.parametrize("name", LAYOUTS)
def test_tp_checkpoint_resumes_on_another_layout(tp2_runs, runs, name):
    full = tp2_runs
    run, r = runs[f"resumed-{name}"]
    assert r.returncode == 0, r.stderr
    assert_runs_match(run, full, steps=range(5, 9), what=f"resumed on {LAYOUTS[name]}")


def test_tp_runs_match_data_parallel(tp2_runs, runs):
    """The same job on dp=2 and on tp=2 (and tp=2 with sequence parallelism) has the same losses."""
    full = tp2_runs
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

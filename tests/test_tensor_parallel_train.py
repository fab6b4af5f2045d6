"""`plait train` with tensor parallelism: runs with and without sequence parallelism, next to data
parallelism; a tp=2 checkpoint resumes with dp=2 (and the reverse) with the same losses."""

import shutil

import pytest
from conftest import TINY, assert_runs_match, losses, plait_train

from plait.zero.state import range_boxes, saved_shape

TP = ("--model.n_head", "4")


@pytest.fixture(scope="module")
def tp2_runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("tp")
    full, cut = base / "full", base / "cut"
    for run, extra in ((full, ()), (cut, ("--train.stop_at", "4"))):
        args = (*TINY, *TP, "--parallel.tp", "2", "--parallel.dp", "1", *extra, "--train.run_dir", str(run))
        r = plait_train(*args)
        assert r.returncode == 0, r.stderr
        assert "tensor parallel over 2" in r.stdout
    return full, cut


@pytest.mark.parametrize(
    "layout",
    [
        ("--parallel.tp", "1", "--parallel.dp", "2"),
        ("--parallel.tp", "2", "--parallel.dp", "2", "--parallel.sequence_parallel", "true"),
    ],
    ids=["dp2", "dp2xtp2-sp"],
)
def test_tp_checkpoint_resumes_on_another_layout(tp2_runs, tmp_path, layout):
    full, cut = tp2_runs
    run = tmp_path / "run"
    shutil.copytree(cut, run)
    r = plait_train("--resume", str(run), *layout)
    assert r.returncode == 0, r.stderr
    assert_runs_match(run, full, steps=range(5, 9), what=f"resumed on {layout}")


def test_tp_runs_match_data_parallel(tp2_runs, tmp_path):
    """The same job on dp=2 and on tp=2 (and tp=2 with sequence parallelism) has the same losses."""
    full, _ = tp2_runs
    dp_run, sp_run = tmp_path / "dp", tmp_path / "sp"
    r = plait_train(*TINY, *TP, "--train.run_dir", str(dp_run))
    assert r.returncode == 0, r.stderr
    r = plait_train(
        *TINY,
        *TP,
        "--parallel.tp",
        "2",
        "--parallel.dp",
        "1",
        "--parallel.sequence_parallel",
        "true",
        "--train.run_dir",
        str(sp_run),
    )
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

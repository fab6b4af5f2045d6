"""Non-finite steps as a user meets them with `plait train` (issue 29, items 7 and 8):

* one rank alone sees a non-finite loss or gradient norm (plait.testing.inject_fault's `nanloss`
  and `nangrad`): every rank skips that step and no other, the replicas stay identical (the
  replica check at steps 4 and 8), and the run goes on to its end, at dp 2 and at pp 2 (where
  the poisoned loss is the first stage's, which is always 0 there);
* the skip line names the quantity that is not finite, with the other's value;
* a run that ends while skipping steps (the issue's command: lr 1000, no clipping) says so in
  one line and exits 1, with no held-out loss reported as if it had trained.
"""

from __future__ import annotations

import functools
import math

import pytest
from conftest import SGD, TINY, assert_runs_match, fault_env, metrics, plait_train, side_by_side

from plait.train.metrics import read_metrics

ONE = (*TINY, *SGD, "--model.n_layer", "2", "--parallel.dp", "1", "--train.log_every", "1")
DP2 = (*TINY, *SGD, "--model.n_layer", "2", "--parallel.dp", "2", "--train.log_every", "1")
PP2 = (*TINY, *SGD, "--model.n_layer", "2", "--parallel.dp", "1", "--parallel.pp", "2")
PP2 = (*PP2, "--train.log_every", "1")
# rank 1 (dp 2) / rank 0 (pp 2: the first stage) sees a NaN loss at step 3, rank 1 a NaN
# gradient norm at step 5
FAULTS = {
    "dp2": "1:3:nanloss,1:5:nangrad",
    "pp2": "0:3:nanloss,1:5:nangrad",
    "one": "0:3:nanloss,0:5:nangrad",
}
DIVERGE = ("--parallel.dp", "1", "--train.steps", "12", "--train.lr", "1000", "--train.grad_clip", "0")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("nonfinite")

    def job(name, *args, env=None):
        return base / name, plait_train(*args, "--train.run_dir", str(base / name), env=env, timeout=300)

    return side_by_side(
        {
            "dp2": functools.partial(job, "dp2", *DP2, env=fault_env(FAULTS["dp2"])),
            "pp2": functools.partial(job, "pp2", *PP2, env=fault_env(FAULTS["pp2"])),
            "one": functools.partial(job, "one", *ONE, env=fault_env(FAULTS["one"])),
            "diverged": functools.partial(job, "diverged", *TINY, *DIVERGE),
        }
    )


def _per_rank(run, world: int) -> list[dict[int, dict]]:
    names = ["metrics.jsonl"] + [f"metrics-rank{r}.jsonl" for r in range(1, world)]
    return [{rec["step"]: rec for rec in read_metrics(run / n)} for n in names]


@pytest.mark.parametrize("layout", ["dp2", "pp2"])
def test_one_rank_non_finite_every_rank_skips_the_same_step(runs, layout):
    run, r = runs[layout]
    assert r.returncode == 0, r.stderr[-3000:]
    for rank, m in enumerate(_per_rank(run, 2)):
        assert sorted(m) == list(range(1, 9)), (rank, sorted(m))
        skipped = [s for s in sorted(m) if m[s].get("skipped")]
        assert skipped == [3, 5], f"{layout} rank {rank} skipped {skipped}"
        assert all(math.isfinite(m[s]["loss"]) for s in (6, 7, 8)), m  # the run goes on
    assert "step 3 skipped: non-finite loss (nan; gradient norm " in r.stdout, r.stdout[-3000:]
    assert "step 5 skipped: non-finite gradient norm (nan; loss " in r.stdout, r.stdout[-3000:]
    if layout == "dp2":  # the replicas compared at steps 4 and 8 (a mismatch stops the run)
        assert metrics(run)[8]["replicas_checked"] > 0


def test_a_run_that_ends_while_skipping_says_so_and_exits_1(runs):
    run, r = runs["diverged"]
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    m = metrics(run)
    assert max(m) == 12 and m[12].get("skipped"), m
    skipped = [s for s in sorted(m) if m[s].get("skipped")]
    n = len([s for s in range(1, 13) if all(m[k].get("skipped") for k in range(s, 13))])
    line = f"training ended at step 12 while skipping steps: the last {n} had a non-finite loss"
    assert line in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert f"the parameters are step {12 - n}'s" in r.stderr and skipped[-n:] == list(range(13 - n, 13))
    assert "held-out loss" not in r.stdout  # nothing reported as if the run had trained
    assert (run / ".plait-diverged").exists()  # a launcher's restart does not train it again


@pytest.mark.parametrize("layout", ["dp2", "pp2"])
def test_skipped_steps_leave_the_run_on_one_process_trajectory(runs, layout):
    """The parity matrix with the fault: one process that skips steps 3 and 5 (its whole loss,
    then its gradient norm, not finite) and each layout whose one rank alone saw them follow the
    same trajectory, to 1e-5, on every step that was taken."""
    (one, r1), (run, r) = runs["one"], runs[layout]
    assert r1.returncode == 0 and r.returncode == 0, r1.stderr[-2000:] + r.stderr[-2000:]
    assert [s for s, rec in sorted(metrics(one).items()) if rec.get("skipped")] == [3, 5]
    assert_runs_match(run, one, steps=[1, 2, 4, 6, 7, 8], what=f"{layout} vs one process")

"""Recovery from a data-parallel peer's memory (plait.controller.peer): which layouts allow it,
which surviving rank hands each fresh rank its state, and when the controller falls back to the
newest checkpoint. The recovery itself (a rank killed at step 6 of a dp2 run, the run ending
with the uninterrupted run's losses bit for bit) is tests/test_controller.py's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from plait.controller.peer import (
    PEER_TIMEOUT_S,
    STATE_TIMEOUT_S,
    choose,
    groups,
    ineligible,
    recover,
    restore,
    snapshot,
)
from plait.data_parallel.engine import DataParallelEngine
from plait.train.checkpoint import _rng_state
from plait.train.config import Config

DP2_TP2 = {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "ep": 1, "tp": 2}


def test_ranks_of_one_model_coordinate_form_a_group():
    # rank order is row-major over the dims, tp fastest: ranks 0 and 2 hold tp shard 0
    assert groups(DP2_TP2) == [(0, 0, 0), (0, 0, 1), (0, 0, 0), (0, 0, 1)]
    pp2_dp2 = {"pp": 2, "dp_replicate": 2, "dp_shard": 1, "ep": 1, "tp": 1}
    assert groups(pp2_dp2) == [(0, 0, 0), (0, 0, 0), (1, 0, 0), (1, 0, 0)]


def test_each_group_takes_its_first_surviving_rank():
    answers = {0: {"taken": 5}, 2: {"taken": 5}, 3: {"taken": 5}}  # rank 1 lost
    assert choose(answers, DP2_TP2, lost=1) == ({(0, 0, 0): 0, (0, 0, 1): 3}, "")


def test_a_group_with_no_survivor_falls_back_to_the_checkpoint():
    sources, why = choose({0: {"taken": 5}, 2: {"taken": 5}}, DP2_TP2, lost=1)  # 1 and 3 gone
    assert sources is None
    assert why == "no surviving rank holds the state of model coordinates (pp, ep, tp) = (0, 0, 1)"


def test_survivors_at_different_steps_fall_back_to_the_checkpoint():
    sources, why = choose({0: {"taken": 5}, 2: {"taken": 6}, 3: {"taken": 5}}, DP2_TP2, lost=1)
    assert sources is None and why == "the surviving ranks are at different steps ([5, 6])"


def test_the_failed_rank_is_never_a_source_even_if_it_answered():
    answers = {0: {"taken": 5}, 1: {"taken": 5}, 2: {"taken": 5}, 3: {"taken": 5}}
    assert choose(answers, DP2_TP2, lost=0) == ({(0, 0, 0): 2, (0, 0, 1): 1}, "")


def _cfg(**parallel) -> Config:
    cfg = Config()
    for k, v in parallel.items():
        if k == "compression":
            cfg.comm.compression = v
        else:
            setattr(cfg.parallel, k, v)
    return cfg


@pytest.mark.parametrize(
    "layout, why",
    [
        ({"dp": 2}, None),
        ({"dp": 2, "tp": 2}, None),
        ({"dp": 1}, "dp = 1: no rank holds a copy of another's state"),
        ({"dp": 2, "zero_stage": 1}, "ZeRO stage 1 shards the state over dp: a lost shard has no copy"),
        ({"dp": 2, "compression": "onebit"}, "comm.compression = onebit: its error-feedback residuals"),
        ({"dp": 2, "pp": 2}, "pipeline stages and experts are not built for it"),
        ({"dp": 2, "ep": 2}, "pipeline stages and experts are not built for it"),
    ],
)
def test_which_layouts_recover_from_a_peer(layout, why):
    got = ineligible(_cfg(**layout))
    if why is None:
        assert got is None, got
    else:
        assert got is not None and got.startswith(why), got


class _Sampler:
    def __init__(self):
        self.position = None

    def load_state_dict(self, sd):
        self.position = sd


def _run(seed: int, tmp_path):
    """The parts of a Run that snapshot and restore touch: a small model trained by SGD with
    momentum under an LR schedule, on no mesh's rank 0."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    engine = DataParallelEngine.__new__(DataParallelEngine)  # its state, without a mesh
    engine.raw, engine.optimizer, engine.ddp = model, opt, None
    mesh = SimpleNamespace(is_rank0=False)
    return SimpleNamespace(
        engine=engine,
        scheduler=sched,
        skipped_in_a_row=0,
        sampler=_Sampler(),
        mesh=mesh,
        run_dir=tmp_path,
        start=0,
        last=8,
        timeline_step=3,
    )


def _train(run, steps: int) -> None:
    for _ in range(steps):
        run.engine.raw(torch.randn(5, 4)).square().sum().backward()
        run.engine.optimizer.step()
        run.engine.optimizer.zero_grad()
        run.scheduler.step()


def test_a_fresh_rank_restored_from_a_snapshot_continues_as_the_peer_would(tmp_path):
    peer_run = _run(0, tmp_path)
    _train(peer_run, 3)
    peer_run.skipped_in_a_row = 2
    torch.manual_seed(11)
    rng = _rng_state()  # the peer's RNG state at the end of step 3, as its actor keeps it
    state = snapshot(peer_run, taken=3, rng=rng, full=True)
    assert set(snapshot(peer_run, taken=3, rng=rng, full=False)) == {"taken", "rng"}
    want_next = torch.rand(3)  # the peer's RNG draws this next
    want = {k: v.clone() for k, v in peer_run.engine.raw.state_dict().items()}
    _train(peer_run, 1)  # the snapshot is a copy: the peer going on does not change it
    state.update(sampler={"position": 5}, source=0)

    fresh = _run(1, tmp_path)  # another initialisation: everything must come from the snapshot
    restore(fresh, state)
    for k, v in fresh.engine.raw.state_dict().items():
        assert torch.equal(v, want[k]), k
    assert torch.equal(torch.rand(3), want_next)  # its RNG state, where it survived
    assert fresh.scheduler.last_epoch == 3 and fresh.skipped_in_a_row == 2
    assert fresh.sampler.position == {"position": 5}
    assert (fresh.start, fresh.timeline_step) == (3, 6)
    # the optimizer state too: one more step from here equals the peer's own next step
    twin = _run(0, tmp_path)
    _train(twin, 3)
    torch.manual_seed(5)
    _train(twin, 1)
    torch.manual_seed(5)
    _train(fresh, 1)
    for (k, a), b in zip(twin.engine.raw.state_dict().items(), fresh.engine.raw.state_dict().values()):
        assert torch.equal(a, b), k


def test_a_lost_ranks_rng_is_left_as_seeded(tmp_path):
    peer_run = _run(0, tmp_path)
    state = {**snapshot(peer_run, taken=0, rng=None, full=True), "sampler": {}, "source": 0}
    torch.manual_seed(3)
    want = torch.rand(2)
    fresh = _run(1, tmp_path)
    torch.manual_seed(3)  # the fresh rank's own seeding (its setup's)
    restore(fresh, state)
    assert torch.equal(torch.rand(2), want)  # restore left it alone


def _recover(taken: dict, done: int, tmp_path, tp: int = 2, errors=None, lost=1, position=None, withheld=()):
    """peer.recover after rank `lost` of a dp2 x tp`tp` run failed, the controller having taken
    step `done` last; the survivors answer with step `taken[r]` (absent: no answer; `errors[r]`:
    that error instead)."""
    dims = {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "ep": 1, "tp": tp}
    data_rank = [r // tp for r in range(2 * tp)]  # tp fastest: tp peers share a data rank

    def ask(ranks, full, timeout_s):
        assert timeout_s == (STATE_TIMEOUT_S if full else PEER_TIMEOUT_S)
        out = {r: {"taken": taken[r], "rng": f"rng of {r}"} for r in ranks if r in taken}
        out = {r: {**a, "model": f"model of {r}"} if full else a for r, a in out.items()}
        out = {r: a for r, a in out.items() if not (full and r in withheld)}
        return out, {r: e for r, e in (errors or {}).items() if r in ranks}

    at = {"at": done} if position is None else position
    return recover(_cfg(dp=2, tp=tp), dims, lost, done, at, data_rank, tmp_path, ask)


def test_the_controller_routes_each_fresh_rank_its_groups_state_and_an_rng(tmp_path):
    states, why = _recover({0: 5, 2: 5, 3: 5}, done=5, tmp_path=tmp_path)  # rank 1 (dp 0, tp 1) lost
    assert why == ""
    # ranks 0 and 2 hold tp shard 0, ranks 1 and 3 tp shard 1 (tp fastest)
    assert [s["model"] for s in states] == ["model of 0", "model of 3", "model of 0", "model of 3"]
    assert [s["source"] for s in states] == [0, 3, 0, 3]
    # each survivor its own; the lost rank its tp peer's (they share a dropout stream)
    assert [s["rng"] for s in states] == ["rng of 0", "rng of 0", "rng of 2", "rng of 3"]
    assert all(s["sampler"] == {"at": 5} and s["taken"] == 5 for s in states)


def test_a_lost_rank_without_a_peer_of_its_data_rank_restarts_its_rng(tmp_path):
    states, _ = _recover({0: 5}, done=5, tp=1, tmp_path=tmp_path)  # dp2: rank 1 lost
    assert [s["rng"] for s in states] == ["rng of 0", None]
    assert [s["model"] for s in states] == ["model of 0", "model of 0"]


@pytest.mark.parametrize(
    "taken, done, errors, said",
    [
        ({0: 5, 2: 5}, 5, {}, "no surviving rank holds the state of model coordinates"),
        ({0: 5, 2: 5}, 5, {3: "ValueError: bad"}, "(0, 0, 1); rank 3: ValueError: bad"),
        ({0: 5, 2: 6, 3: 5}, 5, {}, "the surviving ranks are at different steps ([5, 6])"),
        ({0: 6, 2: 6, 3: 6}, 5, {}, "the survivors finished step 6, the controller took step 5 last"),
        ({0: 5, 2: 5, 3: 5}, -1, {}, "the mesh failed before its first step"),
    ],
)
def test_the_controller_falls_back_to_disk_and_says_why(taken, done, errors, said, tmp_path):
    states, why = _recover(taken, done, tmp_path=tmp_path, errors=errors)
    assert states is None and said in why, why


def test_a_diverged_run_or_a_failed_eval_island_is_not_recovered_from_peers(tmp_path):
    from plait.train.nonfinite import DIVERGED

    assert _recover({0: 5, 2: 5, 3: 5}, 5, tmp_path, lost="eval island") == (
        None,
        "the evaluation island failed, not a training rank",
    )
    (tmp_path / DIVERGED).write_text("")
    assert _recover({0: 5, 2: 5, 3: 5}, 5, tmp_path) == (None, "training diverged")


def test_a_recovery_that_raises_falls_back_instead_of_hiding_the_failure(tmp_path):
    states, why = _recover({0: 5, 2: 5, 3: 5}, 5, None)  # no run directory: a TypeError inside
    assert states is None and why.startswith("TypeError: "), why


def test_the_controller_prints_why_it_uses_the_checkpoint(capsys):
    from plait.controller.driver import Controller, RankFailed

    ctl = Controller.__new__(Controller)
    ctl.cfg, ctl.done, ctl.positions = _cfg(dp=1), 3, {3: {}}
    assert ctl._from_peers(RankFailed(1, RuntimeError("killed"))) is None
    out = capsys.readouterr().out
    assert "plait: no recovery from a peer's memory (dp = 1: no rank holds a copy" in out, out
    assert "): the newest checkpoint is used" in out


def test_a_survivor_that_withholds_its_state_and_the_first_step(tmp_path):
    states, why = _recover({0: 5, 2: 5, 3: 5}, 5, tmp_path, withheld=(3,), errors={3: "OSError: no room"})
    assert states is None and why == "a surviving rank did not hand over its state; rank 3: OSError: no room"
    states, why = _recover({0: 0, 2: 0, 3: 0}, 0, tmp_path)  # failed in step 1: back to step 0
    assert why == "" and [s["taken"] for s in states] == [0, 0, 0, 0]


def test_a_snapshot_refuses_state_its_peers_do_not_share(tmp_path):
    run = _run(0, tmp_path)
    run.engine.residual_buffers = lambda: {"bucket0": torch.zeros(2)}  # compression residuals
    with pytest.raises(RuntimeError, match="DataParallelEngine holds state that its peers do not have"):
        snapshot(run, taken=0, rng=None, full=True)
    run.engine = SimpleNamespace(raw=run.engine.raw, optimizer=run.engine.optimizer)  # not DataParallel
    with pytest.raises(RuntimeError, match="SimpleNamespace holds state"):
        snapshot(run, taken=0, rng=None, full=True)

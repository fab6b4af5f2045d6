"""Recovery from a data-parallel peer's memory (plait.controller.peer): which layouts allow it,
which surviving rank hands each fresh rank its state, and when the controller falls back to the
newest checkpoint. The recovery itself (a rank killed at step 6 of a dp2 run, the run ending
with the uninterrupted run's losses bit for bit) is tests/test_controller.py's."""

from __future__ import annotations

import pytest

from plait.controller.peer import choose, groups, ineligible
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
    assert got == why if why is None else got.startswith(why), got

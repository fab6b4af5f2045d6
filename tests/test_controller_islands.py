"""MPMD on islands (`plait.controller.islands`): a two-stage pipeline whose stages run on process
meshes of their own, of different data-parallel widths, scheduled by the controller with plait's
GPipe and 1F1B orders. Checked against the same training in plain PyTorch on one process (the
example's own few lines of torch, not plait): SGD without clipping, losses and parameters within
1e-5. A failing island is named with its rank and call, and no process is left; bad input is
refused before any process starts.
"""

from __future__ import annotations

import json
import uuid

import pytest
from conftest import live_with, run_python

from plait.errors import ConfigError

TOL = 1e-5

SCRIPT = """
import json, sys
import plait.controller
from plait.controller.program import RankFailedError
from islands import main, stage, optimizer, batches
import functools

out = main(["--runs", "1f1b:2,1", "gpipe:1,2", "--steps", "6"])

def bad_loss(output, targets):
    raise ValueError("planted in the loss")

stages = [functools.partial(stage, 0, 32), functools.partial(stage, 1, 32)]
try:
    with plait.controller.islands(stages, dp=[1, 2], optimizer=optimizer, loss_fn=bad_loss) as p:
        p.step(next(batches(1, 16)))
except RankFailedError as exc:
    out.append({"failed": str(exc), "coords": exc.coords, "call": exc.call})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    script = tmp_path_factory.mktemp("islands") / "islands_run.py"
    script.write_text(SCRIPT)
    tag = uuid.uuid4().hex  # unique: another session's run of this test must not count as left over
    r = run_python(str(script), tag=tag, timeout=400)
    return r, tag


def test_islands_of_different_widths_train_like_one_process(result):
    r, tag = result
    assert r.returncode == 0, r.stderr[-3000:]
    runs = json.loads(r.stdout.strip().splitlines()[-1])
    for run in runs[:2]:
        what = f"{run['schedule']} dp {run['dp']}"
        assert len(run["losses"]) == 6 and run["losses"][-1] < run["losses"][0], what
        assert run["loss_err"] < TOL, (what, run["loss_err"])
        assert run["param_err"] < TOL, (what, run["param_err"])
    assert [(run["schedule"], run["dp"]) for run in runs[:2]] == [("1f1b", [2, 1]), ("gpipe", [1, 2])]


def test_a_failing_island_is_named_and_no_process_islive_with(result):
    r, tag = result
    assert r.returncode == 0, r.stderr[-3000:]
    failed = json.loads(r.stdout.strip().splitlines()[-1])[-1]
    assert failed["coords"]["island"] == 1 and failed["call"] == "forward 0", failed
    assert failed["failed"].startswith("island 1 (stage 1), dp rank "), failed
    assert "planted in the loss" in failed["failed"]  # the rank's own traceback comes with it
    assert not live_with(tag)


@pytest.mark.parametrize(
    "kwargs, said",
    [
        ({"schedule": "interleaved"}, "schedule = 'interleaved' is not available; valid: gpipe, 1f1b"),
        ({"dp": [2]}, "must give one degree >= 1 per stage"),
        ({"dp": [0, 1]}, "must give one degree >= 1 per stage"),
    ],
)
def test_bad_input_is_refused_before_any_process_starts(kwargs, said):
    import plait.controller

    args = {"stages": [list, list], "dp": [1, 1], "optimizer": None, "loss_fn": None, **kwargs}
    with pytest.raises(ConfigError, match=said):
        plait.controller.islands(**args)

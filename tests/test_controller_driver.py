"""The driver API (`plait.controller.mesh`): one program drives a mesh of Monarch processes, each
running `plait.parallelize`'s engine. Checked against the same training in plain PyTorch on one
process (the reference is the example's own few lines of torch, not plait): SGD without
clipping, losses and parameters within 1e-5, for data parallel x ZeRO-3 and tensor parallel. A
rank that raises or dies is reported with its rank, mesh coordinates and call, and no process is left; a
bad layout is refused before any process starts.
"""

from __future__ import annotations

import json
import uuid

import pytest
from conftest import live_with, run_python

from plait.errors import ConfigError

TOL = 1e-5


LAYOUTS = {"dp2-zero3": '{"dp": 2, "zero_stage": 3}', "tp2": '{"tp": 2}'}


@pytest.fixture(scope="module")
def trained():
    """The example, run once over both layouts (one program, two meshes one after the other)."""
    tag = uuid.uuid4().hex
    args = [a for layout in LAYOUTS.values() for a in ("--layout", layout)]
    r = run_python("examples/controller.py", *args, "--steps", "12", "--json", tag=tag)
    return r, tag


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_driver_program_trains_like_plain_pytorch_on_one_process(trained, layout):
    r, tag = trained
    assert r.returncode == 0, r.stderr[-3000:]
    out = {json.dumps(o["layout"]): o for o in json.loads(r.stdout.strip().splitlines()[-1])}
    got = out[json.dumps(json.loads(LAYOUTS[layout]))]
    assert len(got["losses"]) == 12 and got["losses"][-1] < got["losses"][0]
    assert got["loss_err"] < TOL, got
    assert got["param_err"] < TOL, got
    assert "dispatched in" in r.stdout
    assert not live_with(tag)


FAILING = """
import torch, plait.controller
from plait.controller.program import RankFailedError
from controller import make_model, optimizer, loss_fn, batches

def boom(engine):
    if engine.rank == 1:
        FAULT
    return engine.rank

with plait.controller.mesh({"dp": 2}) as m:
    m.parallelize(make_model, optimizer, loss_fn=loss_fn)
    m.step(next(batches(1, 8))).get()
    try:
        m.run(boom)
    except RankFailedError as exc:
        print("caught", exc.rank, exc.coords, exc.call)
        print(exc)
"""


@pytest.mark.parametrize(
    "fault, said",
    [
        ('raise ValueError("planted on rank 1")', "planted on rank 1"),
        ("import os; os._exit(3)", "exited with non-zero code 3"),
    ],
    ids=["raises", "process-dies"],
)
def test_a_failing_rank_is_named_with_its_place_and_no_process_islive_with(tmp_path, fault, said):
    script = tmp_path / "failing.py"
    script.write_text(FAILING.replace("FAULT", fault))
    tag = uuid.uuid4().hex
    r = run_python(str(script), tag=tag)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "caught 1 {'pp': 0, 'dp': 1, 'ep': 0, 'tp': 0} boom" in r.stdout, r.stdout
    assert "rank 1 (pp 0, dp 1, ep 0, tp 0) failed in boom" in r.stdout
    assert said in r.stdout, r.stdout
    assert not live_with(tag)


@pytest.mark.parametrize(
    "layout, said",
    [({"dp": 2, "zero_stag": 1}, "did you mean 'zero_stage'"), ({"dp": 0}, "dp must be an integer >= 1")],
)
def test_a_bad_layout_is_refused_before_any_process_starts(layout, said):
    import plait.controller

    with pytest.raises(ConfigError, match=said):
        plait.controller.mesh(layout)


def test_stepping_before_parallelize_says_what_to_call():
    from plait.controller.program import DriverMesh

    with pytest.raises(ConfigError, match=r"call m.parallelize"):
        DriverMesh({"dp": 2}).step(None)

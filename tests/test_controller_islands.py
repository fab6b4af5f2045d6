"""MPMD on islands (`plait.controller.islands`): a two-stage pipeline whose stages run on process
meshes of their own, of different data-parallel widths, scheduled by the controller with plait's
GPipe and 1F1B orders, with activations and gradients going island to island over gloo links
(or relayed by the controller). Checked against the same training in plain PyTorch on one
process (the example's own few lines of torch, not plait): SGD without clipping, losses and
parameters within 1e-5; the bytes each link carried equal the activations' size. The links'
re-split of a micro-batch's rows between islands of 2 and 3 ranks is checked without Monarch,
against slices of the micro-batch written by hand. A failing island is named with its rank and
call, and no process is left; bad input is refused before any process starts.
"""

from __future__ import annotations

import json
import uuid

import pytest
import torch
from conftest import live_with, run_python

from plait.comm.ports import loopback_store
from plait.controller.links import Link, pieces
from plait.errors import ConfigError
from plait.mesh import Mesh
from plait.testing import run_ranks

TOL = 1e-5

SCRIPT = """
import json, sys
import plait.controller
from plait.controller.program import RankFailedError
from islands import main, stage, optimizer, batches
import functools

runs = ["1f1b:2,1", "gpipe:1,2", "1f1b:2,1:controller", "gpipe:1,2:controller"]
out = main(["--runs", *runs, "--steps", "6"])

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
    for run in runs[:4]:
        what = f"{run['schedule']} dp {run['dp']} {run['transfer']}"
        assert len(run["losses"]) == 6 and run["losses"][-1] < run["losses"][0], what
        assert run["loss_err"] < TOL, (what, run["loss_err"])
        assert run["param_err"] < TOL, (what, run["param_err"])
    assert [(run["schedule"], run["dp"], run["transfer"]) for run in runs[:4]] == [
        ("1f1b", [2, 1], "direct"),
        ("gpipe", [1, 2], "direct"),
        ("1f1b", [2, 1], "controller"),
        ("gpipe", [1, 2], "controller"),
    ]


def test_direct_links_carry_the_activations_and_the_controller_none(result):
    r, tag = result
    assert r.returncode == 0, r.stderr[-3000:]
    runs = json.loads(r.stdout.strip().splitlines()[-1])
    # 6 steps of 32 rows, stage 0's output 32 wide in fp32: forward, and its gradient back
    activations = 6 * 32 * 32 * 4
    assert runs[0]["link_bytes"] == [[activations, activations]]
    assert runs[1]["link_bytes"] == [[activations, activations]]
    assert runs[2]["link_bytes"] == runs[3]["link_bytes"] == [[0, 0]]  # relayed: nothing on a link
    # ... and through the controller instead: each tensor in, then out again
    assert [run["relayed_bytes"] for run in runs[:4]] == [0, 0, 4 * activations, 4 * activations]
    assert [run["pending_sends"] for run in runs[:4]] == [0, 0, 0, 0]  # each step awaited its sends


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


def test_the_pieces_are_the_overlaps_of_the_two_islands_shares():
    # 12 rows: 2 ranks hold 0-6, 6-12; 3 ranks need 0-4, 4-8, 8-12
    assert pieces(12, 2, 3) == [(0, 0, 0, 4), (0, 1, 4, 6), (1, 1, 6, 8), (1, 2, 8, 12)]
    assert pieces(12, 3, 2) == [(0, 0, 0, 4), (1, 0, 4, 6), (1, 1, 6, 8), (2, 1, 8, 12)]
    assert pieces(8, 2, 2) == [(0, 0, 0, 4), (1, 1, 4, 8)]
    assert pieces(6, 1, 3) == [(0, 0, 0, 2), (0, 1, 2, 4), (0, 2, 4, 6)]


def _link_ranks(port: int) -> dict:
    """Ranks 0-1: an island of 2; ranks 2-4: the next island, of 3. Micro-batches 1 and 2 (12
    rows each; 2 is 1 + 100) go forward over the link, received in the other order, and 10 x
    micro-batch 1 back."""
    import torch.distributed as dist

    rank = dist.get_rank()
    first = rank < 2
    index = rank if first else rank - 2
    link = Link(Mesh(dp=5, watchdog=False), port, 0, (2, 3), first, index)
    whole = torch.arange(12 * 3, dtype=torch.float32).reshape(12, 3)
    if first:
        link.send(whole[6 * index : 6 * index + 6], mb=1)
        link.send(whole[6 * index : 6 * index + 6] + 100, mb=2)
        back = link.recv(1, 6, (3,), torch.float32)
        link.wait()
        return {"back": back.tolist(), "sent": link.sent_bytes, "pending": len(link.pending)}
    second = link.recv(2, 4, (3,), torch.float32)  # the micro-batches are told apart by their tag
    got = link.recv(1, 4, (3,), torch.float32)
    link.send(got * 10, mb=1)
    link.wait()
    return {
        "got": got.tolist(),
        "second": second.tolist(),
        "sent": link.sent_bytes,
        "pending": len(link.pending),
    }


def test_a_link_resplits_rows_between_islands_of_2_and_3_ranks():
    store = loopback_store(wait_for_workers=False)
    out = run_ranks(_link_ranks, 5, args=(store.port,), timeout=120)
    whole = torch.arange(12 * 3, dtype=torch.float32).reshape(12, 3)
    for j in range(3):  # each rank of the island of 3 gets its rows, from one or two senders
        assert out[2 + j]["got"] == whole[4 * j : 4 * j + 4].tolist(), j
        assert out[2 + j]["second"] == (whole[4 * j : 4 * j + 4] + 100).tolist(), j
        assert out[2 + j]["sent"] == 4 * 3 * 4
    for i in range(2):
        assert out[i]["back"] == (10 * whole[6 * i : 6 * i + 6]).tolist(), i
        assert out[i]["sent"] == 2 * 6 * 3 * 4
    assert all(o["pending"] == 0 for o in out)  # every send awaited

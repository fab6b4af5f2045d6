"""Checkpoints: round trip, and a crash mid-save leaves the previous checkpoint usable."""

import contextlib
import io
import os
import statistics
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from plait import comm
from plait.data import DistributedBatchSampler, load_corpus
from plait.errors import CheckpointError
from plait.mesh import Mesh
from plait.models import GPT, gpt_config
from plait.testing import assert_close_params, run_ranks
from plait.train import checkpointer
from plait.train.checkpoint import (
    _rng_state,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from plait.zero import wrap

STAGES = (0, 3)


def _state(mesh, seed, stage=0):
    torch.manual_seed(seed)
    model = GPT(gpt_config("tiny"))
    engine = wrap(model, mesh, stage, lambda groups: torch.optim.AdamW(groups, lr=1e-2))
    sched = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda s: 1.0 / (1 + s))
    corpus = load_corpus()
    # both ranks read the same batch: the model stays what one process would train
    sampler = DistributedBatchSampler(corpus.train, 32, 4, 0, 1, seed=seed)
    return engine, sched, sampler


def _step(engine, sched, sampler):
    ((x, y),) = sampler.next_batch()
    engine.module(x, y).backward()
    engine.step()
    sched.step()
    engine.zero_grad()


def _crash_mid_save(root, stage):
    mesh = Mesh(dp=2, timeout_s=60)
    engine, sched, sampler = _state(mesh, 0, stage)
    _step(engine, sched, sampler)
    saved_params = engine.full_parameters()
    saved_sampler = sampler.state_dict()
    path = save_checkpoint(root, 1, mesh, engine, sched, sampler)
    assert latest_checkpoint(root) == path
    _step(engine, sched, sampler)

    real_save = dcp.save

    def dying_save(state, checkpoint_id, **kw):  # writes part of the files, then the machine "dies"
        with open(f"{checkpoint_id}/__{dist.get_rank()}_0.distcp", "wb") as fh:
            fh.write(b"partial")
        raise OSError("No space left on device")

    dcp.save = dying_save
    try:
        save_checkpoint(root, 2, mesh, engine, sched, sampler)
        raise AssertionError("the failed save did not raise")
    except CheckpointError as exc:
        assert "No space left on device" in str(exc) and "previous checkpoint is intact" in str(exc)
    finally:
        dcp.save = real_save
    comm.barrier(mesh)
    assert latest_checkpoint(root) == path  # `latest` still names step 1

    fresh, sched2, sampler2 = _state(mesh, 99, stage)  # different init, different data position
    step = load_checkpoint(latest_checkpoint(root), mesh, fresh, sched2, sampler2)
    assert step == 1 and sampler2.state_dict() == saved_sampler
    assert_close_params(fresh.full_parameters(), saved_params, atol=0.0, what="restored")
    assert sched2.last_epoch == sched.last_epoch - 1
    assert float(fresh.optimizer.state_dict()["state"][0]["step"]) == 1
    # and training continues from it exactly as the original did
    _step(fresh, sched2, sampler2)
    assert_close_params(fresh.full_parameters(), engine.full_parameters(), atol=0.0, what="continued")
    mesh.close()
    try:
        load_checkpoint(root / "nope", Mesh(dp=2, watchdog=False), fresh, sched2, sampler2)
        raise AssertionError("loading a missing checkpoint did not raise")
    except CheckpointError as exc:
        assert "did not complete" in str(exc)
    return True


def _async_saves(root, stage):
    """The asynchronous checkpointer on its own: a save holds the state of its step while
    training goes on, its host buffers are reused, and a write that fails on one rank fails the
    save on every rank, `latest` and the previous checkpoint untouched."""
    mesh = Mesh(dp=2, timeout_s=60)
    engine, sched, sampler = _state(mesh, 0, stage)
    saver = checkpointer.AsyncCheckpointer(mesh, 60)
    _step(engine, sched, sampler)
    saved, saved_sampler = engine.full_parameters(), sampler.state_dict()
    saver.hook = lambda **where: time.sleep(0.5)  # the write starts after the next step
    figures = saver.save(root, 1, engine, sched, sampler, keep=2)
    saver.hook = None
    assert figures["async"] is True and figures["waited_s"] == 0.0 and figures["step"] == 1
    model_sd, optim_sd = engine.checkpoint_state()  # the snapshot is these tensors' bytes, exactly
    held = sum(t.numel() * t.element_size() for t in checkpointer._tensors({"m": model_sd, "o": optim_sd}))
    held += _rng_state().numel()  # and the RNG states' bytes
    assert figures["host_bytes"] == saver.snapshot.nbytes == held, (held, figures)
    for key in ("blocking_s", "prepare_s", "snapshot_s"):
        assert 0 < figures[key] < 30, (key, figures)
    assert figures["prepare_s"] + figures["snapshot_s"] <= figures["blocking_s"]
    assert figures["previous_write_s"] is None and figures["write_s"] is None
    _process_figures_match(figures)
    buffers = [t.data_ptr() for t in checkpointer._tensors(saver.snapshot._buffers)]
    _step(engine, sched, sampler)  # while step 1 is written: it must not see this step
    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # save 2 waits for the rest of save 1's write
        second = saver.save(root, 2, engine, sched, sampler, keep=2)
    assert 0.05 <= second["waited_s"] <= second["blocking_s"] < 30, second
    waited = "plait: the checkpoint of step 1 was still being written: waited"
    assert (waited in out.getvalue()) == mesh.is_rank0, out.getvalue()
    first_write = saver.saves[0]["write_s"]
    assert 0.5 <= first_write < 30 and second["previous_write_s"] == first_write, saver.saves[0]
    assert 0.0 <= saver.wait() < 30 and saver.pending is None and saver.wait() == 0.0
    assert latest_checkpoint(root) == root / "step_00000002"
    assert 0 < saver.saves[-1]["write_s"] < 30
    summary = saver.summary()
    blocking = [figures["blocking_s"], second["blocking_s"]]
    assert summary == {
        "saves": 2,
        "async": True,
        "blocking_s_median": statistics.median(blocking),
        "blocking_s_max": max(blocking),
        "write_s_median": statistics.median([first_write, saver.saves[-1]["write_s"]]),
        "waited_s_total": second["waited_s"],
        "host_bytes": figures["host_bytes"],
    }, summary
    fresh, sched2, sampler2 = _state(mesh, 99, stage)
    assert load_checkpoint(root / "step_00000001", mesh, fresh, sched2, sampler2) == 1
    assert_close_params(fresh.full_parameters(), saved, atol=0.0, what="async checkpoint")
    assert sampler2.state_dict() == saved_sampler
    saver.save(root, 2, engine, sched, sampler, keep=2)  # again, into the same buffers
    assert [t.data_ptr() for t in checkpointer._tensors(saver.snapshot._buffers)] == buffers
    saver.wait()

    real = checkpointer.write_state

    def fails_on_rank1(state, tmp, group=None):  # every file written, then rank 1 reports a failure
        real(state, tmp, group)
        if dist.get_rank() == 1:
            raise CheckpointError("planted: rank 1's write failed")

    checkpointer.write_state = fails_on_rank1
    try:
        _save_fails(saver, root, 3, (engine, sched, sampler), "rank 1: planted")
    finally:
        checkpointer.write_state = real
    comm.barrier(mesh)
    assert latest_checkpoint(root) == root / "step_00000002"
    assert not (root / "step_00000003.tmp").exists() and not (root / "step_00000003").exists()
    saver.save(root, 4, engine, sched, sampler, keep=2)  # and the next save works
    saver.wait()
    assert latest_checkpoint(root) == root / "step_00000004"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000002", "step_00000004"]
    saver.close()
    assert saver.group is None

    # a rank whose write never finishes (it hangs past the checkpointer's timeout): the save is
    # abandoned on every rank, naming it, and `latest` stays
    if stage == 0:  # (once: it waits out two timeouts)
        short = checkpointer.AsyncCheckpointer(mesh, 2)
        if dist.get_rank() == 1:
            short.hook = lambda **where: time.sleep(8)  # past rank 0's DCP timeout and its store wait
        _save_fails(short, root, 5, (engine, sched, sampler), "rank1 never finished writing")
        short.close()
        comm.barrier(mesh)
        assert latest_checkpoint(root) == root / "step_00000004" and not (root / "step_00000005").exists()

    sync = checkpointer.Checkpointer(mesh)  # the synchronous one: the same figures, nothing waited
    done = sync.save(root, 6, engine, sched, sampler, keep=2)
    assert latest_checkpoint(root) == root / "step_00000006" and sync.wait() == 0.0
    assert done["async"] is False and done["waited_s"] == 0.0 and done["host_bytes"] == 0
    assert 0 < done["blocking_s"] == done["write_s"] < 30, done
    _process_figures_match(done)
    assert sync.summary()["async"] is False and sync.summary()["saves"] == 1
    assert checkpointer.Checkpointer(mesh).summary() == {"saves": 0, "async": False}
    mesh.close()
    return True


def _save_fails(saver, root, step, state, why):
    """The asynchronous save of `step` raises, at its wait, a CheckpointError naming the step and `why`."""
    saver.save(root, step, *state, keep=2)
    try:
        saver.wait()
    except CheckpointError as exc:
        assert f"step {step}" in str(exc) and why in str(exc), str(exc)
        return
    raise AssertionError(f"the failed asynchronous save of step {step} did not raise")


def _process_figures_match(figures):
    """A save's process figures are this process's (read from /proc/self/status here)."""
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
    rss = int(status["VmRSS"].split()[0]) * 1024
    assert 0.5 * rss < figures["rss_bytes"] < 2 * rss, (figures, rss)
    assert 3 <= figures["open_files"] <= len(os.listdir("/proc/self/fd")) + 64, figures
    assert 1 <= figures["threads"] <= threading.active_count() + 2, figures


def _every_stage(root):
    crash = {stage: _crash_mid_save(root / f"stage{stage}", stage) for stage in STAGES}
    return crash, {stage: _async_saves(root / f"async{stage}", stage) for stage in STAGES}


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory):
    """Both stages in one spawn, one after another (a spawn costs seconds)."""
    return run_ranks(_every_stage, 2, args=(tmp_path_factory.mktemp("ckpt"),), timeout=240)


@pytest.mark.parametrize("stage", STAGES)
def test_crash_mid_save_keeps_the_previous_checkpoint(per_rank, stage):
    assert all(r[0][stage] for r in per_rank)


@pytest.mark.parametrize("stage", STAGES)
def test_async_saves_snapshot_their_step_and_fail_together(per_rank, stage):
    assert all(r[1][stage] for r in per_rank)


def test_the_finite_check_sees_every_non_finite_value_and_no_overflow():
    from plait.train.checkpoint import _finite

    t = torch.randn(4096)
    assert _finite(t)
    for bad in ([float("nan")], [float("inf")], [float("-inf")], [float("inf"), float("-inf")]):
        u = t.clone()
        u[7 : 7 + len(bad)] = torch.tensor(bad)
        assert not _finite(u), bad
    assert _finite(torch.full((8,), 3e38))  # finite values whose sum overflows are finite
    assert _finite(torch.zeros(0))

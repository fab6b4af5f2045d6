"""Asynchronous checkpoints (`train.checkpoint_async`, docs/fault-tolerance.md): the same
checkpoints as synchronous saves under dp, ZeRO-3, tp+SP and pp, resumed bit for bit; and the
faults of a background write: a rank or the launcher SIGKILLed while a (slowed) write is in
flight leaves `latest` on the previous checkpoint, which resumes exactly; SIGTERM finishes the
save in flight and exits 143; a writer slower than the step (and than the collective timeout)
makes the next save wait, times out nothing, and 20 saves grow neither memory nor files.

The synchronous runs are the shared ones of test_controller.py (conftest's RunCache)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from conftest import (
    SHARED_LAYOUTS,
    TINY,
    TP_HEADS,
    assert_runs_match,
    cleaned_up,
    metrics,
    plait_train,
    ranks_of,
    resume_job,
    session_pids,
    side_by_side,
    start_train,
    train_job,
)

from plait.train.checkpoint import MANIFEST, choose_checkpoint, read_latest, verify_checkpoint
from plait.train.export import completed_steps

ASYNC = ("--train.checkpoint_async", "true")
TP = TP_HEADS
LAYOUTS = SHARED_LAYOUTS  # the synchronous runs are test_controller.py's (RunCache)
HOOK = {"PLAIT_CHECKPOINT_HOOK": "plait.testing:slow_checkpoint_write"}


@pytest.fixture(scope="module")
def layouts(shared_runs, tmp_path_factory):
    """{layout/kind: run dir}: each layout's synchronous run, its asynchronous run, and a copy of
    the asynchronous run cut at its checkpoint of step 4 and resumed (asynchronous again)."""
    base = tmp_path_factory.mktemp("async")
    jobs = {}
    for name, layout in LAYOUTS.items():
        jobs[f"{name}/sync"] = shared_runs.job(*TINY, *layout, timeout=300)
        jobs[f"{name}/async"] = a = train_job(base / name, *TINY, *layout, *ASYNC, timeout=300)
        jobs[f"{name}/resumed"] = resume_job(a, base / f"{name}-resumed", step=4, timeout=300)
    done = side_by_side(jobs)
    for name, (_, r) in done.items():
        assert r.returncode == 0, f"{name}: {r.stderr[-3000:]}"
    return {name: run for name, (run, _) in done.items()}


def _files(ckpt: Path) -> dict:
    """The checkpoint's files and their hashes (the manifest's), but DCP's .metadata, which
    records where it was written; its tensors' names, shapes and boxes instead."""
    files = json.loads((ckpt / MANIFEST).read_text())["files"]
    boxes = {
        key: [(c.offsets, c.sizes) for c in md.chunks] if hasattr(md, "chunks") else type(md).__name__
        for key, md in dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata.items()
    }
    return {"files": {k: v for k, v in files.items() if k != ".metadata"}, "boxes": boxes}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_async_saves_write_what_sync_saves_write(layouts, name):
    sync, run = layouts[f"{name}/sync"], layouts[f"{name}/async"]
    assert_runs_match(run, sync, rtol=0.0, what=f"{name}: async vs sync")
    for step in (4, 8):
        ckpt = f"checkpoints/step_{step:08d}"
        assert _files(run / ckpt) == _files(sync / ckpt), f"{name}: the checkpoints of step {step} differ"
    assert (run / "checkpoints/latest").read_text() == "step_00000008"
    summary = json.loads((run / "summary.json").read_text())["checkpoints"]
    assert summary["async"] and summary["saves"] == 2 and summary["host_bytes"] > 0, summary
    figures = metrics(run)[4]["checkpoint"]
    assert figures["async"] and figures["blocking_s"] > 0 and figures["step"] == 4, figures
    assert metrics(run)[8]["checkpoint"]["previous_write_s"] > 0
    assert json.loads((sync / "summary.json").read_text())["checkpoints"]["async"] is False


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_an_async_checkpoint_resumes_bit_for_bit(layouts, name):
    sync, resumed = layouts[f"{name}/sync"], layouts[f"{name}/resumed"]
    assert min(metrics(resumed)) == 1 and max(metrics(resumed)) == 8
    assert_runs_match(resumed, sync, steps=range(5, 9), rtol=0.0, what=f"{name}: resumed from async")
    ckpt = "checkpoints/step_00000008"
    assert _files(resumed / ckpt) == _files(sync / ckpt)


# ---- faults during the background write ------------------------------------------------------

DP2 = (*TINY, *TP, *ASYNC, "--train.checkpoint_every", "2", "--train.log_every", "1")


def _wait_for(path: Path, proc, timeout: float = 180) -> Path:
    deadline = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None, f"the run ended before {path.name}: {proc.communicate()}"
        assert time.time() < deadline, f"{path} did not appear in {timeout} s"
        time.sleep(0.02)
    return path


def _interrupted(base: Path, kind: str) -> dict:
    """A dp 2 asynchronous run whose rank 1 writes its checkpoint of step 4 late, interrupted
    once that write is under way: `kind` "rank" SIGKILLs rank 1, "launcher" SIGKILLs the
    launcher, "sigterm" sends the run's process group SIGTERM (the write then takes 3 s). Then
    resumed."""
    run, flags = base / kind, base / f"{kind}-flags"
    flags.mkdir(parents=True)
    late = "3" if kind == "sigterm" else "120"
    env = {**HOOK, "PLAIT_SLOW_WRITE": f"1:4:{late}", "PLAIT_SLOW_WRITE_FLAG": str(flags)}
    proc = start_train(run, *DP2, env=env)
    seen: dict = {"kind": kind, "run": run}
    with cleaned_up(proc):
        writer = json.loads(_wait_for(flags / "writing-4-1", proc).read_text())["pid"]
        ranks = ranks_of(proc.pid)
        assert writer in ranks, (writer, ranks)
        if kind == "sigterm":  # to the whole process group, as Slurm, Kubernetes and systemd do
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            os.kill(writer if kind == "rank" else proc.pid, signal.SIGKILL)
        proc.wait(timeout=120)
        deadline = time.time() + 10
        while (alive := [p for p in ranks if p in session_pids(proc.pid)]) and time.time() < deadline:
            time.sleep(0.05)
        seen["alive"] = alive
    seen["out"], seen["err"] = proc.communicate(timeout=30)
    seen["rc"] = proc.returncode
    root = run / "checkpoints"
    seen["latest"] = read_latest(root)[0]
    seen["complete"] = completed_steps(root)
    seen["chosen"] = choose_checkpoint(root)
    seen["verified"] = verify_checkpoint(seen["chosen"][0])["step"]  # before the resume prunes it
    seen["reached"] = max(metrics(run))
    seen["resumed"] = plait_train("--resume", str(run), timeout=240)
    return seen


def _slow_writer(base: Path) -> dict:
    """20 asynchronous saves of a larger model (a 20 MiB snapshot per rank), one each step, with
    rank 1's write of step 3 8 s late: over twice the collective timeout (3 s)."""
    run = base / "slow"
    args = (*TINY, *ASYNC, "--model.d_model", "256", "--train.steps", "20", "--train.checkpoint_every", "1")
    args += ("--comm.timeout_s", "3", "--train.log_every", "5", "--train.run_dir", str(run))
    return {"run": run, "r": plait_train(*args, env={**HOOK, "PLAIT_SLOW_WRITE": "1:3:8"}, timeout=300)}


@pytest.fixture(scope="module")
def faults(shared_runs, tmp_path_factory):
    base = tmp_path_factory.mktemp("async-faults")
    jobs = {kind: (lambda kind=kind: _interrupted(base, kind)) for kind in ("rank", "launcher", "sigterm")}
    jobs["slow"] = lambda: _slow_writer(base)
    jobs["reference"] = shared_runs.job(*TINY, *TP, timeout=300)  # dp 2, synchronous saves
    return side_by_side(jobs)


@pytest.mark.parametrize("kind", ["rank", "launcher"])
def test_a_sigkill_during_the_background_write_leaves_the_previous_checkpoint(faults, kind):
    seen, (reference, _) = faults[kind], faults["reference"]
    assert seen["rc"] != 0 and not seen["alive"], seen
    assert seen["reached"] >= 4, seen  # training went on while step 4 was being written
    # the unfinished checkpoint of step 4 is never `latest`, never complete, never chosen
    assert seen["latest"] == "step_00000002" and seen["complete"] == [2], seen
    chosen, note = seen["chosen"]
    assert chosen.name == "step_00000002" and note is None and seen["verified"] == 2, seen
    resumed = seen["resumed"]
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    what = f"resumed after SIGKILL ({kind})"
    assert_runs_match(seen["run"], reference, steps=range(3, 9), rtol=0.0, what=what)
    assert completed_steps(seen["run"] / "checkpoints")[-1] == 8


def test_sigterm_during_the_background_write_finishes_it_and_exits_143(faults):
    seen, (reference, _) = faults["sigterm"], faults["reference"]
    assert seen["rc"] == 143, seen["err"][-3000:]
    assert not seen["alive"]
    # the save in flight was completed, and the stop saved the step reached
    assert 4 in seen["complete"] and seen["complete"][-1] == seen["reached"], seen
    assert seen["latest"] == f"step_{seen['reached']:08d}" and seen["verified"] == seen["reached"]
    resumed = seen["resumed"]
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = range(seen["reached"] + 1, 9)
    assert_runs_match(seen["run"], reference, steps=after, rtol=0.0, what="resumed after SIGTERM")


def test_a_writer_slower_than_the_step_makes_the_next_save_wait_and_leaks_nothing(faults):
    run, r = faults["slow"]["run"], faults["slow"]["r"]
    assert r.returncode == 0, r.stderr[-3000:]
    assert "timed out" not in r.stderr.lower() and "watchdog" not in r.stderr.lower(), r.stderr[-3000:]
    assert "the checkpoint of step 3 was still being written: waited" in r.stdout, r.stdout
    saves = {step: rec["checkpoint"] for step, rec in metrics(run).items()}
    assert sorted(saves) == list(range(1, 21))
    assert saves[4]["waited_s"] >= 5.0, saves[4]  # rank 1 wrote step 3 8 s late
    assert all(saves[s]["waited_s"] < 5.0 for s in saves if s != 4)
    host = saves[20]["host_bytes"]
    assert host > 15 * 2**20, host  # the snapshot is the model's states (about 20 MiB)
    # a leak of one snapshot, file or thread per save would grow 15 x that from save 5 to save
    # 20; the allowance is the allocator's arenas and a transient descriptor or thread
    assert saves[20]["rss_bytes"] - saves[5]["rss_bytes"] < 2 * host, (saves[5], saves[20])
    assert saves[20]["open_files"] <= saves[5]["open_files"] + 2, (saves[5], saves[20])
    assert saves[20]["threads"] <= saves[5]["threads"] + 1, (saves[5], saves[20])
    assert (run / "checkpoints/latest").read_text() == "step_00000020"
    assert completed_steps(run / "checkpoints") == [19, 20]

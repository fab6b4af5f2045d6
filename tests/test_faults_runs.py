"""Run ownership and the choice of the checkpoint to resume (docs/fault-tolerance.md).

The end-to-end part is one module fixture of four `plait train` jobs, two at a time:

1. two new runs without `train.run_dir` in the same second (the clock of both launchers fixed to
   one stamp), one under plait's own launcher and one under torchrun; each pauses at step 2
   while a second `plait train` on its directory is refused, naming the owner's PID;
2. copies of those runs resumed: one with `latest` deleted and its newest checkpoint corrupted
   (it falls back to step 4), one asked for `checkpoints/step_00000004` while `latest` names
   step 8 (it pauses at step 5 while a second `--resume` is refused and its starting checkpoint
   and the later one are both still there).

The refusals run in this process with `_launch_here` replaced by a failure, so they also show
that nothing was started. This file is also the script both launchers of (1) run (see the end):
it fixes the clock, then is `plait train`; and `pause_hook` is the trainer's step hook that holds
a run at a step until the test lets it go.
"""

import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import TINY, assert_runs_match, losses, metrics

from plait.errors import CheckpointError, RunInUseError
from plait.train import rundir
from plait.train.checkpoint import LATEST, MANIFEST, _prune, choose_checkpoint, step_checkpoints

HERE = Path(__file__).resolve()
STAMP = "20300101-120000"  # the one clock reading of the two launches of the same second
PAUSE = "PLAIT_TEST_PAUSE"  # STEP:FLAG: rank 0 writes FLAG.paused at STEP and waits for FLAG.go


def pause_hook(step: int, rank: int, cfg, engine=None) -> None:
    """PLAIT_STEP_HOOK for these tests: hold the run at a step, so a second launch meets it."""
    at, flag = os.environ[PAUSE].split(":", 1)
    if rank != 0 or step != int(at):
        return
    Path(flag + ".paused").write_text(json.dumps({"pid": os.getpid(), "run_dir": cfg.train.run_dir}))
    deadline = time.time() + 120
    while not Path(flag + ".go").exists():
        if time.time() > deadline:
            raise RuntimeError(f"{flag}.go never appeared")
        time.sleep(0.05)


def _hook_env(step: int, flag: Path) -> dict:
    path = os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])
    return {"PLAIT_STEP_HOOK": "test_faults_runs:pause_hook", PAUSE: f"{step}:{flag}", "PYTHONPATH": path}


def _start(cmd: list, env: dict, cwd: Path, started: list) -> subprocess.Popen:
    job = subprocess.Popen(
        cmd, cwd=cwd, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    started.append(job)
    return job


def _as_they_pause(jobs: dict[str, subprocess.Popen], flags: Path, timeout: float = 150):
    """Yield the names of the jobs as their rank 0 reaches its pause (its FLAG.paused exists)."""
    deadline, waiting = time.time() + timeout, dict(jobs)
    while waiting:
        for name, job in list(waiting.items()):
            if (flags / f"{name}.paused").exists():
                time.sleep(0.1)  # written in one call; let it land
                del waiting[name]
                yield name
            elif job.poll() is not None:
                out, err = job.communicate()
                raise AssertionError(f"{name} ended before its pause:\n{out}\n{err}")
        assert time.time() < deadline, f"{sorted(waiting)} did not reach their pause"
        time.sleep(0.1)


def _finish(job: subprocess.Popen, flag: Path | None = None) -> subprocess.CompletedProcess:
    if flag is not None:
        Path(f"{flag}.go").touch()
    out, err = job.communicate(timeout=180)
    return subprocess.CompletedProcess(job.args, job.returncode, out, err)


def _plait_here(*args) -> tuple[int, str]:
    """`plait train ARGS` in this process, where starting ranks is a failure: (exit code, stderr)."""
    from plait.cli import main

    launch_module = sys.modules["plait.train.launch"]  # (plait.train.launch is also the function)

    def no_ranks(*a, **k):
        raise AssertionError("plait train went on to start its ranks")

    real, launch_module._launch_here = launch_module._launch_here, no_ranks
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(["train", *args])
    finally:
        launch_module._launch_here = real
    return code, err.getvalue()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    started = []
    try:
        yield _runs(tmp_path_factory.mktemp("runs"), started)
    finally:
        for job in started:  # after a failure: stop what is still running (the launchers stop their ranks)
            if job.poll() is None:
                job.terminate()
                try:
                    job.wait(30)
                except subprocess.TimeoutExpired:
                    job.kill()


def _runs(base: Path, started: list):
    flags = base / "flags"
    flags.mkdir()
    done, seen = {}, {}
    # 1. two launches in the same second, unnamed: plait's launcher and torchrun, each paused at step 2
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    jobs = {
        "plait": _start(
            [sys.executable, str(HERE), "train", *TINY], _hook_env(2, flags / "plait"), base, started
        ),
        "torchrun": _start(
            [*torchrun, str(HERE), "train", *TINY], _hook_env(2, flags / "torchrun"), base, started
        ),
    }
    for name in _as_they_pause(jobs, flags):
        job = jobs[name]
        seen[name] = json.loads((flags / f"{name}.paused").read_text())
        run = base / seen[name]["run_dir"]
        holder = job.pid if name == "plait" else seen[name]["pid"]  # the launcher, or torchrun's rank 0
        seen[name]["holder"] = holder
        seen[name]["refused"] = {
            "resume": _plait_here("--resume", str(run)),
            "new run": _plait_here(*TINY, "--train.run_dir", str(run)),
        }
        done[name] = _finish(job, flags / name)
    for name, r in done.items():
        assert r.returncode == 0, f"{name}:\n{r.stdout}\n{r.stderr}"

    # 2. copies resumed: a fallback past a missing `latest` and a corrupted step 8, and step 4 asked for
    fallback, asked = base / "fallback", base / "asked"
    shutil.copytree(base / seen["plait"]["run_dir"], fallback)
    shutil.copytree(base / seen["torchrun"]["run_dir"], asked)
    (fallback / "checkpoints" / LATEST).unlink()
    shard = sorted((fallback / "checkpoints" / "step_00000008").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    seen["damaged pick"] = _plait_here("--resume", str(shard.parent))
    seen["missing pick"] = _plait_here("--resume", str(fallback / "checkpoints" / "step_00000099"))

    jobs = {
        "fallback": _start(
            [sys.executable, "-m", "plait.cli", "train", "--resume", str(fallback)], {}, base, started
        ),
        "asked": _start(
            [
                *(sys.executable, "-m", "plait.cli", "train"),
                *("--resume", str(asked / "checkpoints" / "step_00000004")),
                *("--train.checkpoint_every", "2"),
            ],
            _hook_env(5, flags / "asked"),
            base,
            started,
        ),
    }
    next(_as_they_pause({"asked": jobs["asked"]}, flags))
    seen["asked"] = {
        "holder": jobs["asked"].pid,
        "refused": _plait_here("--resume", str(asked)),
        "latest": (asked / "checkpoints" / LATEST).read_text(),
        "checkpoints": [p.name for p in step_checkpoints(asked / "checkpoints")],
    }
    done["asked"] = _finish(jobs["asked"], flags / "asked")
    done["fallback"] = _finish(jobs["fallback"])
    return base, seen, done


def test_two_launches_in_the_same_second_get_two_run_dirs(runs):
    base, seen, done = runs
    names = sorted(seen[name]["run_dir"] for name in ("plait", "torchrun"))
    assert names == [f"runs/{STAMP}", f"runs/{STAMP}-2"], names
    for name in ("plait", "torchrun"):
        run = base / seen[name]["run_dir"]
        for log in ("metrics.jsonl", "metrics-rank1.jsonl"):  # each run's own steps, once each
            steps = [json.loads(line)["step"] for line in (run / log).read_text().splitlines()]
            assert steps == list(range(1, 9)), (name, log, steps)
        assert (run / "checkpoints" / LATEST).read_text() == "step_00000008"
        assert [p.name for p in step_checkpoints(run / "checkpoints")] == ["step_00000004", "step_00000008"]
        assert f"run dir: {seen[name]['run_dir']}" in done[name].stdout
    # the same configuration trained twice, side by side, without touching each other
    assert losses(base / names[0]) == losses(base / names[1])


@pytest.mark.parametrize("launcher", ["plait", "torchrun"])
def test_a_second_plait_train_on_a_running_run_is_refused_naming_its_owner(runs, launcher):
    _, seen, _ = runs
    pid = seen[launcher]["holder"]
    for what, (code, err) in seen[launcher]["refused"].items():
        assert code == 1, (what, err)
        assert err.count("\n") == 1 and "in use by another plait train" in err, (what, err)
        assert f"(PID {pid} on " in err, (what, pid, err)


def test_a_second_resume_is_refused_while_one_runs(runs):
    _, seen, _ = runs
    code, err = seen["asked"]["refused"]
    assert code == 1 and f"in use by another plait train (PID {seen['asked']['holder']} on " in err, err


def test_resume_falls_back_to_the_newest_checkpoint_that_verifies(runs):
    base, seen, done = runs
    r = done["fallback"]
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if "newest checkpoint that verifies" in x)
    assert "checkpoints/latest is missing; resuming from step_00000004" in line, line
    assert "step_00000008" in line and "SHA-256" in line, line  # the corrupted newer one, named
    assert "resumed from" in r.stdout and "at step 4" in r.stdout
    ref = base / seen["plait"]["run_dir"]
    assert losses(base / "fallback") == losses(ref)  # bit for bit, steps 1-8
    assert_runs_match(base / "fallback", ref, steps=range(5, 9), rtol=0.0, what="fallback")


def test_resume_from_the_checkpoint_asked_for(runs):
    base, seen, done = runs
    r = done["asked"]
    assert r.returncode == 0, r.stderr
    assert "resuming from step_00000004, as asked (the latest was step_00000008" in r.stdout, r.stdout
    assert "at step 4" in r.stdout
    # while it ran and before it saved: `latest` named its start, and the later checkpoint was kept
    assert seen["asked"]["latest"] == "step_00000004"
    assert seen["asked"]["checkpoints"] == ["step_00000004", "step_00000008"]
    ref = base / seen["torchrun"]["run_dir"]
    assert losses(base / "asked") == losses(ref)
    assert sorted(metrics(base / "asked")) == list(range(1, 9))
    # saved every 2 steps from step 4, keeping 2: the old step 8 went at the first save (6)
    ckpts = base / "asked" / "checkpoints"
    assert [p.name for p in step_checkpoints(ckpts)] == ["step_00000006", "step_00000008"]
    assert (ckpts / LATEST).read_text() == "step_00000008"


def test_a_damaged_or_missing_checkpoint_asked_for_is_named_before_any_rank_starts(runs):
    _, seen, _ = runs
    code, err = seen["damaged pick"]
    assert code == 1 and "fails its SHA-256 check" in err and "step_00000008" in err, err
    code, err = seen["missing pick"]
    assert code == 1 and "no checkpoint" in err and "step_00000004, step_00000008" in err, err


# ---- the parts, in this process ----


def test_run_dirs_made_at_once_in_one_second_are_all_distinct(tmp_path, monkeypatch):
    monkeypatch.setattr(rundir, "_stamp", lambda: STAMP)
    made, start = [], threading.Barrier(8)

    def make():
        start.wait()
        made.append(rundir.create_run_dir(tmp_path / "runs"))

    threads = [threading.Thread(target=make) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    want = [STAMP] + [f"{STAMP}-{n}" for n in range(2, 9)]
    assert sorted(p.name for p in made) == sorted(want)


def test_the_lock_names_its_holder_and_dies_with_it(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / rundir.LOCK).write_text("pid=999999 host=gone since=2020-01-01T00:00:00\n")  # stale: no flock
    with rundir.hold_run_dir(run):
        assert f"pid={os.getpid()} " in (run / rundir.LOCK).read_text()
        with pytest.raises(RunInUseError, match=rf"\(PID {os.getpid()} on "):
            rundir.hold_run_dir(run)
    rundir.hold_run_dir(run).release()  # released
    # held by another process, which is then killed: the lock goes with it
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time\n"
            f"fd = os.open({str(run / rundir.LOCK)!r}, os.O_RDWR)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "os.ftruncate(fd, 0); os.write(fd, f'pid={os.getpid()} host=h\\n'.encode())\n"
            "print('held', flush=True); time.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(RunInUseError, match=rf"\(PID {holder.pid} on h\)"):
            rundir.hold_run_dir(run)
    finally:
        holder.kill()
        holder.wait()
    rundir.hold_run_dir(run).release()


def _fake_checkpoint(root: Path, step: int) -> Path:
    """A checkpoint directory that verifies (one data file and its manifest)."""
    path = root / f"step_{step:08d}"
    path.mkdir(parents=True)
    data = f"step {step}".encode()
    (path / "__0_0.distcp").write_bytes(data)
    files = {"__0_0.distcp": {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}}
    (path / MANIFEST).write_text(json.dumps({"step": step, "world_size": 1, "files": files}))
    return path


def _corrupt(path: Path) -> None:
    (path / "__0_0.distcp").write_bytes(b"STEP 99")


def test_choose_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    with pytest.raises(CheckpointError, match="holds no checkpoint to resume from"):
        choose_checkpoint(root)
    c25, c30 = _fake_checkpoint(root, 25), _fake_checkpoint(root, 30)
    (root / LATEST).write_text(c30.name)
    assert choose_checkpoint(root) == (c30, None)  # the plain case says nothing more
    (root / LATEST).write_text(c25.name)
    assert choose_checkpoint(root) == (c25, None)  # `latest` wins over a higher step
    (root / LATEST).unlink()
    path, note = choose_checkpoint(root)
    assert path == c30 and "latest is missing; resuming from step_00000030" in note
    (root / LATEST).write_text("step_00000035")
    path, note = choose_checkpoint(root)
    assert path == c30 and "names step_00000035, which does not exist" in note
    (root / LATEST).write_text(c30.name)
    _corrupt(c30)
    path, note = choose_checkpoint(root)
    assert path == c25 and "fails its SHA-256 check" in note and "resuming from step_00000025" in note
    # asked for: taken as asked, verified first; a short step name is found
    assert choose_checkpoint(root, root / "step_25")[0] == c25
    with pytest.raises(CheckpointError, match="step_00000030.*SHA-256"):
        choose_checkpoint(root, c30)
    with pytest.raises(CheckpointError, match="no checkpoint .*step_00000040.*step_00000025, step_00000030"):
        choose_checkpoint(root, root / "step_00000040")
    _corrupt(c25)
    with pytest.raises(CheckpointError, match="no checkpoint in .* verifies: .*step_00000030.*step_00000025"):
        choose_checkpoint(root)


def test_pruning_keeps_the_start_of_a_resumed_run_until_it_has_newer_ones(tmp_path):
    root = tmp_path / "checkpoints"

    def resumed_from_4_and_saved_6():
        shutil.rmtree(root, ignore_errors=True)
        for step in (4, 8, 12, 6):  # 8 and 12: the continuation the resume from 4 abandoned
            _fake_checkpoint(root, step)
        (root / LATEST).write_text("step_00000006")

    def kept():
        return [p.name for p in step_checkpoints(root)]

    resumed_from_4_and_saved_6()
    _prune(root, 2, 6)
    assert kept() == ["step_00000004", "step_00000006"]  # the start stays, the abandoned ones go
    (root / LATEST).write_text(_fake_checkpoint(root, 8).name)
    _prune(root, 2, 8)
    assert kept() == ["step_00000006", "step_00000008"]
    resumed_from_4_and_saved_6()
    _prune(root, 1, 6)
    assert kept() == ["step_00000006"]  # keep 1: the start goes, now that a newer one exists


if __name__ == "__main__":  # the launcher of a run of the same-second pair (fixture `runs`)
    from plait.cli import main

    rundir._stamp = lambda: STAMP
    sys.exit(main(sys.argv[1:]))

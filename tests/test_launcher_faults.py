"""The launcher under the faults an operator or a scheduler causes, met as they meet them: a
`plait train` started in a session of its own, then signalled (SIGKILL to the launcher, SIGTERM
to the whole process group), its listening sockets read from /proc, its stdout closed after one
line, its stderr a file.

The processes of a run are those of its session (the launcher, multiprocessing's fork server,
the ranks); a process is alive until it is a zombie (it has then closed its files).
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import (
    SGD,
    TINY,
    cleaned_up,
    metrics,
    plait_train,
    ranks_of,
    session_pids,
    start_train,
    wait_for_step,
)

from plait.train.export import completed_steps

# a step of rank 0 lasts at least 0.15 s: the signals below land between checkpoints
SLOW = {"PLAIT_STEP_HOOK": "plait.testing:slow_hook", "PLAIT_PS_SLOW": "0:0.15"}
DP2 = (*TINY, *SGD, "--parallel.dp", "2", "--train.log_every", "1")


def listening(pids: list[int]) -> list[str]:
    """host:port of every TCP socket in the LISTEN state held by `pids` (from /proc/net/tcp*)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            continue
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # 0A: TCP_LISTEN
                found.append(_address(f[1]))
    return found


def _address(hex_addr: str) -> str:
    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        ip = ".".join(str(b) for b in reversed(raw))
    else:  # four little-endian 32-bit words
        words = [raw[i : i + 4][::-1] for i in range(0, 16, 4)]
        full = b"".join(words)
        ip = ":".join(full[i : i + 2].hex() for i in range(0, 16, 2))
    return f"{ip}:{int(port, 16)}"


LOOPBACK = (
    "127.0.0.1:",
    "0000:0000:0000:0000:0000:0000:0000:0001:",
    "0000:0000:0000:0000:0000:ffff:7f00:0001:",
)


def assert_on_loopback(sockets: list[str], what: str) -> None:
    assert sockets, f"{what}: no listening socket found (the probe itself is broken)"
    off = [s for s in sockets if not s.startswith(LOOPBACK)]
    assert not off, f"{what} listens off loopback: {off} (all: {sockets})"


def lock_is_free(run: Path) -> bool:
    fd = os.open(run / "run.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_a_killed_launcher_takes_its_ranks_and_holds_the_run_until_they_are_gone(tmp_path):
    """SIGKILL to the launcher: its ranks die within seconds, the run's lock is never free while
    one of them lives, and `--resume` is refused while the run lives, accepted after. The same run
    shows that every socket it listens on is on loopback (gloo, the agent's and rank 0's stores)."""
    run = tmp_path / "run"
    proc = start_train(run, *DP2, "--train.steps", "200", env=SLOW)
    with cleaned_up(proc):
        wait_for_step(run, 5, proc)  # past the checkpoint of step 4
        pids, ranks = session_pids(proc.pid), ranks_of(proc.pid)
        assert len(ranks) == 2, (pids, ranks)
        sockets = listening(pids)  # (checked at the end: the kill is the first thing under test)
        refused = plait_train("--resume", str(run), timeout=120)
        assert refused.returncode != 0 and "in use by another plait train" in refused.stderr, refused.stderr

        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()  # (its pipes stay open while a rank, which writes to them, lives)
        deadline = time.time() + 10
        while (alive := [p for p in ranks if p in session_pids(proc.pid)]) and time.time() < deadline:
            # the lock is held for as long as any rank lives
            free = lock_is_free(run)
            assert not (free and [p for p in ranks if p in session_pids(proc.pid)]), (
                f"lock free, {alive} live"
            )
            time.sleep(0.02)
        assert not alive, f"ranks of the killed launcher still live after 10 s: {alive}"
        while session_pids(proc.pid) and time.time() < deadline:  # the fork server, the resource tracker
            time.sleep(0.1)
        assert not session_pids(proc.pid), "processes of the killed launcher's run still live after 10 s"
    proc.communicate(timeout=10)
    assert lock_is_free(run)
    reached = max(metrics(run))
    assert reached < 200
    again = plait_train("--resume", str(run), "--train.steps", str(reached + 2), timeout=240)
    assert again.returncode == 0, again.stderr[-3000:]
    assert max(metrics(run)) == reached + 2
    assert_on_loopback(sockets, "a dp 2 run")


def test_a_group_sigterm_saves_the_step_reached_with_stdout_closed_and_stderr_a_file(tmp_path):
    """What Slurm, Kubernetes and systemd send: SIGTERM to every process of the job (each rank
    gets it from the group, then again from the launcher). The run saves at the step it reached,
    exits 143 and says so in one line.

    The same run meets `plait train ... 2> log | head -1`: the reader of stdout goes away after
    one line, and the run trains on (a log line per step into the closed pipe) to the signal;
    stderr, a file, holds plain progress lines, not a progress bar's carriage-return frames."""
    run, log = tmp_path / "run", tmp_path / "stderr.log"
    args = (*DP2, "--train.steps", "200", "--train.checkpoint_every", "5", "--train.progress", "true")
    with open(log, "w") as stderr:
        proc = start_train(run, *args, env=SLOW, stderr=stderr)
        with cleaned_up(proc):
            first = proc.stdout.readline()
            proc.stdout.close()  # what `head -1` does after its line
            wait_for_step(run, 6, proc)
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=120)
    err = log.read_text()
    assert first.startswith("plait:"), first
    assert proc.returncode == 143, err[-3000:]
    reached = max(metrics(run))
    saved = completed_steps(run / "checkpoints")
    assert saved[-1] == reached, (saved, reached)
    plait_lines = [line for line in err.splitlines() if line.startswith("plait")]
    assert plait_lines == [f"plait: stopped by SIGTERM; continue with: plait train --resume {run}"], err
    assert "Traceback" not in err and "BrokenPipe" not in err, err[-3000:]
    assert "\r" not in err and f"train: step {reached}/200 (" in err, err[-3000:]


def test_a_parameter_server_run_listens_on_loopback_only(tmp_path):
    run = tmp_path / "run"
    args = (
        *TINY,
        "--train.steps",
        "200",
        "--ps.servers",
        "1",
        "--parallel.dp",
        "2",
        "--train.log_every",
        "1",
    )
    slow = {"PLAIT_STEP_HOOK": "plait.testing:slow_hook", "PLAIT_PS_SLOW": "0:0.1"}
    proc = start_train(run, *args, env=slow)
    with cleaned_up(proc):
        deadline = time.time() + 240
        while not list(run.glob("ps/*")) and time.time() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        time.sleep(2)  # the servers' and workers' RPC up
        assert proc.poll() is None, proc.communicate()
        sockets = listening(session_pids(proc.pid))
    proc.communicate(timeout=30)
    assert_on_loopback(sockets, "a parameter-server run")


# A script of the user's own, written with torch alone: it joins the group, says it is ready and
# waits (Ctrl-C ends it quietly: what a script does on Ctrl-C is its own business).
SCRIPT = """
import pathlib, sys, time
import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
pathlib.Path(sys.argv[1], f"ready{dist.get_rank()}").touch()
try:
    time.sleep(600)
except KeyboardInterrupt:
    sys.exit(130)
"""


def _launch(tmp_path: Path, name: str) -> tuple[subprocess.Popen, Path]:
    where = tmp_path / name
    where.mkdir()
    script = where / "script.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "plait.cli", "launch", "--nproc", "2", str(script), str(where)]
    proc = subprocess.Popen(
        cmd, text=True, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    return proc, where


def _ready(proc: subprocess.Popen, where: Path) -> None:
    deadline = time.time() + 240
    while not ((where / "ready0").exists() and (where / "ready1").exists()):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.05)


def test_plait_launch_listens_on_loopback_and_a_signal_ends_it_in_one_line(tmp_path):
    """SIGTERM to `plait launch` (a scheduler's), Ctrl-C to its process group (a terminal's):
    the ranks stop and the launcher says so in one line, exit 143 / 130, no traceback. While the
    ranks run, every socket the launch listens on is on loopback."""
    term, term_dir = _launch(tmp_path, "term")
    ctrl_c, ctrl_c_dir = _launch(tmp_path, "ctrl-c")
    with cleaned_up(term, ctrl_c):
        _ready(term, term_dir)
        sockets = listening(session_pids(term.pid))
        term.send_signal(signal.SIGTERM)
        _ready(ctrl_c, ctrl_c_dir)
        os.killpg(ctrl_c.pid, signal.SIGINT)
        ends = {proc: proc.communicate(timeout=120)[1] for proc in (term, ctrl_c)}
    for proc, code, line in (
        (term, 143, "plait launch: stopped by SIGTERM; the ranks were stopped"),
        (ctrl_c, 130, "plait launch: interrupted; the ranks were stopped"),
    ):
        err = ends[proc]
        assert proc.returncode == code, err[-3000:]
        # (torchrun's note on OMP_NUM_THREADS may come first)
        assert [ln for ln in err.splitlines() if "plait" in ln] == [line], err[-3000:]
        assert "Traceback" not in err and "death signal" not in err, err[-3000:]
    assert_on_loopback(sockets, "plait launch --nproc 2")


def test_plait_launch_refuses_an_absurd_nproc_at_once(tmp_path):
    script = tmp_path / "script.py"
    script.write_text("print('never')\n")
    t0 = time.time()
    r = subprocess.run(
        [sys.executable, "-m", "plait.cli", "launch", "--nproc", "100000", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and time.time() - t0 < 60, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--nproc" in lines[0] and "100000" in lines[0], r.stderr
    assert f"between 1 and {4 * os.cpu_count()}" in lines[0], r.stderr

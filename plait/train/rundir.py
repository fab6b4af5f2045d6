"""Run ownership: every run has a directory of its own and, while it runs, one owner.

* A run without `train.run_dir` gets `runs/<timestamp>`, made with `os.mkdir`, which fails when
  the name exists: two launches in the same second get `runs/<stamp>` and `runs/<stamp>-2`,
  whichever creates first taking the plain name. The launching process does it before any rank
  starts, and the ranks take rank 0's name (`plait.train.loop`).
* The owner holds an exclusive `flock` on `<run_dir>/run.lock` for the run's life and writes its
  PID, host and start time into it. A second `plait train` on the directory, a fresh run or a
  `--resume`, finds the lock taken and stops with one line naming that PID. The operating system
  releases the lock when the owner's process ends however it ends (a crash, SIGKILL), so a lock
  is never stale; the file itself stays and means nothing while nobody holds it.
* Who owns the run: the process that ran `plait train` (it holds the lock while its ranks run,
  which share its open lock file, so the lock lasts until the last of them has exited:
  `plait.train.launch.SharedLock`; or while it runs the only rank itself), or, under an outer
  launcher such as torchrun, global rank 0's process, which claims the directory before it
  joins the process group (the other ranks wait for it at their first collective).
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import fcntl
import os
import socket
import sys
import time
from pathlib import Path

from plait.errors import ConfigError, RunInUseError
from plait.train.checkpoint import checkpoint_step, choose_checkpoint, read_latest, set_latest
from plait.train.checkpoint_faults import check_writable

LOCK = "run.lock"

# flock is not supported by every file system (some network file systems); there the run goes on
# unlocked, and says so.
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def _stamp() -> str:
    return datetime.datetime.now().strftime("%Y%m%d-%H%M%S")


def create_run_dir(base: str | Path = "runs") -> Path:
    """Create and return a new `base/<timestamp>` (or `<timestamp>-N` when that exists)."""
    base, stamp = Path(base), _stamp()
    base.mkdir(parents=True, exist_ok=True)
    n = 1
    while True:
        path = base / (stamp if n == 1 else f"{stamp}-{n}")
        try:
            path.mkdir()  # atomic: exactly one of two launches creates a given name
            return path
        except FileExistsError:
            n += 1


class RunLock:
    """An exclusive hold on a run directory; released by `release()`, on leaving a `with`
    block, or by the operating system when the process ends."""

    def __init__(self, path: Path, fd: int | None):
        self.path, self._fd = path, fd

    @property
    def fd(self) -> int | None:
        """The locked file's descriptor (None: not locked), for processes that share the hold."""
        return self._fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _holder(path: Path) -> str:
    """Who holds the lock at `path`, from what it wrote there (it writes right after locking, so
    give it a moment)."""
    for _ in range(20):
        try:
            fields = dict(f.split("=", 1) for f in path.read_text().split() if "=" in f)
        except OSError:
            fields = {}
        if "pid" in fields:
            since = f", since {fields['since']}" if "since" in fields else ""
            return f"PID {fields['pid']} on {fields.get('host', '?')}{since}"
        time.sleep(0.05)
    return "a process that has not written its PID yet"


def hold_run_dir(run_dir: str | Path) -> RunLock:
    """Take `run_dir`'s lock, or raise RunInUseError naming the process that holds it."""
    run_dir = Path(run_dir)
    path = run_dir / LOCK
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by child processes
    except OSError as exc:
        raise ConfigError(f"train.run_dir {str(run_dir)!r}: cannot create {LOCK} ({exc.strerror})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunInUseError(
            f"{run_dir} is in use by another plait train ({_holder(path)}): wait for it to end, "
            "or use another run directory"
        ) from None
    except OSError as exc:
        os.close(fd)
        if exc.errno not in _NO_LOCKS:
            raise
        print(
            f"plait: note: the file system of {run_dir} has no file locks ({exc.strerror}); "
            "nothing stops a second plait train on this directory",
            file=sys.stderr,
        )
        return RunLock(path, None)
    since = datetime.datetime.now().isoformat(timespec="seconds")
    os.ftruncate(fd, 0)
    os.write(fd, f"pid={os.getpid()} host={socket.gethostname()} since={since}\n".encode())
    return RunLock(path, fd)


def check_fresh_run_dir(run_dir: Path) -> None:
    """A new run never writes into another run's directory (its checkpoints and metrics)."""
    if (run_dir / "metrics.jsonl").exists() or (run_dir / "checkpoints").exists():
        raise ConfigError(
            f"train.run_dir {str(run_dir)!r} already holds a run: continue it with --resume {run_dir}, "
            "or choose another train.run_dir"
        )


def resume_target(arg: str | Path) -> tuple[Path, Path | None]:
    """--resume's argument as (run directory, checkpoint asked for or None): a run directory, or
    one of its checkpoints, RUN_DIR/checkpoints/step_N."""
    path = Path(arg)
    if (path / "config.toml").is_file():
        return path, None
    if path.parent.name == "checkpoints" and (path.parent.parent / "config.toml").is_file():
        return path.parent.parent, path
    raise ConfigError(
        f"--resume {arg}: no config.toml there; give a plait run directory, or one of its "
        "checkpoints (RUN_DIR/checkpoints/step_N)"
    )


def claim_run(cfg, resume: bool, checkpoint: str | Path | None = None):
    """What the run's owner does before any rank trains: name the run directory (creating
    runs/<timestamp> when `train.run_dir` is empty), lock it, and check it: a new run needs a
    directory that holds no run; a resumed one gets its checkpoint chosen and verified, and
    `latest` names that checkpoint, so every rank loads it and it is never pruned before the run
    saves a newer one. Returns (the config with its run directory, the held RunLock)."""
    try:
        if not cfg.train.run_dir:
            train = dataclasses.replace(cfg.train, run_dir=str(create_run_dir()))
            cfg = dataclasses.replace(cfg, train=train)
        run_dir = Path(cfg.train.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"train.run_dir {cfg.train.run_dir or 'runs/<timestamp>'}: cannot create it ({exc}); "
            "choose another train.run_dir"
        ) from None
    lock = hold_run_dir(run_dir)
    try:
        if resume:
            root = run_dir / "checkpoints"
            if root.is_dir():
                check_writable(root)
            path, note = choose_checkpoint(root, checkpoint)
            reached = checkpoint_step(path)
            if reached is not None and reached > cfg.train.steps:
                raise ConfigError(
                    f"train.steps = {cfg.train.steps}, but {path.name} is at step {reached}: give "
                    f"train.steps > {reached} to train on, or resume an earlier checkpoint"
                )
            if read_latest(root)[0] != path.name:
                set_latest(root, path)
            if note:
                print(note, flush=True)
        else:
            check_fresh_run_dir(run_dir)
    except BaseException:
        lock.release()
        raise
    return cfg, lock

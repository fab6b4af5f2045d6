"""The entry point of a `plait` command that `tests/conftest.py::run_cli` starts: a process forked
from a server that imported torch and plait once, which then is the `plait` command (the console
script's `plait.cli:main`) with the caller's arguments, environment, working directory and its own
stdout and stderr files. Kept out of conftest so that a child imports nothing of pytest."""

import atexit
import os
import sys
from multiprocessing import resource_tracker


def cli_child(argv: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):  # the C level too (torch's warnings, a rank's output)
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.argv = ["plait", *argv]
    # A fresh interpreter has no resource tracker yet; a forked child shares the test process's,
    # which would then report the semaphores a failed or killed launch leaves at the session's end.
    tracker = resource_tracker._resource_tracker
    if tracker._fd is not None:
        os.close(tracker._fd)
    tracker._fd = tracker._pid = None
    from plait.cli import main

    try:
        code = main(argv)
    finally:
        atexit._run_exitfuncs()  # as an interpreter's exit would (a multiprocessing child skips them)
    sys.exit(code)

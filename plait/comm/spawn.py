"""Run a function on N local gloo ranks (processes) and collect each rank's result: the tests'
harness, and what the planner's calibration measures its collectives with.

Ranks fork from a server that imported torch and plait once, bind their store on loopback, and
report a failure with its own traceback as soon as one rank fails (the others are then killed),
so a broken rank never leaves the caller hanging. Results come back through files in a private
temporary directory the ranks write themselves.
"""

from __future__ import annotations

import ast
import datetime
import functools
import gc
import json
import multiprocessing as mp
import os
import pickle
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.distributed as dist

from plait.comm.ports import free_port
from plait.comm.recorder import write_error_file
from plait.errors import ConfigError

GUARD = 'if __name__ == "__main__":'


class RankFailure(AssertionError):
    """One or more ranks failed; `failures` maps rank -> its traceback or report."""

    def __init__(self, message: str, failures: dict[int, str], exitcodes: dict[int, int | None]):
        super().__init__(message)
        self.failures = failures
        self.exitcodes = exitcodes


def rank_env(rank: int, world: int, port: int, **extra: str) -> None:
    """This process's torch.distributed environment, as a launcher sets a rank's (one host,
    loopback store): the group is then formed from it (`init_process_group`'s env://)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        **extra,
    )


def reimported_main() -> str | None:
    """The path of the main module a rank process re-imports (as ``__mp_main__``) before it runs
    its function, as multiprocessing's spawn and forkserver starts do to find the functions and
    arguments defined there; None when it imports none (``python -c``, an interactive session, a
    package's ``__main__``)."""
    main = sys.modules.get("__main__")
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name is not None:
        return None if name == "__main__" or name.endswith(".__main__") else getattr(main, "__file__", None)
    return getattr(main, "__file__", None)


@functools.lru_cache(maxsize=8)
def _guarded_lines(path: str) -> tuple[tuple[int, int], ...] | None:
    """The line ranges of `path`'s top-level ``if __name__ == "__main__":`` blocks (None: unreadable)."""
    try:
        tree = ast.parse(Path(path).read_text(), path)
    except (OSError, SyntaxError, ValueError):
        return None
    spans = []
    for node in tree.body:
        test = node.test if isinstance(node, ast.If) else None
        if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq):
            sides = {ast.unparse(test.left), ast.unparse(test.comparators[0])}
            if sides in ({"__name__", "'__main__'"}, {"__name__", '"__main__"'}):
                spans.append((node.lineno, node.end_lineno or node.lineno))
    return tuple(spans)


def check_main_guard(what: str = "run_ranks") -> None:
    """Refuse to start ranks from the main script's module level outside ``if __name__ ==
    "__main__":``: every rank re-imports that script before running its function and would run
    the same call again, and die in it (multiprocessing refuses to start processes there)."""
    path = reimported_main()
    frame = sys._getframe(1)
    main = sys.modules.get("__main__")
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals is vars(main)):
        frame = frame.f_back
    if path is None or frame is None:
        return
    spans = _guarded_lines(frame.f_code.co_filename)
    if spans is None or any(lo <= frame.f_lineno <= hi for lo, hi in spans):
        return
    raise ConfigError(
        f"{what} was called from the module level of {path} (line {frame.f_lineno}) without "
        f"`{GUARD}`: every rank process re-imports that script (as __mp_main__) to find the "
        f"functions it is given, and would run the call again. Put the call (or the main() that "
        f"makes it) under `{GUARD}`, keeping the functions it is given at module level"
    )


def _child(fn: Callable, rank: int, world_size: int, port: int, workdir: str, args: tuple, env: dict) -> None:
    Path(workdir, f"started-{rank}").touch()  # the process got this far: its bootstrap went well
    os.environ.update(env)
    rank_env(rank, world_size, port, TORCHELASTIC_ERROR_FILE=os.path.join(workdir, f"error-{rank}.json"))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
        result = fn(*args)
        with open(os.path.join(workdir, f"result-{rank}.pkl"), "wb") as fh:
            pickle.dump(result, fh)
        del result
        gc.collect()  # free wrappers (DDP, FSDP) holding the group before it is destroyed
        dist.barrier()  # leave together: a peer tearing down gloo under a live one can abort it
        dist.destroy_process_group()
    except BaseException as exc:
        write_error_file(f"{type(exc).__name__}: {exc}", traceback.format_exc())
        os._exit(1)  # skip atexit hooks that could block on a dead peer
    # The result is on disk. Skip the interpreter's teardown: destructors of torch's C++ threads
    # at exit were seen (rarely) to abort a finished rank with "terminate called without an
    # active exception".
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _failure_text(workdir: Path, rank: int, exitcode: int | None, fn_name: str = "fn") -> str:
    path = workdir / f"error-{rank}.json"
    if path.exists():
        try:
            info = json.loads(path.read_text())["message"]
            return info["extraInfo"].get("py_callstack") or info["message"]
        except (ValueError, KeyError):
            pass
    if not (workdir / f"started-{rank}").exists():
        main = reimported_main()
        imports = f"re-imports the main module {main} (as __mp_main__) and " if main else ""
        return (
            f"exited with code {exitcode} before running {fn_name}: it died while multiprocessing "
            f"started it, which {imports}unpickles the function and its arguments (its traceback is "
            f"on this process's stderr). A script that starts ranks must do so under `{GUARD}`, "
            "and what it passes them must be importable (defined at a module's level)"
        )
    return f"exited with code {exitcode} and left no traceback"


def run_ranks(
    fn: Callable,
    world_size: int,
    args: Iterable = (),
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    grace: float = 2.0,
) -> list:
    """Run `fn(*args)` on `world_size` gloo ranks (processes); return each rank's result.

    `fn` must be importable (defined at module level). Raises `RankFailure` naming every rank
    that failed, with its traceback, as soon as one fails (after `grace` seconds for the others
    to report their own errors), or when `timeout` seconds pass. Called from a script's module
    level without ``if __name__ == "__main__":`` it raises ConfigError before starting any rank.
    """
    check_main_guard(f"run_ranks({getattr(fn, '__name__', fn)})")
    # Ranks fork from a server that imported torch and plait once (spawn would import them in
    # every rank: seconds per call); each gets this process's environment of now.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "plait"])
    env = {**os.environ, **(env or {})}
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="plait-ranks-") as tmp:
        workdir = Path(tmp)
        procs = [
            ctx.Process(target=_child, args=(fn, r, world_size, port, tmp, tuple(args), env))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        first_failure = None
        while any(p.is_alive() for p in procs):
            now = time.monotonic()
            if first_failure is None and any(p.exitcode not in (None, 0) for p in procs):
                first_failure = now
            if now > deadline or (first_failure is not None and now - first_failure > grace):
                break
            time.sleep(0.05)
        timed_out = any(p.is_alive() for p in procs) and first_failure is None
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        codes = {r: p.exitcode for r, p in enumerate(procs)}
        failures = {}
        for r, code in codes.items():
            reported = (workdir / f"error-{r}.json").exists()
            if code != 0 and (reported or code != -9):  # -9 without a report: killed by us
                failures[r] = _failure_text(workdir, r, code, getattr(fn, "__name__", "fn"))
        if timed_out or failures or any(c != 0 for c in codes.values()):
            head = f"timed out after {timeout:g}s" if timed_out else "ranks failed"
            parts = [
                f"--- rank {r} (exit code {codes[r]}) ---\n{text}" for r, text in sorted(failures.items())
            ]
            killed = [r for r, c in codes.items() if c == -9 and r not in failures]
            if killed:
                parts.append(f"(ranks {killed} were killed after the failure)")
            raise RankFailure(
                f"run_ranks({getattr(fn, '__name__', fn)}, {world_size}): {head}\n" + "\n".join(parts),
                failures,
                codes,
            )
        results = []
        for r in range(world_size):
            with open(workdir / f"result-{r}.pkl", "rb") as fh:
                results.append(pickle.load(fh))
        return results

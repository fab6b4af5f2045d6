"""Mutation testing of one module against the tests that cover it: `make mutate MODULE=plait/gradsync.py`.

mutmut (2.x, the dev extra) changes the module one small edit at a time (an operator, a number, a
keyword, a name) and runs the module's tests on each mutant; a mutant the tests pass on "survived":
a bug of that shape would go unnoticed. This script picks the tests (TESTS below, or --tests), runs
mutmut on the module alone, and prints the score (killed / total) and every survivor's diff.

String mutations are left out (mutmut turns "abc" into "XXabcXX": on messages that only a reader
sees, noise), and so is decorator removal. The module is restored from a copy afterwards even if
the run is interrupted. Results are kept in .mutmut-cache: a second run retests only what changed.
docs/testing.md ("Mutation testing") has the scores and the survivors accepted.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_CALIBRATED = [  # the measured-collective path of the cost model (a fake calibration, 7 s)
    "tests/test_planner.py::test_tensor_parallel_prices_the_collectives_plait_sends",
    "tests/test_planner.py::test_the_step_sync_and_the_tp_share_enter_the_step",
]

TESTS = {
    "plait/gradsync.py": ["tests/test_gradsync_units.py", "tests/test_gradsync.py"],
    "plait/train/nonfinite.py": ["tests/test_nonfinite_guard.py"],
    "plait/train/checkpointer.py": ["tests/test_train_checkpoint.py"],
    "plait/planner/cost_terms.py": ["tests/test_planner_terms.py", *_CALIBRATED],
    "plait/planner/cost.py": ["tests/test_planner_terms.py", *_CALIBRATED],
    "plait/moe/router.py": ["tests/test_moe.py", "tests/test_moe_reference.py"],
    "plait/pipeline/runtime.py": ["tests/test_pipeline_parity.py", "tests/test_pipeline_stage.py"],
    "plait/zero/shard.py": ["tests/test_zero.py"],
    "plait/controller/links.py": [
        "tests/test_controller_islands.py::test_the_pieces_are_the_overlaps_of_the_two_islands_shares",
        "tests/test_controller_islands.py::test_a_link_resplits_rows_between_islands_of_2_and_3_ranks",
    ],
    "plait/controller/peer.py": ["tests/test_controller_peer.py"],
    "plait/planner/stages.py": [
        "tests/test_planner_terms.py",
        "tests/test_planner.py::test_inter_op_dp_equals_brute_force_on_random_cases",
    ],
}
"""The fast test files that cover each module (a module not named here needs --tests)."""

STANDALONE = {
    "tests/test_gradsync_units.py",
    "tests/test_gradsync.py",
    "tests/test_nonfinite_guard.py",
    "tests/test_planner_terms.py",
    "tests/test_controller_peer.py",
    *_CALIBRATED,
}
"""Test files that need nothing of tests/conftest.py: run with --noconftest, which spares each
mutant the forkserver conftest starts (seconds a run on a busy machine)."""

SKIPPED_TYPES = "string,fstring,decorator"


def _results(cache: Path, module: str) -> dict[str, list[int]]:
    """Mutant ids of `module` by status, read from mutmut's cache (a plain SQLite file)."""
    con = sqlite3.connect(cache)
    rows = con.execute(
        "SELECT m.id, m.status FROM mutant m JOIN line l ON m.line = l.id "
        "JOIN sourcefile f ON l.sourcefile = f.id WHERE f.filename = ?",
        (module,),
    ).fetchall()
    con.close()
    out: dict[str, list[int]] = {}
    for mid, status in rows:
        out.setdefault(status, []).append(mid)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("module", help="the file to mutate, e.g. plait/gradsync.py")
    ap.add_argument("--tests", nargs="+", help="test files or node ids (default: the module's in TESTS)")
    ap.add_argument(
        "--minutes", type=float, default=0, help="stop after this long and score the mutants tested (0: all)"
    )
    args = ap.parse_args(argv)
    module = args.module.removeprefix("./")
    if not (ROOT / module).is_file():
        print(f"mutate: MODULE={module!r} is not a file of this repository", file=sys.stderr)
        return 2
    tests = args.tests or TESTS.get(module)
    if not tests:
        print(
            f"mutate: no tests are mapped to {module}; pass TESTS=... (mapped: {', '.join(TESTS)})",
            file=sys.stderr,
        )
        return 2
    alone = " --noconftest" if all(t in STANDALONE for t in tests) else ""
    runner = f"{shlex.quote(sys.executable)} -m pytest -x -q -p no:cacheprovider{alone} {' '.join(tests)}"
    source = (ROOT / module).read_bytes()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "mutmut", "run", "--paths-to-mutate", module, "--runner", runner]
    cmd += [
        "--tests-dir",
        "tests",
        "--disable-mutation-types",
        SKIPPED_TYPES,
        "--simple-output",
        "--no-progress",
    ]
    start = time.monotonic()
    print(f"mutate: {module} against {' '.join(tests)}", flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)
    try:
        proc.wait(timeout=args.minutes * 60 or None)
    except subprocess.TimeoutExpired:
        print(f"mutate: stopping after {args.minutes:g} minutes; the score counts the mutants tested")
    finally:
        if proc.poll() is None:  # mutmut, its test process and the tests' ranks: one session
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
        (ROOT / f"{module}.bak").unlink(missing_ok=True)
        if (ROOT / module).read_bytes() != source:
            (ROOT / module).write_bytes(source)
            print(f"mutate: {module} restored", file=sys.stderr)
    cache = ROOT / ".mutmut-cache"
    if not cache.exists():
        print("mutate: mutmut left no results (.mutmut-cache); see its output above", file=sys.stderr)
        return 1
    by = _results(cache, module)
    # killed: the tests failed; "suspicious" (failed, slowly) and timed out (hung) are caught too
    caught = sum(len(by.get(k, [])) for k in ("ok_killed", "ok_suspicious", "bad_timeout"))
    survivors = sorted(by.get("bad_survived", []))
    total = caught + len(survivors)
    for mid in survivors:
        diff = subprocess.run(
            [sys.executable, "-m", "mutmut", "show", str(mid)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
        ).stdout
        print(f"--- survivor {mid}\n{diff.strip()}")
    counts = ", ".join(f"{k} {len(v)}" for k, v in sorted(by.items()))  # "untested": not reached
    print(
        f"mutate: {module}: {caught} / {total} mutants killed ({100 * caught / max(total, 1):.0f}%), "
        f"{len(survivors)} survived [{counts}] in {time.monotonic() - start:.0f} s"
    )
    return 0 if not survivors and total else 3


if __name__ == "__main__":
    sys.exit(main())

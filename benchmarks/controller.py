"""Step time of `plait train --runtime.kind controller` against the SPMD runtime on the default config.

What is measured: `plait train configs/default.toml` (the small GPT, dp = 2, gloo on the CPU),
shortened to `--steps` steps with a log line every `--log-every` steps and no evaluation,
checkpoint or sample in between, run as three setups: `spmd` (the default runtime: torch
elastic starts two ranks that each run the loop), `controller` (one driver program, two Monarch
actors, `runtime.run_ahead = 2`: the next step is dispatched before the last one's loss is back)
and `controller, run_ahead 1` (the controller waits for each step before sending the next: the
dispatch cost is not hidden). The setups run one after another, `--rounds` rounds, in rotating
order, so that a drift of the machine's load reaches all of them.

A step's time is read from the log records: `tokens per step / tokens_per_s`, where tokens_per_s
is measured by rank 0 over each log interval's wall time (the loop's own figure, which under the
controller includes any time an actor waits for its next step). The first interval (warm-up) is
left out. Reported: per setup, the median over all the intervals of all its runs, and the ratio
of each controller setup's median to spmd's (the issue's goal: <= 1.03). The start-up (spawn,
imports, set-up) is reported apart, as each run's wall time minus its steps'.

    .venv/bin/python benchmarks/controller.py [--rounds 3] [--steps 60] [--log-every 10] [--quick]

writes benchmarks/results/controller.md (not with --quick).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import machine_info, markdown_table, text_table, write_report

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "controller.md"
SETUPS = {
    "spmd": ("--runtime.kind", "spmd"),
    "controller": ("--runtime.kind", "controller", "--runtime.run_ahead", "2"),
    "controller, run_ahead 1": ("--runtime.kind", "controller", "--runtime.run_ahead", "1"),
}


def one_run(setup: str, steps: int, log_every: int, tmp: Path, i: int) -> dict:
    """One `plait train` of `setup`: its step times (one per log interval after the first) and
    its start-up time."""
    run_dir = tmp / f"{setup.replace(' ', '').replace(',', '-')}-{i}"
    cmd = [
        sys.executable,
        "-m",
        "plait.cli",
        "train",
        str(ROOT / "configs" / "default.toml"),
        *SETUPS[setup],
        *("--train.steps", str(steps), "--train.log_every", str(log_every)),
        *("--train.eval_every", "0", "--train.checkpoint_every", "0", "--train.sample_tokens", "0"),
        *("--train.progress", "false", "--train.run_dir", str(run_dir)),
    ]
    t0 = time.perf_counter()
    r = subprocess.run(
        cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{setup} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if "tokens_per_s" in r]
    tokens = 32 * 128  # the default config's global batch x context
    step_s = [tokens / r["tokens_per_s"] for r in logged[1:]]
    losses = [r["loss"] for r in records]
    return {
        "step_s": step_s,
        "startup_s": wall - sum(tokens / r["tokens_per_s"] * log_every for r in logged),
        "losses": losses,
    }


def measure(rounds: int, steps: int, log_every: int) -> dict[str, list[dict]]:
    order = list(SETUPS)
    out: dict[str, list[dict]] = {s: [] for s in SETUPS}
    with tempfile.TemporaryDirectory(prefix="plait-bench-controller-") as tmp:
        for i in range(rounds):
            for setup in order if i % 2 == 0 else order[::-1]:
                out[setup].append(one_run(setup, steps, log_every, Path(tmp), i))
                print(
                    f"round {i + 1}/{rounds} {setup}: median step "
                    f"{statistics.median(out[setup][-1]['step_s']) * 1e3:.1f} ms",
                    flush=True,
                )
    return out


def rows(results: dict[str, list[dict]]) -> list[list[str]]:
    base = statistics.median(s for r in results["spmd"] for s in r["step_s"])
    table = []
    for setup, runs in results.items():
        step = statistics.median(s for r in runs for s in r["step_s"])
        startup = statistics.median(r["startup_s"] for r in runs)
        same = all(r["losses"] == results["spmd"][0]["losses"] for r in runs)
        n = sum(len(r["step_s"]) for r in runs)
        table.append(
            [
                setup,
                f"{step * 1e3:.1f}",
                f"{step / base:.3f}",
                f"{startup:.1f}",
                str(n),
                "yes" if same else "NO",
            ]
        )
    return table


HEADERS = ["setup", "step ms (median)", "/ spmd", "start-up s (median)", "intervals", "losses = spmd's"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="1 round of 20 steps; writes nothing")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.log_every = 1, 20, 5
    info, t0 = machine_info(), time.perf_counter()
    results = measure(args.rounds, args.steps, args.log_every)
    table = rows(results)
    print(text_table(HEADERS, table))
    if args.quick:
        return 0
    write_report(
        RESULTS,
        "plait train: single controller (Monarch) vs SPMD, step time",
        info,
        time.perf_counter() - t0,
        [
            f"- configs/default.toml (small GPT, dp = 2, CPU), {args.steps} steps per run, a log line "
            f"every {args.log_every}; {args.rounds} rounds, setups in rotating order; step = tokens per "
            "step / tokens_per_s of each log interval after the first; medians over all intervals.",
            "- Goal of issue 32: controller / spmd <= 1.03.",
            "",
            markdown_table(HEADERS, table),
        ],
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

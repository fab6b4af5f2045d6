"""Evaluation on an island of its own vs in-line, under the single controller (issue 32 item 4).

What is measured: `plait train configs/default.toml --runtime.kind controller` (the small GPT,
gloo on the CPU), `--steps` steps, at dp 2 and at dp 1, as three setups: `no periodic
evaluation` (only the final one, in-line), `in-line` (a held-out evaluation every `--eval-every`
steps on the training ranks: training waits for it) and `island` (the same evaluations on a
process of their own,
`runtime.eval_island = true`: the controller ships each evaluated step's weights there and goes on
training). The setups run `--rounds` rounds in rotating order. Reported per setup: the median
wall time of the training loop (the sum of rank 0's log intervals, a log line every step, the
first left out: start-up and the final evaluation are not in it), its ratio to in-line's, and the
time the periodic evaluations added over `no periodic evaluation`. The held-out losses of
island and in-line evaluations are compared step by step (same weights, so equal to rounding).

On a machine where the island has devices of its own the evaluations leave the training's
critical path. On a 2-core CPU the island takes cores from the two training ranks at dp 2; at
dp 1 the one training rank leaves the island the second core, the case of an island with
devices of its own.

    .venv/bin/python benchmarks/controller_island.py [--rounds 3] [--steps 40] [--eval-every 10] [--quick]

writes benchmarks/results/controller_island.md (not with --quick).
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
RESULTS = ROOT / "benchmarks" / "results" / "controller_island.md"
SETUPS = {
    "no periodic evaluation": ("--train.eval_every", "0"),
    "in-line": ("--train.eval_every", "EVERY"),
    "island": ("--train.eval_every", "EVERY", "--runtime.eval_island", "true"),
}


def one_run(setup: str, steps: int, every: int, dp: int, tmp: Path, i: int) -> dict:
    """One run of `setup` at data-parallel degree `dp`: the training loop's wall time and its
    held-out losses by step."""
    run_dir = tmp / f"dp{dp}-{setup.replace(' ', '-')}-{i}"
    cmd = [
        sys.executable,
        "-m",
        "plait.cli",
        "train",
        str(ROOT / "configs" / "default.toml"),
        *("--runtime.kind", "controller", "--parallel.dp", str(dp)),
        *(a.replace("EVERY", str(every)) for a in SETUPS[setup]),
        *("--train.steps", str(steps), "--train.log_every", "1", "--train.checkpoint_every", "0"),
        *("--train.sample_tokens", "0", "--train.progress", "false", "--train.run_dir", str(run_dir)),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if dp == 1:  # the rank takes one core (every setup), which leaves the island the other
        env["OMP_NUM_THREADS"] = "1"
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if r.returncode != 0:
        raise SystemExit(f"{setup} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_ = [r for r in records if "loss" in r]
    held = {r["step"]: r["val_loss"] for r in records if r.get("val_loss") is not None and r["step"] < steps}
    # the loop's time: rank 0 measures each log interval's wall time (tokens_per_s; a log line every
    # step), which holds an in-line evaluation of the step before; the first interval is left out
    tokens = 32 * 128  # the default config's global batch x context
    loop_s = sum(tokens / r["tokens_per_s"] for r in steps_[1:])
    return {"loop_s": loop_s, "held": held, "losses": [r["loss"] for r in steps_]}


def measure(rounds: int, steps: int, every: int, dp: int) -> dict[str, list[dict]]:
    order = list(SETUPS)
    out: dict[str, list[dict]] = {s: [] for s in SETUPS}
    with tempfile.TemporaryDirectory(prefix="plait-bench-island-") as tmp:
        for i in range(rounds):
            for setup in order if i % 2 == 0 else order[::-1]:
                out[setup].append(one_run(setup, steps, every, dp, Path(tmp), i))
                loop = out[setup][-1]["loop_s"]
                print(f"dp {dp}, round {i + 1}/{rounds} {setup}: loop {loop:.1f} s", flush=True)
    return out


DPS = {  # the training mesh's dp: with 2, the island shares the 2 cores; with 1, it has the second
    2: "two training ranks; the island shares their 2 cores",
    1: "one training rank on one core (OMP_NUM_THREADS=1); the island has the second core",
}
HEADERS = ["setup", "loop s (median)", "/ in-line", "evaluations' cost s", "held-out losses = in-line's"]


def rows(results: dict[str, list[dict]]) -> list[list[str]]:
    med = {s: statistics.median(r["loop_s"] for r in runs) for s, runs in results.items()}
    inline = results["in-line"][0]["held"]
    table = []
    for setup, runs in results.items():
        if setup == "no periodic evaluation":
            same = "-"
        else:
            errs = [abs(r["held"][k] - v) / v for r in runs for k, v in inline.items()]
            complete = all(set(r["held"]) == set(inline) for r in runs)
            same = f"yes (largest rel. diff {max(errs):.1e})" if complete and max(errs) < 1e-5 else "NO"
        cost = med[setup] - med["no periodic evaluation"]
        table.append([setup, f"{med[setup]:.2f}", f"{med[setup] / med['in-line']:.3f}", f"{cost:+.2f}", same])
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="1 round of 12 steps; writes nothing")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.eval_every = 1, 12, 4
    info, t0 = machine_info(), time.perf_counter()
    tables = {}
    for dp, what in DPS.items():
        tables[dp] = rows(measure(args.rounds, args.steps, args.eval_every, dp))
        print(f"dp {dp}: {what}\n" + text_table(HEADERS, tables[dp]))
    if args.quick:
        return 0
    n_evals = (args.steps - 1) // args.eval_every
    write_report(
        RESULTS,
        "Single controller: held-out evaluation on an island vs in-line",
        info,
        time.perf_counter() - t0,
        [
            f"- configs/default.toml (small GPT, CPU) under `--runtime.kind controller`, "
            f"{args.steps} steps, {n_evals} periodic evaluations (every {args.eval_every} steps) "
            f"before the final one; {args.rounds} rounds, setups in rotating order; loop = the first "
            "step's log line to the last's; medians.",
            *(
                line
                for dp, what in DPS.items()
                for line in ("", f"## dp {dp}: {what}", "", markdown_table(HEADERS, tables[dp]))
            ),
        ],
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A pipeline over islands (MPMD, `plait.controller.islands`) against one process, step time.

What is measured: examples/islands.py's two-stage MLP (16 -> W -> W -> 4, stage 0 the first
layer, stage 1 the rest) at width `--width`, `--steps` steps of `--rows` rows in 4 micro-batches,
under each layout below; the same training in plain PyTorch on one process runs in the same
call (one thread, as each island's rank) and gives the baseline. Reported per layout: the
median step time, its ratio to one process's, and the largest relative difference of the
losses and final parameters from one process (the parity the tests check at 1e-5).

On 2 shared CPU cores the islands' processes (up to 3 here) and the controller compete for the
cores, and each micro-batch's activations travel through the controller (TCP): the figures show
the controller's overhead on small stages, not a speed-up.

    .venv/bin/python benchmarks/controller_islands.py [--width 512] [--rows 256] [--steps 12]

writes benchmarks/results/controller_islands.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from _common import machine_info, markdown_table, text_table, write_report

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "controller_islands.md"
LAYOUTS = ["gpipe:1,1", "1f1b:1,1", "1f1b:2,1", "1f1b:1,2"]
HEADERS = [
    "schedule",
    "islands' dp",
    "step ms (median)",
    "one process ms",
    "/ one process",
    "losses",
    "params",
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT / "examples"))
    # the islands' processes unpickle the example's functions by module name: they import it too
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "examples"), os.environ.get("PYTHONPATH", "")])
    from islands import run  # the example is the workload: its stages, data and reference

    torch.set_num_threads(1)  # the one-process baseline on one core, as each island's rank
    info, t0 = machine_info(), time.perf_counter()
    table = []
    for spec in LAYOUTS:
        schedule, dp = spec.split(":")
        r = run(schedule, [int(d) for d in dp.split(",")], args.steps, args.rows, 4, args.width)
        table.append(
            [
                schedule,
                str(r["dp"]),
                f"{r['step_ms']:.1f}",
                f"{r['one_process_ms']:.1f}",
                f"{r['step_ms'] / r['one_process_ms']:.2f}",
                f"{r['loss_err']:.1e}",
                f"{r['param_err']:.1e}",
            ]
        )
        print(text_table(HEADERS, table[-1:]), flush=True)
    write_report(
        RESULTS,
        "Single controller: a pipeline over islands (MPMD) vs one process",
        info,
        time.perf_counter() - t0,
        [
            f"- examples/islands.py's MLP, width {args.width}, {args.rows} rows per step in 4 "
            f"micro-batches, {args.steps} steps (the first left out of the median); the one-process "
            "time is plain PyTorch on the same batches, measured in the same call; losses and params: "
            "the largest relative difference from one process.",
            "",
            markdown_table(HEADERS, table),
        ],
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

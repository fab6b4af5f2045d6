"""A pipeline over islands (MPMD, `plait.controller.islands`): direct island-to-island links
against transfers relayed by the controller, and both against one process, step time.

What is measured: examples/islands.py's two-stage MLP (16 -> W -> W -> 4, stage 0 the first
layer, stage 1 the rest) at each of `--sizes` (width x rows per step), `--steps` steps in 4
micro-batches, under each layout below, once with `transfer="direct"` (activations and gradients over a gloo
link between the islands) and once with `transfer="controller"` (relayed through the controller
as endpoint arguments and results), the two alternating first over `--rounds` rounds. The same
training in plain PyTorch on one process runs in the same call (one thread, as each island's
rank) and gives the baseline. Reported per layout: the median step time of each transfer (the
median over rounds of each round's median), relayed / direct, direct / one process, the bytes
the link carried per step, the bytes that went through the controller and the controller's own
CPU time per step, and the largest relative difference of the losses and final
parameters from one process (the parity the tests check at 1e-5).

On 2 shared CPU cores the islands' processes (up to 3 here) and the controller compete for the
cores: the figures show the runtime's overhead on small stages, not a speed-up.

    .venv/bin/python benchmarks/controller_islands.py [--sizes 512x256 2048x1024] [--steps 12] [--rounds 2]

writes benchmarks/results/controller_islands.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from _common import machine_info, markdown_table, text_table, write_report

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "controller_islands.md"
LAYOUTS = ["gpipe:1,1", "1f1b:1,1", "1f1b:2,1", "1f1b:1,2"]
TRANSFERS = ["direct", "controller"]
HEADERS = [
    "width x rows",
    "schedule",
    "islands' dp",
    "direct ms",
    "relayed ms",
    "relayed / direct",
    "one process ms",
    "direct / one process",
    "link MB / step",
    "via controller MB / step (direct, relayed)",
    "controller CPU ms / step (direct, relayed)",
    "losses",
    "params",
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--sizes", nargs="+", default=["512x256", "2048x1024"], help="WIDTHxROWS ...")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT / "examples"))
    # the islands' processes unpickle the example's functions by module name: they import it too
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "examples"), os.environ.get("PYTHONPATH", "")])
    from islands import run  # the example is the workload: its stages, data and reference

    torch.set_num_threads(1)  # the one-process baseline on one core, as each island's rank
    info, t0 = machine_info(), time.perf_counter()
    table = []
    for size in args.sizes:
        width, rows = (int(v) for v in size.split("x"))
        for spec in LAYOUTS:
            schedule, dp = spec.split(":")
            dp_ = [int(d) for d in dp.split(",")]
            runs: dict[str, list[dict]] = {t: [] for t in TRANSFERS}
            for k in range(args.rounds):
                for transfer in TRANSFERS[k % 2 :] + TRANSFERS[: k % 2]:  # each goes first in turn
                    runs[transfer].append(run(schedule, dp_, args.steps, rows, 4, width, transfer))
            table.append([size, schedule, str(dp_), *_row(runs, args.steps)])
            print(text_table(HEADERS, table[-1:]), flush=True)
    write_report(
        RESULTS,
        "Single controller: a pipeline over islands (MPMD), direct links vs relayed, vs one process",
        info,
        time.perf_counter() - t0,
        [
            f"- examples/islands.py's MLP (16 -> width -> width -> 4), rows per step in 4 micro-batches, "
            f"{args.steps} steps (the first left out of each median), {args.rounds} rounds with direct "
            "and relayed transfers alternating first; the one-process time is plain PyTorch on the same "
            "batches, measured in the same call; link MB / step: what the direct link carried "
            "(activations forward, gradients back); via controller: the activations and gradients the "
            "controller received and sent again; controller CPU: the controller process's CPU time per "
            "step (`time.process_time`, all its threads, median); losses and params: the largest "
            "relative difference from one process over every run.",
            "",
            markdown_table(HEADERS, table),
        ],
    )
    return 0


def _row(runs: dict[str, list[dict]], steps: int) -> list[str]:
    direct = statistics.median(r["step_ms"] for r in runs["direct"])
    relayed = statistics.median(r["step_ms"] for r in runs["controller"])
    one = statistics.median(r["one_process_ms"] for rs in runs.values() for r in rs)
    forward, back = runs["direct"][0]["link_bytes"][0]
    via = [runs[t][0]["relayed_bytes"] / steps / 2**20 for t in TRANSFERS]
    cpu = [statistics.median(r["controller_cpu_ms"] for r in runs[t]) for t in TRANSFERS]
    every = [r for rs in runs.values() for r in rs]
    return [
        f"{direct:.1f}",
        f"{relayed:.1f}",
        f"{relayed / direct:.2f}",
        f"{one:.1f}",
        f"{direct / one:.2f}",
        f"{(forward + back) / steps / 2**20:.2f}",
        f"{via[0]:.2f}, {via[1]:.2f}",
        f"{cpu[0]:.1f}, {cpu[1]:.1f}",
        f"{max(r['loss_err'] for r in every):.1e}",
        f"{max(r['param_err'] for r in every):.1e}",
    ]


if __name__ == "__main__":
    raise SystemExit(main())

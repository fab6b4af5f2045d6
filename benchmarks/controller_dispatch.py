"""The dispatch microbenchmark of Pathways (Barham et al. 2022, Fig. 5) on plait's controller runtime.

A *unit* of work is what each rank does: spin for `u` ms (stand-in compute of a known length),
then one all-reduce of a scalar over the ranks (gloo, CPU) and an add. Units per second are
measured, for 2 and 4 ranks (Monarch actors, one process each), in three ways:

* **chained (SPMD)**: one controller call runs `n` units inside each actor, which loops by itself
  (what every SPMD rank does: no controller per unit; the baseline);
* **futures**: the controller issues all `n` unit calls without waiting, then gathers them
  (Pathways' asynchronous dispatch: the controller runs ahead of the ranks);
* **op-by-op**: the controller issues a unit and waits for its result (`.get()`) before the next.

For each unit length, the ratio of each controller mode's units/s to chained's, and the
*crossover*: the shortest unit length at which a controller mode reaches 97% of chained's rate.
Each figure is the median of `--repeats` measurements, the modes interleaved in rotating order.

    .venv/bin/python benchmarks/controller_dispatch.py [--repeats 3] [--quick]

writes benchmarks/results/controller_dispatch.md (not with --quick).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _common import command_line, machine_info, markdown_table, text_table
from monarch.actor import Actor, current_rank, endpoint, this_host

RESULTS = Path(__file__).resolve().parent / "results" / "controller_dispatch.md"
UNITS_MS = (0.0, 0.3, 1.0, 3.0, 10.0, 30.0)
MODES = ("chained", "futures", "op-by-op")


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class UnitActor(Actor):
    """One rank: a gloo group with its peers and a scalar that the units all-reduce."""

    def __init__(self) -> None:
        self.rank = current_rank().rank

    @endpoint
    def init(self, port: int, world: int) -> None:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=self.rank, world_size=world
        )
        self.t = torch.zeros(1)

    def _unit(self, spin_s: float) -> float:
        _spin(spin_s)
        dist.all_reduce(self.t)
        self.t += 1
        return float(self.t[0])

    @endpoint
    def unit(self, spin_s: float) -> float:
        return self._unit(spin_s)

    @endpoint
    def chain(self, n: int, spin_s: float) -> float:
        for _ in range(n):
            value = self._unit(spin_s)
        return value

    @endpoint
    def close(self) -> None:
        dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def units_per_s(actors, mode: str, n: int, spin_s: float) -> float:
    t0 = time.perf_counter()
    if mode == "chained":
        actors.chain.call(n, spin_s).get()
    elif mode == "futures":
        futures = [actors.unit.call(spin_s) for _ in range(n)]
        for f in futures:
            f.get()
    else:
        for _ in range(n):
            actors.unit.call(spin_s).get()
    return n / (time.perf_counter() - t0)


def measure(world: int, repeats: int, budget_s: float) -> dict[tuple[float, str], float]:
    procs = this_host().spawn_procs(per_host={"ranks": world})
    try:
        actors = procs.spawn("units", UnitActor)
        actors.init.call(_port(), world).get()
        for mode in MODES:  # warm-up: connections, first calls
            units_per_s(actors, mode, 5, 0.0)
        out = {}
        for u in UNITS_MS:
            n = max(10, min(400, int(budget_s / max(u / 1e3, 1e-3))))
            rates = {m: [] for m in MODES}
            for r in range(repeats):
                for mode in MODES if r % 2 == 0 else MODES[::-1]:
                    rates[mode].append(units_per_s(actors, mode, n, u / 1e3))
            for mode in MODES:
                out[(u, mode)] = statistics.median(rates[mode])
            print(f"world {world}, unit {u} ms: " + ", ".join(f"{m} {out[(u, m)]:,.0f}/s" for m in MODES))
        actors.close.call().get()
        return out
    finally:
        procs.stop().get()


def rows(world: int, rates: dict) -> list[list[str]]:
    table = []
    for u in UNITS_MS:
        base = rates[(u, "chained")]
        table.append(
            [str(world), f"{u:g}"]
            + [f"{rates[(u, m)]:,.0f}" for m in MODES]
            + [f"{rates[(u, m)] / base:.2f}" for m in MODES[1:]]
        )
    return table


def crossover(rates: dict, mode: str) -> str:
    for u in UNITS_MS:
        if rates[(u, mode)] >= 0.97 * rates[(u, "chained")]:
            return f"{u:g} ms"
    return f"> {UNITS_MS[-1]:g} ms"


HEADERS = [
    "ranks",
    "unit ms",
    "chained /s",
    "futures /s",
    "op-by-op /s",
    "futures / chained",
    "op-by-op / chained",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=0.4, help="about this long per measurement")
    parser.add_argument("--quick", action="store_true", help="2 ranks, 1 repeat; writes nothing")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    info, t0 = machine_info(), time.perf_counter()
    worlds = (2,) if args.quick else (2, 4)
    results = {w: measure(w, 1 if args.quick else args.repeats, args.budget_s) for w in worlds}
    table = [row for w in worlds for row in rows(w, results[w])]
    cross = [[str(w), crossover(results[w], "futures"), crossover(results[w], "op-by-op")] for w in worlds]
    print(text_table(HEADERS, table))
    print(text_table(["ranks", "futures reach 97% at", "op-by-op reaches 97% at"], cross))
    if args.quick:
        return 0
    RESULTS.write_text(
        "\n".join(
            [
                "# Dispatch microbenchmark (Pathways Fig. 5 shape) on Monarch actors",
                "",
                "Written by `benchmarks/controller_dispatch.py`; every figure below comes from one run of",
                "it. See the script's docstring for the method. A unit: spin `unit ms`, then an all-reduce",
                "of one float32 over the ranks (gloo) and an add; units per second, medians of "
                f"{args.repeats} interleaved measurements.",
                "",
                f"- Command: `{command_line()}`",
                *(f"- {k}: {v}" for k, v in info.items()),
                f"- Runtime: {time.perf_counter() - t0:.0f} s",
                "",
                markdown_table(HEADERS, table),
                "",
                "## Crossover: the shortest unit at which the controller reaches 97% of chained (SPMD)",
                "",
                markdown_table(["ranks", "futures", "op-by-op"], cross),
                "",
            ]
        )
    )
    print(f"wrote {RESULTS.name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""plait DataParallel vs torch DistributedDataParallel: step time, scaling efficiency, bytes moved.

What is measured, per GPT size (`plait.models.gpt_config`):

* **Step times.** One job of 2 gloo ranks on the CPU, one compute thread per rank, trains three
  replicas of the same model from the same initialisation on the same data, each with its own
  AdamW: one wrapped in `plait.data_parallel.DataParallel(bucket_mb=25)`, one in
  `torch.nn.parallel.DistributedDataParallel(bucket_cap_mb=25)`, and the one-process baseline:
  no DDP, the *global* batch (2 x the per-rank batch), run by rank 0 alone while rank 1 waits.
  Their steps are interleaved (the order rotates every step), so all three see the same machine
  state, load from elsewhere included. A step is zero_grad + forward + backward (with the
  gradient all-reduce overlapped, for DDP) + optimizer step. The first `--warmup` steps are not
  counted; the figure is the median over the `--steps` measured steps of each step's wall time,
  the maximum over the ranks, every step starting from a barrier (see `_common.timed_step`).
* **Scaling efficiency** (Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating
  Data Parallel Training", VLDB: speed-up of N ranks over one, divided by N). With the global
  batch fixed, N ranks each compute 1/N of it, so perfect scaling runs a step in T_1 / N and
  efficiency = T_1(global batch) / (N x T_ddp)  is 1 for perfect scaling. The optimizer step
  is not divided among the ranks (every replica updates all parameters), so even free
  communication leaves it a little below 1; the 2 ranks also share one memory bus.
* **Bytes moved.** plait records every collective in its ledger (`mesh.ledger`); per step the
  gradient all-reduce must carry 4 bytes x parameters (fp32) as payload, and the ring
  algorithm sends 2 (N-1)/N times that per rank (reduce-scatter + all-gather; the bus bytes of
  nccl-tests).

As a check that both wrappers do the same work, the losses of plait and torch DDP (averaged over
the ranks) are compared with the one-process losses step by step, and plait's parameters with
torch's after the run.

Run from the repository root:  .venv/bin/python benchmarks/ddp.py [--steps 25] [--models 3m,20m]
[--quick]. Prints the table and writes it to benchmarks/results/ddp.md (not with --quick,
unless --out is given).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _common import (
    command_line,
    corpus_batches,
    idle,
    machine_info,
    markdown_table,
    max_over_ranks,
    mean_over_ranks,
    median_ms,
    text_table,
    timed_step,
    train_step,
)
from tqdm import tqdm

from plait.models import GPT, gpt_config
from plait.testing import run_ranks

WORLD = 2
# Per-rank micro-batch (sequences, tokens per sequence). 3m keeps its own seq_len; 20m runs at 256
# tokens instead of its 512 so that a 2-rank step takes ~1.5 s on one core (~3 s at 512), which
# keeps the default run within minutes.
SHAPES = {"3m": (4, 256), "20m": (4, 256)}
N_BATCHES = 4  # distinct global batches, cycled: enough to keep the loss honest, cheap to build
SEED = 0
TARGET_MODEL, TARGET_RATIO, TARGET_EFFICIENCY = "20m", 1.0, 0.85
RESULTS = Path(__file__).resolve().parent / "results" / "ddp.md"


def _model(name: str, seq_len: int) -> GPT:
    torch.manual_seed(SEED)  # the same initialisation for plait, torch and the one-process run
    return GPT(gpt_config(name, seq_len=seq_len))


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)


def ddp_job(name: str, rows: int, seq_len: int, steps: int, warmup: int) -> dict:
    """On each of WORLD ranks: train plait's and torch's DDP replicas and the one-process baseline
    in turn, timing every step.

    The baseline ("one") runs on rank 0 alone, on the global batch, while the other ranks wait in
    the barrier that starts the next timed step (a blocked gloo wait sleeps, it does not spin): one
    busy core, the others idle, as a single-process user would run it. Doing it inside the same
    job, interleaved with the DDP steps, exposes all three to the same machine state.
    """
    from plait.data_parallel import DataParallel
    from plait.mesh import Mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    batches = corpus_batches(rows * world, seq_len, N_BATCHES, SEED)
    mine = [(x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]) for x, y in batches]
    mesh = Mesh(dp=world)
    plait_model = DataParallel(_model(name, seq_len), mesh, bucket_mb=25)
    torch_model = torch.nn.parallel.DistributedDataParallel(_model(name, seq_len), bucket_cap_mb=25)
    runs = {"plait": (plait_model, _optimizer(plait_model)), "torch": (torch_model, _optimizer(torch_model))}
    if rank == 0:
        one_model = _model(name, seq_len)
        runs["one"] = (one_model, _optimizer(one_model))
    order = ["plait", "torch", "one"]
    times = {k: [] for k in order}
    losses = {k: [] for k in order}
    ledger_payload, ledger_bus = [], []
    total = warmup + steps
    desc = f"{name}: plait, torch ({world} ranks), one process"
    bar = tqdm(total=total, desc=desc, unit="step") if rank == 0 else None
    for i in range(total):
        # Rotate who goes first, so no implementation always runs right after the same other one.
        for impl in order[i % 3 :] + order[: i % 3]:
            if impl == "one":
                if rank == 0:
                    x, y = batches[i % len(batches)]
                    seconds, loss = timed_step(train_step, *runs["one"], x, y)
                    losses["one"].append(float(loss))
                else:
                    seconds, _ = timed_step(idle)
            else:
                if impl == "plait":
                    # Ledger steps start at 1: step 0 holds the broadcast done at wrap time.
                    mesh.ledger.set_step(i + 1)
                x, y = mine[i % len(mine)]
                seconds, loss = timed_step(train_step, *runs[impl], x, y)
                losses[impl].append(float(loss))
            if i >= warmup:
                times[impl].append(seconds)
        if i >= warmup:
            ledger_payload.append(mesh.ledger.total(i + 1, "payload_bytes"))
            ledger_bus.append(mesh.ledger.total(i + 1, "bus_bytes"))
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    dist.barrier()  # the last step may have been rank 0's baseline
    with torch.no_grad():
        param_diff = max(
            float((a - b).abs().max())
            for a, b in zip(plait_model.module.parameters(), torch_model.module.parameters())
        )
    result = {
        "params": sum(p.numel() for p in plait_model.module.parameters()),
        "times": {k: max_over_ranks(v) for k, v in times.items()},
        "losses": {
            "plait": mean_over_ranks(losses["plait"]),
            "torch": mean_over_ranks(losses["torch"]),
            "one": losses["one"],  # rank 0's; empty elsewhere
        },
        "param_diff": max_over_ranks([param_diff])[0],
        "ledger_payload": ledger_payload,
        "ledger_bus": ledger_bus,
    }
    mesh.close()
    return result


def measure(name: str, steps: int, warmup: int, timeout: float) -> dict:
    rows, seq_len = SHAPES[name]
    r = run_ranks(ddp_job, WORLD, args=(name, rows, seq_len, steps, warmup), timeout=timeout)[0]
    p, times, losses = r["params"], r["times"], r["losses"]
    t_plait, t_torch, t_one = (median_ms(times[k]) for k in ("plait", "torch", "one"))
    ring = 2 * (WORLD - 1) / WORLD * 4 * p
    return {
        "model": name,
        "params": p,
        "shape": f"{rows} x {seq_len}",
        "t_one": t_one,
        "t_plait": t_plait,
        "t_torch": t_torch,
        "ratio": t_plait / t_torch,
        "eff_plait": t_one / (WORLD * t_plait),
        "eff_torch": t_one / (WORLD * t_torch),
        "ledger_payload": r["ledger_payload"],
        "ledger_bus": r["ledger_bus"],
        "payload_formula": 4 * p,
        "bus_formula": ring,
        "ledger_ok": all(math.isclose(b, 4 * p) for b in r["ledger_payload"])
        and all(math.isclose(b, ring) for b in r["ledger_bus"]),
        "loss_diff_plait": max(abs(a - b) for a, b in zip(losses["plait"], losses["one"])),
        "loss_diff_torch": max(abs(a - b) for a, b in zip(losses["torch"], losses["one"])),
        "param_diff": r["param_diff"],
        "spread": {k: (1e3 * min(v), 1e3 * max(v)) for k, v in times.items()},
        # Steps i of plait and torch ran seconds apart, so their ratio cancels slow drifts of the
        # machine's load that the ratio of the two medians does not.
        "paired_ratio": statistics.median(a / b for a, b in zip(times["plait"], times["torch"])),
    }


HEADERS = [
    "model",
    "params",
    "batch/rank",
    "1-proc ms (global batch)",
    "plait ms",
    "torch ms",
    "plait/torch",
    "plait eff",
    "torch eff",
    "plait ledger MB/step (payload / bus)",
    "formula MB (4P / ring 2(N-1)/N x 4P)",
]


def _mb(x: float) -> str:
    return f"{x / 1e6:.2f}"


def _ledger_cell(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return _mb(lo) if math.isclose(lo, hi) else f"{_mb(lo)}-{_mb(hi)}"


def table_rows(results: list[dict]) -> list[list[str]]:
    return [
        [
            r["model"],
            f"{r['params'] / 1e6:.2f}M",
            r["shape"],
            f"{r['t_one']:.0f}",
            f"{r['t_plait']:.0f}",
            f"{r['t_torch']:.0f}",
            f"{r['ratio']:.3f}",
            f"{r['eff_plait']:.3f}",
            f"{r['eff_torch']:.3f}",
            f"{_ledger_cell(r['ledger_payload'])} / {_ledger_cell(r['ledger_bus'])}",
            f"{_mb(r['payload_formula'])} / {_mb(r['bus_formula'])}",
        ]
        for r in results
    ]


def targets(results: list[dict]) -> list[tuple[str, str, str]]:
    """(target, measured, verdict) for the ratio and efficiency targets on TARGET_MODEL."""
    r = next((r for r in results if r["model"] == TARGET_MODEL), None)
    ratio_t = f"plait/torch step time <= {TARGET_RATIO:.2f} on {TARGET_MODEL}"
    eff_t = f"plait scaling efficiency >= {TARGET_EFFICIENCY:.2f} on {TARGET_MODEL}"
    if r is None:
        return [(ratio_t, "-", "not measured (model not run)"), (eff_t, "-", "not measured (model not run)")]
    return [
        (ratio_t, f"{r['ratio']:.3f}", "met" if r["ratio"] <= TARGET_RATIO else "NOT met"),
        (eff_t, f"{r['eff_plait']:.3f}", "met" if r["eff_plait"] >= TARGET_EFFICIENCY else "NOT met"),
    ]


def checks(results: list[dict]) -> list[str]:
    lines = []
    for r in results:
        s = r["spread"]
        lines.append(
            f"{r['model']}: ledger equals the formula on every measured step: "
            f"{'yes' if r['ledger_ok'] else 'NO'}; max |loss - one-process loss| over all steps: "
            f"plait {r['loss_diff_plait']:.2e}, torch {r['loss_diff_torch']:.2e}; "
            f"max |plait param - torch param| after the run: {r['param_diff']:.2e}; "
            f"median of the per-step plait/torch ratios: {r['paired_ratio']:.3f}; "
            f"step time min-max ms: plait {s['plait'][0]:.0f}-{s['plait'][1]:.0f}, "
            f"torch {s['torch'][0]:.0f}-{s['torch'][1]:.0f}, one process {s['one'][0]:.0f}-{s['one'][1]:.0f}"
        )
    return lines


def markdown(results: list[dict], info: dict, command: str, args, runtime_s: float) -> str:
    out = [
        "# plait DataParallel vs torch DistributedDataParallel",
        "",
        "Written by `benchmarks/ddp.py`; every figure below comes from one run of it. See the",
        "script's docstring for the method.",
        "",
        f"- Command: `{command}`",
        *(f"- {k}: {v}" for k, v in info.items()),
        f"- Runtime: {runtime_s:.0f} s",
        f"- Set-up: {WORLD} gloo ranks on the CPU, 1 thread each (torch.set_num_threads(1)); GPT from",
        "  `plait.models.gpt_config`; AdamW; bucket 25 MB for both; batch/rank = sequences x tokens;",
        "  1-proc = one process, one thread, the global batch (2 x batch/rank), no DDP (rank 0 runs it",
        "  while rank 1 waits). plait, torch and 1-proc steps are interleaved in one job, in rotating",
        f"  order; {args.warmup} warm-up + {args.steps} measured steps each; figures are medians over the",
        "  steps of the per-step maximum over the ranks, each step started from a barrier.",
        f"- Efficiency = T_1-proc / ({WORLD} x T_ddp) (Li et al. 2020); 1.0 is perfect scaling.",
        "",
        markdown_table(HEADERS, table_rows(results)),
        "",
        "## Targets",
        "",
        markdown_table(["target", "measured", "verdict"], [list(t) for t in targets(results)]),
        "",
        "## Checks",
        "",
        *(f"- {line}" for line in checks(results)),
        "",
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", type=int, default=25, help="measured steps per implementation")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured steps first")
    parser.add_argument("--models", default="3m,20m", help=f"comma-separated, from {sorted(SHAPES)}")
    parser.add_argument("--quick", action="store_true", help="smoke check: 3m only, 1 + 4 steps, no file")
    parser.add_argument("--out", type=Path, default=None, help=f"markdown output (default {RESULTS})")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per spawned job")
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.steps, args.warmup = "3m", 4, 1
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in SHAPES]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {sorted(SHAPES)}")
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")

    command, info = command_line(), machine_info()
    start = time.perf_counter()
    results = []
    for k, name in enumerate(models, 1):
        print(f"[{k}/{len(models)}] {name}: one {WORLD}-rank job", flush=True)
        results.append(measure(name, args.steps, args.warmup, args.timeout))
    runtime = time.perf_counter() - start

    print()
    print(text_table(HEADERS, table_rows(results)))
    print()
    for target, measured, verdict in targets(results):
        print(f"target: {target}: {measured} -> {verdict}")
    for line in checks(results):
        print(line)
    print(f"runtime {runtime:.0f} s")
    text = markdown(results, info, command, args, runtime)
    out = args.out if args.out is not None else (None if args.quick else RESULTS)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

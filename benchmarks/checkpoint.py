"""Checkpoint blocking time: synchronous saves vs `train.checkpoint_async`, from one run.

What is measured, per model (the default config's `small` GPT, and GPT-2's shape with a
128-token context: 124M parameters), in one job of 2 gloo ranks on the CPU laid out as the
default config is (data parallel over 2, AdamW, ZeRO 0):

* **Blocking time** of a checkpoint: the seconds from the start of the save to the moment the
  training loop may take its next step, the maximum over the ranks. Synchronous
  (`plait.train.checkpointer.Checkpointer`): DCP writes every rank's files, rank 0 fsyncs them,
  hashes them into the manifest and renames the directory, then `latest`. Asynchronous
  (`AsyncCheckpointer`): the finiteness check and the copy of the state into reused host buffers;
  the rest runs on the writer thread.
* **Write time** of an asynchronous save: its writer thread's time until the commit (rank 0),
  the maximum over the ranks; a training step runs meanwhile, and that step's time is shown
  beside a step without a write in flight (what the background write costs the step).
* **Host snapshot**: the bytes of host memory the reused buffers hold (the rank's model and
  optimizer states).

Each save is repeated `--repeats` times, the modes alternating (sync, async, sync, ...) so both
see the same machine state; the figures are medians. The checkpoints are written under a
temporary directory on the file system of the repository (`--dir` to choose), then removed.

Run from the repository root:  .venv/bin/python benchmarks/checkpoint.py [--repeats 3]
[--models small,gpt2] [--quick]. Writes benchmarks/results/checkpoint.md (not with --quick).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _common import machine_info, markdown_table, max_over_ranks, text_table, write_report  # noqa: E402

from plait.testing import run_ranks  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "checkpoint.md"
SIZES = {"small": {}, "gpt2": {"seq_len": 128}}  # gpt2: 124M parameters


class _Sampler:
    """The sampler's part of a checkpoint (a position): the benchmark feeds its own batches."""

    def state_dict(self) -> dict:
        return {"position": 0}


def _measure(name: str, repeats: int, directory: str) -> dict:
    from plait.mesh import Mesh
    from plait.models import GPT, gpt_config
    from plait.train.checkpointer import AsyncCheckpointer, Checkpointer
    from plait.zero import wrap

    torch.set_num_threads(1)
    mesh = Mesh(dp=2, timeout_s=600)
    cfg = gpt_config(name, **SIZES[name])
    torch.manual_seed(0)
    engine = wrap(GPT(cfg), mesh, 0, lambda g: torch.optim.AdamW(g, lr=1e-4))
    sched = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda s: 1.0)
    x = torch.randint(
        0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(mesh.rank("dp"))
    )

    def step() -> float:
        t0 = time.perf_counter()
        engine.module(x, x).backward()
        engine.step()
        engine.zero_grad()
        return time.perf_counter() - t0

    step()  # the optimizer's state exists from here on
    root = Path(directory) / name
    sync, asyn = Checkpointer(mesh), AsyncCheckpointer(mesh, 600)
    figures = {"sync": [], "async": [], "write": [], "step_alone": [], "step_writing": []}
    n = 0
    for _ in range(repeats):
        n += 1
        figures["sync"].append(sync.save(root, n, engine, sched, _Sampler(), keep=2)["blocking_s"])
        figures["step_alone"].append(step())
        n += 1
        saved = asyn.save(root, n, engine, sched, _Sampler(), keep=2)
        figures["async"].append(saved["blocking_s"])
        figures["step_writing"].append(step())  # while the checkpoint is written
        asyn.wait()
        figures["write"].append(asyn.saves[-1]["write_s"])
    out = {k: max_over_ranks(v) for k, v in figures.items()}
    out["host_bytes"] = asyn.snapshot.nbytes
    out["params"] = sum(p.numel() for p in engine.module.parameters())
    out["state_bytes"] = engine.memory()["params"] + engine.memory()["optimizer"]
    asyn.close()
    engine.close()
    mesh.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", default="small,gpt2")
    ap.add_argument(
        "--dir", default=None, help="where the checkpoints are written (default: a temp dir in the repo)"
    )
    ap.add_argument("--quick", action="store_true", help="small only, 2 repeats, no results file")
    args = ap.parse_args(argv)
    models = ["small"] if args.quick else args.models.split(",")
    repeats = 2 if args.quick else args.repeats
    t0 = time.perf_counter()
    rows, md_rows, ratios = [], [], {}
    for name in models:
        directory = tempfile.mkdtemp(prefix="plait-ckpt-bench-", dir=args.dir or ROOT)
        try:
            r = run_ranks(_measure, 2, (name, repeats, directory), timeout=1800)[0]
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        med = {k: statistics.median(r[k]) for k in ("sync", "async", "write", "step_alone", "step_writing")}
        ratios[name] = med["async"] / med["sync"]
        cells = [
            name,
            f"{r['params'] / 1e6:.1f}M",
            f"{r['state_bytes'] / 2**20:,.0f}",
            f"{med['sync']:.3f}",
            f"{med['async']:.3f}",
            f"{ratios[name]:.3f} (1/{1 / ratios[name]:.0f})",
            f"{med['write']:.3f}",
            f"{r['host_bytes'] / 2**20:,.0f}",
            f"{med['step_alone']:.3f} / {med['step_writing']:.3f}",
        ]
        rows.append(cells)
    headers = [
        "model",
        "params",
        "states/rank MiB",
        "sync blocks s",
        "async blocks s",
        "async/sync",
        "async write s",
        "snapshot MiB",
        "step s alone / writing",
    ]
    md_rows = rows
    print(text_table(headers, rows))
    worst = max(ratios.values())
    verdict = "met" if worst <= 0.2 else "NOT met"
    summary = f"Largest async/sync blocking ratio: {worst:.3f} (goal <= 1/5: {verdict})."
    print(summary)
    if not args.quick:
        lines = [
            "",
            "Blocking time per checkpoint (median over the repeats, slowest rank), dp 2 on the CPU,",
            "AdamW, the checkpoint written by DCP to the repository's file system:",
            "",
            markdown_table(headers, md_rows),
            "",
            summary,
            "",
            "`async write s`: the writer thread's time from the snapshot to the commit (fsync, manifest,",
            "rename, `latest`), while a training step runs; `step s alone / writing`: that step's time",
            "beside a step without a write in flight (the two share the machine's 2 cores).",
        ]
        info = {**machine_info(), "Repeats": str(repeats)}
        write_report(
            RESULTS,
            "Checkpoints: blocking time, synchronous vs asynchronous",
            info,
            time.perf_counter() - t0,
            lines,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

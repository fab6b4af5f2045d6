"""Run metrics: one JSON line per step per rank, the loss-curve PNG, memory readings."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import torch

from plait.train.tensorboard import TensorBoardWriter


class MetricsWriter:
    """Appends one JSON object per line to `metrics.jsonl` (rank 0) or `metrics-rank<r>.jsonl`;
    with `tensorboard`, rank 0 also writes every record's numbers as TensorBoard scalars."""

    def __init__(self, run_dir: Path, rank: int, tensorboard: bool = False, purge_step: int | None = None):
        name = "metrics.jsonl" if rank == 0 else f"metrics-rank{rank}.jsonl"
        self.path = Path(run_dir) / name
        self._fh = open(self.path, "a", buffering=1)
        self._tb = None
        if tensorboard and rank == 0:
            self._tb = TensorBoardWriter(Path(run_dir) / "tensorboard", purge_step=purge_step)

    def write(self, **record) -> None:
        self._fh.write(json.dumps(record) + "\n")
        if self._tb is not None:
            self._tb.write(record)

    def flush(self) -> None:
        self._fh.flush()
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        self._fh.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: str | Path) -> list[dict]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def peak_memory_bytes(device: torch.device) -> int:
    """Peak device memory on CUDA; on the CPU the process's peak resident set size."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB


def plot_loss_curve(records: list[dict], out: Path, title: str = "", baseline: float | None = None) -> Path:
    """Training loss per step, held-out loss where evaluated, and an optional baseline, to a PNG."""
    # Here, not at the top: the Agg backend must be chosen before pyplot loads, and only plots
    # pay matplotlib's import.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    # sorted: an evaluation island's records land when they are back, after later steps'
    held = sorted((r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1.2)
    if held:
        ax.plot(*zip(*held), "o-", label="held-out loss", lw=1.5)
    if baseline is not None:
        ax.axhline(baseline, color="grey", ls="--", lw=1, label="unigram entropy of the corpus")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out

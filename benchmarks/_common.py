"""Helpers shared by the benchmark scripts: step timing across ranks, data, machine facts, tables.

The scripts in benchmarks/ run as `python benchmarks/<name>.py`, so this directory is on
`sys.path` (also in the ranks that `plait.testing.run_ranks` spawns: spawn hands the parent's
`sys.path` to its children) and they import this file as `_common`.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def timed_step(step: Callable[..., T], *args) -> tuple[float, T]:
    """(seconds this rank spends in `step(*args)`, its result), timed from a barrier of the default group.

    The barrier lines the ranks up, so every rank's clock starts at (nearly) the same moment and
    no skew left over from the previous step (one rank still in its optimizer while the other
    already waits in the next all-reduce) is charged to this one. The barrier itself is not
    timed. Combine the ranks' figures with `max_over_ranks`: a synchronous step ends when its
    slowest rank does.
    """
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    t0 = time.perf_counter()
    result = step(*args)
    return time.perf_counter() - t0, result


def train_step(model, opt, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One plain optimizer step of a model whose forward(x, y) returns the loss."""
    opt.zero_grad(set_to_none=True)
    loss = model(x, y)
    loss.backward()
    opt.step()
    return loss.detach()


def idle() -> None:
    """What a rank times while another runs the one-process reference."""
    return None


def max_over_ranks(values: Sequence[float]) -> list[float]:
    """Element-wise maximum of `values` over the ranks of the default group (identity on one rank)."""
    t = torch.tensor(list(values), dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def mean_over_ranks(values: Sequence[float]) -> list[float]:
    """Element-wise mean of `values` over the ranks of the default group."""
    t = torch.tensor(list(values), dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return t.tolist()


def median_ms(seconds: Sequence[float]) -> float:
    return 1e3 * statistics.median(seconds)


def corpus_batches(
    rows: int, seq_len: int, count: int, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` global batches of `rows` random windows of the embedded pydoc corpus.

    Each is `(x, y)` of shape (rows, seq_len), y being x shifted by one byte. The same seed gives
    the same batches in every process, so each rank can slice its rows out of the global batch.
    """
    from plait.data import load_corpus

    tokens = load_corpus("pydoc").train.long()
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        starts = torch.randint(0, tokens.numel() - seq_len - 1, (rows,), generator=g)
        windows = torch.stack([tokens[s : s + seq_len + 1] for s in starts.tolist()])
        out.append((windows[:, :-1].contiguous(), windows[:, 1:].contiguous()))
    return out


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gib() -> str:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return f"{int(line.split()[1]) / 2**20:.1f} GiB"
    except OSError:
        pass
    return "unknown"


def machine_info() -> dict[str, str]:
    """What a reader needs to judge the figures: date, CPUs, memory, load, versions."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "unknown"
    return {
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "cpu": _cpu_model(),
        "nproc": f"{usable} usable of {os.cpu_count()}",
        "memory": _memory_gib(),
        "load average at start (1, 5, 15 min)": load,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "os": platform.platform(),
    }


def command_line() -> str:
    """The command as typed from the repository root, e.g. `.venv/bin/python benchmarks/ddp.py`."""
    exe = os.path.relpath(sys.executable) if sys.executable.startswith(os.getcwd()) else sys.executable
    return shlex.join([exe, *sys.argv])


def report_preamble(title: str, script: str, info: dict[str, str], runtime_s: float) -> list[str]:
    """The first lines of a results page: its title, the script that wrote it, the command, the
    machine and the run's duration."""
    return [
        f"# {title}",
        "",
        f"Written by `{script}`; every figure below comes from one run of it. See the",
        "script's docstring for the method.",
        "",
        f"- Command: `{command_line()}`",
        *(f"- {k}: {v}" for k, v in info.items()),
        f"- Runtime: {runtime_s:.0f} s",
    ]


def write_report(path: Path, title: str, info: dict[str, str], runtime_s: float, lines: list[str]) -> None:
    """A results page: the preamble (the script is the one running), then `lines`; says where."""
    script = os.path.relpath(os.path.abspath(sys.argv[0]), path.parents[2])
    path.write_text("\n".join([*report_preamble(title, script, info, runtime_s), *lines, ""]))
    print(f"wrote {path.relative_to(path.parents[2])}")


def text_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---:" for _ in headers) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def running_mean(values: list[float], window: int) -> list[float]:
    """The mean of each value and the `window - 1` before it (fewer at the start): a loss curve
    smoothed for plotting."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out

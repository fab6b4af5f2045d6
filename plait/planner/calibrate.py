"""`plait plan --calibrate`: measure this machine and describe it as the cluster `this`.

What is measured, in about 30 s on this 2-core machine when it is quiet, more under load (docs/planner.md,
"Calibration"):

* **Compute per rank.** A large fp32 matmul in every rank at once, each with the threads plait's
  launcher gives it (``cores // ranks``, at least 1), in worlds of 1, 2 and 4 processes: the
  FLOP/s a rank gets when its peers compute too (four ranks on two cores share them).
* **Efficiency.** One process, one thread: the forward and backward of a 2-block GPT at widths
  64 to 512 and micro-batches of 1 and 8 sequences of 128 tokens, its model FLOPs
  (`plait.models.flops`) over the time, as a fraction of the one-thread matmul measured just
  before: the layer's non-GEMM work (norms, softmax, element-wise) and small GEMMs are what make
  narrow models and small micro-batches slower than the matmul. The same again as one of 2 and
  of 4 tensor-parallel ranks computes its share (`probes.tp_rank_model`: narrower GEMMs, whole norms).
* **Collectives.** Each collective plait uses (all-reduce, reduce-scatter, all-gather,
  all-to-all, send/recv), through `plait.comm` over gloo, at a few payloads each: over 2 ranks
  in a world of 2, over 4 in a world of 4, and over pairs of a world of 4 (both pairs at once,
  as tp or dp groups run). Per (op, ranks, world) the α-β model ``t = α + bus_bytes / β``
  (Hockney 1994; bus bytes as `plait.comm.ledger.bus_bytes` counts them) is fitted by least
  squares (`fit_alpha_beta`).
* **Pipeline engine.** A 2-stage `PipelineEngine` of a tiny GPT under each schedule at 4 and 16
  micro-batches: the time per micro-batch the engine adds beyond the compute (`probes.pipeline_probe`).
* **Optimizer.** AdamW steps over 4M fp32 parameters in 32 tensors, one thread, their median
  expressed as the memory bandwidth the cost model's step term assumes.

The result is cached as ``~/.cache/plait/cluster-this.toml`` (``$XDG_CACHE_HOME`` if set), a
cluster file like any other with a ``[calibration]`` table holding what it was measured on
(host, CPU, cores, torch version); a cache whose key differs from this machine's is measured
again, as is any with ``plait plan --calibrate``.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from plait.comm.ledger import bus_bytes
from plait.comm.spawn import run_ranks
from plait.errors import ConfigError
from plait.planner import probes
from plait.planner.cluster_file import read_calibration_key, read_cluster_file
from plait.train.peak import _cpu_model

CALIBRATION_VERSION = 3
"""Bumped when what is measured changes: older caches are measured again."""
WORLDS = (2, 4)


def cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "plait" / "cluster-this.toml"


def machine_key() -> dict:
    """What a calibration is valid for: a change in any of these measures again."""
    return {
        "version": CALIBRATION_VERSION,
        "host": platform.node(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count() or 1,
        "torch": torch.__version__,
    }


def fit_alpha_beta(nbytes, seconds) -> tuple[float, float]:
    """Least-squares fit of ``t = α + n / β`` to (bytes, seconds) points: ``(α s, β bytes/s)``.
    α is kept >= 0 and β finite and positive (a flat or noisy series gets the fastest slope seen)."""
    xs, ys = [float(x) for x in nbytes], [float(y) for y in seconds]
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError("fit_alpha_beta needs at least two (bytes, seconds) points")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    if slope <= 0:  # no bandwidth term visible: the largest message over its time bounds β
        i = max(range(len(xs)), key=lambda k: xs[k])
        slope = ys[i] / xs[i] if xs[i] > 0 and ys[i] > 0 else 1e-12
    alpha = my - slope * mx
    if alpha < 0:  # refit through the origin
        alpha = 0.0
        slope = sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)
    return alpha, 1.0 / slope


def calibrate(quiet: bool = False) -> dict:
    """Measure this machine: the fields of a cluster file (see `plait.planner.cluster_file`)."""
    key = machine_key()
    cores = key["cores"]
    t_start = time.perf_counter()
    bar = probes.Bar(len(probes.WIDTHS) * len(probes.ROWS) * len(probes.TP_SHARES) + 2, quiet=quiet)
    bar.step("matmul, one process")
    peak1 = probes.matmul_flops(1)
    rank_tflops = [(1, round(probes.matmul_flops(probes.threads_per_rank(1, cores)) / 1e12, 6))]
    curve = probes.efficiency_curve(bar=bar)
    whole = [(h, n, e) for h, n, tp, e in curve if tp == 1]
    bar.step("optimizer step")
    opt_bw = probes.optimizer_bandwidth()
    bar.end()
    collectives = []
    for world in WORLDS:
        results = run_ranks(probes.ranks_measure, world, args=(cores, probes.SIZES, probes.REPS), timeout=120)
        rank_tflops.append((world, round(min(r["flops"] for r in results) / 1e12, 6)))
        for (op, n), points in sorted(results[0]["times"].items()):
            alpha, beta = fit_alpha_beta([bus_bytes(op, s, n) for s, _ in points], [t for _, t in points])
            collectives.append(
                {"op": op, "ranks": n, "world": world, "alpha_us": alpha * 1e6, "beta_gbps": beta / 1e9}
            )
    engine = run_ranks(probes.pipeline_probe, 2, args=(probes.PIPELINE_KINDS,), timeout=120)
    pipeline = {k: round(max(r[k] for r in engine) * 1e3, 4) for k in probes.PIPELINE_KINDS}
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    # A rank's peak for MFU is its one-thread matmul; what it gets with peers is rank_tflops.
    return {
        "name": "this",
        "gpus_per_node": 1024,
        "peak_tflops": round(peak1 / 1e12, 6),
        "memory_gb": round(mem_gb, 3),
        "efficiency": whole[-1][2],
        "memory_bw_gbps": round(opt_bw / 1e9, 4),
        "cores": cores,
        "precision": "fp32",
        "rank_tflops": [list(x) for x in rank_tflops],
        "efficiency_curve": [list(x) for x in whole],
        "tp_efficiency": [[h, n, tp, e] for h, n, tp, e in curve if tp > 1],
        "note": f"measured by plait plan --calibrate in {time.perf_counter() - t_start:.0f} s",
        "intra": _summary_link(collectives),
        "inter": _summary_link(collectives),
        "pipeline_overhead_ms": pipeline,
        "collective": collectives,
        "calibration": key | {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")},
    }


def _summary_link(collectives: list[dict]) -> dict:
    """The link class of the whole machine: the 2-rank all-reduce's α-β (what a cluster without
    per-collective figures would use)."""
    ar = next(c for c in collectives if c["op"] == "all_reduce" and c["ranks"] == 2)
    return {"alpha_us": ar["alpha_us"], "beta_gbps": ar["beta_gbps"]}


def to_toml(fields: dict) -> str:
    """A cluster file (the subset of TOML these fields need)."""

    def value(v):
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, list | tuple):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return repr(v)

    lines, tables = [], []
    for k, v in fields.items():
        if isinstance(v, dict):
            tables.append((k, v))
        elif isinstance(v, list) and v and isinstance(v[0], dict):
            for item in v:
                tables.append((f"[{k}]", item))
        else:
            lines.append(f"{k} = {value(v)}")
    for name, table in tables:
        lines += ["", f"[{name}]"] + [f"{k} = {value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


def load_this(recalibrate: bool = False, quiet: bool = False):
    """The `this` cluster: the cache when it matches this machine, else measured (and cached)."""
    path = cache_path()
    if not recalibrate and path.is_file() and read_calibration_key(path) == machine_key():
        try:
            return read_cluster_file(str(path))
        except ConfigError:  # a damaged or hand-edited cache: measure again
            pass
    if not quiet:
        why = "--calibrate" if recalibrate else ("stale cache" if path.is_file() else "no cache")
        sys.stderr.write(f"plait: calibrating this machine ({why}; about a minute), cached in {path}\n")
    fields = calibrate(quiet=quiet)
    write_cache(fields, path)
    return read_cluster_file(str(path))


def write_cache(fields: dict, path: Path | None = None) -> Path:
    path = path or cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(to_toml(fields), encoding="utf-8")
    os.replace(tmp, path)
    return path

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
  of 4 tensor-parallel ranks computes its share (`_tp_rank_model`: narrower GEMMs, whole norms).
* **Collectives.** Each collective plait uses (all-reduce, reduce-scatter, all-gather,
  all-to-all, send/recv), through `plait.comm` over gloo, at a few payloads each: over 2 ranks
  in a world of 2, over 4 in a world of 4, and over pairs of a world of 4 (both pairs at once,
  as tp or dp groups run). Per (op, ranks, world) the α-β model ``t = α + bus_bytes / β``
  (Hockney 1994; bus bytes as `plait.comm.ledger.bus_bytes` counts them) is fitted by least
  squares (`fit_alpha_beta`).
* **Pipeline engine.** A 2-stage `PipelineEngine` of a tiny GPT under each schedule at 4 and 16
  micro-batches: the time per micro-batch the engine adds beyond the compute (`_pipeline_probe`).
* **Optimizer.** AdamW steps over 4M fp32 parameters in 32 tensors, one thread, their median
  expressed as the memory bandwidth the cost model's step term assumes.

The result is cached as ``~/.cache/plait/cluster-this.toml`` (``$XDG_CACHE_HOME`` if set), a
cluster file like any other with a ``[calibration]`` table holding what it was measured on
(host, CPU, cores, torch version); a cache whose key differs from this machine's is measured
again, as is any with ``plait plan --calibrate``.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

CALIBRATION_VERSION = 3
"""Bumped when what is measured changes: older caches are measured again."""
OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "send")
SIZES = (4 * 2**10, 64 * 2**10, 512 * 2**10, 4 * 2**20, 16 * 2**20)
"""Collective payloads in bytes (the full tensor, as the ledger counts it)."""
REPS = 5
WIDTHS = (64, 128, 256, 512)
ROWS = (1, 8)
PROBE_SEQ = 128
"""The efficiency probe: widths x rows of PROBE_SEQ tokens (128 and 1024 tokens per micro-batch)."""
WORLDS = (2, 4)
TP_SHARES = (1, 2, 4)
"""The efficiency probe also runs as one of 2 and 4 tensor-parallel ranks (`_tp_rank_model`)."""


def cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "plait" / "cluster-this.toml"


def machine_key() -> dict:
    """What a calibration is valid for: a change in any of these measures again."""
    from plait.train.peak import _cpu_model

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


def threads_per_rank(world: int, cores: int) -> int:
    """The threads plait's launcher gives each rank (`plait.train.launch`)."""
    return max(1, cores // world)


class _Bar:
    """A one-line progress bar on stderr (nothing when stderr is not a terminal, but the end)."""

    def __init__(self, total: int, quiet: bool = False):
        self.total, self.done, self.quiet = total, 0, quiet
        self.tty = sys.stderr.isatty()

    def step(self, what: str, n: int = 1) -> None:
        self.done = min(self.total, self.done + n)
        if self.quiet or not self.tty:
            return
        filled = round(30 * self.done / self.total)
        sys.stderr.write(f"\rcalibrating [{'#' * filled}{'.' * (30 - filled)}] {what:<40}")
        sys.stderr.flush()

    def end(self) -> None:
        if not self.quiet and self.tty:
            sys.stderr.write("\r" + " " * 90 + "\r")
            sys.stderr.flush()


def _matmul_flops(threads: int, n: int = 768, seconds: float = 0.4) -> float:
    """Median FLOP/s of an n^3 fp32 matmul with `threads` threads over about `seconds` (the
    median, as the step times it is compared with: on a shared machine the best is luck)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
        torch.mm(a, b)
        times, t_end = [], time.perf_counter() + seconds
        while len(times) < 5 or time.perf_counter() < t_end:
            t0 = time.perf_counter()
            torch.mm(a, b)
            times.append(time.perf_counter() - t0)
        return 2.0 * n**3 / statistics.median(times)
    finally:
        torch.set_num_threads(previous)


def _ranks_measure(cores: int, sizes: tuple[int, ...], reps: int) -> dict:
    """In each rank of a gloo world: the concurrent matmul rate, then every op at every size over
    the whole world and (world 4) over pairs. Returns {"flops": f, "times": {(op, n): [(bytes, s)]}}."""
    import torch.distributed as dist

    from plait import comm
    from plait.mesh import Mesh

    world = dist.get_world_size()
    threads = threads_per_rank(world, cores)
    torch.set_num_threads(threads)
    whole = Mesh(dp=world, watchdog=False)
    comm.barrier(whole)
    flops = _matmul_flops(threads)
    rank = dist.get_rank()
    meshes = [(whole, "dp", world)]
    if world == 4:
        meshes.append((Mesh(dp=2, tp=2, watchdog=False), "tp", 2))
    times: dict = {}
    bar = _Bar(sum(len(OPS) - (n != 2) for *_, n in meshes) * len(sizes), quiet=rank != 0)
    for mesh, axis, n in meshes:
        for op in OPS:
            if op == "send" and n != 2:
                continue  # point to point: pairs (pipeline neighbours), one sends, one receives
            points = []
            for size in sizes:
                bar.step(f"{op} over {n} of {world} ranks, {size // 1024} KiB")
                x = torch.ones(size // 4)
                out = torch.empty(size // 4 // n) if op == "reduce_scatter" else torch.empty_like(x)
                src = x[: size // 4 // n] if op == "all_gather" else x
                samples = []
                for r in range(reps + 1):
                    comm.barrier(whole)
                    t0 = time.perf_counter()
                    if op == "all_reduce":
                        comm.all_reduce(x, mesh, axis)
                    elif op == "reduce_scatter":
                        comm.reduce_scatter(out, x, mesh, axis)
                    elif op == "all_gather":
                        comm.all_gather(out, src, mesh, axis)
                    elif op == "all_to_all":
                        comm.all_to_all(out, x, mesh, axis)
                    elif mesh.rank(axis) == 0:
                        comm.send(x, mesh, axis, 1)
                    else:
                        comm.recv(out, mesh, axis, 0)
                    if r:  # the first is a warm-up
                        samples.append(time.perf_counter() - t0)
                worst = torch.tensor(samples, dtype=torch.float64)
                comm.all_reduce(worst, whole, "world", op="max")  # a collective ends with its last rank
                points.append((size, statistics.median(worst.tolist())))
            times[(op, n)] = points
    bar.end()
    return {"flops": flops, "times": times}


PIPELINE_KINDS = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")
PIPE_MICRO = (4, 16)
"""The pipeline probe's micro-batch counts: the slope between them is the per-micro-batch time."""


def _pipeline_probe(kinds: tuple[str, ...]) -> dict:
    """In each rank of a 2-stage pipeline (`plait.pipeline.engine.PipelineEngine`) of a tiny GPT (4
    blocks of width 16 on 8 tokens: next to no FLOPs), the time per micro-batch of each schedule
    (the slope of the step time between PIPE_MICRO micro-batches), less the same rank computing a
    micro-batch of a stage's share (a plain forward + backward of the 2-block GPT, timed here): what
    the engine adds per micro-batch beyond the compute the efficiency probe prices, its
    actions' bookkeeping and point-to-point calls."""
    import torch.distributed as dist

    from plait.mesh import Mesh
    from plait.models import GPT
    from plait.models.gpt import GPTConfig
    from plait.pipeline.engine import PipelineEngine

    torch.set_num_threads(1)
    mesh = Mesh(pp=dist.get_world_size(), watchdog=False)
    tiny = {"vocab_size": 256, "seq_len": 8, "n_head": 2, "d_model": 16}
    x = torch.randint(0, 256, (max(PIPE_MICRO), 8), generator=torch.Generator().manual_seed(0))

    def median_s(fn, reps: int = 7) -> float:
        fn()  # warm-up
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    torch.manual_seed(0)
    stage = GPT(GPTConfig(n_layer=2, **tiny))
    local = median_s(lambda: stage(x[:1], x[:1]).backward())
    out = {}
    for kind in kinds:
        v = 2 if kind in ("interleaved", "zb-v") else 1
        per_m = []
        for m in PIPE_MICRO:
            torch.manual_seed(0)
            engine = PipelineEngine(
                GPT(GPTConfig(n_layer=4, **tiny)),
                mesh,
                lambda groups: torch.optim.SGD(groups, lr=0.0),
                schedule=kind,
                microbatches=m,
                **({"virtual_stages": v} if v > 1 else {}),
            )
            batch = list(zip(x[:m].chunk(m), x[:m].chunk(m), strict=True))

            def step(engine=engine, batch=batch, m=m):
                engine.forward_backward(batch, 1.0 / (8 * m))
                engine.zero_grad(set_to_none=True)

            per_m.append(median_s(step))
            engine.close()
        out[kind] = max(0.0, (per_m[1] - per_m[0]) / (PIPE_MICRO[1] - PIPE_MICRO[0]) - local)
    return out


def _tp_rank_model(cfg, tp: int):
    """plait's GPT as one of `tp` tensor-parallel ranks computes it, without the collectives:
    q/k/v and the MLP's first layer split by columns (whole heads), the two output projections by
    rows, the tied embedding and head by vocabulary rows (Megatron-LM §3); the norms whole."""
    from torch import nn

    from plait.models import GPT

    model = GPT(dataclasses.replace(cfg, vocab_size=cfg.vocab_size // tp))
    h, f, bias = cfg.d_model, cfg.ff_dim, cfg.bias
    if tp > 1:
        for block in model.blocks:
            block.attn.qkv = nn.Linear(h, 3 * h // tp, bias=bias)
            block.attn.proj = nn.Linear(h // tp, h, bias=bias)
            block.mlp.fc = nn.Linear(h, f // tp, bias=bias)
            block.mlp.proj = nn.Linear(f // tp, h, bias=bias)
    return model


def _efficiency_curve(widths=WIDTHS, rows=ROWS, shares=TP_SHARES, bar: _Bar | None = None) -> list:
    """[(d_model, tokens per micro-batch, tp, efficiency)]: a 2-block GPT's forward + backward
    at sequence `PROBE_SEQ`, one thread, as one of `tp` tensor-parallel ranks computes it
    (`_tp_rank_model`; tp 1: the whole model): its share of the model FLOPs per second over the
    matmul's measured just before (the median of three such ratios, each pair measured moments
    apart)."""
    from plait.models.flops import gpt_train_flops_per_token
    from plait.models.gpt import GPTConfig

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    out = []
    try:
        for h in widths:
            cfg = GPTConfig(vocab_size=256, seq_len=PROBE_SEQ, n_layer=2, n_head=max(4, h // 32), d_model=h)
            for tp in shares:
                torch.manual_seed(0)
                model = _tp_rank_model(cfg, tp)
                for r in rows:
                    x = torch.randint(0, 256 // tp, (r, PROBE_SEQ))
                    flops = gpt_train_flops_per_token(cfg) * r * PROBE_SEQ / tp
                    model(x, x).backward()  # warm-up
                    ratios = []
                    for _ in range(3):  # pairs taken moments apart: the load of the moment cancels
                        peak = _matmul_flops(1, seconds=0.1)
                        t0 = time.perf_counter()
                        model(x, x).backward()
                        ratios.append(flops / (time.perf_counter() - t0) / peak)
                    model.zero_grad(set_to_none=True)
                    out.append((h, r * PROBE_SEQ, tp, round(min(1.0, statistics.median(ratios)), 4)))
                    if bar:
                        bar.step(f"GPT efficiency, d_model {h}, tp {tp}, {r * PROBE_SEQ} tokens")
    finally:
        torch.set_num_threads(previous)
    return out


def _optimizer_bandwidth(elems: int = 2**22, tensors: int = 32, reps: int = 7) -> float:
    """AdamW's step over `elems` fp32 parameters in `tensors` tensors (a model's step walks many),
    one thread as a rank on a full node has, as the bytes/s the cost model's step term uses
    (2 x (param + grad + state) bytes per parameter: read and write): the median of `reps` steps
    after two warm-ups (a single timed step varied 100x between calibrations on a shared machine)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        params = [torch.nn.Parameter(torch.zeros(elems // tensors)) for _ in range(tensors)]
        for p in params:
            p.grad = torch.ones_like(p)
        opt = torch.optim.AdamW(params, lr=1e-3)
        times = []
        for i in range(reps + 2):
            t0 = time.perf_counter()
            opt.step()
            if i >= 2:
                times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(previous)
    return 2 * elems * (4 + 4 + 8) / statistics.median(times)


def calibrate(quiet: bool = False) -> dict:
    """Measure this machine: the fields of a cluster file (see `plait.planner.cluster`)."""
    from plait.testing import run_ranks

    key = machine_key()
    cores = key["cores"]
    t_start = time.perf_counter()
    bar = _Bar(len(WIDTHS) * len(ROWS) * len(TP_SHARES) + 2, quiet=quiet)
    bar.step("matmul, one process")
    peak1 = _matmul_flops(1)
    rank_tflops = [(1, round(_matmul_flops(threads_per_rank(1, cores)) / 1e12, 6))]
    curve = _efficiency_curve(bar=bar)
    whole = [(h, n, e) for h, n, tp, e in curve if tp == 1]
    bar.step("optimizer step")
    opt_bw = _optimizer_bandwidth()
    bar.end()
    collectives = []
    for world in WORLDS:
        results = run_ranks(_ranks_measure, world, args=(cores, SIZES, REPS), timeout=120)
        rank_tflops.append((world, round(min(r["flops"] for r in results) / 1e12, 6)))
        for (op, n), points in sorted(results[0]["times"].items()):
            alpha, beta = fit_alpha_beta([_bus(op, s, n) for s, _ in points], [t for _, t in points])
            collectives.append(
                {"op": op, "ranks": n, "world": world, "alpha_us": alpha * 1e6, "beta_gbps": beta / 1e9}
            )
    probes = run_ranks(_pipeline_probe, 2, args=(PIPELINE_KINDS,), timeout=120)
    pipeline = {k: round(max(r[k] for r in probes) * 1e3, 4) for k in PIPELINE_KINDS}
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


def _bus(op: str, payload: int, n: int) -> float:
    from plait.comm.ledger import bus_bytes

    return bus_bytes(op, payload, n)


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
    from plait.errors import ConfigError
    from plait.planner.cluster import load_cluster, read_calibration_key

    path = cache_path()
    if not recalibrate and path.is_file() and read_calibration_key(path) == machine_key():
        try:
            return load_cluster(str(path))
        except ConfigError:  # a damaged or hand-edited cache: measure again
            pass
    if not quiet:
        why = "--calibrate" if recalibrate else ("stale cache" if path.is_file() else "no cache")
        sys.stderr.write(f"plait: calibrating this machine ({why}; about a minute), cached in {path}\n")
    fields = calibrate(quiet=quiet)
    write_cache(fields, path)
    return load_cluster(str(path))


def write_cache(fields: dict, path: Path | None = None) -> Path:
    path = path or cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(to_toml(fields), encoding="utf-8")
    os.replace(tmp, path)
    return path

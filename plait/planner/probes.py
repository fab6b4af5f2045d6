"""The measurements behind `plait plan --calibrate` (`plait.planner.calibrate` runs them, fits
them and writes the cluster file): the matmul rate, the GPT efficiency probe (whole and as one of
tp ranks), the collectives in gloo worlds, the pipeline engine's own time, the optimizer step.
docs/planner.md, "Calibration", says what each measures and why."""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from plait import comm
from plait.apply import parallelize
from plait.layout import Layout
from plait.mesh import Mesh
from plait.models import GPT
from plait.models.flops import gpt_train_flops_per_token
from plait.models.gpt import GPTConfig

OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "send")
SIZES = (4 * 2**10, 64 * 2**10, 512 * 2**10, 4 * 2**20, 16 * 2**20)
"""Collective payloads in bytes (the full tensor, as the ledger counts it)."""
REPS = 5
WIDTHS = (64, 128, 256, 512)
ROWS = (1, 8)
PROBE_SEQ = 128
"""The efficiency probe: widths x rows of PROBE_SEQ tokens (128 and 1024 tokens per micro-batch)."""
TP_SHARES = (1, 2, 4)
"""The efficiency probe also runs as one of 2 and 4 tensor-parallel ranks (`tp_rank_model`)."""


def median_s(fn, reps: int = 7, warmup: int = 1) -> float:
    """The median seconds of `reps` calls of `fn` after `warmup` untimed ones (on a shared machine
    the best of a series is luck; the step times the figures are compared with are medians too)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def threads_per_rank(world: int, cores: int) -> int:
    """The threads plait's launcher gives each rank (`plait.train.launch`)."""
    return max(1, cores // world)


class Bar:
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


def matmul_flops(threads: int, n: int = 768, seconds: float = 0.4) -> float:
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


def ranks_measure(cores: int, sizes: tuple[int, ...], reps: int) -> dict:
    """In each rank of a gloo world: the concurrent matmul rate, then every op at every size over
    the whole world and (world 4) over pairs. Returns {"flops": f, "times": {(op, n): [(bytes, s)]}}."""
    world = dist.get_world_size()
    threads = threads_per_rank(world, cores)
    torch.set_num_threads(threads)
    whole = Mesh(dp=world, watchdog=False)
    comm.barrier(whole)
    flops = matmul_flops(threads)
    rank = dist.get_rank()
    meshes = [(whole, "dp", world)]
    if world == 4:
        meshes.append((Mesh(dp=2, tp=2, watchdog=False), "tp", 2))
    times: dict = {}
    bar = Bar(sum(len(OPS) - (n != 2) for *_, n in meshes) * len(sizes), quiet=rank != 0)
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


def pipeline_probe(kinds: tuple[str, ...]) -> dict:
    """In each rank of a 2-stage pipeline (`plait.pipeline.engine.PipelineEngine`) of a tiny GPT (4
    blocks of width 16 on 8 tokens: next to no FLOPs), the time per micro-batch of each schedule
    (the slope of the step time between PIPE_MICRO micro-batches), less the same rank computing a
    micro-batch of a stage's share (a plain forward + backward of the 2-block GPT, timed here): what
    the engine adds per micro-batch beyond the compute the efficiency probe prices, its
    actions' bookkeeping and point-to-point calls."""
    torch.set_num_threads(1)
    mesh = Mesh(pp=dist.get_world_size(), watchdog=False)
    tiny = {"vocab_size": 256, "seq_len": 8, "n_head": 2, "d_model": 16}
    x = torch.randint(0, 256, (max(PIPE_MICRO), 8), generator=torch.Generator().manual_seed(0))

    torch.manual_seed(0)
    stage = GPT(GPTConfig(n_layer=2, **tiny))
    local = median_s(lambda: stage(x[:1], x[:1]).backward())
    out = {}
    for kind in kinds:
        v = 2 if kind in ("interleaved", "zb-v") else 1
        per_m = []
        for m in PIPE_MICRO:
            torch.manual_seed(0)
            engine = parallelize(
                GPT(GPTConfig(n_layer=4, **tiny)),
                Layout(**mesh.sizes, schedule=kind, microbatches=m, virtual_stages=v),
                mesh,
                lambda groups: torch.optim.SGD(groups, lr=0.0),
            )
            batch = list(zip(x[:m].chunk(m), x[:m].chunk(m), strict=True))

            def step(engine=engine, batch=batch, m=m):
                engine.forward_backward(batch, 1.0 / (8 * m))
                engine.zero_grad(set_to_none=True)

            per_m.append(median_s(step))
            engine.close()
        out[kind] = max(0.0, (per_m[1] - per_m[0]) / (PIPE_MICRO[1] - PIPE_MICRO[0]) - local)
    return out


def tp_rank_model(cfg, tp: int):
    """plait's GPT as one of `tp` tensor-parallel ranks computes it, without the collectives:
    q/k/v and the MLP's first layer split by columns (whole heads), the two output projections by
    rows, the tied embedding and head by vocabulary rows (Megatron-LM §3); the norms whole."""
    model = GPT(dataclasses.replace(cfg, vocab_size=cfg.vocab_size // tp))
    h, f, bias = cfg.d_model, cfg.ff_dim, cfg.bias
    if tp > 1:
        for block in model.blocks:
            block.attn.qkv = nn.Linear(h, 3 * h // tp, bias=bias)
            block.attn.proj = nn.Linear(h // tp, h, bias=bias)
            block.mlp.fc = nn.Linear(h, f // tp, bias=bias)
            block.mlp.proj = nn.Linear(f // tp, h, bias=bias)
    return model


def efficiency_curve(widths=WIDTHS, rows=ROWS, shares=TP_SHARES, bar: Bar | None = None) -> list:
    """[(d_model, tokens per micro-batch, tp, efficiency)]: a 2-block GPT's forward + backward
    at sequence `PROBE_SEQ`, one thread, as one of `tp` tensor-parallel ranks computes it
    (`tp_rank_model`; tp 1: the whole model): its share of the model FLOPs per second over the
    matmul's measured just before (the median of three such ratios, each pair measured moments
    apart)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    out = []
    try:
        for h in widths:
            cfg = GPTConfig(vocab_size=256, seq_len=PROBE_SEQ, n_layer=2, n_head=max(4, h // 32), d_model=h)
            for tp in shares:
                torch.manual_seed(0)
                model = tp_rank_model(cfg, tp)
                for r in rows:
                    x = torch.randint(0, 256 // tp, (r, PROBE_SEQ))
                    flops = gpt_train_flops_per_token(cfg) * r * PROBE_SEQ / tp
                    model(x, x).backward()  # warm-up
                    ratios = []
                    for _ in range(3):  # pairs taken moments apart: the load of the moment cancels
                        peak = matmul_flops(1, seconds=0.1)
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


def optimizer_bandwidth(elems: int = 2**22, tensors: int = 32, reps: int = 7) -> float:
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
        seconds = median_s(opt.step, reps, warmup=2)
    finally:
        torch.set_num_threads(previous)
    return 2 * elems * (4 + 4 + 8) / seconds

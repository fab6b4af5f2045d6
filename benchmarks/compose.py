"""plait ZeRO-3 over tensor parallelism (dp 2 x tp 2) vs torch FSDP2 over DTensor tensor parallelism.

What is measured (one job of 4 gloo ranks on the CPU, one compute thread per rank):

* **Setups.** Two replicas of the same GPT (`plait.models.gpt_config`, default "small": 4
  layers, 4 heads, d_model 128, vocabulary 256, embedding and head tied) start from the same
  initialisation and train on the same batches, each with its own AdamW (fp32, ``fused=True``
  as in zero.py, the same two parameter groups from `plait.optim.param_groups`: matrices
  decayed, vectors not) and global-norm clipping at 1.0:

  - ``plait``: ``Mesh(dp=2, tp=2)``; `plait.tensor_parallel.apply_tp(model, mesh)` (Megatron-LM:
    qkv and mlp.fc column-parallel, attn.proj and mlp.proj row-parallel, vocabulary-parallel
    embedding, tied head and vocabulary-parallel cross-entropy), then
    `plait.zero.wrap(model, mesh, 3, ...)` (ZeRO-3 over dp of the tp-local parameters; one unit
    per transformer block, the root unit holding the rest).
  - ``torch``: ``init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))``; the tensor-
    parallel plan of `benchmarks/tp.py` applied with `parallelize_module` on ``mesh["tp"]``
    (``ColwiseParallel`` for attn.qkv and mlp.fc, ``RowwiseParallel`` for attn.proj and
    mlp.proj, ``RowwiseParallel(input_layouts=Replicate())`` for the token embedding,
    ``ColwiseParallel(output_layouts=Shard(-1))`` for the head, tied back to the embedding,
    and the cross-entropy under ``loss_parallel()``: vocabulary-parallel like plait's); then
    `torch.distributed.fsdp.fully_shard` on ``mesh["dp"]``: each transformer block, then the
    root (the order of torchtitan's parallelize functions: tp first, then FSDP bottom-up).
    ``reshard_after_forward=True`` everywhere, the root included (torch's default keeps the
    root's parameters gathered between forward and backward; plait's ZeRO-3 frees every unit),
    so both gather every parameter twice per step: ZeRO-3's 3Ψ.
    plait's attention computes ``[q | k | v]`` with one Linear, so the torch replica gets its
    qkv rows permuted to ``[q_0 k_0 v_0 | q_1 k_1 v_1]`` first (see tp.py): the function
    computed is unchanged, so both setups start from the same model.
    Clipping: torch 2.13's `torch.nn.utils.clip_grad_norm_` fails here (gradients on two
    meshes), so the torch setup uses torch's `get_total_norm` per mesh
    (`clip_grad_norm_mixed_meshes`).

  With ``--sequence-parallel`` both add sequence parallelism (plait ``sequence_parallel=True``;
  torch the ``SequenceParallel`` plan of tp.py).

* **Data.** ``_common.corpus_batches``: global batches of ``2 x --batch`` rows; dp rank r takes
  rows ``[r·b, (r+1)·b)``, both tp ranks of a dp rank the same rows. Every rank's loss is the
  mean over its rows; the loss reported is the mean over the ranks (= over dp).

* **Step.** zero_grad + forward + backward + clip_grad_norm_(1.0) + AdamW step. Steps of the two
  setups are interleaved, the order alternating every step, so both see the same machine state;
  every step starts from a barrier, its time is the maximum over the 4 ranks
  (`_common.timed_step`), and the first ``--warmup`` steps are not counted. Figures are medians.
  Each rank also notes its own time per phase (forward, backward, clip, optimizer step; no
  barrier between them, so a phase includes waiting in its collectives).
  Four ranks on two cores are oversubscribed: the times are indicative only, the ratio (both
  setups suffer alike) is the figure to read.

* **Bytes.** plait's ledger (`mesh.ledger`) records every collective, per step, op and axis, as
  ring bus bytes. Formulas (fp32): ZeRO-3 moves 3Ψ·(dp-1)/dp over dp per step (all-gather in
  forward, all-gather in backward, reduce-scatter of the gradients), Ψ = the tp-local parameters
  of a rank (what ZeRO shards; its flat buffers are padded to a multiple of dp); tensor
  parallelism moves 8·b·s·h·(t-1)/t per layer (2 all-reduces forward, 2 backward), plus the
  embedding, the head's input gradient and the vocabulary-parallel loss (`tp.formula_bytes`).
  torch's collectives over one step are sized by wrapping `dist.all_gather_single` /
  `dist.reduce_scatter_single` / `dist.all_reduce` (FSDP2's calls) and by a dispatch mode over
  the functional collectives DTensor issues (tensor parallelism, the norm), both priced with the
  same ring factors as plait's ledger.

* **Memory.** Model-state bytes per rank at the end of a step (before the next zero_grad):
  plait's `engine.memory()` (counted from tensor storage) and, for torch, the local storage of
  the sharded parameters, their gradients and AdamW's state. Peak memory is not measured: both
  setups live in the same processes (interleaved steps), and the CPU allocator keeps no peak
  counter per setup.

Run from the repository root:  .venv/bin/python benchmarks/compose.py [--model small]
[--batch 4] [--seq-len 128] [--steps 30] [--warmup 3] [--sequence-parallel] [--quick]. Prints
the table and writes benchmarks/results/compose.md and compose.json (not with --quick, unless
--out is given).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from _common import (
    command_line,
    corpus_batches,
    machine_info,
    markdown_table,
    max_over_ranks,
    mean_over_ranks,
    median_ms,
    text_table,
    timed_step,
)
from tp import _model, formula_bytes, torch_tp_model

from plait.comm.ledger import bus_bytes
from plait.models import gpt_config
from plait.testing import run_ranks

DP, TP = 2, 2
WORLD = DP * TP
SEED = 0
N_BATCHES = 4  # distinct global batches, cycled
LR, WEIGHT_DECAY, CLIP = 1e-3, 0.1, 1.0
SETUPS = ("plait", "torch")
RESULTS = Path(__file__).resolve().parent / "results" / "compose.md"


def _adamw(groups) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)


# --- torch: sizing its collectives ----------------------------------------------------------------


class TorchCommCounter:
    """Bus bytes of the collectives torch issues inside the `with` block, by (op, mesh axis).

    FSDP2 calls `dist.all_gather_single` / `dist.reduce_scatter_single` (and `dist.all_reduce`),
    which are wrapped for the block; DTensor issues functional collectives
    (`torch.ops._c10d_functional.*`), which a dispatch mode sees. `axis_of` maps a process
    group's name to the mesh axis it spans.
    """

    def __init__(self, axis_of: dict[str, str]) -> None:
        self.axis_of = axis_of
        self.rows: dict[tuple[str, str], list[float]] = {}  # (op, axis) -> [count, bus bytes]

    def _add(self, op: str, group_name: str, payload: int, n: int) -> None:
        row = self.rows.setdefault((op, self.axis_of.get(group_name, group_name)), [0, 0.0])
        row[0] += 1
        row[1] += bus_bytes(op, payload, n)

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        def size_of(t: torch.Tensor) -> int:
            return t.numel() * t.element_size()

        def group_size(name: str) -> int:
            return dist.distributed_c10d._resolve_process_group(name).size()

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                from torch.distributed.tensor import DTensor

                if any(t is DTensor for t in types):
                    # let DTensor run first and desugar into the collectives this mode then sees
                    # (a mode runs before subclasses; CommDebugMode does the same)
                    return NotImplemented
                namespace, _, op = str(getattr(func, "overloadpacket", "")).partition(".")
                if namespace in ("_c10d_functional", "_c10d_functional_autograd"):
                    if op in ("all_reduce", "all_reduce_"):  # (input, reduce_op, group_name)
                        counter._add("all_reduce", args[2], size_of(args[0]), group_size(args[2]))
                    elif op == "all_gather_into_tensor":  # (input, group_size, group_name)
                        counter._add("all_gather", args[2], size_of(args[0]) * args[1], args[1])
                    elif op == "reduce_scatter_tensor":  # (input, reduce_op, group_size, group_name)
                        counter._add("reduce_scatter", args[3], size_of(args[0]), args[2])
                    elif op == "all_to_all_single":  # (input, out_splits, in_splits, group_name)
                        counter._add("all_to_all", args[3], size_of(args[0]), group_size(args[3]))
                    elif op not in ("wait_tensor", "_wrap_tensor_autograd"):
                        counter._add(f"{op} (not sized)", "?", 0, 1)
                return func(*args, **(kwargs or {}))

        self._saved = {
            k: getattr(dist, k) for k in ("all_gather_single", "reduce_scatter_single", "all_reduce")
        }
        saved = self._saved

        def all_gather_single(output_tensor, input_tensor, group=None, async_op=False):
            counter._add("all_gather", group.group_name, size_of(output_tensor), group.size())
            return saved["all_gather_single"](output_tensor, input_tensor, group=group, async_op=async_op)

        def reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
            counter._add("reduce_scatter", group.group_name, size_of(input), group.size())
            return saved["reduce_scatter_single"](output, input, op=op, group=group, async_op=async_op)

        def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            g = group if group is not None else dist.group.WORLD
            counter._add("all_reduce", g.group_name, size_of(tensor), g.size())
            return saved["all_reduce"](tensor, op=op, group=group, async_op=async_op)

        dist.all_gather_single = all_gather_single
        dist.reduce_scatter_single = reduce_scatter_single
        dist.all_reduce = all_reduce
        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        for k, v in self._saved.items():
            setattr(dist, k, v)
        return False


# --- the two setups -------------------------------------------------------------------------------


def build_torch(name: str, device_mesh, sequence_parallel: bool):
    """(model, optimizer) of the torch setup: DTensor tp on mesh["tp"], then FSDP2 on mesh["dp"]."""
    from torch.distributed.fsdp import fully_shard

    from plait.optim import param_groups

    model = torch_tp_model(name, device_mesh["tp"], sequence_parallel)
    for block in model.blocks:
        fully_shard(block, mesh=device_mesh["dp"], reshard_after_forward=True)
    fully_shard(model, mesh=device_mesh["dp"], reshard_after_forward=True)
    return model, _adamw(param_groups(model, WEIGHT_DECAY))


def clip_grad_norm_mixed_meshes(parameters, max_norm: float) -> float:
    """torch's clip_grad_norm_ for gradients on more than one DeviceMesh; returns the norm before.

    Under FSDP2 over DTensor tp, the parameters tp splits or replicates live on the 2-D (dp, tp)
    mesh and the others (LayerNorms, the position embedding without SP) on the 1-D dp mesh, and
    `torch.nn.utils.clip_grad_norm_` fails in torch 2.13 ("All operands in aten.stack.default
    must have the same mesh": pytorch/pytorch#180346). So: torch's `get_total_norm` per mesh
    (each a DTensor reduced with `full_tensor`), combined, and torch's factor
    min(1, max_norm / (norm + 1e-6)) applied per mesh.
    """
    from torch.distributed.tensor import DTensor

    by_mesh: dict = {}
    for p in parameters:
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p.grad)
    squares = 0.0
    for grads in by_mesh.values():
        n = torch.nn.utils.get_total_norm(grads, foreach=True)
        squares += float(n.full_tensor() if isinstance(n, DTensor) else n) ** 2
    norm = squares**0.5
    coef = min(1.0, max_norm / (norm + 1e-6))
    if coef < 1.0:
        for grads in by_mesh.values():
            torch._foreach_mul_(grads, coef)
    return norm


PHASES = ("zero_grad + forward", "backward", "clip", "optimizer step")


def _phases(t: list[float]) -> list[float]:
    """Seconds between consecutive time stamps: one per entry of PHASES."""
    return [b - a for a, b in zip(t, t[1:])]


def torch_step(model, opt):
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    def step(x, y):
        t = [time.perf_counter()]
        opt.zero_grad(set_to_none=True)
        with loss_parallel():
            loss = model(x, y)
            t.append(time.perf_counter())
            loss.backward()
        t.append(time.perf_counter())
        norm = clip_grad_norm_mixed_meshes(model.parameters(), CLIP)
        t.append(time.perf_counter())
        opt.step()
        t.append(time.perf_counter())
        loss = loss.detach()
        return (loss.to_local() if isinstance(loss, DTensor) else loss), norm, _phases(t)

    return step


def build_plait(name: str, mesh, sequence_parallel: bool):
    from plait.optim import param_groups
    from plait.tensor_parallel import apply_tp, sequence_parallel_params
    from plait.zero import wrap

    model = apply_tp(_model(name), mesh, sequence_parallel=sequence_parallel)
    psi = sum(p.numel() for p in model.parameters())  # tp-local, tied once: what ZeRO shards
    sp_params = sum(p.numel() for p in sequence_parallel_params(model)) if sequence_parallel else 0
    engine = wrap(model, mesh, 3, _adamw, param_groups=param_groups(model, WEIGHT_DECAY))
    return engine, psi, sp_params


def plait_step(engine):
    def step(x, y):
        t = [time.perf_counter()]
        engine.zero_grad()
        loss = engine.module(x, y)
        t.append(time.perf_counter())
        loss.backward()
        t.append(time.perf_counter())
        norm = engine.clip_grad_norm_(CLIP)
        t.append(time.perf_counter())
        engine.step()
        t.append(time.perf_counter())
        return loss.detach(), float(norm), _phases(t)

    return step


def torch_memory(model, opt) -> dict:
    """Model-state bytes of this rank, from the local storage of the sharded tensors."""
    from torch.distributed.tensor import DTensor

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    def nbytes(ts):
        seen, total = set(), 0
        for t in ts:
            t = local(t)
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
        return total

    params = list(model.parameters())
    p = nbytes(params)
    g = nbytes([q.grad for q in params if q.grad is not None])
    o = nbytes([v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.numel() > 1])
    return {"params": p, "grads": g, "optimizer": o, "total": p + g + o}


PARTS = ("zero3", "tp", "other")


def by_part(rows: dict[str, float]) -> dict[str, float]:
    """Bus bytes of one step split into ZeRO-3's dp collectives, tp's, and the rest."""
    out = dict.fromkeys(PARTS, 0.0)
    for key, v in rows.items():
        op, axis = key.split(" ", 1)
        if axis == "dp" and op in ("all_gather", "reduce_scatter"):
            out["zero3"] += v
        else:
            out["tp" if axis == "tp" else "other"] += v
    return out


def _over_ranks(parts: dict[str, float]) -> dict[str, dict[str, float]]:
    """{part: {"mean", "min", "max"} over the ranks} of this rank's bytes by part."""
    values = [parts[k] for k in PARTS]
    mean, hi = mean_over_ranks(values), max_over_ranks(values)
    lo = [-x for x in max_over_ranks([-v for v in values])]
    return {k: {"mean": mean[i], "min": lo[i], "max": hi[i]} for i, k in enumerate(PARTS)}


# --- the job --------------------------------------------------------------------------------------


def compose_job(name: str, rows: int, seq_len: int, steps: int, warmup: int, sp: bool) -> dict:
    """On each of the 4 ranks: build both setups, train them step by step in alternating order."""
    from torch.distributed.device_mesh import init_device_mesh

    from plait.mesh import Mesh

    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    # DTensor logs, on every rank, that reducing the 2-D norm takes two all-reduces (see Notes)
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    mesh = Mesh(dp=DP, tp=TP)
    dmesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    r = mesh.rank("dp")
    assert dmesh["dp"].get_local_rank() == r and dmesh["tp"].get_local_rank() == mesh.rank("tp")
    batches = corpus_batches(DP * rows, seq_len, N_BATCHES, SEED)
    mine = [(x[r * rows : (r + 1) * rows], y[r * rows : (r + 1) * rows]) for x, y in batches]

    engine, psi, sp_params = build_plait(name, mesh, sp)
    tmodel, topt = build_torch(name, dmesh, sp)
    run = {"plait": plait_step(engine), "torch": torch_step(tmodel, topt)}
    axis_of = {dmesh["dp"].get_group().group_name: "dp", dmesh["tp"].get_group().group_name: "tp"}
    axis_of[dist.group.WORLD.group_name] = "world"
    times = {k: [] for k in SETUPS}
    losses = {k: [] for k in SETUPS}
    norms = {k: [] for k in SETUPS}
    phase_times = {k: [] for k in SETUPS}  # per measured step, this rank's seconds per phase
    torch_comms = None
    total = warmup + steps
    count_at = max(warmup - 1, 0)  # torch's collectives are sized on the last warm-up step
    for i in range(total):
        x, y = mine[i % len(mine)]
        for k in SETUPS if i % 2 == 0 else SETUPS[::-1]:
            if k == "plait":
                mesh.ledger.set_step(i)
                seconds, (loss, norm, phases) = timed_step(run[k], x, y)
            elif i == count_at:
                counter = TorchCommCounter(axis_of)
                with counter:
                    seconds, (loss, norm, phases) = timed_step(run[k], x, y)
                torch_comms = {f"{op} {axis}": v for (op, axis), v in counter.rows.items()}
            else:
                seconds, (loss, norm, phases) = timed_step(run[k], x, y)
            losses[k].append(float(loss))
            norms[k].append(norm)
            if i >= warmup:
                times[k].append(seconds)
                phase_times[k].append(phases)
    dist.barrier()
    memory = {"plait": engine.memory(), "torch": torch_memory(tmodel, topt)}
    per_step = [mesh.ledger.rows(i) for i in range(warmup, total)]
    ledger = {
        "bus_bytes": [{f"{op} {axis}": row.bus_bytes for (op, axis), row in s.items()} for s in per_step],
        "ops": {f"{op} {axis}": (row.count, row.bus_bytes) for (op, axis), row in per_step[-1].items()},
    }
    plait_parts = [by_part(rows) for rows in ledger["bus_bytes"]]
    torch_parts = by_part({k: v[1] for k, v in torch_comms.items()})
    result = {
        # bytes by part, over the ranks (with SP a rank's ZeRO shard decides how much it sums over tp)
        "plait_bytes": _over_ranks(plait_parts[-1]),
        "torch_bytes": _over_ranks(torch_parts),
        "plait_steps_equal": max_over_ranks([float(any(p != plait_parts[0] for p in plait_parts))])[0] == 0,
        "times": {k: max_over_ranks(v) for k, v in times.items()},
        # per phase: the median over the measured steps of the maximum over the ranks
        "phases_ms": {
            k: [median_ms(max_over_ranks([p[j] for p in v])) for j in range(len(PHASES))]
            for k, v in phase_times.items()
        },
        "losses": {k: mean_over_ranks(v) for k, v in losses.items()},
        "norms": {k: v for k, v in norms.items()},  # identical on every rank
        "psi": psi,
        "sp_params": sp_params,
        "ledger": ledger,
        "torch_comms": torch_comms,
        "memory": memory,
        "torch_params": sum(p.numel() for p in tmodel.parameters()),
    }
    engine.close()
    mesh.close()
    return result


# --- results --------------------------------------------------------------------------------------


def formulas(psi: int, cfg, b: int, s: int, sp_params: int) -> dict[str, float]:
    """Bus bytes per step (fp32, ring) of ZeRO-3 over dp and of tp, by the papers' formulas."""
    tp = formula_bytes(cfg, b, s, TP)
    parts = {"zero3": 3 * psi * (DP - 1) / DP * 4, "tp": sum(tp.values())}
    # sequence parallelism: ZeRO-3 sums over tp only its shard of the partial gradients
    parts["sp"] = 2 * (sp_params / DP) * (TP - 1) / TP * 4
    return parts


def measure(name: str, rows: int, seq_len: int, steps: int, warmup: int, sp: bool, timeout: float) -> dict:
    r = run_ranks(compose_job, WORLD, args=(name, rows, seq_len, steps, warmup, sp), timeout=timeout)[0]
    times, losses, norms = r["times"], r["losses"], r["norms"]
    med = {k: median_ms(v) for k, v in times.items()}
    cfg = gpt_config(name)
    return {
        **r,
        "model": name,
        "params": cfg.n_params(),
        "shape": (rows, seq_len),
        "sp": sp,
        "median_ms": med,
        "ratio": med["plait"] / med["torch"],
        # the two setups' steps i ran moments apart: their ratio cancels slow drifts of the load
        "paired_ratio": statistics.median(a / b for a, b in zip(times["plait"], times["torch"])),
        "spread": {k: (1e3 * min(v), 1e3 * max(v)) for k, v in times.items()},
        "loss_diff": max(abs(a - b) for a, b in zip(losses["plait"], losses["torch"])),
        "norm_rel_diff": max(abs(a - b) / b for a, b in zip(norms["plait"], norms["torch"])),
        "formula": formulas(r["psi"], cfg, rows, seq_len, r["sp_params"]),
    }


def _mib(x: float) -> str:
    return f"{x / 2**20:.2f}"


def _mb(x: float) -> str:
    return f"{x / 1e6:.3f}"


HEADERS = [
    "setup",
    "median ms",
    "min-max ms",
    "plait/torch",
    "first loss",
    "last loss",
    "model state MiB/rank",
]
DESCRIPTION = {
    "plait": "plait apply_tp + zero.wrap(stage 3)",
    "torch": "torch parallelize_module + fully_shard",
}


def table_rows(r: dict) -> list[list[str]]:
    out = []
    for k in SETUPS:
        lo, hi = r["spread"][k]
        out.append([
            DESCRIPTION[k] + (" (SP)" if r["sp"] else ""), f"{r['median_ms'][k]:.0f}", f"{lo:.0f}-{hi:.0f}",
            f"{r['ratio']:.3f}" if k == "plait" else "", f"{r['losses'][k][0]:.6f}",
            f"{r['losses'][k][-1]:.6f}", _mib(r["memory"][k]["total"]),
        ])  # fmt: skip
    return out


BYTES_HEADERS = ["part", "formula MB", "plait ledger MB", "plait - formula (B)", "torch MB"]


def _cell(b: dict[str, float]) -> str:
    """Mean over the ranks, and the range when the ranks differ."""
    if b["min"] == b["max"]:
        return _mb(b["mean"])
    return f"{_mb(b['mean'])} ({_mb(b['min'])}-{_mb(b['max'])})"


def bytes_rows(r: dict) -> list[list[str]]:
    f, mine, theirs = r["formula"], r["plait_bytes"], r["torch_bytes"]
    expected = {"zero3": f["zero3"], "tp": f["tp"] + f["sp"], "other": 0.0}
    labels = {
        "zero3": "ZeRO-3 over dp: 3Ψ·(dp-1)/dp, Ψ = tp-local params",
        "tp": "tp: 8·b·s·h·(t-1)/t per layer + embedding, head, loss"
        + (" + 1/dp of the SP grads" if r["sp"] else ""),
        "other": "other (gradient-norm scalars over dp)",
    }
    rows = [
        [
            labels[k],
            _mb(expected[k]),
            _cell(mine[k]),
            f"{mine[k]['mean'] - expected[k]:+.0f}",
            _cell(theirs[k]),
        ]
        for k in PARTS
    ]
    total = {side: sum(v[k]["mean"] for k in PARTS) for side, v in (("plait", mine), ("torch", theirs))}
    total_f = sum(expected.values())
    rows.append(
        ["total", _mb(total_f), _mb(total["plait"]), f"{total['plait'] - total_f:+.0f}", _mb(total["torch"])]
    )
    return rows


PHASE_HEADERS = ["setup", *(f"{p} ms" for p in PHASES)]


def phase_rows(r: dict) -> list[list[str]]:
    return [[DESCRIPTION[k], *(f"{x:.0f}" for x in r["phases_ms"][k])] for k in SETUPS]


MEMORY_HEADERS = ["setup", "params MiB", "grads MiB", "optimizer MiB", "total MiB"]


def memory_rows(r: dict) -> list[list[str]]:
    return [
        [DESCRIPTION[k], *(_mib(r["memory"][k][p]) for p in ("params", "grads", "optimizer", "total"))]
        for k in SETUPS
    ]


def verdict(r: dict) -> tuple[str, str, str]:
    ratio = r["ratio"]
    target = "plait/torch step time <= 1.0 (dp2 x tp2, ZeRO-3 vs FSDP2 + DTensor tp)"
    if ratio <= 1.0:
        return target, f"{ratio:.3f}", "met"
    return target, f"{ratio:.3f}", f"NOT met ({100 * (ratio - 1):.1f}% slower)"


def _ops(rows: dict) -> str:
    return ", ".join(f"{k} x{c} {_mb(v)} MB" for k, (c, v) in sorted(rows.items()))


def checks(r: dict) -> list[str]:
    b, s = r["shape"]
    cfg = gpt_config(r["model"])
    steps = len(r["losses"]["plait"])
    per_layer = 8 * b * s * cfg.d_model * (TP - 1) / TP
    last = {k: r["losses"][k][-1] for k in SETUPS}
    return [
        "median of the per-step ratios plait/torch (steps of a pair run moments apart): "
        f"{r['paired_ratio']:.3f}",
        f"losses (mean over dp) after {steps} steps: plait {last['plait']:.6f}, torch {last['torch']:.6f}; "
        f"largest |plait - torch| over all steps {r['loss_diff']:.2e}; gradient norms before clipping "
        f"agree to {r['norm_rel_diff']:.1e} (relative)",
        f"Ψ = {r['psi']:,} tp-local parameters per rank (of {r['params']:,}: the tied embedding and the "
        "blocks' matrices split over tp; LayerNorms, position embedding and row-parallel biases "
        "replicated); no padding was needed (every unit's size divides by dp)"
        if r["plait_bytes"]["zero3"]["mean"] == r["formula"]["zero3"]
        else f"Ψ = {r['psi']:,} tp-local parameters per rank (of {r['params']:,}); the difference to "
        "the formula is the padding of ZeRO's flat buffers to a multiple of dp",
        f"plait ledger by op on the last step (rank 0): {_ops(r['ledger']['ops'])}; equal on every "
        f"measured step on every rank: {'yes' if r['plait_steps_equal'] else 'NO'}",
        f"torch collectives on one warm-up step (rank 0): {_ops(r['torch_comms'])}",
        f"per layer 8·b·s·h·(t-1)/t = 8·{b}·{s}·{cfg.d_model}·{TP - 1}/{TP} = {per_layer:.0f} elements = "
        f"{_mb(4 * per_layer)} MB (fp32), x {cfg.n_layer} layers; b = rows per dp rank. plait's tp row "
        "also holds the gradient norm's float64 all-reduce over tp (8 bus bytes)",
    ]


def markdown(r: dict, info: dict, command: str, args, runtime_s: float, load_end: str) -> str:
    b, s = r["shape"]
    target, measured, v = verdict(r)
    out = [
        "# plait ZeRO-3 x tensor parallelism vs torch FSDP2 x DTensor tensor parallelism (dp 2 x tp 2)",
        "",
        "Written by `benchmarks/compose.py`; every figure below comes from one run of it. See the",
        "script's docstring for the method.",
        "",
        f"- Command: `{command}`",
        *(f"- {k}: {v_}" for k, v_ in info.items()),
        f"- load average at end: {load_end}",
        f"- Runtime: {runtime_s:.0f} s",
        f"- Model: GPT `{r['model']}` ({r['params'] / 1e6:.2f}M parameters, tied embedding/head), the",
        f"  same initialisation for both; global batch {DP * b} x {s} tokens, {b} rows per dp rank (both",
        f"  tp ranks of a dp rank see the same rows); AdamW (lr {LR}, weight decay {WEIGHT_DECAY} on",
        f"  matrices only, fused=True), fp32, global-norm clipping at {CLIP}.",
        f"- Mesh: dp = {DP} x tp = {TP} on {WORLD} gloo ranks on the CPU, 1 thread each; "
        + ("sequence parallelism on." if r["sp"] else "no sequence parallelism."),
        "- Both setups split the same way: Megatron column/row-parallel attention and MLP, the",
        "  embedding and the tied head vocabulary-parallel with a vocabulary-parallel cross-entropy",
        "  (torch: `RowwiseParallel` / `ColwiseParallel(Shard(-1))` + `loss_parallel()`), ZeRO-3 /",
        "  FSDP2 over dp with one unit per transformer block and the root, every unit re-gathered in",
        "  backward.",
        f"- Steps of the two setups interleaved in alternating order; {args.warmup} warm-up +",
        f"  {args.steps} measured steps; figures are medians over the steps of the per-step maximum over",
        "  the ranks, each step started from a barrier.",
        f"- **Timings are indicative only**: {WORLD} ranks share the machine's cores (oversubscribed),",
        "  and the machine is shared with other work. Read the ratio (both setups suffer alike), not",
        "  the milliseconds.",
        "",
        markdown_table(HEADERS, table_rows(r)),
        "",
        "## Verdict",
        "",
        markdown_table(["target", "measured", "verdict"], [[target, measured, v]]),
        "",
        "## Where the time goes",
        "",
        "Each rank's own time per phase (no barrier between phases, so a phase includes waiting for the",
        "other ranks in its collectives); median over the measured steps of the maximum over the ranks.",
        "",
        markdown_table(PHASE_HEADERS, phase_rows(r)),
        "",
        "## Bytes per step (bus bytes, ring algorithm, per rank)",
        "",
        "plait: its ledger (`mesh.ledger`), every measured step; torch: FSDP2's `dist` calls and DTensor's",
        "functional collectives sized over one warm-up step (see the docstring).",
        "",
        markdown_table(BYTES_HEADERS, bytes_rows(r)),
        "",
        "## Model-state memory per rank at the end of a step",
        "",
        "plait: `engine.memory()`; torch: local storage of the sharded DTensor parameters, their gradients",
        "and AdamW's state. Peak memory (activations, gathered units) is not measured: both setups share",
        "the ranks' processes, and the CPU allocator has no per-setup peak counter.",
        "",
        markdown_table(MEMORY_HEADERS, memory_rows(r)),
        "",
        "## Checks",
        "",
        *(f"- {line}" for line in checks(r)),
        "",
        "## Notes",
        "",
        "- torch 2.13's `torch.nn.utils.clip_grad_norm_` fails on this model under FSDP2 + tp: the",
        "  parameters tp splits live on the 2-D (dp, tp) mesh, the others on the 1-D dp mesh, and the",
        "  per-parameter norms cannot be stacked across meshes (pytorch/pytorch#180346). The torch setup",
        "  computes torch's `get_total_norm` per mesh and combines them (`clip_grad_norm_mixed_meshes`).",
        "- plait's fused qkv (`[q | k | v]` in one Linear) needs whole heads of q, k and v on each tp rank;",
        "  the torch replica's qkv rows are permuted before `parallelize_module` so that plain",
        "  `ColwiseParallel` gives that (same function, same losses), as in `benchmarks/tp.py`.",
        "- torch keeps the root's parameters gathered between forward and backward by default",
        "  (`reshard_after_forward=None`); here it is `True` for the root too, so both setups do ZeRO-3's",
        "  3Ψ. torch's default would skip one all-gather of the root (embeddings, final LayerNorm).",
        "- Reducing the norm of the 2-D DTensor gradients to a replicated value takes two sequential",
        "  all-reduces (dp, then tp), which DTensor logs as suboptimal on every step (silenced here);",
        "  plait's norm is one float64 all-reduce per axis as well.",
        "",
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--model", default="small", help="plait.models.gpt_config name (default small)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per dp rank (default 4)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    parser.add_argument("--steps", type=int, default=30, help="measured steps per setup")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured steps first")
    parser.add_argument("--sequence-parallel", action="store_true", help="sequence parallelism in both")
    parser.add_argument(
        "--quick", action="store_true", help="smoke check: 1 + 3 steps, batch 2 x 64, no file"
    )
    parser.add_argument("--out", type=Path, default=None, help=f"markdown output (default {RESULTS})")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds for the spawned job")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.batch, args.seq_len = 3, 1, 2, 64
    cfg = gpt_config(args.model)
    if args.steps < 1 or args.warmup < 1 or args.batch < 1:
        parser.error(
            "--steps, --warmup and --batch must be >= 1 (torch's collectives are sized on a warm-up step)"
        )
    if not 0 < args.seq_len <= cfg.seq_len or args.seq_len % TP:
        parser.error(f"--seq-len must be a multiple of tp = {TP} and <= {cfg.seq_len}")
    if cfg.n_head % TP or cfg.vocab_size % TP:
        parser.error(f"model {args.model}: heads and vocabulary must divide by tp = {TP}")

    command, info = command_line(), machine_info()
    start = time.perf_counter()
    print(
        f"{args.model}: one {WORLD}-rank job (dp {DP} x tp {TP}), {args.batch} x {args.seq_len} per dp rank, "
        f"{args.warmup} + {args.steps} steps" + (", sequence parallel" if args.sequence_parallel else ""),
        flush=True,
    )
    r = measure(
        args.model, args.batch, args.seq_len, args.steps, args.warmup, args.sequence_parallel, args.timeout
    )
    runtime = time.perf_counter() - start
    load_end = ", ".join(f"{x:.2f}" for x in os.getloadavg())

    print()
    print(text_table(HEADERS, table_rows(r)))
    print()
    target, measured, v = verdict(r)
    print(f"target: {target}: {measured} -> {v}")
    print()
    print(text_table(PHASE_HEADERS, phase_rows(r)))
    print()
    print(text_table(BYTES_HEADERS, bytes_rows(r)))
    print()
    print(text_table(MEMORY_HEADERS, memory_rows(r)))
    print()
    for line in checks(r):
        print(line)
    print("timings are indicative only: 4 ranks oversubscribe this machine's cores")
    print(f"runtime {runtime:.0f} s; load average at end {load_end}")
    out = args.out if args.out is not None else (None if args.quick else RESULTS)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(markdown(r, info, command, args, runtime, load_end))
        raw = {"command": command, **info, "runtime_s": runtime, **r}
        out.with_suffix(".json").write_text(json.dumps(raw, indent=1, default=str) + "\n")
        print(f"wrote {out} and {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""plait tensor parallelism vs torch DTensor tensor parallelism on plait's GPT, tp = 2.

What is measured (one job of 2 gloo ranks on the CPU, one compute thread per rank):

* **Setups.** Five replicas of the same GPT (`plait.models.gpt_config`, default "3m": 4 layers,
  4 heads, d_model 256, vocabulary 256, embedding and head tied) start from the same
  initialisation and train on the same batches, each with its own AdamW:

  - ``plait``: `plait.tensor_parallel.apply_tp(model, mesh)` on ``Mesh(tp=2)`` (Megatron-LM:
    qkv and mlp.fc column-parallel, attn.proj and mlp.proj row-parallel, vocabulary-parallel
    embedding, tied head and vocabulary-parallel cross-entropy).
  - ``plait-sp``: the same with ``sequence_parallel=True`` (Korthikanti et al. 2022); after
    backward the gradients of the replicated, sequence-sharded parameters (LayerNorms,
    row-parallel biases, position embedding) are summed over tp with
    `allreduce_sequence_parallel_grads`, as plait's trainer does.
  - ``torch``: `torch.distributed.tensor.parallel.parallelize_module` with the styles torch
    documents for a transformer: ``ColwiseParallel`` for attn.qkv and mlp.fc, ``RowwiseParallel``
    for attn.proj and mlp.proj, ``RowwiseParallel(input_layouts=Replicate())`` for the token
    embedding, ``ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)`` for the head
    and the cross-entropy under ``loss_parallel()`` (the logits are never gathered either).
  - ``torch-sp``: the same plus sequence parallelism as torch documents it: ``SequenceParallel``
    on the LayerNorms, the column-parallel layers taking ``Shard(1)`` input (all-gather), the
    row-parallel ones giving ``Shard(1)`` output (reduce-scatter), the embedding giving
    ``Shard(1)``; the position embedding's output is declared replicated and sliced to the
    local positions (no communication).
  - ``one``: one process, one thread, the same batch, no parallelism (rank 0 runs it while
    rank 1 waits): the reference for the losses and for the speed-up of tp.

  **The fused qkv.** plait's attention computes ``[q | k | v]`` with one Linear and reads the
  number of heads from the width it receives, so each rank must hold whole heads of q, k *and*
  v. Plain ``ColwiseParallel`` would give rank 0 all of q and half of k. The torch replica
  therefore gets its qkv rows permuted before `parallelize_module` to ``[q_0 k_0 v_0 | q_1 k_1
  v_1]`` (what plait's ``Colwise(fused=3)`` does internally): rank r's contiguous rows are then
  its heads of q, k and v, and with ``use_local_output=True`` the attention sees exactly that
  local tensor. The function computed is the same as the one-process model's (the losses below
  check it).

  **Tied weights.** torch shards both the embedding (Rowwise) and the head (Colwise) along the
  vocabulary as ``Shard(0)`` of the same [V, h] table, so after `parallelize_module` (which
  distributes the two separately) the head is tied back to the embedding's DTensor parameter.

* **Step.** zero_grad + forward (returns the loss) + backward + AdamW step (+ the sequence-
  parallel gradient all-reduce for plait-sp). Steps of the five setups are interleaved, the
  order rotating every step, so all see the same machine state; every step starts from a
  barrier and a step's time is the maximum over the ranks (`_common.timed_step`). The first
  `--warmup` steps are not counted; figures are medians.

* **Losses.** Every rank of a tp group holds the same loss; the table gives the largest
  |loss - one-process loss| over all steps, warm-up included.

* **Bytes.** plait's ledger (`mesh.ledger`) records every collective; per step it is compared
  with the analytical volume (bus bytes under the ring algorithm, fp32): per transformer layer
  and micro-batch 8·b·s·h·(t-1)/t elements (2 all-reduces forward + 2 backward, or with SP the
  same volume as all-gather/reduce-scatter pairs: Korthikanti et al. 2022, Table 2), plus the
  embedding (one all-reduce of b·s·h), the head's input gradient (one all-reduce of b·s·h), the
  vocabulary-parallel loss (all-reduces of 3·b·s numbers: the max, the sum of exponentials and
  the target logit) and, with SP, the sequence-parallel parameters' gradients. torch's
  collectives are counted (not sized) with ``CommDebugMode`` over one warm-up step.

Run from the repository root:  .venv/bin/python benchmarks/tp.py [--steps 30] [--batch 4]
[--seq-len 256] [--quick]. Prints the table and writes benchmarks/results/tp.md and tp.json
(not with --quick, unless --out is given).
"""

from __future__ import annotations

import argparse
import json
import math
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
    idle,
    machine_info,
    markdown_table,
    max_over_ranks,
    median_ms,
    text_table,
    timed_step,
    train_step,
)
from tqdm import tqdm

from plait.models import GPT, gpt_config
from plait.testing import run_ranks

TP = 2
SEED = 0
N_BATCHES = 4  # distinct batches, cycled
SETUPS = ("plait", "torch", "plait-sp", "torch-sp", "one")
PAIRS = (("plait", "torch"), ("plait-sp", "torch-sp"))
TARGET_RATIO = 0.9
RESULTS = Path(__file__).resolve().parent / "results" / "tp.md"


def _model(name: str) -> GPT:
    torch.manual_seed(SEED)  # the same initialisation for every setup
    return GPT(gpt_config(name))


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)


# --- torch DTensor tensor parallelism -------------------------------------------------------------


@torch.no_grad()
def _heads_together(qkv: torch.nn.Linear, t: int) -> None:
    """Reorder qkv's output rows [q | k | v] to [q_0 k_0 v_0 | q_1 k_1 v_1 | ...], so that
    ColwiseParallel's contiguous Shard(0) gives rank r its heads of q, k and v."""
    for p in (qkv.weight, qkv.bias):
        if p is not None:
            blocks = p.chunk(3, dim=0)
            p.copy_(torch.cat([b.chunk(t, dim=0)[r] for r in range(t) for b in blocks], dim=0))


def torch_tp_model(name: str, device_mesh, sequence_parallel: bool) -> GPT:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    model = _model(name)
    t = device_mesh.size()
    for block in model.blocks:
        _heads_together(block.attn.qkv, t)
    if not sequence_parallel:
        plan = {
            "wte": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        }
        for i in range(len(model.blocks)):
            plan |= {
                f"blocks.{i}.attn.qkv": ColwiseParallel(),
                f"blocks.{i}.attn.proj": RowwiseParallel(),
                f"blocks.{i}.mlp.fc": ColwiseParallel(),
                f"blocks.{i}.mlp.proj": RowwiseParallel(),
            }
    else:
        # The residual stream stays a DTensor sharded along the sequence (dim 1).
        plan = {
            "wte": RowwiseParallel(
                input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
            ),
            # [T, h] positions: declared replicated, then sliced to this rank's T/t (no comm).
            "wpe": PrepareModuleOutput(
                output_layouts=Replicate(), desired_output_layouts=Shard(0), use_local_output=False
            ),
            "ln_f": SequenceParallel(),
            "lm_head": ColwiseParallel(
                input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
            ),
        }
        for i in range(len(model.blocks)):
            plan |= {
                f"blocks.{i}.ln_1": SequenceParallel(),
                f"blocks.{i}.attn.qkv": ColwiseParallel(input_layouts=Shard(1)),
                f"blocks.{i}.attn.proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
                f"blocks.{i}.ln_2": SequenceParallel(),
                f"blocks.{i}.mlp.fc": ColwiseParallel(input_layouts=Shard(1)),
                f"blocks.{i}.mlp.proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            }
    parallelize_module(model, device_mesh, plan)
    if model.cfg.tie_weights:  # both are Shard(0) of the same [V, h] table
        model.lm_head.weight = model.wte.weight
    return model


def _torch_step(model, opt, x, y):
    from torch.distributed.tensor.parallel import loss_parallel

    opt.zero_grad(set_to_none=True)
    with loss_parallel():
        loss = model(x, y)
        loss.backward()
    opt.step()
    return loss.detach().to_local()


# --- plait ------------------------------------------------------------------------------------------


def _plait_step(model, opt, x, y, mesh=None):
    from plait.tensor_parallel import allreduce_sequence_parallel_grads

    opt.zero_grad(set_to_none=True)
    loss = model(x, y)
    loss.backward()
    if mesh is not None:  # sequence parallelism: sum the partial gradients of replicated params
        allreduce_sequence_parallel_grads(model, mesh)
    opt.step()
    return loss.detach()


def tp_job(name: str, rows: int, seq_len: int, steps: int, warmup: int) -> dict:
    """On each of the TP ranks: train the five setups in turn, timing every step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    from plait.comm import ops as comm_ops
    from plait.mesh import Mesh
    from plait.tensor_parallel import apply_tp, sequence_parallel_params

    # CommDebugMode's module tracker hooks every module's backward; the embeddings' inputs (ids,
    # positions) need no gradient, which torch warns about
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    rank = dist.get_rank()
    batches = corpus_batches(rows, seq_len, N_BATCHES, SEED)  # every tp rank sees the whole batch
    mesh = Mesh(tp=TP)
    torch_mesh = init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
    models = {
        "plait": apply_tp(_model(name), mesh),
        "plait-sp": apply_tp(_model(name), mesh, sequence_parallel=True),
        "torch": torch_tp_model(name, torch_mesh, sequence_parallel=False),
        "torch-sp": torch_tp_model(name, torch_mesh, sequence_parallel=True),
    }
    if rank == 0:
        models["one"] = _model(name)
    runs = {k: (m, _optimizer(m)) for k, m in models.items()}
    sp_params = sum(p.numel() for p in sequence_parallel_params(models["plait-sp"]))
    ledger_key = {"plait": 1, "plait-sp": 2}  # ledger step = 10 * step + this
    times = {k: [] for k in SETUPS}
    losses = {k: [] for k in SETUPS}
    torch_comms = {}
    total = warmup + steps
    bar = tqdm(total=total, desc=f"{name}: {', '.join(SETUPS)}", unit="step") if rank == 0 else None
    for i in range(total):
        x, y = batches[i % len(batches)]
        for k in SETUPS[i % len(SETUPS) :] + SETUPS[: i % len(SETUPS)]:
            if k == "one":
                if rank == 0:
                    seconds, loss = timed_step(train_step, *runs[k], x, y)
                else:
                    seconds, loss = timed_step(idle)
            elif k.startswith("plait"):
                mesh.ledger.set_step(10 * i + ledger_key[k])
                sp_mesh = mesh if k == "plait-sp" else None
                seconds, loss = timed_step(_plait_step, *runs[k], x, y, sp_mesh)
            elif i == 0:  # count torch's collectives over its first (warm-up) step
                with CommDebugMode() as comm_mode:
                    seconds, loss = timed_step(_torch_step, *runs[k], x, y)
                # keys print as "_c10d_functional.<op>[.overload]"
                torch_comms[k] = {str(op).split(".")[1]: n for op, n in comm_mode.get_comm_counts().items()}
            else:
                seconds, loss = timed_step(_torch_step, *runs[k], x, y)
            if loss is not None:
                losses[k].append(float(loss))
            if i >= warmup:
                times[k].append(seconds)
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    dist.barrier()  # the last step may have been rank 0's alone
    # The price of one activation all-reduce (b x s x h fp32, what each layer moves 4 times a
    # step) through plait.comm, alone: a floor for the communication time of a step.
    act = torch.randn(rows, seq_len, gpt_config(name).d_model)
    mesh.ledger.set_step(-1)
    ar = [timed_step(comm_ops.all_reduce, act.clone(), mesh, "tp")[0] for _ in range(30)]
    ledger = {}
    for k, key in ledger_key.items():
        per_step = [mesh.ledger.rows(10 * i + key) for i in range(warmup, total)]
        ledger[k] = {
            "bus_bytes": [sum(r.bus_bytes for r in rows.values()) for rows in per_step],
            "ops": {op: (r.count, r.bus_bytes) for (op, _), r in per_step[-1].items()},
        }
    result = {
        "one_params": models["one"].cfg.n_params() if rank == 0 else None,
        "times": {k: max_over_ranks(v) for k, v in times.items()},
        "losses": losses,
        "ledger": ledger,
        "sp_params": sp_params,
        "torch_comms": torch_comms,
        "allreduce_s": statistics.median(max_over_ranks(ar[5:])),
    }
    mesh.close()
    return result


def formula_bytes(cfg, b: int, s: int, t: int, sp_params: int = 0) -> dict[str, float]:
    """Bus bytes per step (fp32, ring algorithm) of Megatron tp on plait's GPT, by part."""
    h, f = cfg.d_model, (t - 1) / t
    return {
        "layers": cfg.n_layer * 8 * b * s * h * f * 4,
        "embedding": 2 * b * s * h * f * 4,
        "head input grad": 2 * b * s * h * f * 4,
        "loss": 2 * 3 * b * s * f * 4,
        "sp param grads": 2 * sp_params * f * 4,
    }


def measure(name: str, rows: int, seq_len: int, steps: int, warmup: int, timeout: float) -> dict:
    r = run_ranks(tp_job, TP, args=(name, rows, seq_len, steps, warmup), timeout=timeout)[0]
    times, losses = r["times"], r["losses"]
    med = {k: median_ms(v) for k, v in times.items()}
    cfg = gpt_config(name)
    formulas = {
        "plait": formula_bytes(cfg, rows, seq_len, TP),
        "plait-sp": formula_bytes(cfg, rows, seq_len, TP, r["sp_params"]),
    }
    ledger = {}
    for k, f in formulas.items():
        got = r["ledger"][k]["bus_bytes"]
        ledger[k] = {
            "measured": got,
            "formula": sum(f.values()),
            "parts": f,
            "ops": r["ledger"][k]["ops"],
            "ok": all(math.isclose(g, sum(f.values()), rel_tol=1e-9) for g in got),
        }
    return {
        "model": name,
        "params": r["one_params"],
        "shape": (rows, seq_len),
        "median_ms": med,
        "ratio": {a: med[a] / med[b] for a, b in PAIRS},
        # Steps i of a pair ran moments apart: their ratio cancels slow drifts of the machine's load.
        "paired_ratio": {a: statistics.median(x / y for x, y in zip(times[a], times[b])) for a, b in PAIRS},
        "speedup": {k: med["one"] / med[k] for k in SETUPS},
        "loss_diff": {k: max(abs(a - b) for a, b in zip(losses[k], losses["one"])) for k in SETUPS},
        "first_losses": {k: losses[k][:3] for k in SETUPS},
        "spread": {k: (1e3 * min(v), 1e3 * max(v)) for k, v in times.items()},
        "ledger": ledger,
        "torch_comms": r["torch_comms"],
        "allreduce_ms": 1e3 * r["allreduce_s"],
        "times": times,
        "losses": losses,
    }


HEADERS = ["setup", "median ms", "plait/torch", "speed-up vs 1 proc", "max abs loss diff vs 1 proc"]
DESCRIPTION = {
    "plait": "plait apply_tp",
    "torch": "torch parallelize_module",
    "plait-sp": "plait apply_tp, sequence_parallel",
    "torch-sp": "torch parallelize_module + SequenceParallel",
    "one": "one process (reference)",
}


def table_rows(r: dict) -> list[list[str]]:
    out = []
    for k in SETUPS:
        ratio = f"{r['ratio'][k]:.3f}" if k in r["ratio"] else ""
        diff = "0 (reference)" if k == "one" else f"{r['loss_diff'][k]:.2e}"
        out.append([DESCRIPTION[k], f"{r['median_ms'][k]:.0f}", ratio, f"{r['speedup'][k]:.2f}", diff])
    return out


def verdict(r: dict) -> tuple[str, str, str]:
    ratio = r["ratio"]["plait"]
    target = f"plait/torch step time <= {TARGET_RATIO} (tp=2, no SP)"
    if ratio > TARGET_RATIO:
        return target, f"{ratio:.3f}", "NOT met"
    paired = r["paired_ratio"]["plait"]
    narrow = ratio > 0.95 * TARGET_RATIO or paired > TARGET_RATIO
    note = f" narrowly (within 5% of the target; median of per-step ratios {paired:.3f})" if narrow else ""
    return target, f"{ratio:.3f}", "met" + note


def _mb(x: float) -> str:
    return f"{x / 1e6:.3f}"


def checks(r: dict) -> list[str]:
    b, s = r["shape"]
    lines = [
        "median of the per-step ratios (steps of a pair run moments apart): "
        + ", ".join(f"{a}/{b_}: {r['paired_ratio'][a]:.3f}" for a, b_ in PAIRS),
        "step time min-max ms: " + ", ".join(f"{k} {lo:.0f}-{hi:.0f}" for k, (lo, hi) in r["spread"].items()),
        "first 3 losses: "
        + "; ".join(f"{k} " + ", ".join(f"{x:.6f}" for x in v) for k, v in r["first_losses"].items()),
    ]
    for k, led in r["ledger"].items():
        got = led["measured"]
        ops = ", ".join(f"{op} x{c} {_mb(bus)} MB" for op, (c, bus) in sorted(led["ops"].items()))
        parts = " + ".join(f"{name} {_mb(v)}" for name, v in led["parts"].items() if v)
        lines.append(
            f"{k} ledger per step: {_mb(min(got))}-{_mb(max(got))} MB bus ({ops}); formula "
            f"{_mb(led['formula'])} MB = {parts}; "
            f"equal on every measured step: {'yes' if led['ok'] else 'NO'}"
        )
    cfg = gpt_config(r["model"])
    per_layer = 8 * b * s * cfg.d_model * (TP - 1) / TP
    lines.append(
        f"per layer per micro-batch 8·b·s·h·(t-1)/t = 8·{b}·{s}·{cfg.d_model}·{TP - 1}/{TP} = "
        f"{per_layer:.0f} elements = {_mb(4 * per_layer)} MB (fp32), x {cfg.n_layer} layers"
    )
    n_act = 4 * cfg.n_layer + 2  # activation-sized all-reduces of a plait step (no SP)
    floor = n_act * r["allreduce_ms"]
    lines.append(
        f"one all-reduce of b·s·h fp32 ({_mb(4 * b * s * cfg.d_model)} MB) through plait.comm, alone: "
        f"{r['allreduce_ms']:.2f} ms (median); a tp step has {n_act} of them (4 per layer, embedding, head), "
        f"{floor:.0f} ms; half the one-process step plus that is {r['median_ms']['one'] / 2 + floor:.0f} ms, "
        f"the step time tp = 2 would have if the two ranks computed in parallel undisturbed"
    )
    for k, counts in r["torch_comms"].items():
        lines.append(
            f"{k} collectives in one step (CommDebugMode, count only): "
            + ", ".join(f"{op} x{n}" for op, n in sorted(counts.items()))
        )
    return lines


def markdown(r: dict, info: dict, command: str, args, runtime_s: float) -> str:
    b, s = r["shape"]
    target, measured, v = verdict(r)
    out = [
        "# plait tensor parallelism vs torch DTensor tensor parallelism",
        "",
        "Written by `benchmarks/tp.py`; every figure below comes from one run of it. See the",
        "script's docstring for the method (how the fused qkv and the tied head are split on the",
        "torch side, what the ledger formula counts).",
        "",
        f"- Command: `{command}`",
        *(f"- {k}: {v_}" for k, v_ in info.items()),
        f"- Runtime: {runtime_s:.0f} s",
        f"- Model: GPT `{r['model']}` ({r['params'] / 1e6:.2f}M parameters, tied embedding/head), "
        f"batch {b} x {s} tokens, the same batch on both tp ranks; AdamW (lr 3e-4, wd 0.1).",
        f"- Set-up: tp = {TP} on {TP} gloo ranks on the CPU, 1 thread each (torch.set_num_threads(1));",
        "  the five setups train their own replica from the same initialisation on the same data,",
        f"  steps interleaved in rotating order; {args.warmup} warm-up + {args.steps} measured steps each;",
        "  figures are medians over the steps of the per-step maximum over the ranks, each step",
        "  started from a barrier. The one-process reference runs on rank 0 while rank 1 waits.",
        "- The machine is shared and noisy: read medians and ratios, not single steps.",
        "",
        markdown_table(HEADERS, table_rows(r)),
        "",
        "## Verdict",
        "",
        markdown_table(["target", "measured", "verdict"], [[target, measured, v]]),
        "",
        "## Checks",
        "",
        *(f"- {line}" for line in checks(r)),
        "",
        "## Notes",
        "",
        "- Speed-up vs 1 proc = one-process step time / setup step time, on the same batch. tp = 2",
        "  halves each rank's matmuls but adds blocking collectives on the critical path (no overlap",
        "  with compute, in plait or torch), and on this 2-core machine gloo's threads share the two",
        "  cores with the ranks' compute; the all-reduce line above prices the collectives alone.",
        "- With sequence parallelism the volume is the same but a step has twice as many collectives",
        "  (all-gather + reduce-scatter for each all-reduce); plait's GPT is batch-first, so each of",
        "  them moves the sequence dim to the front (a copy) before the collective and hands back a",
        "  strided view after it.",
        "- torch's collectives are counted by CommDebugMode, which sees the functional collectives",
        "  DTensor issues (forward, backward and optimizer step); it does not size them.",
        "",
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--model", default="3m", help="plait.models.gpt_config name (default 3m)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step (default 4)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default 256)")
    parser.add_argument("--steps", type=int, default=30, help="measured steps per setup")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured steps first")
    parser.add_argument(
        "--quick", action="store_true", help="smoke check: 1 + 3 steps, batch 2 x 64, no file"
    )
    parser.add_argument("--out", type=Path, default=None, help=f"markdown output (default {RESULTS})")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds for the spawned job")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.batch, args.seq_len = 3, 1, 2, 64
    cfg = gpt_config(args.model)
    if args.steps < 1 or args.warmup < 0 or args.batch < 1:
        parser.error("--steps and --batch must be >= 1 and --warmup >= 0")
    if not 0 < args.seq_len <= cfg.seq_len or args.seq_len % TP:
        parser.error(f"--seq-len must be a multiple of tp = {TP} (sequence parallelism) and <= {cfg.seq_len}")
    if cfg.n_head % TP:
        parser.error(f"model {args.model} has {cfg.n_head} heads, not divisible by tp = {TP}")

    command, info = command_line(), machine_info()
    start = time.perf_counter()
    print(f"{args.model}: one {TP}-rank job, batch {args.batch} x {args.seq_len}", flush=True)
    r = measure(args.model, args.batch, args.seq_len, args.steps, args.warmup, args.timeout)
    runtime = time.perf_counter() - start

    print()
    print(text_table(HEADERS, table_rows(r)))
    print()
    target, measured, v = verdict(r)
    print(f"target: {target}: {measured} -> {v}")
    for line in checks(r):
        print(line)
    print(f"runtime {runtime:.0f} s")
    out = args.out if args.out is not None else (None if args.quick else RESULTS)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(markdown(r, info, command, args, runtime))
        raw = {"command": command, **info, "runtime_s": runtime, **{k: v_ for k, v_ in r.items()}}
        out.with_suffix(".json").write_text(json.dumps(raw, indent=1, default=str) + "\n")
        print(f"wrote {out} and {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

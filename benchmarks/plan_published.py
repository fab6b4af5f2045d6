"""The planner's cost model against published figures: Narayanan et al. 2021 Table 1.

Narayanan, Shoeybi, Casper, LeGresley, Patwary, Korthikanti, Vainbrand, Kashinkunti, Bernauer,
Catanzaro, Phanishayee, Zaharia, "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", SC'21 (arXiv:2104.04473), Table 1: weak scaling of GPT models from 1.7B
parameters on 32 A100s to 1T on 3072, with the tensor- and pipeline-parallel sizes used and the
achieved TFLOP/s per GPU. The rows are transcribed from /work/shared/REFERENCE.md (which quotes
the table); they were not re-checked against the paper's PDF here (no copy on this machine).

For each row: the row's own layout priced by `plait.planner.cost.evaluate` against the reported
TFLOP/s per GPU, and the layout `plait.planner.search.plan` chooses for the same model, batch and
GPU count. Table 1 does not give the micro-batch size or the number of model chunks per pipeline
rank: the row's layout is taken as micro-batch 1, the interleaved schedule with v = 2 chunks
(v = 3 for the 105-layer row, whose 35 stages hold 3 layers each), full recomputation, no ZeRO.

    PYTHONPATH=. python benchmarks/plan_published.py   ->  benchmarks/results/plan_published.md
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from plait.models.gpt import GPTConfig
from plait.planner.cluster import PRESETS
from plait.planner.cost import Candidate, evaluate
from plait.planner.search import check_runnable, load_plan_config, plan

# params (B), heads, hidden, layers, tp, pp, GPUs, batch, reported TFLOP/s per GPU
ROWS = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
V, SEQ = 51200, 2048
OUT = Path(__file__).parent / "results" / "plan_published.md"


def row_layout(heads, layers, tp, pp, gpus, batch) -> Candidate:
    dp = gpus // (tp * pp)
    rows = batch // dp
    if pp == 1:
        return Candidate(
            dp=dp, tp=tp, pp=1, sequence_parallel=False, microbatch_size=1, microbatches=rows, recompute=True
        )
    v = 2 if layers % (2 * pp) == 0 else layers // pp
    return Candidate(
        dp=dp, tp=tp, pp=pp, microbatch_size=1, microbatches=rows, schedule="interleaved", virtual_stages=v,
        recompute=True,
    )  # fmt: skip


def main() -> int:
    cluster = PRESETS["dgx-a100"]
    lines = [
        "# plait plan against Narayanan et al. 2021, Table 1",
        "",
        "Source: Narayanan et al., SC'21 (arXiv:2104.04473), Table 1, as transcribed in",
        "/work/shared/REFERENCE.md (not re-checked against the paper here). Cluster: the `dgx-a100`",
        f"preset (312 TFLOP/s bf16, efficiency {cluster.efficiency} — a preset, not fitted to these rows),",
        "V = 51,200, s = 2048. TFLOP/s per GPU count recomputation, as the paper's do.",
        "Row's layout: Table 1's t and p, micro-batch 1, interleaved (v = 2; v = 3 for 105 layers),",
        "recomputation, no ZeRO (Table 1 does not give the micro-batch size or v: assumptions).",
        "",
        "| params | GPUs | t | p | batch | reported | predicted (row's layout) | error | plait's own check "
        "| planner's choice | its predicted TFLOP/s | planning s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    errors = []
    for params, heads, h, layers, tp, pp, gpus, batch, reported in ROWS:
        cfg = GPTConfig(vocab_size=V, seq_len=SEQ, n_layer=layers, n_head=heads, d_model=h)
        lay = row_layout(heads, layers, tp, pp, gpus, batch)
        got = evaluate(cfg, batch, lay, cluster)
        err = got["tflops_per_device"] / reported - 1
        errors.append(err)
        overrides = [("model.n_layer", str(layers)), ("model.n_head", str(heads)), ("model.d_model", str(h))]
        overrides += [
            ("model.seq_len", str(SEQ)),
            ("model.vocab_size", str(V)),
            ("train.global_batch", str(batch)),
        ]
        base = load_plan_config(None, overrides)
        runnable = check_runnable(base, lay) or "runs"
        if runnable != "runs":
            runnable = "refused: " + runnable.split(": ", 1)[1].split(" (")[0]
        t0 = time.perf_counter()
        chosen = plan(base, cfg, batch, gpus, cluster, top=1)
        took = time.perf_counter() - t0
        best = chosen["plans"][0] if chosen["plans"] and chosen["plans"][0]["feasible"] else None
        mem = "" if got["feasible"] else f" ({got['reason']})"
        pred = f"{got['tflops_per_device']:.0f}{mem}"
        if best:
            choice = f"{best['layout']} | {best['tflops_per_device']:.0f}"
        else:
            choice = "none feasible | "
        lines.append(
            f"| {params}B | {gpus} | {tp} | {pp} | {batch} | {reported} | {pred} | {err:+.0%} | {runnable} "
            f"| {choice} | {took:.1f} |"
        )
        print(lines[-1], flush=True)
    mean_abs = sum(abs(e) for e in errors) / len(errors)
    median = sorted(abs(e) for e in errors)[len(errors) // 2]
    lines += [
        "",
        f"Error of the row's own layout: mean |error| {mean_abs:.0%}, median |error| {median:.0%}, "
        f"from {min(errors):+.0%} to {max(errors):+.0%}.",
        "",
    ]
    OUT.write_text("\n".join(lines))
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Beside parity, what each layout measured against what plait predicts for it: the bus bytes of
each mesh axis against the papers' formulas, the model states per rank against `plait estimate`'s
formula, and the step time against the planner's cost model (plait's GPT only).

The formulas, per rank and step, Ψ the parameters rank 0 holds before ZeRO shards them, n the
data-parallel degree, t the tensor-parallel degree (docs/verify.md):

* dp: data parallelism and ZeRO-1/2 move 2(n-1)/n Ψ elements (an all-reduce, or a reduce-scatter
  and an all-gather); ZeRO-3 3(n-1)/n Ψ (a parameter all-gather in the forward and again in the
  backward, a gradient reduce-scatter); ZeRO-3 inside pipeline stages gathers once per step:
  2(n-1)/n Ψ. Given for one micro-batch, without hybrid sharding or expert parallelism.
* tp (plait's GPT): Megatron-LM's 4 all-reduces of the activations (b s h) per block, one more
  each for the vocabulary-parallel embedding's output and the head's input gradient, and the
  vocabulary-parallel loss's 3 per-token scalars, each all-reduce 2(t-1)/t of its payload; under
  context parallelism of the s/c tokens a rank holds.
* cp (c ranks, each holding L = s/c tokens of every sequence; k_v the key/value width, q the query
  width, both over t): ring attention sends K and V (2 b L k_v) over c-1 hops per layer forward and,
  beside their gradients, twice that backward (once more forward under recomputation); the ledger
  counts each hop's send and receive. Ulysses: 8 all-to-alls per layer (q, k, v, output and their
  gradients; 4 more recomputing) of (c-1)/c of b L (2q + 2k_v). At dp = 1 the gradients' all-reduce
  (2(c-1)/c Ψ) runs on cp too; ZeRO's over dp x cp is not given.
"""

from __future__ import annotations

import statistics

from plait.layout import Layout
from plait.planner.candidate import Candidate
from plait.planner.cost import evaluate
from plait.train.config import Config, model_config
from plait.zero.estimate import model_state_bytes_formula

FP32 = 4


def _ring(n: int) -> float:
    return (n - 1) / n


def dp_formula(cfg: Config, psi: int) -> float | None:
    p = cfg.parallel
    if p.dp < 2 or p.ep > 1 or p.cp > 1 or p.hybrid_shard or cfg.train.micro_batches > 1:
        return None
    passes = 3 if p.zero_stage == 3 and p.pp == 1 else 2
    return passes * _ring(p.dp) * psi * FP32


def tp_formula(cfg: Config) -> float | None:
    p, m = cfg.parallel, cfg.model
    if p.tp < 2 or cfg.model.source != "plait" or m.experts:
        return None
    g = model_config(cfg)
    if g.seq_len % p.cp:
        return None
    rows = cfg.train.global_batch // (p.dp * p.ep)  # per rank and step, over its micro-batches
    seq = g.seq_len // p.cp  # the tokens of each sequence a rank holds
    activations = (4 * g.n_layer // p.pp + (2 if p.pp == 1 else 1)) * rows * seq * g.d_model
    scalars = 3 * rows * seq if p.pp == 1 else 0
    return 2 * _ring(p.tp) * (activations + scalars) * FP32


def cp_formula(cfg: Config, psi: int | None) -> float | None:
    p, c = cfg.parallel, cfg.parallel.cp
    g = model_config(cfg)
    if c < 2 or g.seq_len % (2 * c) or (p.dp == 1 and (p.zero_stage or not psi)):
        return None
    head = g.d_model // g.n_head
    kv = (getattr(g, "n_kv_head", None) or g.n_head) * head // p.tp
    q = g.d_model // p.tp
    tokens = cfg.train.global_batch // (p.dp * p.ep) * (g.seq_len // c)  # b L over the step
    layers, forwards = g.n_layer // p.pp, 2 if cfg.train.activation_checkpointing else 1
    if p.cp_style == "ring":
        attn = 2 * (c - 1) * tokens * 2 * kv * (forwards + 2)
    else:
        attn = _ring(c) * tokens * (2 * q + 2 * kv) * (forwards + 1)
    grads = 2 * _ring(c) * psi if p.dp == 1 and p.ep == 1 else 0.0
    return (layers * attn + grads) * FP32


def _row(what: str, got: float, want: float | None, unit: str, scale: float) -> dict:
    return {
        "what": what,
        "got": f"{got / scale:.3f} {unit}",
        "want": f"{want / scale:.3f} {unit}" if want is not None else "-",
        "ratio": got / want if want else None,
    }


def measured(cfg: Config, trace, cluster=None) -> dict:
    """{"rows": [...]} comparing rank 0's figures of the run `trace` with plait's formulas."""
    records = getattr(trace, "records", [])
    if not records:
        return {}
    last = records[-1]
    psi = (getattr(trace, "local_params", {}) or {}).get(0)
    rows = []
    by_axis = last.get("comm_by_axis", {})
    formulas = {
        "dp": dp_formula(cfg, psi) if psi else None,
        "tp": tp_formula(cfg),
        "cp": cp_formula(cfg, psi),
    }
    for axis in sorted(set(by_axis) | {a for a, f in formulas.items() if f}):
        got = by_axis.get(axis, 0.0)
        rows.append(_row(f"bus bytes on {axis} per step", got, formulas.get(axis), "MB", 1e6))
    state = last.get("model_state_bytes", {}).get("total")
    if state is not None and psi:
        rows.append(_row("model states per rank", state, _state_formula(cfg, psi), "MiB", 2**20))
    times = [r["step_time_s"] for r in records[1:] or records if r.get("step_time_s")]  # step 1 warms up
    if times:
        rows.append(_row("step time", statistics.median(times), _predicted_step(cfg, cluster), "ms", 1e-3))
    return {"rows": rows}


def _state_formula(cfg: Config, psi: int) -> float:
    """`plait estimate`'s formula for fp32 SGD without momentum (no optimizer state)."""
    p = cfg.parallel
    return model_state_bytes_formula(
        psi,
        p.dp * p.cp,  # ZeRO shards over dp x cp
        p.zero_stage,
        param_bytes=FP32,
        grad_bytes=FP32,
        optimizer_k=0,
        shard=p.hybrid_shard or None,
    )["total"]


def _predicted_step(cfg: Config, cluster) -> float | None:
    """The planner's step time for this layout on `cluster` (None: not plait's GPT, or no cluster)."""
    if cluster is None or cfg.model.source != "plait" or cfg.model.experts:
        return None
    lay = Layout.from_config(cfg)
    m = lay.pipeline_microbatches if lay.pp > 1 else cfg.train.micro_batches
    candidate = Candidate(
        dp=lay.dp,
        tp=lay.tp,
        pp=lay.pp,
        ep=lay.ep,
        cp=lay.cp,
        zero_stage=lay.zero_stage,
        hybrid_shard=lay.dp_shard,
        sequence_parallel=lay.sequence_parallel,
        microbatch_size=cfg.train.global_batch // (lay.dp * lay.ep * m),
        microbatches=m,
        schedule=lay.schedule if lay.pp > 1 else "none",
        virtual_stages=lay.stages_per_rank if lay.pp > 1 else 1,
    )
    result = evaluate(
        model_config(cfg), cfg.train.global_batch, candidate, cluster, optimizer="sgd", precision="fp32"
    )
    return result["step_s"]

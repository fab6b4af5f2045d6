"""The planner's cost model: step time, throughput and memory of one layout of a GPT on a cluster.

Each term is one function of `plait.planner.cost_terms`; `evaluate` adds them into a step.

Every term reuses the piece of plait that already states it (docs/planner.md has the derivation):

* compute — the model's FLOPs (`plait.models.flops`, Narayanan et al. 2021 §5.1) over
  ``peak x efficiency`` (on `this`, the efficiency measured for this width, micro-batch and tp
  share); per layer and micro-batch the forward is one pass, and the backward
  splits as Zero Bubble's B and W (Qi et al. 2023: F ∝ 24h + 4s, B ∝ 24h + 8s, W ∝ 24h);
  full recomputation adds one forward to B;
* context parallelism — each rank holds 1/cp of every sequence: its compute, activations,
  logits and tp traffic are those of seq_len / cp tokens, and ring attention's K/V hops (cp − 1
  per block forward, twice that backward) run on the cp axis's link;
* communication — the ring bus bytes of `plait.comm.ledger.bus_bytes` (the same formulas the
  ledger is checked against) on the link the axis lives on (`plait.planner.cluster`), α per
  ring step: tp's Megatron all-reduces (2 forward, 2 backward per layer; SP's reduce-scatter +
  all-gather pairs have the same volume) and the vocab-parallel edges, pp's point-to-point
  activations, ep's all-to-alls, dp's gradient all-reduce / ZeRO's reduce-scatter and
  all-gather, and once a step the small synchronous ones (SP's replicated-parameter gradients,
  the gradient norm's and the loss's sums);
* overlap where plait overlaps: the dp gradient reduction with the backward of the step's last
  micro-batch (plait's bucketed `GradSync`), ZeRO-3's gathers with compute; tp, ep and ZeRO-1/2's
  parameter all-gather after the step are exposed; on a CPU node (``cluster.cores``) nothing
  hides: gloo reduces and copies on the cores that compute, so a rank in a collective counts as
  busy when the node's cores are shared out (`evaluate`);
* the pipeline — plait's own simulator on the schedule plait runs (`plait.planner.stages`);
* DiLoCo — an inner step priced on a replica group's degrees, plus the outer exchange of the
  pseudo-gradient over the replica axis averaged over the H inner steps (`plait.planner.diloco`);
* memory — `plait.zero.estimate`'s model states and activations (Korthikanti et al. 2022) times
  the micro-batches the simulator finds in flight, plus the fp32 logits.
"""

from __future__ import annotations

import dataclasses
import math

from plait.models.flops import gpt_train_flops_per_token
from plait.models.gpt import GPTConfig
from plait.planner.candidate import Candidate
from plait.planner.cluster import Cluster
from plait.planner.cost_terms import (
    ACT_BYTES,
    BUCKET_BYTES,
    Compute,
    DataSync,
    LayerComm,
    Memory,
    Pipeline,
    Setting,
    compute_term,
    cp_bytes_per_block,
    data_parallel_term,
    memory_term,
    optimizer_step_term,
    pipeline_term,
    step_sync_term,
    tp_ep_term,
)
from plait.planner.diloco import OuterSync, outer_sync_term
from plait.zero.estimate import GB, dtype_preset

__all__ = ["ACT_BYTES", "BUCKET_BYTES", "Candidate", "evaluate", "stage_params"]


def stage_params(cfg: GPTConfig, layout: Candidate) -> int:
    """Parameters one device holds on the heaviest pipeline stage (the first, with the embeddings,
    or the last, with ln_f and the head, whose copy of a tied embedding it keeps), after tp (which
    splits all but the norms and the row-parallel biases) and ep."""
    h, V, s, L = cfg.d_model, cfg.vocab_size, cfg.seq_len, cfg.n_layer
    ln = h + h * int(cfg.bias)
    outside = V * h + s * h + ln + (0 if cfg.tie_weights else V * h)
    blocks = cfg.n_params() - outside
    mlp = 2 * h * cfg.ff_dim + int(cfg.bias) * (cfg.ff_dim + h)
    E = cfg.experts
    # A block with a mixture-of-experts MLP has a router (E x h) and E MLPs where a dense block has
    # one MLP; the blocks are otherwise alike. Counted per block, so that a stage holding more
    # MoE blocks than another (moe_every > 1 with few blocks per stage) is priced as it is.
    dense = (blocks - cfg.n_moe_layers * (E * h + (E - 1) * mlp)) / L
    # Megatron keeps whole on every tp rank a block's two LayerNorms and the biases of its two
    # row-parallel layers (added after the all-reduce): 4h + 2h with biases, 2h without.
    whole = 2 * ln + 2 * h * int(cfg.bias)

    def block(i: int) -> float:
        if not cfg.is_moe(i):
            return (dense - whole) / layout.tp + whole
        return (dense - mlp + E * h - whole) / layout.tp + whole + E * mlp / (layout.tp * layout.ep)

    k = L // layout.pp
    bodies = [sum(block(i) for i in range(j * k, (j + 1) * k)) for j in range(layout.pp)]
    if layout.pp == 1:  # the vocabulary splits over tp, the positions and ln_f do not
        return math.ceil(bodies[0] + (outside - s * h - ln) / layout.tp + s * h + ln)
    first = (V * h) / layout.tp + s * h
    last = V * h / layout.tp + ln  # the head, or a tied embedding's copy
    return math.ceil(max(bodies[0] + first, bodies[-1] + last, *bodies[1:-1]))


def evaluate(
    cfg: GPTConfig,
    global_batch: int,
    layout: Candidate,
    cluster: Cluster,
    *,
    optimizer: str = "adamw",
    precision: str | None = None,
    lower_bound: bool = False,
) -> dict:
    """The predicted step of `layout` (see `_evaluate`). On a CPU node (``cluster.cores``) the
    ranks share the cores: a rank waiting in a pipeline's bubble leaves them to the others, so
    the compute rate follows the ranks busy on average, found by a fixed point from all of them
    busy (three rounds); a lower bound takes one busy rank. A rank in a collective counts as busy:
    over loopback, gloo's copies and reductions run on the same cores as the ranks' compute."""
    kw = {"optimizer": optimizer, "precision": precision, "lower_bound": lower_bound}
    node_ranks = min(layout.devices, cluster.gpus_per_node)
    if not cluster.cores or node_ranks == 1:
        return _evaluate(cfg, global_batch, layout, cluster, **kw)
    if lower_bound:
        return _evaluate(cfg, global_batch, layout, cluster, computing=1.0, **kw)
    out = _evaluate(cfg, global_batch, layout, cluster, computing=float(node_ranks), **kw)
    for _ in range(3):
        busy = min(1.0, out["terms"]["busy_s"] / out["step_s"])
        out = _evaluate(cfg, global_batch, layout, cluster, computing=max(1.0, node_ranks * busy), **kw)
    return out


def _evaluate(
    cfg: GPTConfig,
    global_batch: int,
    layout: Candidate,
    cluster: Cluster,
    *,
    optimizer: str = "adamw",
    precision: str | None = None,
    lower_bound: bool = False,
    computing: float = 0.0,
) -> dict:
    """The predicted step of `layout`: time, throughput, memory and their terms (see the module
    docstring). The layout's divisibility is the search's business; this prices what it is given.

    ``lower_bound=True`` skips the pipeline simulation: no bubble, one micro-batch in flight, so
    time and memory are lower bounds of the full evaluation (the search's pruning uses them).
    ``precision`` defaults to the cluster's (bf16 on accelerators, fp32 on `this`)."""
    st = Setting.of(cfg, layout, cluster, precision or cluster.precision)
    # A rank's rate: its device's peak (or, on a CPU node, the matmul rate measured with as many
    # ranks computing at once) times the efficiency of a layer of this width, as one of tp ranks
    # computes its share of it (narrower GEMMs, the norms still whole).
    rate = cluster.rank_flops(st.node_ranks, computing) * cluster.efficiency_at(
        cfg.d_model, st.tokens, layout.tp
    )
    c = compute_term(st, rate)
    comm = tp_ep_term(st)
    pipe = pipeline_term(st, c, comm, lower_bound)
    psi = stage_params(cfg, layout)
    p_bytes, g_bytes, k_opt = dtype_preset(st.precision, optimizer)
    dp = data_parallel_term(st, psi, p_bytes, g_bytes, c)
    sync_t = step_sync_term(st, g_bytes)
    step_t = optimizer_step_term(st, psi, p_bytes, g_bytes, k_opt)
    mem = memory_term(st, psi, p_bytes, g_bytes, k_opt, pipe.in_flight)
    outer = outer_sync_term(st, psi, pipe.body + dp.exposed + sync_t + step_t)
    if outer.state_bytes:
        mem = dataclasses.replace(mem, state=mem.state + outer.state_bytes)
    return _result(st, global_batch, computing, c, comm, pipe, dp, sync_t, step_t, psi, mem, outer)


def _result(
    st: Setting,
    global_batch: int,
    computing: float,
    c: Compute,
    comm: LayerComm,
    pipe: Pipeline,
    dp: DataSync,
    sync_t: float,
    step_t: float,
    psi: int,
    mem: Memory,
    outer: OuterSync,
) -> dict:
    """The terms added up into the step, its throughput and memory (`plait plan --json`)."""
    lo, cfg, cluster, m, s = st.lo, st.cfg, st.cluster, st.lo.microbatches, st.cfg.seq_len
    inner_step = pipe.body + dp.exposed + sync_t + step_t
    step = inner_step + outer.exposed_s
    hw_flops = gpt_train_flops_per_token(cfg, recompute=lo.recompute) * global_batch * s
    model_flops = gpt_train_flops_per_token(cfg)
    comm_s = m * (comm.f + comm.b) + pipe.p2p_exposed + dp.exposed + sync_t + outer.exposed_s
    compute_s = m * (c.f + c.b + c.w + c.head_f + c.head_b)
    memory = mem.total
    out = {
        "layout": lo.name(),
        **dataclasses.asdict(lo),
        "step_s": step,
        "tflops_per_device": hw_flops / step / lo.devices / 1e12,
        "mfu": model_flops * global_batch * s / step / lo.devices / cluster.peak_flops,
        "memory_gb": memory / GB,
        "bubble": pipe.bubble,
        "comm_share": min(comm_s / step, 1.0),
        "feasible": memory <= mem.usable,
        "reason": "",
        "terms": {
            "compute_s": compute_s,
            # one block, one micro-batch, with tp/ep
            "block_s": (c.f + c.b + c.w + comm.f - comm.edge_f + comm.b - comm.edge_b) / st.k,
            "head_s": c.head_f + c.head_b,
            "tp_ep_s": m * (comm.f + comm.b),
            "p2p_s": pipe.p2p,
            "pipeline_s": pipe.body,
            "dp_grad_s": dp.grad,
            "dp_exposed_s": dp.exposed,
            "step_sync_s": sync_t,
            "pipeline_engine_s": m * pipe.engine_mb,
            # a rank's cores in use: computing, in a collective, or in the pipeline engine
            "busy_s": compute_s
            + m * (comm.f + comm.b)
            + dp.exposed
            + sync_t
            + m * pipe.engine_mb
            + outer.exposed_s,
            "optimizer_step_s": step_t,
            "params_per_device": psi,
            "computing_ranks": computing or st.node_ranks,
            "model_state_bytes": mem.state,
            "activation_bytes_per_microbatch": mem.act_per_microbatch,
            "in_flight_microbatches": pipe.in_flight,
            "activation_bytes": mem.act,
        },
    }
    if lo.cp > 1:  # the ring's bytes a rank sends per step (the ledger's sends on cp)
        f, b = cp_bytes_per_block(st)
        out["terms"]["cp_send_bytes"] = m * st.k * (f + b)
    if lo.diloco:  # a plain layout's terms are the hand-worked ones (tests/test_planner_terms.py)
        out["terms"] |= {
            "dp_bus_bytes": dp.bus,
            "inner_step_s": inner_step,
            "diloco_payload_bytes": outer.payload,
            "diloco_bus_bytes_per_exchange": outer.bus_per_exchange,
            "diloco_bus_bytes_per_step": outer.bus_per_step,
            "diloco_exchange_s": outer.exchange_s,
            "diloco_hidden_s": outer.hidden_s,
            "diloco_exposed_s": outer.exposed_s,
            "diloco_state_bytes": outer.state_bytes,
        }
    if memory > mem.usable:
        out["reason"] = (
            f"out of memory: needs {memory / GB:.1f} GB, {mem.usable / GB:.1f} GB usable "
            f"({(memory - mem.usable) / GB:.1f} GB over)"
        )
    return out

"""The planner's cost model: step time, throughput and memory of one layout of a GPT on a cluster.

Every term reuses the piece of plait that already states it (docs/planner.md has the derivation):

* compute — the model's FLOPs (`plait.models.flops`, Narayanan et al. 2021 §5.1) over
  ``peak x efficiency`` (on `this`, the efficiency measured for this width, micro-batch and tp
  share); per layer and micro-batch the forward is one pass, and the backward
  splits as Zero Bubble's B and W (Qi et al. 2023: F ∝ 24h + 4s, B ∝ 24h + 8s, W ∝ 24h);
  full recomputation adds one forward to B;
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
* memory — `plait.zero.estimate`'s model states and activations (Korthikanti et al. 2022) times
  the micro-batches the simulator finds in flight, plus the fp32 logits.
"""

from __future__ import annotations

import dataclasses
import math

from plait.comm.ledger import bus_bytes
from plait.models.flops import gpt_train_flops_per_token
from plait.models.gpt import GPTConfig
from plait.planner.cluster import Cluster, axis_links
from plait.planner.stages import pipeline_time
from plait.zero.estimate import GB, activation_bytes, dtype_preset, model_state_bytes_formula

BUCKET_BYTES = 25e6
"""plait's gradient bucket (parallel.bucket_mb = 25)."""
ACT_BYTES = 2
"""bf16 activations cross the tp and pp links."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """One way to run a step: the mesh, the sharding, the micro-batching, the schedule."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    zero_stage: int = 0
    hybrid_shard: int = 0
    sequence_parallel: bool = False
    microbatch_size: int = 1
    microbatches: int = 1
    """Pipeline micro-batches with pp > 1; gradient-accumulation micro-batches with pp = 1."""
    schedule: str = "none"
    virtual_stages: int = 1
    recompute: bool = False
    offload: str = "none"

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp * self.ep

    def name(self) -> str:
        parts = [f"dp{self.dp}", f"tp{self.tp}", f"pp{self.pp}"]
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        parts.append(f"z{self.zero_stage}")
        if self.hybrid_shard:
            parts.append(f"hs{self.hybrid_shard}")
        if self.sequence_parallel:
            parts.append("sp")
        parts.append(f"b{self.microbatch_size}x{self.microbatches}")
        if self.pp > 1:
            parts.append(
                self.schedule + (f"-v{self.virtual_stages}" if self.schedule == "interleaved" else "")
            )
        if self.recompute:
            parts.append("rc")
        if self.offload != "none":
            parts.append(f"off-{self.offload}")
        return "-".join(parts)


def _ring_time(link, op: str, payload: float, n: int, messages: int = 1, cluster=None, world=0) -> float:
    """α-β time of one collective: the ledger's bus bytes over β, α per ring step; or, where the
    cluster has measured this op over n ranks (`plait plan --calibrate`), α per collective and
    the measured β over the same bus bytes."""
    if n <= 1 or payload <= 0:
        return 0.0
    measured = cluster.collective_link(op, n, world) if cluster is not None else None
    if measured is not None:
        return messages * measured.alpha_s + bus_bytes(op, payload, n) / measured.beta_bps
    steps = 2 * (n - 1) if op == "all_reduce" else (n - 1)
    return messages * steps * link.alpha_s + bus_bytes(op, payload, n) / link.beta_bps


def _scalar_all_reduce(link, n: int, cluster=None, world=0) -> float:
    """One float64 summed over n ranks: latency-bound, so recursive doubling's ⌈log2 n⌉ steps of α
    (Thakur et al. 2005) rather than a ring's 2(n-1); the measured all-reduce where there is one."""
    if n <= 1:
        return 0.0
    measured = cluster.collective_link("all_reduce", n, world) if cluster is not None else None
    if measured is not None:
        return measured.alpha_s + bus_bytes("all_reduce", 8, n) / measured.beta_bps
    return math.ceil(math.log2(n)) * link.alpha_s + 8 / link.beta_bps


def stage_params(cfg: GPTConfig, layout: Layout) -> int:
    """Parameters one device holds on the heaviest pipeline stage (the first, with the embeddings,
    or the last, with ln_f and the head, whose copy of a tied embedding it keeps), after tp and ep."""
    h, V, s, L = cfg.d_model, cfg.vocab_size, cfg.seq_len, cfg.n_layer
    ln = h + h * int(cfg.bias)
    outside = V * h + s * h + ln + (0 if cfg.tie_weights else V * h)
    blocks = cfg.n_params() - outside
    mlp = 2 * h * cfg.ff_dim + int(cfg.bias) * (cfg.ff_dim + h)
    experts = cfg.n_moe_layers * cfg.experts * mlp if cfg.experts else 0
    per_block_dense, per_block_experts = (blocks - experts) / L, experts / L
    k = L // layout.pp
    body = k * (per_block_dense / layout.tp + per_block_experts / (layout.tp * layout.ep))
    if layout.pp == 1:  # the vocabulary splits over tp, the positions and ln_f do not
        edges = (outside - s * h - ln) / layout.tp + s * h + ln
    else:
        first = (V * h) / layout.tp + s * h
        last = V * h / layout.tp + ln  # the head, or a tied embedding's copy
        edges = max(first, last)
    return math.ceil(body + edges)


def evaluate(
    cfg: GPTConfig,
    global_batch: int,
    layout: Layout,
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
    layout: Layout,
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
    lo = layout
    precision = precision or cluster.precision
    act_bytes = 4 if precision == "fp32" else ACT_BYTES
    b, m, s, h, L, V = (
        lo.microbatch_size,
        lo.microbatches,
        cfg.seq_len,
        cfg.d_model,
        cfg.n_layer,
        cfg.vocab_size,
    )
    # A rank's rate: its device's peak (or, on a CPU node, the matmul rate measured with as many
    # ranks computing at once) times the efficiency of a layer of this width, as one of tp ranks
    # computes its share of it (narrower GEMMs, the norms still whole).
    node_ranks = min(lo.devices, cluster.gpus_per_node)
    rate = cluster.rank_flops(node_ranks, computing) * cluster.efficiency_at(h, b * s, lo.tp)
    coll = {"cluster": cluster, "world": node_ranks}
    links = axis_links(cluster, {"tp": lo.tp, "ep": lo.ep, "dp": lo.dp, "pp": lo.pp})
    tokens = b * s

    # Compute, from plait's FLOP count: one extra forward of every layer is what recompute adds.
    model_flops = gpt_train_flops_per_token(cfg)
    layer_fwd = (gpt_train_flops_per_token(cfg, recompute=True) - model_flops) / L  # per token
    head_flops = model_flops - 3 * L * layer_fwd  # the logits' forward and backward, per token
    k = L // lo.pp  # blocks per pipeline rank
    f = tokens * layer_fwd * k / lo.tp / rate
    b_ = f * (24 * h + 8 * s) / (24 * h + 4 * s)  # Qi et al. 2023's B and W of a layer
    w_ = f * (24 * h) / (24 * h + 4 * s)
    if lo.recompute:
        b_ += f
    head_f = tokens * head_flops / 3 / lo.tp / rate
    head_b = 2 * head_f

    # Tensor parallel: 2 all-reduces forward, 2 backward per block (Megatron's f and g), 2 more
    # when recomputation replays the forward. Under SP each all-reduce is an all-gather before
    # the split region and a reduce-scatter after it: the same bytes, but two collectives, each
    # priced by its own measured α-β where the cluster has them (gloo's reduce-scatter is slower).
    act = tokens * h * act_bytes
    if lo.sequence_parallel:
        tp_ar = _ring_time(links["tp"], "all_gather", act, lo.tp, **coll) + _ring_time(
            links["tp"], "reduce_scatter", act, lo.tp, **coll
        )
    else:
        tp_ar = _ring_time(links["tp"], "all_reduce", act, lo.tp, **coll)
    tp_f, tp_b = 2 * k * tp_ar, (4 if lo.recompute else 2) * k * tp_ar
    # ... and at the edges: the vocab-parallel embedding's output (one such collective forward),
    # the head's input (one backward), and the vocab-parallel loss's two all-reduces (the logits'
    # max, a float per token; the sum of exponentials stacked with the target's logit, two).
    # A pipeline's first stage holds the embedding and its last the head and the loss: each stage
    # is priced with the edge collectives (communication, so not in compute_s).
    edge_f = (
        0.0
        if lo.tp == 1
        else tp_ar
        + _ring_time(links["tp"], "all_reduce", tokens * 4, lo.tp, **coll)
        + _ring_time(links["tp"], "all_reduce", 2 * tokens * 4, lo.tp, **coll)
    )
    edge_b = 0.0 if lo.tp == 1 else tp_ar
    # Expert parallel: dispatch and combine all-to-alls of top_k copies of each token, per MoE block.
    moe_k = cfg.n_moe_layers * k / L
    ep_a2a = (
        _ring_time(links["ep"], "all_to_all", act * max(cfg.top_k, 1), lo.ep, **coll) if cfg.experts else 0.0
    )
    ep_f, ep_b = 2 * moe_k * ep_a2a, 2 * moe_k * ep_a2a
    comm_f, comm_b = tp_f + ep_f + edge_f, tp_b + ep_b + edge_b

    # The pipeline, or the accumulation loop.
    engine_mb = cluster.pipeline_overhead_s(lo.schedule) if lo.pp > 1 else 0.0
    p2p_bytes = act / (lo.tp if lo.sequence_parallel else 1)
    p2p_link = cluster.collective_link("send", 2, node_ranks) or links["pp"]
    p2p = p2p_link.time(p2p_bytes) if lo.pp > 1 else 0.0
    if lo.pp > 1 and lower_bound:
        body = m * (f + b_ + w_ + comm_f + comm_b + head_f + head_b + engine_mb)
        bubble, in_flight, p2p_exposed = 0.0, 1.0, 0.0
    elif lo.pp > 1:
        # What plait's engine adds per micro-batch (measured on `this`), shared by the actions of
        # a micro-batch: F, B and W where the schedule splits the backward, else F and BW.
        split = lo.schedule in ("zb-h1", "zb-h2", "zb-v")
        o_f, o_b, o_w = (engine_mb / 3,) * 3 if split else (engine_mb / 2, engine_mb / 4, engine_mb / 4)
        pipe = pipeline_time(
            lo.schedule,
            lo.pp,
            m,
            lo.virtual_stages,
            f + comm_f + o_f,
            b_ + comm_b + o_b,
            w_ + o_w,
            p2p,
            0.0,
            head_f,
            head_b,
        )
        body, bubble, in_flight = pipe["makespan"], pipe["bubble"], pipe["peak_activations"]
        p2p_exposed = 2 * (lo.pp * lo.virtual_stages - 1) * p2p  # the fill and the drain
    else:
        body = m * (f + b_ + w_ + comm_f + comm_b + head_f + head_b)
        bubble, in_flight, p2p_exposed = 0.0, 1.0, 0.0

    # Data parallel / ZeRO over the data axes (dense parameters over dp x ep).
    n_data = lo.dp * lo.ep
    psi = stage_params(cfg, lo)
    p_bytes, g_bytes, k_opt = dtype_preset(precision, optimizer)
    shard = lo.hybrid_shard or n_data
    link_d = links["dp"] if lo.dp > 1 else links["ep"]
    buckets = max(1, math.ceil(psi * g_bytes / BUCKET_BYTES))
    if lo.zero_stage == 3:  # one unit per block and the root (plait.zero.shard): a message each
        buckets = k + 1
    if lo.zero_stage == 0:
        grad_t = _ring_time(link_d, "all_reduce", psi * g_bytes, n_data, buckets, **coll)
        gather_t = 0.0
    else:
        shard_link = (
            axis_links(cluster, {"tp": lo.tp, "ep": lo.ep, "dp": shard})["dp"] if lo.hybrid_shard else link_d
        )
        grad_t = _ring_time(shard_link, "reduce_scatter", psi * g_bytes, shard, buckets, **coll)
        if lo.hybrid_shard and n_data > shard:  # the shards' all-reduce across the replicas
            grad_t += _ring_time(
                link_d, "all_reduce", psi * g_bytes / shard, n_data // shard, buckets, **coll
            )
        gather_t = _ring_time(shard_link, "all_gather", psi * p_bytes, shard, buckets, **coll)
    last_backward = b_ + w_ + head_b
    last_bucket = grad_t / buckets
    dp_exposed = max(grad_t - last_backward, last_bucket) if grad_t else 0.0
    if cluster.cores:  # a CPU's ranks reduce and copy on the cores that compute: nothing hides
        dp_exposed = grad_t
    if lo.zero_stage == 3:  # gathered again for every micro-batch's forward and backward
        gathers = 2 * m * gather_t
        hidden = 0.0 if cluster.cores else m * (f + b_ + w_)
        dp_exposed += max(gathers - hidden, gather_t / max(k, 1))
    else:
        dp_exposed += gather_t  # ZeRO-1/2: the updated parameters, gathered after the step

    # The optimizer step: memory-bound on the device, or on the host with offload.
    opt_elems = psi / (shard if lo.zero_stage >= 1 else 1)
    if lo.offload == "cpu":
        step_t = opt_elems / cluster.host_adam_params_per_s + opt_elems * (g_bytes + p_bytes) / (
            cluster.pcie_gbps * 1e9
        )
    else:
        step_t = 2 * opt_elems * (p_bytes + g_bytes + k_opt) / (cluster.memory_bw_gbps * 1e9)
    # Once per step, synchronous and small: under SP the gradients of the parameters every tp rank
    # holds whole but sees a slice of the sequence for (each block's two norms with the bias of
    # the row-parallel layer after them; the positions and the final norm) are summed over tp:
    # without ZeRO, plait's GradSync sums each run of them between the sharded gradients (two per
    # block and one more); under ZeRO each bucket (stages 1-2: buckets of their own) or unit
    # (stage 3) sums its share of this rank's shard. The gradient norm sums its squares over each
    # axis that splits parameters, and the loss is summed over the data axes and pp
    # (`plait.train.loop`'s step; the stop check's all-reduce after it is not in the step's time).
    sync_t = 0.0
    if lo.tp > 1 and lo.sequence_parallel:
        ln = 2 if cfg.bias else 1
        partial = (2 * k * (ln + int(cfg.bias)) + s + ln) * h * g_bytes
        if lo.zero_stage == 3:
            msgs, partial = k + 1, partial / shard
        elif lo.zero_stage >= 1:
            msgs, partial = max(1, math.ceil(partial / BUCKET_BYTES)), partial / shard
        else:
            msgs = 2 * k + 1
        sync_t += _ring_time(links["tp"], "all_reduce", partial, lo.tp, msgs, **coll)
    norm_axes = [(links["tp"], lo.tp), (links["pp"], lo.pp), (links["ep"], lo.ep)]
    if lo.zero_stage >= 1:
        norm_axes.append((link_d, shard))
    loss_link = links["pp"] if lo.pp > 1 else link_d  # pp outermost: the group spans the mesh
    for link, n in [*norm_axes, (loss_link, n_data * lo.pp)]:
        sync_t += _scalar_all_reduce(link, n, **coll)
    step = body + dp_exposed + sync_t + step_t

    # Memory: the estimator's model states and activations.
    states = model_state_bytes_formula(
        psi, n_data, lo.zero_stage, param_bytes=p_bytes, grad_bytes=g_bytes, optimizer_k=k_opt, shard=shard
    )
    state_bytes = states["total"] - (states["optimizer"] if lo.offload == "cpu" else 0)
    stage_cfg = dataclasses.replace(cfg, n_layer=k)
    act_mb = activation_bytes(
        stage_cfg,
        b,
        precision=precision if precision != "fp16" else "bf16",
        recompute=lo.recompute,
        tp=lo.tp,
        sequence_parallel=lo.sequence_parallel,
        stored_scores=False,
    )
    working = 0
    if lo.recompute:  # one block's full activations while it is recomputed
        working = activation_bytes(
            dataclasses.replace(cfg, n_layer=1),
            b,
            tp=lo.tp,
            sequence_parallel=lo.sequence_parallel,
            stored_scores=False,
        )
    logits = tokens * V * 4 // lo.tp
    act_total = round(act_mb * in_flight) + working + logits
    memory = state_bytes + act_total
    usable = cluster.memory_gb * cluster.usable_memory * GB
    if cluster.cores:  # a CPU node's memory is shared by its ranks
        usable /= node_ranks

    hw_flops = gpt_train_flops_per_token(cfg, recompute=lo.recompute) * global_batch * s
    comm_s = m * (comm_f + comm_b) + p2p_exposed + dp_exposed + sync_t
    compute_s = m * (f + b_ + w_ + head_f + head_b)
    out = {
        "layout": lo.name(),
        **dataclasses.asdict(lo),
        "step_s": step,
        "tflops_per_device": hw_flops / step / lo.devices / 1e12,
        "mfu": model_flops * global_batch * s / step / lo.devices / cluster.peak_flops,
        "memory_gb": memory / GB,
        "bubble": bubble,
        "comm_share": min(comm_s / step, 1.0),
        "feasible": memory <= usable,
        "reason": "",
        "terms": {
            "compute_s": compute_s,
            "block_s": (f + b_ + w_ + comm_f - edge_f + comm_b - edge_b)
            / k,  # one block, one micro-batch, with tp/ep
            "head_s": head_f + head_b,
            "tp_ep_s": m * (comm_f + comm_b),
            "p2p_s": p2p,
            "pipeline_s": body,
            "dp_grad_s": grad_t,
            "dp_exposed_s": dp_exposed,
            "step_sync_s": sync_t,
            "pipeline_engine_s": m * engine_mb,
            # a rank's cores in use: computing, in a collective, or in the pipeline engine
            "busy_s": compute_s + m * (comm_f + comm_b) + dp_exposed + sync_t + m * engine_mb,
            "optimizer_step_s": step_t,
            "params_per_device": psi,
            "computing_ranks": computing or node_ranks,
            "model_state_bytes": state_bytes,
            "activation_bytes_per_microbatch": act_mb,
            "in_flight_microbatches": in_flight,
            "activation_bytes": act_total,
        },
    }
    if memory > usable:
        out["reason"] = (
            f"out of memory: needs {memory / GB:.1f} GB, {usable / GB:.1f} GB usable "
            f"({(memory - usable) / GB:.1f} GB over)"
        )
    return out

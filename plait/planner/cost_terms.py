"""The terms of the planner's cost model, one function each, in the order of docs/planner.md
("The cost model, term by term"): compute, tensor and expert parallel, the pipeline, data parallel
and ZeRO, the step's small synchronous collectives, the optimizer step, memory.

Every term reads a :class:`Setting` (the model, the layout, the cluster and the sizes derived from
them once); `plait.planner.cost.evaluate` adds the terms up into a step.
"""

from __future__ import annotations

import dataclasses
import math

from plait.comm.ledger import bus_bytes
from plait.models.flops import gpt_train_flops_per_token
from plait.models.gpt import GPTConfig
from plait.planner.candidate import Candidate
from plait.planner.cluster import Cluster, Link, axis_links
from plait.planner.stages import pipeline_time
from plait.zero.estimate import GB, activation_bytes, model_state_bytes_formula

BUCKET_BYTES = 25e6
"""plait's gradient bucket (parallel.bucket_mb = 25)."""
ACT_BYTES = 2
"""bf16 activations cross the tp and pp links."""
SPLIT_BACKWARD = ("zb-h1", "zb-h2", "zb-v")
"""Schedules whose actions are F, B and W (the others: F and BW)."""


def ring_time(link, op: str, payload: float, n: int, messages: int = 1, cluster=None, world=0) -> float:
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


def scalar_all_reduce(link, n: int, cluster=None, world=0) -> float:
    """One float64 summed over n ranks: latency-bound, so recursive doubling's ⌈log2 n⌉ steps of α
    (Thakur et al. 2005) rather than a ring's 2(n-1); the measured all-reduce where there is one."""
    if n <= 1:
        return 0.0
    measured = cluster.collective_link("all_reduce", n, world) if cluster is not None else None
    if measured is not None:
        return measured.alpha_s + bus_bytes("all_reduce", 8, n) / measured.beta_bps
    return math.ceil(math.log2(n)) * link.alpha_s + 8 / link.beta_bps


@dataclasses.dataclass(frozen=True)
class Setting:
    """What every term reads: the model, the layout, the cluster, and sizes derived from them."""

    cfg: GPTConfig
    lo: Candidate
    cluster: Cluster
    precision: str
    node_ranks: int
    """Ranks on one node (the world the cluster's measured collectives are looked up for)."""
    links: dict[str, Link]
    k: int
    """Blocks per pipeline rank."""
    tokens: int
    """Tokens of one micro-batch on a rank (its 1/cp of each sequence under context parallelism)."""
    act: int
    """Bytes of one micro-batch's activations (tokens x d_model) on the tp and pp links."""

    @classmethod
    def of(cls, cfg: GPTConfig, lo: Candidate, cluster: Cluster, precision: str) -> Setting:
        tokens = lo.microbatch_size * -(-cfg.seq_len // lo.cp)
        sizes = {"tp": lo.tp, "cp": lo.cp, "ep": lo.ep, "dp": lo.dp, "pp": lo.pp}
        links = axis_links(cluster, sizes)
        links["replica"] = links["dp"]
        if lo.diloco:  # DiLoCo's replica axis is dp's outer factor: a group is dp/M consecutive dp ranks
            links["dp"] = axis_links(cluster, sizes | {"dp": lo.group_dp})["dp"]
        return cls(
            cfg=cfg,
            lo=lo,
            cluster=cluster,
            precision=precision,
            node_ranks=min(lo.devices, cluster.gpus_per_node),
            links=links,
            k=cfg.n_layer // lo.pp,
            tokens=tokens,
            act=tokens * cfg.d_model * (4 if precision == "fp32" else ACT_BYTES),
        )

    def ring(self, link: Link, op: str, payload: float, n: int, messages: int = 1) -> float:
        return ring_time(link, op, payload, n, messages, cluster=self.cluster, world=self.node_ranks)

    def scalar(self, link: Link, n: int) -> float:
        return scalar_all_reduce(link, n, cluster=self.cluster, world=self.node_ranks)

    @property
    def n_data(self) -> int:
        """The data axes (dense parameters are replicated over dp x ep x cp); under DiLoCo a
        replica group's (its dp / M), which is all an inner step reduces over."""
        return self.lo.group_dp * self.lo.ep * self.lo.cp

    @property
    def shard(self) -> int:
        """The ZeRO shard group: the hybrid shard, else every data rank."""
        return self.lo.hybrid_shard or self.n_data

    @property
    def data_link(self) -> Link:
        """The outermost data axis's link (the slowest a gradient reduction crosses)."""
        lo = self.lo
        return self.links["dp"] if lo.group_dp > 1 else self.links["ep"] if lo.ep > 1 else self.links["cp"]

    @property
    def shard_link(self) -> Link:
        """The ZeRO shard group's link: under hybrid sharding its F consecutive dp ranks' (a node),
        else the data axes'."""
        lo = self.lo
        if not lo.hybrid_shard:
            return self.data_link
        return axis_links(self.cluster, {"tp": lo.tp, "ep": lo.ep, "dp": lo.hybrid_shard})["dp"]


@dataclasses.dataclass(frozen=True)
class Compute:
    """Seconds of one micro-batch through a rank's blocks (F, B, W) and through the logits."""

    f: float
    b: float
    w: float
    head_f: float
    head_b: float


def compute_term(st: Setting, rate: float) -> Compute:
    """Term 1: plait's FLOP count at `rate` FLOP/s; one extra forward of every layer is what
    recompute adds, the backward split as Qi et al. 2023's B and W of a layer."""
    cfg, lo, h, s, L = st.cfg, st.lo, st.cfg.d_model, st.cfg.seq_len, st.cfg.n_layer
    model_flops = gpt_train_flops_per_token(cfg)
    layer_fwd = (gpt_train_flops_per_token(cfg, recompute=True) - model_flops) / L  # per token
    head_flops = model_flops - 3 * L * layer_fwd  # the logits' forward and backward, per token
    f = st.tokens * layer_fwd * st.k / lo.tp / rate
    b = f * (24 * h + 8 * s) / (24 * h + 4 * s)
    w = f * (24 * h) / (24 * h + 4 * s)
    if lo.recompute:
        b += f
    head_f = st.tokens * head_flops / 3 / lo.tp / rate
    return Compute(f=f, b=b, w=w, head_f=head_f, head_b=2 * head_f)


@dataclasses.dataclass(frozen=True)
class LayerComm:
    """Exposed tp and ep seconds of one micro-batch on a rank, forward and backward; `edge_*` is
    the part at the vocab-parallel embedding, head and loss."""

    f: float
    b: float
    edge_f: float
    edge_b: float


def tp_ep_term(st: Setting) -> LayerComm:
    """Terms 2 and 3: tensor parallel's 2 all-reduces forward, 2 backward per block (Megatron's f
    and g), 2 more when recomputation replays the forward, and its edge collectives; expert
    parallel's dispatch and combine all-to-alls of top_k copies of each token, per MoE block."""
    cfg, lo, tp_link, k = st.cfg, st.lo, st.links["tp"], st.k
    # Under SP each all-reduce is an all-gather before the split region and a reduce-scatter after
    # it: the same bytes, but two collectives, each priced by its own measured α-β where the
    # cluster has them (gloo's reduce-scatter is slower).
    if lo.sequence_parallel:
        tp_ar = st.ring(tp_link, "all_gather", st.act, lo.tp) + st.ring(
            tp_link, "reduce_scatter", st.act, lo.tp
        )
    else:
        tp_ar = st.ring(tp_link, "all_reduce", st.act, lo.tp)
    tp_f, tp_b = 2 * k * tp_ar, (4 if lo.recompute else 2) * k * tp_ar
    # At the edges: the vocab-parallel embedding's output (one such collective forward), the
    # head's input (one backward), and the vocab-parallel loss's two all-reduces (the logits' max,
    # a float per token; the sum of exponentials stacked with the target's logit, two). A
    # pipeline's first stage holds the embedding and its last the head and the loss: each stage is
    # priced with the edge collectives (communication, so not in compute_s).
    edge_f = (
        0.0
        if lo.tp == 1
        else tp_ar
        + st.ring(tp_link, "all_reduce", st.tokens * 4, lo.tp)
        + st.ring(tp_link, "all_reduce", 2 * st.tokens * 4, lo.tp)
    )
    edge_b = 0.0 if lo.tp == 1 else tp_ar
    moe_k = cfg.n_moe_layers * k / cfg.n_layer
    ep_a2a = st.ring(st.links["ep"], "all_to_all", st.act * max(cfg.top_k, 1), lo.ep) if cfg.experts else 0.0
    ep_f, ep_b = 2 * moe_k * ep_a2a, 2 * moe_k * ep_a2a
    cp_f, cp_b = cp_term(st)
    return LayerComm(
        f=tp_f + ep_f + cp_f + edge_f, b=tp_b + ep_b + cp_b + edge_b, edge_f=edge_f, edge_b=edge_b
    )


def cp_bytes_per_block(st: Setting) -> tuple[float, float]:
    """Bytes a rank sends per block and micro-batch for context parallelism's ring attention,
    forward and backward (plait.context_parallel.ring): K and V of its heads (d_model / tp wide,
    plait's GPT has as many key/value heads as query heads) over cp − 1 hops forward, and again
    beside their gradients backward; a recomputed forward sends K and V once more."""
    lo = st.lo
    if lo.cp == 1:
        return 0.0, 0.0
    hop = 2 * st.act / lo.tp  # K and V
    f = (lo.cp - 1) * hop
    return f, 2 * f + (f if lo.recompute else 0.0)


def cp_term(st: Setting) -> tuple[float, float]:
    """With terms 2 and 3, context parallelism's ring: cp − 1 point-to-point hops per block forward (K, V)
    and backward (K, V and their gradients), α each, on the cp axis's link; counted exposed (an
    upper bound: plait posts each hop before the block it overlaps)."""
    lo = st.lo
    if lo.cp == 1:
        return 0.0, 0.0
    link, hop = st.links["cp"], 2 * st.act / lo.tp
    one = st.ring(link, "send", hop, 2)  # α + one hop's bytes over β
    f = st.k * (lo.cp - 1) * one
    return f, st.k * (lo.cp - 1) * one * (3 if lo.recompute else 2)


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """The body of the step (the pipeline's makespan, or the accumulation loop), its bubble and
    peak micro-batches in flight, and its point-to-point messages."""

    body: float
    bubble: float
    in_flight: float
    p2p: float
    p2p_exposed: float
    engine_mb: float
    """What plait's pipeline engine adds per micro-batch (measured on `this`)."""


def pipeline_term(st: Setting, c: Compute, comm: LayerComm, lower_bound: bool) -> Pipeline:
    """Term 4: plait's simulator on the schedule plait runs; a lower bound (or pp = 1, the
    accumulation loop) takes the micro-batches back to back, one in flight."""
    lo, m = st.lo, st.lo.microbatches
    engine_mb = st.cluster.pipeline_overhead_s(lo.schedule) if lo.pp > 1 else 0.0
    p2p_bytes = st.act / (lo.tp if lo.sequence_parallel else 1)
    p2p_link = st.cluster.collective_link("send", 2, st.node_ranks) or st.links["pp"]
    p2p = p2p_link.time(p2p_bytes) if lo.pp > 1 else 0.0
    if lo.pp == 1 or lower_bound:
        body = m * (c.f + c.b + c.w + comm.f + comm.b + c.head_f + c.head_b + engine_mb)
        return Pipeline(body, bubble=0.0, in_flight=1.0, p2p=p2p, p2p_exposed=0.0, engine_mb=engine_mb)
    # The engine's time per micro-batch is shared by the actions of a micro-batch: F, B and W where
    # the schedule splits the backward, else F and BW.
    if lo.schedule in SPLIT_BACKWARD:
        o_f, o_b, o_w = (engine_mb / 3,) * 3
    else:
        o_f, o_b, o_w = engine_mb / 2, engine_mb / 4, engine_mb / 4
    pipe = pipeline_time(
        lo.schedule,
        lo.pp,
        m,
        lo.virtual_stages,
        c.f + comm.f + o_f,
        c.b + comm.b + o_b,
        c.w + o_w,
        p2p,
        0.0,
        c.head_f,
        c.head_b,
    )
    return Pipeline(
        body=pipe["makespan"],
        bubble=pipe["bubble"],
        in_flight=pipe["peak_activations"],
        p2p=p2p,
        p2p_exposed=2 * (lo.pp * lo.virtual_stages - 1) * p2p,  # the fill and the drain
        engine_mb=engine_mb,
    )


@dataclasses.dataclass(frozen=True)
class DataSync:
    """Data parallel / ZeRO seconds: the gradient reduction, and what of it and of ZeRO's
    parameter gathers the step waits for."""

    grad: float
    exposed: float
    bus: float = 0.0
    """Ring bus bytes a rank sends per step for the gradients and ZeRO's gathers."""


def data_parallel_term(st: Setting, psi: int, p_bytes: int, g_bytes: int, c: Compute) -> DataSync:
    """Term 5: the gradient all-reduce (ZeRO: reduce-scatter, and across hybrid replicas an
    all-reduce of the shards) over the data axes, α once per bucket; ZeRO's parameter gathers;
    what of them overlaps the backward (plait's bucketed `GradSync`) and compute."""
    lo, k, m, shard, n_data, link_d = st.lo, st.k, st.lo.microbatches, st.shard, st.n_data, st.data_link
    buckets = max(1, math.ceil(psi * g_bytes / BUCKET_BYTES))
    if lo.zero_stage == 3:  # one unit per block and the root (plait.zero.shard): a message each
        buckets = k + 1
    if lo.zero_stage == 0:
        grad_t = st.ring(link_d, "all_reduce", psi * g_bytes, n_data, buckets)
        gather_t = 0.0
        bus = bus_bytes("all_reduce", psi * g_bytes, n_data)
    else:
        shard_link = st.shard_link
        grad_t = st.ring(shard_link, "reduce_scatter", psi * g_bytes, shard, buckets)
        bus = bus_bytes("reduce_scatter", psi * g_bytes, shard)
        if lo.hybrid_shard and n_data > shard:  # the shards' all-reduce across the replicas
            grad_t += st.ring(link_d, "all_reduce", psi * g_bytes / shard, n_data // shard, buckets)
            bus += bus_bytes("all_reduce", psi * g_bytes / shard, n_data // shard)
        gather_t = st.ring(shard_link, "all_gather", psi * p_bytes, shard, buckets)
        bus += bus_bytes("all_gather", psi * p_bytes, shard) * (2 * m if lo.zero_stage == 3 else 1)
    last_backward = c.b + c.w + c.head_b
    last_bucket = grad_t / buckets
    exposed = max(grad_t - last_backward, last_bucket) if grad_t else 0.0
    if st.cluster.cores:  # a CPU's ranks reduce and copy on the cores that compute: nothing hides
        exposed = grad_t
    if lo.zero_stage == 3:  # gathered again for every micro-batch's forward and backward
        gathers = 2 * m * gather_t
        hidden = 0.0 if st.cluster.cores else m * (c.f + c.b + c.w)
        exposed += max(gathers - hidden, gather_t / max(k, 1))
    else:
        exposed += gather_t  # ZeRO-1/2: the updated parameters, gathered after the step
    return DataSync(grad=grad_t, exposed=exposed, bus=bus)


def step_sync_term(st: Setting, g_bytes: int) -> float:
    """Term 6: once per step, synchronous and small. Under SP the gradients of the parameters every
    tp rank holds whole but sees a slice of the sequence for (each block's two norms with the bias
    of the row-parallel layer after them; the positions and the final norm) are summed over tp:
    without ZeRO, plait's GradSync sums each run of them between the sharded gradients (two per
    block and one more); under ZeRO each bucket (stages 1-2: buckets of their own) or unit (stage
    3) sums its share of this rank's shard. The gradient norm sums its squares over each axis that
    splits parameters, and the loss is summed over the data axes and pp (`plait.train.loop`'s
    step; the stop check's all-reduce after it is not in the step's time)."""
    cfg, lo, k, links, shard = st.cfg, st.lo, st.k, st.links, st.shard
    sync_t = 0.0
    if lo.tp > 1 and lo.sequence_parallel:
        ln = 2 if cfg.bias else 1
        partial = (2 * k * (ln + int(cfg.bias)) + cfg.seq_len + ln) * cfg.d_model * g_bytes
        if lo.zero_stage == 3:
            msgs, partial = k + 1, partial / shard
        elif lo.zero_stage >= 1:
            msgs, partial = max(1, math.ceil(partial / BUCKET_BYTES)), partial / shard
        else:
            msgs = 2 * k + 1
        sync_t += st.ring(links["tp"], "all_reduce", partial, lo.tp, msgs)
    norm_axes = [(links["tp"], lo.tp), (links["pp"], lo.pp), (links["ep"], lo.ep)]
    if lo.zero_stage >= 1:  # over the shard group (hybrid sharding: within a node)
        norm_axes.append((st.shard_link, shard))
    loss_link = links["pp"] if lo.pp > 1 else st.data_link  # pp outermost: the group spans the mesh
    for link, n in [*norm_axes, (loss_link, st.n_data * lo.pp)]:
        sync_t += st.scalar(link, n)
    return sync_t


def optimizer_step_term(st: Setting, psi: int, p_bytes: int, g_bytes: int, k_opt: int) -> float:
    """Term 7: the optimizer step, memory-bound on the device, or on the host with offload."""
    lo, cluster = st.lo, st.cluster
    opt_elems = psi / (st.shard if lo.zero_stage >= 1 else 1)
    if lo.offload == "cpu":
        return opt_elems / cluster.host_adam_params_per_s + opt_elems * (g_bytes + p_bytes) / (
            cluster.pcie_gbps * 1e9
        )
    return 2 * opt_elems * (p_bytes + g_bytes + k_opt) / (cluster.memory_bw_gbps * 1e9)


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes one device holds at its peak, and what it may use."""

    state: int
    act_per_microbatch: int
    act: int
    usable: float

    @property
    def total(self) -> int:
        return self.state + self.act


def memory_term(st: Setting, psi: int, p_bytes: int, g_bytes: int, k_opt: int, in_flight: float) -> Memory:
    """Term 8: `plait.zero.estimate`'s model states (the optimizer's left on the host with
    offload) and activations times the micro-batches in flight, one block's full activations
    while it is recomputed, and the fp32 logits."""
    cfg, lo, cluster = st.cfg, st.lo, st.cluster
    states = model_state_bytes_formula(
        psi,
        st.n_data,
        lo.zero_stage,
        param_bytes=p_bytes,
        grad_bytes=g_bytes,
        optimizer_k=k_opt,
        shard=st.shard,
    )
    state_bytes = states["total"] - (states["optimizer"] if lo.offload == "cpu" else 0)
    shape = {"tp": lo.tp, "sequence_parallel": lo.sequence_parallel, "stored_scores": False}
    precision = st.precision if st.precision != "fp16" else "bf16"
    seq = st.tokens // lo.microbatch_size  # a rank's 1/cp of each sequence
    act_mb = activation_bytes(
        dataclasses.replace(cfg, n_layer=st.k),
        lo.microbatch_size,
        seq,
        precision=precision,
        recompute=lo.recompute,
        **shape,
    )
    working = 0
    if lo.recompute:  # one block's full activations while it is recomputed
        working = activation_bytes(dataclasses.replace(cfg, n_layer=1), lo.microbatch_size, seq, **shape)
    logits = st.tokens * cfg.vocab_size * 4 // lo.tp
    usable = cluster.memory_gb * cluster.usable_memory * GB
    if cluster.cores:  # a CPU node's memory is shared by its ranks
        usable /= st.node_ranks
    return Memory(
        state=state_bytes,
        act_per_microbatch=act_mb,
        act=round(act_mb * in_flight) + working + logits,
        usable=usable,
    )

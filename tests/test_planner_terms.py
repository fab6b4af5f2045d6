"""Every number of a plan (`plait plan --json`: the step, bubble, comm_share, memory, MFU and each
key of `terms`) against its closed form, worked by hand from the papers (shared/REFERENCE.md) on a
GPT small enough to follow, without plait's own helpers.

The model: h = 64 and s = 96 = 1.5 h, so a layer's Zero Bubble passes (Qi et al. 2023: F = sbh(24h +
4s), B = sbh(24h + 8s), W = sbh(24h)) stand F : B : W = 1 : 1.2 : 0.8 exactly, and the logits'
forward (2hV FLOPs a token) with V = 96 is 0.1 F of a layer, its backward 0.2 F. The cluster: one
node of 8 devices at 1 TFLOP/s with efficiency 1, every link α-β (`alpha`, `beta` below).

Tolerances: 1e-9 relative where the model is exact; 1e-3 where plait's pipeline simulator is
involved (its cache rounds each cost ratio to three significant digits: the ratios here are exact
at three digits but a message's, which moves by < 0.1%). The bugs they must see are far
larger: ZeRO-3 priced at 2Ψ instead of 3Ψ moves its volume by 1/3, a fill or drain off by one
stage moves a pipeline's step by >= 4% here (>= 40x the tolerance).
"""

import json
import math

import pytest

from plait.cli import main
from plait.models.gpt import GPTConfig
from plait.planner.cost import Candidate, evaluate
from plait.planner.hardware import Cluster, Link

H, S, NH = 64, 96, 4
PEAK = 1e12  # FLOP/s of a device (peak_tflops = 1, efficiency 1)
MEM_BW = 100e9  # device memory bytes/s: the optimizer step
GB = 1e9
TERMS = {
    "compute_s", "block_s", "head_s", "tp_ep_s", "p2p_s", "pipeline_s", "dp_grad_s", "dp_exposed_s",
    "step_sync_s", "pipeline_engine_s", "busy_s", "optimizer_step_s", "params_per_device",
    "computing_ranks", "model_state_bytes", "activation_bytes_per_microbatch",
    "in_flight_microbatches", "activation_bytes",
}  # fmt: skip
EXACT = 1e-9
SIM = 1e-3


def gpt(V: int = 96, L: int = 4) -> GPTConfig:
    return GPTConfig(vocab_size=V, seq_len=S, n_layer=L, n_head=NH, d_model=H)


def cluster(alpha: float = 10e-6, beta: float = 1e9, **kw) -> Cluster:
    link = Link(alpha_s=alpha, beta_bps=beta)
    return Cluster(
        name="hand", gpus_per_node=8, peak_tflops=PEAK / 1e12, memory_gb=80.0, intra=link, inter=link,
        efficiency=1.0, memory_bw_gbps=MEM_BW / 1e9, **kw,
    )  # fmt: skip


FAST = cluster(alpha=0.0, beta=1e21)  # links that cost nothing: the pipeline's own shape


# ---- the hand model -----------------------------------------------------------------------------


def passes(tokens: int, layers: int, tp: int = 1) -> tuple[float, float, float]:
    """Seconds of F, B, W of `layers` layers on a micro-batch (Qi et al. 2023's per-layer FLOPs)."""
    unit = tokens * H * layers / tp / PEAK
    return unit * (24 * H + 4 * S), unit * (24 * H + 8 * S), unit * 24 * H


def logits(tokens: int, V: int, tp: int = 1) -> tuple[float, float]:
    """The logits' forward (2hV a token) and backward (twice that)."""
    f = 2 * H * V * tokens / tp / PEAK
    return f, 2 * f


def block_params() -> int:
    """qkv 3h²+3h, proj h²+h, fc 4h²+4h, fc2 4h²+h, two LayerNorms 4h."""
    return 12 * H * H + 13 * H


def params_whole(V: int, L: int) -> int:
    """Tied embedding Vh, positions sh, final norm 2h, the blocks."""
    return V * H + S * H + 2 * H + L * block_params()


def params_stage(V: int, L: int, p: int) -> int:
    """The heaviest pipeline stage: its blocks and the first's embeddings or the last's norm and head."""
    return L // p * block_params() + max(V * H + S * H, V * H + 2 * H)


def ring(op: str, nbytes: float, n: int, alpha: float, beta: float, messages: int = 1) -> float:
    """Ring collectives (REFERENCE: all-reduce moves 2(n-1)/n of the payload, in 2(n-1) steps)."""
    if n == 1:
        return 0.0
    steps = 2 * (n - 1) if op == "all_reduce" else n - 1
    return messages * steps * alpha + steps / n * nbytes / beta


def scalar(n: int, alpha: float, beta: float) -> float:
    """One float64 summed by recursive doubling: ceil(log2 n) steps."""
    return 0.0 if n == 1 else math.ceil(math.log2(n)) * alpha + 8 / beta


def korthikanti(tokens: int, layers: int, tp: int = 1, sp: bool = False, rc: bool = False) -> float:
    """Activation bytes of 16-bit training a layer keeps (Korthikanti et al. 2022 §4, fused attention:
    no 5as/h term): sbh(10 + 24/t), sbh·34/t with SP; 2sbh (/t under SP) with full recomputation."""
    if rc:
        per = 2 / (tp if sp else 1)
    else:
        per = 34 / tp if sp else 10 + 24 / tp
    return tokens * H * per * layers


def model_flops_per_token(V: int, L: int, rc: bool = False) -> float:
    """Narayanan et al. 2021: 72lh² + 12lsh + 6hV a token (96lh² + 16lsh + 6hV recomputing)."""
    n = 4 if rc else 3
    return n * (24 * L * H * H + 4 * L * S * H) + 6 * H * V


def plan_of(lay: Candidate, cl: Cluster, V: int = 96, L: int = 4) -> tuple[dict, dict]:
    batch = lay.microbatch_size * lay.microbatches * lay.dp
    out = evaluate(gpt(V, L), batch, lay, cl)
    return out, out["terms"]


# ---- the tests ----------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 4])
def test_zero_volumes_are_2psi_and_3psi(n):
    """Rajbhandari et al. 2019 §7: per rank a step moves 2Ψ under DP and ZeRO-1/2 (reduce-scatter +
    all-gather), 3Ψ under ZeRO-3 (a gather forward, one backward, the reduce-scatter), in units of
    the ring's (n-1)/n of Ψ's bytes; with m micro-batches ZeRO-3 gathers twice for each (1 + 2m).
    On a CPU node (cores) nothing hides, so the exposed time is the whole volume over β."""
    beta = 1e9
    cl = cluster(alpha=0.0, beta=beta, cores=2)
    psi = params_whole(96, 4)
    unit = psi * 2 * (n - 1) / n / beta  # Ψ bf16 bytes through a ring's (n-1)/n
    for stage, m, volume in [(0, 1, 2), (1, 1, 2), (2, 1, 2), (3, 1, 3), (3, 2, 5)]:
        out, t = plan_of(Candidate(dp=n, zero_stage=stage, microbatch_size=2, microbatches=m), cl)
        assert t["dp_exposed_s"] / unit == pytest.approx(volume, rel=EXACT), (stage, m)
        assert t["dp_grad_s"] / unit == pytest.approx(2 if stage == 0 else 1, rel=EXACT), stage
        # the gradient norm over the shards (ZeRO) and the loss over dp: a float64 each
        norms = 1 + (stage >= 1)
        assert t["step_sync_s"] == pytest.approx(norms * 8 / beta, rel=EXACT), stage
        # the ranks busy on the node's cores: all of them while computing or in a collective
        assert t["computing_ranks"] == pytest.approx(n * t["busy_s"] / out["step_s"], rel=EXACT)
        assert t["busy_s"] == pytest.approx(t["compute_s"] + t["dp_exposed_s"] + t["step_sync_s"], rel=EXACT)


@pytest.mark.parametrize("n", [2, 4])
def test_zero_model_states_and_the_optimizer_step(n):
    """REFERENCE (ZeRO, K = 12 for mixed-precision AdamW): per device 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N,
    16Ψ/N; the optimizer step reads and writes each of its elements' 16 bytes once, memory-bound."""
    psi = params_whole(96, 4)
    shard = -(-psi // n)
    want = {0: 16 * psi, 1: 4 * psi + 12 * shard, 2: 2 * psi + 14 * shard, 3: 16 * shard}
    for stage, states in want.items():
        out, t = plan_of(Candidate(dp=n, zero_stage=stage, microbatch_size=2), cluster())
        assert t["params_per_device"] == psi
        assert t["model_state_bytes"] == states, stage
        elems = psi if stage == 0 else psi / n
        assert t["optimizer_step_s"] == pytest.approx(2 * elems * 16 / MEM_BW, rel=EXACT), stage
    # offload: the host's Adam at its rate, the gradients down and the parameters up the PCIe link
    lay = Candidate(dp=n, zero_stage=2, microbatch_size=2, offload="cpu")
    out, t = plan_of(lay, cluster(pcie_gbps=10.0, host_adam_params_per_s=1e8))
    assert t["optimizer_step_s"] == pytest.approx(psi / n / 1e8 + psi / n * 4 / 10e9, rel=EXACT)
    assert t["model_state_bytes"] == 2 * psi + 2 * shard  # the optimizer's 12 bytes on the host


def test_data_parallel_overlaps_the_last_backward_and_zero3_gathers_behind_compute():
    """On devices that compute while they communicate: ZeRO-3 sends one message per unit (each of L
    blocks and the root); its reduce-scatter hides behind the last micro-batch's backward (B + W of
    the blocks and the logits) but for its last unit, its 2m gathers behind the m micro-batches'
    compute but for one block's; ZeRO-1/2's gather after the step is exposed whole."""
    alpha, beta, n, b, L = 10e-6, 1e9, 2, 2, 4
    cl = cluster(alpha, beta)
    psi, tokens = params_whole(96, L), b * S
    f, bw, w = passes(tokens, L)
    _, hb = logits(tokens, 96)
    for m in (1, 2):
        out, t = plan_of(Candidate(dp=n, zero_stage=3, microbatch_size=b, microbatches=m), cl)
        rs = ring("reduce_scatter", psi * 2, n, alpha, beta, messages=L + 1)
        gather = ring("all_gather", psi * 2, n, alpha, beta, messages=L + 1)
        assert t["dp_grad_s"] == pytest.approx(rs, rel=EXACT)
        assert rs - (bw + w + hb) > rs / (L + 1)  # the case is in the overlap branch
        assert 2 * m * gather - m * (f + bw + w) > gather / L
        exposed = (rs - (bw + w + hb)) + (2 * m * gather - m * (f + bw + w))
        assert t["dp_exposed_s"] == pytest.approx(exposed, rel=EXACT), m
    # ZeRO-1: one 25 MB bucket, all of it exposed (the last bucket), and the gather after the step
    out, t = plan_of(Candidate(dp=n, zero_stage=1, microbatch_size=b), cl)
    rs, gather = ring("reduce_scatter", psi * 2, n, alpha, beta), ring("all_gather", psi * 2, n, alpha, beta)
    assert t["dp_exposed_s"] == pytest.approx(rs + gather, rel=EXACT)
    # on devices, computing_ranks is every rank of the node
    assert t["computing_ranks"] == n


@pytest.mark.parametrize("n", [2, 3])
def test_data_parallel_step_mfu_memory_and_comm_share(n):
    """The step of dp n by hand: m (F + B + W + the logits), the exposed reduction, the two scalar
    sums, the optimizer step; MFU and TFLOP/s from Narayanan's FLOPs; memory from the states, one
    micro-batch's activations and the fp32 logits."""
    alpha, beta, b, m, L, V = 10e-6, 1e9, 2, 2, 4, 96
    out, t = plan_of(Candidate(dp=n, microbatch_size=b, microbatches=m), cluster(alpha, beta))
    tokens, psi = b * S, params_whole(V, L)
    f, bw, w = passes(tokens, L)
    hf, hb = logits(tokens, V)
    compute = m * (f + bw + w + hf + hb)
    grad = ring("all_reduce", psi * 2, n, alpha, beta)
    sync = scalar(n, alpha, beta)  # the loss over dp
    opt = 2 * psi * 16 / MEM_BW
    step = compute + grad + sync + opt
    assert t["compute_s"] == pytest.approx(compute, rel=EXACT)
    assert t["pipeline_s"] == pytest.approx(compute, rel=EXACT)  # the accumulation loop
    assert t["head_s"] == pytest.approx(hf + hb, rel=EXACT)
    assert t["block_s"] == pytest.approx((f + bw + w) / L, rel=EXACT)
    assert (t["tp_ep_s"], t["p2p_s"], t["pipeline_engine_s"]) == (0.0, 0.0, 0.0)
    assert t["dp_exposed_s"] == pytest.approx(grad, rel=EXACT)
    assert t["step_sync_s"] == pytest.approx(sync, rel=EXACT)
    assert out["step_s"] == pytest.approx(step, rel=EXACT)
    assert out["comm_share"] == pytest.approx((grad + sync) / step, rel=EXACT)
    assert out["bubble"] == 0.0
    flops = model_flops_per_token(V, L) * n * b * m * S
    assert out["mfu"] == pytest.approx(flops / step / n / PEAK, rel=EXACT)
    assert out["tflops_per_device"] == pytest.approx(flops / step / n / 1e12, rel=EXACT)
    act = korthikanti(tokens, L)
    assert t["activation_bytes_per_microbatch"] == act
    assert t["in_flight_microbatches"] == 1.0
    assert t["activation_bytes"] == act + tokens * V * 4
    assert out["memory_gb"] == pytest.approx((16 * psi + act + tokens * V * 4) / GB, rel=EXACT)
    assert out["feasible"]
    # recomputation: one more forward in B, Narayanan's 96lh² FLOPs, a layer's input kept
    out, t = plan_of(Candidate(dp=n, microbatch_size=b, microbatches=m, recompute=True), cluster(alpha, beta))
    assert t["compute_s"] == pytest.approx(compute + m * f, rel=EXACT)
    step = compute + m * f + grad + sync + opt
    hw = model_flops_per_token(V, L, rc=True) * n * b * m * S
    assert out["tflops_per_device"] == pytest.approx(hw / step / n / 1e12, rel=EXACT)
    assert out["mfu"] == pytest.approx(flops / step / n / PEAK, rel=EXACT)
    working = korthikanti(tokens, 1)  # the block being recomputed, whole
    assert t["activation_bytes"] == korthikanti(tokens, L, rc=True) + working + tokens * V * 4


@pytest.mark.parametrize("t_", [2, 4])
def test_tensor_parallel_moves_8bsh_per_layer(t_):
    """Megatron (Narayanan et al. 2021): per layer and micro-batch 8bsh(t-1)/t elements (2 all-reduces
    forward, 2 backward; 2 more when recomputation replays the forward); at the edges the embedding's
    (forward) and the head's (backward) all-reduce of bsh and the vocab-parallel loss's bs + 2bs
    fp32 floats. SP: an all-gather + reduce-scatter pair per all-reduce, the same bytes."""
    alpha, beta, b, m, L, V = 10e-6, 1e9, 2, 2, 4, 96
    tokens = b * S
    for sp, rc in [(False, False), (True, False), (False, True)]:
        lay = Candidate(tp=t_, sequence_parallel=sp, recompute=rc, microbatch_size=b, microbatches=m)
        out, t = plan_of(lay, cluster(0.0, beta))
        per_layer = (12 if rc else 8) * tokens * H * (t_ - 1) / t_ * 2  # bf16 bytes
        edges = 2 * 2 * tokens * H * 2 * (t_ - 1) / t_ + 2 * 3 * tokens * 4 * (t_ - 1) / t_
        assert t["tp_ep_s"] * beta == pytest.approx(m * (L * per_layer + edges), rel=EXACT), (sp, rc)
        # with latency: 4 (6) ring collectives a layer of 2(t-1) steps each, as many under SP in
        # twice the collectives of half the steps; the edges' 4 all-reduces
        out, t = plan_of(lay, cluster(alpha, beta))
        hops = ((6 if rc else 4) * L + 4) * 2 * (t_ - 1)
        assert t["tp_ep_s"] == pytest.approx(m * (L * per_layer + edges) / beta + m * hops * alpha, rel=EXACT)
        f, bw, w = passes(tokens, L, t_)
        hf, hb = logits(tokens, V, t_)
        assert t["compute_s"] == pytest.approx(m * (f + bw + w + hf + hb + (f if rc else 0)), rel=EXACT)
        assert t["head_s"] == pytest.approx(hf + hb, rel=EXACT)
        layer_comm = (per_layer / beta + (6 if rc else 4) * 2 * (t_ - 1) * alpha) / 1
        assert t["block_s"] == pytest.approx((f + bw + w + (f if rc else 0)) / L + layer_comm, rel=EXACT)
        # once a step: the gradient norm over tp; under SP the replicated parameters' gradients
        # (per block two norms' weight and bias and two row-parallel biases, then the positions and
        # the final norm) summed over tp, in one run per block's two and one more
        sync = scalar(t_, alpha, beta)
        if sp:
            partial = (2 * L * 3 * H + S * H + 2 * H) * 2  # bf16 bytes
            sync += ring("all_reduce", partial, t_, alpha, beta, messages=2 * L + 1)
        assert t["step_sync_s"] == pytest.approx(sync, rel=EXACT), (sp, rc)
        rows = korthikanti(tokens, L, t_, sp, rc) + (korthikanti(tokens, 1, t_, sp) if rc else 0)
        assert t["activation_bytes"] == rows + tokens * V * 4 // t_, (sp, rc)
        psi = (V * H + L * (12 * H * H + 7 * H)) // t_ + S * H + 2 * H + L * 6 * H
        assert t["params_per_device"] == psi


@pytest.mark.parametrize("c", [2, 4])
def test_context_parallel_ring_moves_kv_per_layer(c):
    """Ring attention over cp = c (Liu et al. 2023): a rank holds bs/c tokens of the micro-batch and
    per layer sends K and V of them, 2·b(s/c)h 16-bit elements, c − 1 times forward and twice that
    backward (K, V and their gradients; once more when recomputation replays the forward), each hop
    one α. Its compute, activations and logits are those of bs/c tokens (the attention term of a
    token's FLOPs keeps the whole s); its gradients are all-reduced over the c ranks."""
    alpha, beta, b, m, L, V = 10e-6, 1e9, 2, 2, 4, 96
    tokens = b * S // c
    for rc in (False, True):
        lay = Candidate(cp=c, recompute=rc, microbatch_size=b, microbatches=m)
        out, t = plan_of(lay, cluster(alpha, beta))
        hop_bytes = 2 * tokens * H * 2  # K and V, bf16
        hops = (c - 1) * L * (4 if rc else 3)
        assert t["cp_send_bytes"] == m * hops * hop_bytes, rc
        assert t["tp_ep_s"] == pytest.approx(m * hops * (alpha + hop_bytes / beta), rel=EXACT), rc
        f, bw, w = passes(tokens, L)
        hf, hb = logits(tokens, V)
        assert t["compute_s"] == pytest.approx(m * (f + bw + w + hf + hb + (f if rc else 0)), rel=EXACT)
        rows = korthikanti(tokens, L, rc=rc) + (korthikanti(tokens, 1) if rc else 0)
        assert t["activation_bytes"] == rows + tokens * V * 4, rc
        psi = params_whole(V, L)
        assert t["dp_grad_s"] == pytest.approx(ring("all_reduce", psi * 2, c, alpha, beta), rel=EXACT)


def pipeline_want(kind, p, m, v, T, head, c=0.0, f=0.0, b=0.0, w=0.0) -> float:
    """The step's body of a pipeline of p ranks (T = F + B + W of a rank's blocks, `head` the logits'
    F + B on the last stage, c a point-to-point message): m (T + head) on the last stage, plus the
    fill and drain: GPipe and 1F1B (p-1) T (Narayanan et al. 2021 §2.2, bubble (p-1)/(m+p-1) without
    the head), interleaved (p-1) T / v (§2.2.2, bubble (p-1)/(vm+p-1)), ZB-H1 (p-1)(F + B - W) and
    ZB-V (p-1)(F + B - 2W) (Qi et al. 2023, 2024); each of the 2(pv-1) hops of the fill and the
    drain sends one message."""
    fill = {
        "gpipe": (p - 1) * T,
        "1f1b": (p - 1) * T,
        "interleaved": (p - 1) * T / v,
        "zb-h1": (p - 1) * (f + b - w),
        "zb-v": (p - 1) * (f + b - 2 * w),
    }[kind]
    return m * (T + head) + fill + 2 * (p * v - 1) * c


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "interleaved"])
def test_pipeline_fill_drain_bubble_and_activations(kind):
    """On links that cost nothing: the makespan, the bubble (1 - the ranks' work over p makespans),
    the micro-batches in flight (GPipe m, 1F1B p, interleaved p + (p-1)/v: Narayanan et al. 2021
    §2.2.2, at most m) and the activations they hold."""
    V, L, b = 96, 8, 1
    v = 2 if kind == "interleaved" else 1
    # (2, 16): more micro-batches than the simulator runs (4p), the rest extrapolated
    for p, m in [(2, 4), (4, 4), (4, 8), (2, 16)]:
        lay = Candidate(pp=p, microbatch_size=b, microbatches=m, schedule=kind, virtual_stages=v)
        out, t = plan_of(lay, FAST, V, L)
        tokens = b * S
        f, bw, w = passes(tokens, L // p)
        hf, hb = logits(tokens, V)
        T, head = f + bw + w, hf + hb
        span = pipeline_want(kind, p, m, v, T, head)
        assert t["pipeline_s"] == pytest.approx(span, rel=SIM), (p, m)
        work = p * m * T + m * head
        assert out["bubble"] == pytest.approx(1 - work / (p * span), rel=SIM), (p, m)
        flight = {"gpipe": m, "1f1b": p, "interleaved": min(m, p + (p - 1) / v)}[kind]
        assert t["in_flight_microbatches"] == pytest.approx(flight, rel=EXACT)
        act = korthikanti(tokens, L // p)
        assert t["activation_bytes_per_microbatch"] == act
        assert t["activation_bytes"] == round(act * flight) + tokens * V * 4
        assert t["params_per_device"] == params_stage(V, L, p)
        assert t["compute_s"] == pytest.approx(m * (T + head), rel=EXACT)


@pytest.mark.parametrize("kind", ["zb-h1", "zb-v"])
def test_zero_bubble_schedules(kind):
    """Qi et al. 2023: ZB-H1's bubble is (p-1)(T_F + T_B - T_W); ZB-V's (2024, two chunks a rank)
    (p-1)(T_F + T_B - 2T_W), ZB-H2's; both hold p micro-batches. A vocabulary of one token makes
    the logits' share 1e-4 of the step: the formula has no term for the last stage's extra work."""
    V, L, b = 1, 8, 1
    for p, m in [(2, 8), (4, 8)]:
        v = 2 if kind == "zb-v" else 1  # ZB-V's V: two chunks a rank
        lay = Candidate(pp=p, microbatch_size=b, microbatches=m, schedule=kind, virtual_stages=v)
        out, t = plan_of(lay, FAST, V, L)
        f, bw, w = passes(b * S, L // p)
        hf, hb = logits(b * S, V)
        span = pipeline_want(kind, p, m, 1, f + bw + w, hf + hb, f=f, b=bw, w=w)
        assert t["pipeline_s"] == pytest.approx(span, rel=SIM), (p, m)
        assert out["bubble"] == pytest.approx(1 - m * (f + bw + w) / span, rel=SIM, abs=SIM)
        assert t["in_flight_microbatches"] == p


@pytest.mark.parametrize("kind, alpha, beta", [("gpipe", 10e-6, 1e9), ("interleaved", 1e-6, 10e9)])
def test_pipeline_messages_step_and_comm_share(kind, alpha, beta):
    """With links that cost: a point-to-point message is α + bsh bf16 bytes over β; the fill and the
    drain expose 2(pv-1) of them (in the step and in comm_share); the gradient norm and the loss are
    summed over pp (a float64 each); the step adds the optimizer's. (Interleaving hides the steady
    state's messages only while one is shorter than a chunk's forward, here 2.2 us against 12 us;
    GPipe's whatever their length.)"""
    V, L, b, p, m = 96, 8, 1, 4, 8
    v = 2 if kind == "interleaved" else 1
    lay = Candidate(pp=p, microbatch_size=b, microbatches=m, schedule=kind, virtual_stages=v)
    out, t = plan_of(lay, cluster(alpha, beta), V, L)
    tokens = b * S
    c = alpha + tokens * H * 2 / beta
    f, bw, w = passes(tokens, L // p)
    hf, hb = logits(tokens, V)
    span = pipeline_want(kind, p, m, v, f + bw + w, hf + hb, c)
    sync = 2 * scalar(p, alpha, beta)
    opt = 2 * params_stage(V, L, p) * 16 / MEM_BW
    step = span + sync + opt
    assert t["p2p_s"] == pytest.approx(c, rel=EXACT)
    assert t["pipeline_s"] == pytest.approx(span, rel=SIM)
    assert t["step_sync_s"] == pytest.approx(sync, rel=EXACT)
    assert t["optimizer_step_s"] == pytest.approx(opt, rel=EXACT)
    assert out["step_s"] == pytest.approx(step, rel=SIM)
    assert out["comm_share"] == pytest.approx((2 * (p * v - 1) * c + sync) / step, rel=SIM)
    states = 16 * params_stage(V, L, p)
    assert out["memory_gb"] == pytest.approx((states + t["activation_bytes"]) / GB, rel=EXACT)
    assert (t["dp_grad_s"], t["dp_exposed_s"], t["tp_ep_s"]) == (0.0, 0.0, 0.0)


@pytest.mark.parametrize("kind", ["gpipe", "zb-h1"])
def test_the_pipeline_engine_adds_its_overhead_to_every_micro_batch(kind):
    """A measured engine overhead o per micro-batch on a rank: m o in pipeline_engine_s and in the
    busy time, and in the makespan as if the actions' compute were longer: GPipe's F by o/2 and BW
    by o/2, (p-1)(T + o) + m(T + o + head); ZB-H1's F, B and W by o/3 each, so its bubble
    (p-1)(F + B - W) grows by (p-1) o/3 only (V = 1 there, as in test_zero_bubble_schedules)."""
    L, b, p, m = 8, 1, 4, 8
    V = 96 if kind == "gpipe" else 1
    f, bw, w = passes(b * S, L // p)
    hf, hb = logits(b * S, V)
    o = 3 * f  # the actions' cost ratios stay exact at the simulator's three digits
    cl = cluster(alpha=0.0, beta=1e21, pipeline_overhead=((kind, o),))
    out, t = plan_of(Candidate(pp=p, microbatch_size=b, microbatches=m, schedule=kind), cl, V, L)
    assert t["pipeline_engine_s"] == pytest.approx(m * o, rel=EXACT)
    if kind == "gpipe":
        want = pipeline_want(kind, p, m, 1, f + bw + w + o, hf + hb)
    else:
        want = pipeline_want(kind, p, m, 1, f + bw + w + o, hf + hb, f=f + o / 3, b=bw + o / 3, w=w + o / 3)
    assert t["pipeline_s"] == pytest.approx(want, rel=SIM)
    busy = t["compute_s"] + m * o + t["step_sync_s"]
    assert t["busy_s"] == pytest.approx(busy, rel=EXACT)


def test_plait_plan_json_prints_the_hand_worked_terms(tmp_path, capsys):
    """`plait plan --json` on a cluster file: every plan has exactly the pinned terms, and the
    rows this file works by hand (dp 2 under each ZeRO stage, pp 2 under GPipe and interleaving)
    print the values of the closed forms (interleaving is left to the test above: this cluster's
    message is longer than a chunk's forward, which the closed form does not cover)."""
    alpha_us, beta_gbps, V, L = 10.0, 1.0, 256, 4
    (tmp_path / "hand.toml").write_text(
        f'name = "hand"\ngpus_per_node = 8\npeak_tflops = 1.0\nmemory_gb = 80.0\nefficiency = 1.0\n'
        f"memory_bw_gbps = {MEM_BW / 1e9}\n"
        f"[intra]\nalpha_us = {alpha_us}\nbeta_gbps = {beta_gbps}\n"
        f"[inter]\nalpha_us = {alpha_us}\nbeta_gbps = {beta_gbps}\n"
    )
    args = ["--model.vocab_size", str(V), "--model.seq_len", str(S), "--model.n_layer", str(L)]
    args += ["--model.n_head", str(NH), "--model.d_model", str(H), "--train.global_batch", "4"]
    args += ["--devices", "2", "--cluster", str(tmp_path / "hand.toml"), "--top", "100", "--json"]
    code = main(["plan", *args])
    assert code == 0
    plans = {r["layout"]: r for r in json.loads(capsys.readouterr().out)["plans"]}
    for r in plans.values():  # (a cp layout's ring bytes: test_context_parallel_ring_moves_kv_per_layer)
        assert set(r["terms"]) == TERMS | ({"cp_send_bytes"} if r["cp"] > 1 else set()), "a new term's test?"
    alpha, beta, psi = alpha_us * 1e-6, beta_gbps * 1e9, params_whole(V, L)
    rs, ag = ring("reduce_scatter", psi * 2, 2, alpha, beta), ring("all_gather", psi * 2, 2, alpha, beta)
    f, bw, w = passes(2 * S, L)
    _, hb = logits(2 * S, V)
    rs3 = ring("reduce_scatter", psi * 2, 2, alpha, beta, L + 1)
    ag3 = ring("all_gather", psi * 2, 2, alpha, beta, L + 1)
    want = {
        "dp2-tp1-pp1-z0-b2x1": ring("all_reduce", psi * 2, 2, alpha, beta),
        "dp2-tp1-pp1-z1-b2x1": rs + ag,
        "dp2-tp1-pp1-z2-b2x1": rs + ag,
        "dp2-tp1-pp1-z3-b2x1": max(rs3 - (bw + w + hb), rs3 / (L + 1)) + max(2 * ag3 - (f + bw + w), ag3 / L),
    }
    for name, exposed in want.items():
        assert plans[name]["terms"]["dp_exposed_s"] == pytest.approx(exposed, rel=EXACT), name
    for mb, m in [(1, 4), (2, 2)]:  # GPipe over pp 2, b1x4 and b2x2
        name = f"dp1-tp1-pp2-z0-b{mb}x{m}-gpipe"
        f, bw, w = passes(mb * S, L // 2)
        hf, hb = logits(mb * S, V)
        c = alpha + mb * S * H * 2 / beta
        span = pipeline_want("gpipe", 2, m, 1, f + bw + w, hf + hb, c)
        assert plans[name]["terms"]["pipeline_s"] == pytest.approx(span, rel=SIM), name
        sync = 2 * scalar(2, alpha, beta)
        step = span + sync + 2 * params_stage(V, L, 2) * 16 / MEM_BW
        assert plans[name]["comm_share"] == pytest.approx((2 * c + sync) / step, rel=SIM), name


@pytest.mark.parametrize(
    "kw",
    [{}, {"tie_weights": False}, {"bias": False}, {"experts": 4, "top_k": 2}, {"experts": 4, "moe_every": 1}],
    ids=["tied", "untied", "no-bias", "moe-every-2", "moe-every-1"],
)
@pytest.mark.parametrize("pp", [1, 2, 4])
def test_stage_params_are_the_heaviest_stages_own_parameters(kw, pp):
    """The parameters the planner prices for the heaviest pipeline stage are those of the actual
    stage modules (plait's GPT cut by split_gpt, counted with torch; a tied head's copy of the
    embedding on the last stage). Mutation testing found the count unpinned; this test found that
    MoE blocks were spread evenly over the stages: at pp 4 with moe_every 2 the heaviest stage
    holds an MoE block, 41,024 parameters where the planner priced 28,880."""
    from plait.models.gpt import GPT
    from plait.models.gpt_parallel import split_gpt
    from plait.planner.cost import stage_params

    cfg = GPTConfig(vocab_size=96, seq_len=16, n_layer=4, n_head=2, d_model=32, **kw)
    model = GPT(cfg)
    stages = split_gpt(model, pp) if pp > 1 else [model]
    heaviest = max(sum(p.numel() for p in s.parameters()) for s in stages)
    assert stage_params(cfg, Candidate(pp=pp)) == heaviest


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("n, f", [(8, 2), (8, 4), (6, 3)])
def test_hybrid_sharding_reduce_scatters_in_a_shard_group_and_all_reduces_over_the_replicas(stage, n, f):
    """Hybrid sharding (FSDP's HYBRID_SHARD, Zhao et al. 2023 §3.2): dp n = N/F replicas x shard
    groups of F consecutive ranks (one node here: gpus_per_node = F). The gradient is a
    reduce-scatter of Ψ over the F ranks on the node's link, then an all-reduce of each Ψ/F shard
    over the N/F replicas on the link between nodes, one message per bucket (one 25 MB bucket;
    ZeRO-3: a unit per block and the root); the parameters are gathered in the shard group, and
    the step and the states are 1/F's. On a CPU node (cores) nothing hides: the exposed time is
    the whole volume. The links differ by 20x in β and α, so a term on the wrong link is off by far."""
    a_in, b_in, a_out, b_out, L = 1e-6, 100e9, 20e-6, 5e9, 4
    cl = Cluster(
        name="hand", gpus_per_node=f, peak_tflops=PEAK / 1e12, memory_gb=80.0, efficiency=1.0,
        intra=Link(alpha_s=a_in, beta_bps=b_in), inter=Link(alpha_s=a_out, beta_bps=b_out),
        memory_bw_gbps=MEM_BW / 1e9, cores=2,
    )  # fmt: skip
    psi = params_whole(96, L)
    out, t = plan_of(Candidate(dp=n, zero_stage=stage, hybrid_shard=f, microbatch_size=2), cl)
    msgs = L + 1 if stage == 3 else 1
    rs = ring("reduce_scatter", psi * 2, f, a_in, b_in, messages=msgs)
    ar = ring("all_reduce", psi * 2 / f, n // f, a_out, b_out, messages=msgs)
    gather = ring("all_gather", psi * 2, f, a_in, b_in, messages=msgs)
    assert t["dp_grad_s"] == pytest.approx(rs + ar, rel=EXACT)
    gathers = 2 * gather if stage == 3 else gather  # ZeRO-3: forward and backward; 1-2: after the step
    assert t["dp_exposed_s"] == pytest.approx(rs + ar + gathers, rel=EXACT)
    assert t["optimizer_step_s"] == pytest.approx(2 * psi / f * 16 / MEM_BW, rel=EXACT)
    shard = -(-psi // f)
    states = {1: 4 * psi + 12 * shard, 2: 2 * psi + 14 * shard, 3: 16 * shard}[stage]
    assert t["model_state_bytes"] == states
    # the norm over the shard group and the loss over every data rank, a float64 each
    norm = math.ceil(math.log2(f)) * a_in + 8 / b_in
    loss = math.ceil(math.log2(n)) * a_out + 8 / b_out
    assert t["step_sync_s"] == pytest.approx(norm + loss, rel=EXACT)

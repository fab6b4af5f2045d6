"""plait.moe: routers against loop transcriptions of GShard Algorithm 1 and Switch, the batched
expert bank against a loop over experts, and expert parallelism (ep = 2, 4 and dp 2 x ep 2)
against one process routing the same groups one after another with every expert.

The transcriptions below are written token by token from the papers (GShard, Lepikhin et al.
2020, Algorithm 1; Switch, Fedus et al. 2021, §2.1-2.2; ST-MoE's z-loss, Zoph et al. 2022,
eq. 5), independently of plait.moe's vectorised code.
"""

import math

import pytest
import torch

from plait.comm import ops
from plait.errors import ConfigError
from plait.mesh import Mesh
from plait.moe import (
    MoE,
    Router,
    Routing,
    attach_loss,
    choose,
    expert_capacity,
    load_balancing_loss,
    route,
    router_z_loss,
)
from plait.moe.experts import Experts, _batched, _per_expert, is_expert_param
from plait.placement import gather_full, placement
from plait.testing import run_ranks

# --- literal transcriptions (loops, float64) ------------------------------------------------------


def _softmax_row(row):
    m = max(row)
    ex = [math.exp(v - m) for v in row]
    return [v / sum(ex) for v in ex]


def _argmax(row):
    best = 0
    for i, v in enumerate(row):
        if v > row[best]:
            best = i
    return best


def gshard_top2(logits, capacity, uniform=None):
    """GShard Algorithm 1 for one group of S tokens (logits [S][E] as lists), literally: returns
    (combine [S][E][C], dispatch [S][E][C], l_aux, dropped claims, dropped tokens)."""
    S, E = len(logits), len(logits[0])
    gates = [_softmax_row(row) for row in logits]
    index_1 = [_argmax(g) for g in gates]
    mask_1 = [[1 if e == index_1[s] else 0 for e in range(E)] for s in range(S)]
    density_1_proxy = [sum(gates[s][e] for s in range(S)) / S for e in range(E)]
    density_1 = [sum(mask_1[s][e] for s in range(S)) / S for e in range(E)]
    # GShard: mean_e(density_proxy · density) · E², i.e. E² · (1/E) Σ_e (c_e/S)·m_e.
    l_aux = sum(density_1_proxy[e] * density_1[e] for e in range(E)) / E * E * E
    gates_without_top_1 = [[gates[s][e] * (1 - mask_1[s][e]) for e in range(E)] for s in range(S)]
    index_2 = [_argmax(g) for g in gates_without_top_1]
    gates_1 = [gates[s][index_1[s]] for s in range(S)]
    gates_2 = [gates[s][index_2[s]] for s in range(S)]
    for s in range(S):
        denom = gates_1[s] + gates_2[s] + 1e-9
        gates_1[s] /= denom
        gates_2[s] /= denom
    # position_in_expert_1 = cumsum(mask_1, exclusive) * mask_1; mask_1 *= (position < C)
    count = [0] * E
    position_1, keep_1 = [], []
    for s in range(S):
        e = index_1[s]
        position_1.append(count[e])
        count[e] += 1
        keep_1.append(position_1[s] < capacity)
    mask_1_count = [sum(1 for s in range(S) if index_1[s] == e and keep_1[s]) for e in range(E)]
    # random routing: the second expert only when 2·g2 > U(0,1)
    active_2 = [uniform is None or 2 * gates_2[s] > uniform[s] for s in range(S)]
    count = [0] * E
    position_2, keep_2 = [], []
    for s in range(S):
        e = index_2[s]
        position_2.append(count[e] + mask_1_count[e])
        if active_2[s]:
            count[e] += 1
        keep_2.append(active_2[s] and position_2[s] < capacity)
    combine = [[[0.0] * capacity for _ in range(E)] for _ in range(S)]
    for s in range(S):
        if keep_1[s]:
            combine[s][index_1[s]][position_1[s]] += gates_1[s]
        if keep_2[s]:
            combine[s][index_2[s]][position_2[s]] += gates_2[s]
    dispatch = [[[c > 0 for c in row] for row in tok] for tok in combine]
    dropped = sum(not k for k in keep_1) + sum(a and not k for a, k in zip(active_2, keep_2))
    dropped_tokens = sum(not (k1 or k2) for k1, k2 in zip(keep_1, keep_2))
    return combine, dispatch, l_aux, dropped, dropped_tokens


def switch_top1(logits, capacity):
    """Switch Transformer top-1 routing of one group (§2.1-2.2): combine, dispatch, the loss
    E · Σ_i f_i · P_i, dropped tokens."""
    S, E = len(logits), len(logits[0])
    p = [_softmax_row(row) for row in logits]
    choice = [_argmax(row) for row in p]
    f = [sum(1 for s in range(S) if choice[s] == e) / S for e in range(E)]
    P = [sum(p[s][e] for s in range(S)) / S for e in range(E)]
    loss = E * sum(f[e] * P[e] for e in range(E))
    combine = [[[0.0] * capacity for _ in range(E)] for _ in range(S)]
    count = [0] * E
    dropped = 0
    for s in range(S):
        e = choice[s]
        if count[e] < capacity:
            combine[s][e][count[e]] = p[s][e]
        else:
            dropped += 1
        count[e] += 1
    dispatch = [[[c > 0 for c in row] for row in tok] for tok in combine]
    return combine, dispatch, loss, dropped


def z_loss_loop(logits):
    """ST-MoE eq. 5: (1/B) Σ_tokens (log Σ_j exp x_j)²."""
    rows = [row for group in logits for row in group]
    return sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in rows) / len(rows)


def _logits(g, s, e, seed, skew=1.5):
    """Fixed logits with expert 0 favoured, so a capacity of k·S/E overflows."""
    gen = torch.Generator().manual_seed(seed)
    out = torch.randn(g, s, e, generator=gen, dtype=torch.float64)
    out[..., 0] += skew
    return out


def _check_routing(r: Routing, combine, dispatch, group: int):
    want_c = torch.tensor(combine, dtype=torch.float64)
    want_d = torch.tensor(dispatch)
    torch.testing.assert_close(r.combine_weights()[group].double(), want_c, atol=1e-6, rtol=0)
    assert torch.equal(r.dispatch_mask()[group], want_d)


# --- routers --------------------------------------------------------------------------------------


@pytest.mark.parametrize("random_routing", [False, True])
@pytest.mark.parametrize("capacity_factor", [1.0, 0.5, 2.0])
def test_top2_routing_is_gshard_algorithm_1(capacity_factor, random_routing):
    G, S, E = 3, 10, 4
    logits = _logits(G, S, E, seed=1)
    uniform = torch.rand(G, S, generator=torch.Generator().manual_seed(2)) if random_routing else None
    routing, choices = route(logits.float(), 2, capacity_factor, uniform)
    C = math.ceil(2 * capacity_factor * S / E)
    assert routing.capacity == C
    dropped = tokens_dropped = 0
    aux = []
    for g in range(G):
        u = None if uniform is None else uniform[g].tolist()
        combine, dispatch, l_aux, d, dt = gshard_top2(logits[g].tolist(), C, u)
        _check_routing(routing, combine, dispatch, g)
        aux.append(l_aux)
        dropped += d
        tokens_dropped += dt
    assert int(routing.dropped) == dropped
    assert int(routing.dropped_tokens) == tokens_dropped
    if capacity_factor <= 1.0:
        assert dropped > 0  # the fixture overflows expert 0
    torch.testing.assert_close(float(load_balancing_loss(choices)), sum(aux) / G, atol=1e-6, rtol=0)
    torch.testing.assert_close(float(router_z_loss(choices)), z_loss_loop(logits.tolist()), atol=1e-5, rtol=0)
    if random_routing:
        assert not bool(choices.active[..., 1].all())  # some second choices were skipped


@pytest.mark.parametrize("capacity_factor", [1.0, 1.5])
def test_top1_routing_is_switch(capacity_factor):
    G, S, E = 2, 12, 4
    logits = _logits(G, S, E, seed=3)
    routing, choices = route(logits.float(), 1, capacity_factor)
    C = math.ceil(capacity_factor * S / E)
    assert routing.capacity == C
    losses, dropped = [], 0
    for g in range(G):
        combine, dispatch, loss, d = switch_top1(logits[g].tolist(), C)
        _check_routing(routing, combine, dispatch, g)
        losses.append(loss)
        dropped += d
    assert dropped > 0 and int(routing.dropped) == dropped == int(routing.dropped_tokens)
    torch.testing.assert_close(float(load_balancing_loss(choices)), sum(losses) / G, atol=1e-6, rtol=0)
    torch.testing.assert_close(float(router_z_loss(choices)), z_loss_loop(logits.tolist()), atol=1e-5, rtol=0)


def test_capacity_dropless_and_balance():
    assert expert_capacity(10, 4, 2, 1.0) == 5
    assert expert_capacity(10, 4, 1, 1.0) == 3
    assert expert_capacity(10, 2, 2, 1.1) == 11  # 2 · 1.1 · 10 / 2 = 11.000000000000002 in floats
    assert expert_capacity(1, 64, 1, 1.0) == 1
    with pytest.raises(ConfigError, match="capacity_factor"):
        expert_capacity(10, 4, 2, 0.0)
    # Dropless: C is the largest load, nothing is dropped, every token keeps both claims.
    routing, choices = route(_logits(2, 10, 4, seed=4).float(), 2, 0.0)
    assert int(routing.dropped) == 0 and bool(routing.kept.all())
    assert routing.capacity == int(choices.load().max())
    # A perfectly balanced router (uniform probabilities, first choices spread evenly) scores 1.
    logits = torch.zeros(1, 8, 4)
    logits[0, torch.arange(8), torch.arange(8) % 4] = 1e-6
    assert abs(float(load_balancing_loss(choose(logits, 1))) - 1.0) < 1e-5
    with pytest.raises(ConfigError, match="top_k"):
        choose(logits, 3)
    with pytest.raises(ConfigError, match="random_routing"):
        Router(8, 4, top_k=1, random_routing=True)


def test_router_draws_random_routing_from_its_generator():
    torch.manual_seed(0)
    router = Router(8, 4, top_k=2, random_routing=True, generator=torch.Generator().manual_seed(7))
    x = torch.randn(2, 16, 8)
    a = router(x).active
    router.generator.manual_seed(7)
    b = router(x).active
    want = router(x).active  # a third draw, from a generator that moved on
    assert torch.equal(a, b) and not torch.equal(a, want)


# --- the expert bank -----------------------------------------------------------------------------


def test_expert_bank_equals_a_loop_over_experts():
    torch.manual_seed(0)
    bank = Experts(d_model=6, d_ff=10, experts=5)
    x = torch.randn(5, 7, 6, requires_grad=True)
    y = bank(x)
    loop = []
    for i in range(5):
        h = torch.nn.functional.gelu(x[i] @ bank.w1[i] + bank.b1[i], approximate="tanh")
        loop.append(h @ bank.w2[i] + bank.b2[i])
    torch.testing.assert_close(y, torch.stack(loop), atol=1e-6, rtol=0)
    assert all(is_expert_param(p) for p in bank.parameters())
    assert placement(bank.w1).sharded == ()  # no mesh: the whole bank, nothing recorded
    with pytest.raises(ConfigError, match="expected"):
        bank(torch.randn(4, 7, 6))


@pytest.mark.parametrize("bias", [True, False])
def test_expert_bank_on_the_cpu_is_the_batched_bank_one_expert_at_a_time(bias):
    """On the CPU the bank runs the batched calls one expert at a time (intermediates one expert's
    size: fewer page faults). Outputs and every gradient are bitwise the batched form's at the MoE
    benchmark's sizes (fp32 and bf16); on a tiny ragged bank, within fp32 rounding."""
    cases = [(2, 1280, 128, 512, torch.float32, True), (2, 1280, 128, 512, torch.bfloat16, True)]
    cases.append((3, 37, 24, 40, torch.float32, False))
    for local, n, d, f, dtype, exact in cases:
        torch.manual_seed(0)
        bank = Experts(d_model=d, d_ff=f, experts=local, bias=bias, dtype=dtype)
        x, grad = torch.randn(2, local, n, d, dtype=dtype)
        results = []
        for fn in (_batched, _per_expert):
            xi = x.clone().requires_grad_()
            params = [
                p if p is None else p.detach().clone().requires_grad_()
                for p in (bank.w1, bank.b1, bank.w2, bank.b2)
            ]
            y = fn(xi, *params)
            y.backward(grad)
            results.append([y, xi.grad, *(p.grad for p in params if p is not None)])
        for a, b in zip(*results):
            if exact:
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(a, b)
        assert torch.equal(bank(x), _per_expert(x, bank.w1, bank.b1, bank.w2, bank.b2))  # the CPU path


def test_moe_layer_is_the_gated_sum_of_its_experts():
    """Single process: y = Σ over kept claims of gate · expert(x) (GShard's einsums with the
    dense combine tensor), groups routed alike in one call or one after another."""
    torch.manual_seed(0)
    d, E, G, S = 8, 4, 3, 10
    moe = MoE(d, 16, E, top_k=2, capacity_factor=0.75, group_size=S)
    x = torch.randn(G, S, d)
    y, stats = moe(x)
    routing, _ = route(moe.router(x).logits, 2, 0.75)
    combine = routing.combine_weights()  # [G, S, E, C]
    dispatched = torch.einsum("gsec,gsd->egcd", routing.dispatch_mask().float(), x)
    out = moe.experts(dispatched.reshape(E, -1, d)).reshape(dispatched.shape)
    want = torch.einsum("gsec,egcd->gsd", combine, out)
    torch.testing.assert_close(y, want, atol=1e-6, rtol=0)
    assert int(stats.dropped) == int(routing.dropped) > 0 and stats.capacity == routing.capacity
    assert int(stats.tokens_per_expert.sum()) == 2 * G * S
    # One group at a time gives the same outputs and, averaged, the same losses.
    parts = [moe(x[g]) for g in range(G)]
    torch.testing.assert_close(y, torch.stack([p[0] for p in parts]), atol=1e-6, rtol=0)
    torch.testing.assert_close(stats.aux_loss, sum(p[1].aux_loss for p in parts) / G, atol=1e-6, rtol=0)
    assert int(stats.dropped) == sum(int(p[1].dropped) for p in parts)
    # A token none of whose claims fit leaves as zero.
    lost = ~routing.kept.any(-1)
    assert bool(lost.any()) and bool((y[lost] == 0).all())
    with pytest.raises(ConfigError, match="group_size"):
        moe(torch.randn(7, d))
    with pytest.raises(ConfigError, match="capacity_factor"):
        MoE(d, 16, E, capacity_factor=-1)


def test_moe_in_bfloat16_routes_in_float32():
    torch.manual_seed(0)
    moe = MoE(8, 16, 4, top_k=1, capacity_factor=0.0, dtype=torch.bfloat16)
    x = torch.randn(2, 5, 8, dtype=torch.bfloat16, requires_grad=True)
    y, stats = moe(x)
    assert y.dtype == torch.bfloat16 and stats.aux_loss.dtype == torch.float32
    (y.float().sum() + stats.aux_loss + stats.z_loss).backward()
    assert x.grad.dtype == torch.bfloat16 and moe.experts.w1.grad.dtype == torch.bfloat16
    assert int(stats.dropped) == 0 and int(stats.tokens_per_expert.sum()) == 10


def test_attach_loss_trains_the_router_as_an_added_loss():
    torch.manual_seed(0)
    moe = MoE(8, 16, 4, top_k=2, capacity_factor=1.0)
    x, w = torch.randn(3, 8), torch.randn(3, 8)
    grads = []
    for attached in (False, True):
        moe.zero_grad()
        y, st = moe(x)
        if attached:
            ((attach_loss(y, 0.3 * st.aux_loss + 0.02 * st.z_loss, 0.5)) * w).sum().backward()
        else:
            ((y * w).sum() + 0.5 * (0.3 * st.aux_loss + 0.02 * st.z_loss)).backward()
        grads.append(moe.router.weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=0)
    assert float((grads[0] - moe_router_grad_without_losses(moe, x, w)).abs().max()) > 1e-4


def moe_router_grad_without_losses(moe, x, w):
    moe.zero_grad()
    y, _ = moe(x)
    (y * w).sum().backward()
    return moe.router.weight.grad.clone()


# --- expert parallelism ---------------------------------------------------------------------------

D, FF, E, TOKENS = 8, 12, 4, (2, 6)  # each rank's micro-batch: 2 sequences of 6 tokens, one group
COEF_AUX, COEF_Z = 0.1, 0.01
CASES = [  # name, top_k, capacity_factor, random routing, force every token to experts 0 (and 1)
    ("top2 capacity", 2, 0.75, False, False),
    ("top2 capacity random", 2, 0.75, True, False),
    ("top1 capacity", 1, 1.0, False, False),
    ("top2 dropless", 2, 0.0, False, False),
    ("top1 dropless", 1, 0.0, False, False),
    ("top2 all to rank 0", 2, 1.0, False, True),
    ("top1 dropless all to rank 0", 1, 0.0, False, True),
]


def _build(top_k, cf, rr, force, mesh=None):
    torch.manual_seed(11)  # the same draws whatever the mesh: router, then the whole bank
    gen = torch.Generator().manual_seed(0) if rr else None
    moe = MoE(D, FF, E, top_k=top_k, capacity_factor=cf, mesh=mesh, random_routing=rr, generator=gen)
    if force:  # equal logits: argmax takes expert 0, then expert 1 (on ep rank 0, or 0 and 1 at ep=4)
        with torch.no_grad():
            moe.router.weight.zero_()
    return moe


def _group_data(groups):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(groups, *TOKENS, D, generator=gen)
    w = torch.randn(groups, *TOKENS, D, generator=gen)  # upstream weights of each group's output
    return x, w


def _loss(y, stats, w):
    return (y * w).sum() + COEF_AUX * stats.aux_loss + COEF_Z * stats.z_loss


def _reference(case, groups):
    """One process, every expert, the groups one after another (random routing: group g draws
    from a generator seeded with g)."""
    _, top_k, cf, rr, force = case
    moe = _build(top_k, cf, rr, force)
    x, w = _group_data(groups)
    x.requires_grad_(True)
    outs, stats, total = [], [], 0
    for g in range(groups):
        if rr:
            moe.router.generator.manual_seed(g)
        y, st = moe(x[g])
        outs.append(y.detach())
        stats.append(st)
        total = total + _loss(y, st, w[g])
    total.backward()
    grads = {n: p.grad.clone() for n, p in moe.named_parameters()}
    return outs, stats, grads, x.grad


def _ep_case(mesh, case, step):
    """Rank at group index q (over dp x ep) routes group q; compare with the reference."""
    name, top_k, cf, rr, force = case
    groups, q = mesh.size("dp*ep"), mesh.rank("dp*ep")
    ref_out, ref_stats, ref_grads, ref_xgrad = _reference(case, groups)
    moe = _build(top_k, cf, rr, force, mesh)
    if rr:
        moe.router.generator.manual_seed(q)
    x, w = _group_data(groups)
    x = x[q].clone().requires_grad_(True)
    mesh.ledger.set_step(step)
    y, st = moe(x)
    _loss(y, st, w[q]).backward()
    rows = mesh.ledger.rows(step)  # what the layer sent, before the checks' own collectives
    mesh.ledger.set_step(step + 1000)

    close = lambda a, b, what: torch.testing.assert_close(  # noqa: E731
        a, b, atol=1e-5, rtol=0, msg=lambda m: f"{name}, rank {mesh.global_rank}, {what}: {m}"
    )
    close(y, ref_out[q], "output")
    close(x.grad, ref_xgrad[q], "input gradient")
    close(st.aux_loss, ref_stats[q].aux_loss, "aux loss")
    close(st.z_loss, ref_stats[q].z_loss, "z loss")
    assert int(st.dropped) == int(ref_stats[q].dropped), (name, "dropped")
    assert int(st.dropped_tokens) == int(ref_stats[q].dropped_tokens), (name, "dropped tokens")
    assert torch.equal(st.tokens_per_expert, ref_stats[q].tokens_per_expert), (name, "tokens per expert")
    if cf > 0:
        assert st.capacity == ref_stats[q].capacity
    # The router is replicated: its gradient summed over the batch axes is the reference's.
    g = moe.router.weight.grad.clone()
    ops.all_reduce(g, mesh, "dp*ep")
    close(g, ref_grads["router.weight"], "router gradient")
    # An expert's gradient is complete over its ep line (the combine all-to-all brought every
    # line rank's tokens back), so only dp replicas need summing.
    for pname, p in moe.experts.named_parameters():
        assert placement(p).shard("ep") is not None and is_expert_param(p)
        full = gather_full(p.grad, mesh, "ep", pl=placement(p))
        ops.all_reduce(full, mesh, "dp")
        close(full, ref_grads[f"experts.{pname}"], f"gradient of {pname}")

    # Ledger: 4 all-to-alls of the [E, G·C, d] buffer (dispatch and combine, forward and backward).
    ep, c = mesh.size("ep"), st.capacity
    a2a = rows[("all_to_all", "ep")]
    payload = E * 1 * c * D * 4  # E experts x (1 group x C slots) x d_model x fp32 bytes
    assert a2a.count == 4 and a2a.payload_bytes == 4 * payload, (name, a2a)
    assert a2a.bus_bytes == pytest.approx(4 * payload * (ep - 1) / ep)
    dropless = rows.get(("all_reduce", "ep"))
    if cf == 0:  # the one int64 all-reduce(max) that agrees on C
        assert dropless is not None and dropless.count == 1 and dropless.payload_bytes == 8
    else:
        assert dropless is None
    if force:  # experts 2 and 3 got no token; their ranks still took part in every exchange
        assert int(st.tokens_per_expert[2:].sum()) == 0
        if moe.experts.first >= 2:
            assert all(float(p.grad.abs().max()) == 0 for p in moe.experts.parameters())
    assert set(rows) <= {("all_to_all", "ep"), ("all_reduce", "ep")}, rows
    return int(st.dropped)


def _ep_cases(shapes):
    dropped = {}
    for shape in shapes:
        mesh = Mesh(**shape, timeout_s=60)
        for i, case in enumerate(CASES):
            dropped[(tuple(shape.items()), case[0])] = _ep_case(mesh, case, step=i + 1)
        with pytest.raises(ConfigError, match="multiple of ep"):
            MoE(D, FF, 3, mesh=mesh)
        mesh.close()
    return dropped


def _assert_some_dropped(results):
    for key in results[0]:
        total = sum(r[key] for r in results)
        if "capacity" in key[1] or ("rank 0" in key[1] and "dropless" not in key[1]):
            assert total > 0, f"{key}: no token was dropped, the capacity case tests nothing"
        else:
            assert total == 0, key


def test_expert_parallel_ep2_matches_one_process():
    _assert_some_dropped(run_ranks(_ep_cases, 2, args=([dict(ep=2)],), timeout=180))


def test_expert_parallel_ep4_and_dp2_ep2_match_one_process():
    _assert_some_dropped(run_ranks(_ep_cases, 4, args=([dict(ep=4), dict(dp=2, ep=2)],), timeout=240))


def test_the_routers_bounds_are_exact():
    """The smallest valid inputs pass and the next ones down are refused (mutation testing found
    these bounds untested): top-2 over exactly 2 experts (one token or four), capacity 1."""
    from plait.moe.router import assign

    for tokens in (1, 4):
        choices = choose(torch.randn(1, tokens, 2), top_k=2)  # 2 experts: the least top-2 takes
        routing = assign(choices, capacity=1)  # one slot per expert: the least capacity
        assert routing.expert.shape == (1, tokens, 2)
    with pytest.raises(ConfigError, match="top_k=2 needs at least 2 experts"):
        choose(torch.randn(1, 4, 1), top_k=2)
    with pytest.raises(ConfigError, match="expert capacity must be >= 1, got 0"):
        assign(choose(torch.randn(1, 4, 2), top_k=2), capacity=0)

"""Ring attention and Ulysses (plait.context_parallel) against attention written from its
equations, softmax(QKᵀ/√d + causal mask)·V on the whole sequence in float64, at cp = 2 and 4:
outputs and the gradients of q, k and v within 1e-10 (float64), with grouped-query heads, the
head-tail and contiguous layouts, and sequences that do and do not divide into 2·cp chunks; the
ledger's bytes equal the formulas exactly; planted bugs (the causal skip dropped, the merge
without the log-sum-exp correction) fail by far more than 3x the tolerance.
"""

import math

import pytest
import torch

from plait.context_parallel import SequenceSplit, chunk_bounds, ring_attention, ring_work, ulysses_attention
from plait.context_parallel import ring as ring_mod
from plait.errors import ConfigError
from plait.testing import run_ranks

TOL = 1e-10
B, D = 2, 8


def reference(q, k, v):
    """softmax(q kᵀ / sqrt(d) + M) v with M = -inf above the diagonal; key/value head j repeated
    for its H / H_kv consecutive query heads. Written from the definition, not torch's sdpa."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    T = q.shape[2]
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    p = torch.exp(s - s.max(-1, keepdim=True).values)
    return (p / p.sum(-1, keepdim=True)) @ v


def _inputs(T, H, Hkv, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, T, D, generator=g, dtype=torch.float64) for h in (H, Hkv, Hkv))
    dout = torch.randn(B, H, T, D, generator=g, dtype=torch.float64)
    return q, k, v, dout


def _errors(fn, mesh, split, T, H, Hkv, dtype=torch.float64):
    """Max |error| of the output and each input gradient (computed in `dtype`) against the
    float64 reference, on this rank's tokens; the ledger's sends (ring) or all-to-all bus bytes
    (Ulysses) in forward and backward."""
    q, k, v, dout = _inputs(T, H, Hkv)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = reference(*ref_in)
    ref.backward(dout)
    me = mesh.rank("dp")
    mesh.ledger.clear()
    loc = [split.take(t, me, dim=2).to(dtype).requires_grad_() for t in (q, k, v)]
    mesh.ledger.set_step(1)
    out = fn(*loc)
    mesh.ledger.set_step(2)
    out.backward(split.take(dout, me, dim=2).to(dtype))
    errs = {"out": (out - split.take(ref.detach(), me, dim=2)).abs().max().item()}
    for name, mine, whole in zip("qkv", loc, ref_in, strict=True):
        errs["d" + name] = (mine.grad - split.take(whole.grad, me, dim=2)).abs().max().item()
    rows = {s: mesh.ledger.rows(s) for s in (1, 2)}
    sent = {s: sum(r.payload_bytes for (op, _), r in rows[s].items() if op == "send") for s in (1, 2)}
    a2a = {s: sum(r.bus_bytes for (op, _), r in rows[s].items() if op == "all_to_all") for s in (1, 2)}
    return errs, sent, a2a


def _cases(cp):
    H, Hkv = 4, 2  # grouped-query attention: 2 query heads per key/value head
    return [
        ("ring", "head-tail", 8 * cp, H, Hkv),
        ("ring", "head-tail", 8 * cp + 3, H, Hkv),  # not a multiple of 2 cp: chunks of unequal length
        ("ring", "contiguous", 4 * cp + 1, H, Hkv),
        ("ulysses", "contiguous", 4 * cp, 2 * cp, cp),
    ]


def _check_world(cp):
    import torch.distributed as dist

    from plait.mesh import Mesh

    mesh = Mesh(dp=dist.get_world_size(), watchdog=False)
    out = {}
    for style, layout, T, H, Hkv in _cases(cp):
        split = SequenceSplit(T, cp, layout)
        if style == "ring":
            fn = lambda q, k, v, split=split: ring_attention(q, k, v, mesh, "dp", split)  # noqa: E731
        else:
            fn = lambda q, k, v: ulysses_attention(q, k, v, mesh, "dp")  # noqa: E731
        out[(style, layout, T)] = _errors(fn, mesh, split, T, H, Hkv)
    # fp32, as training computes (the blocks accumulate in fp32): head-tail ring and Ulysses
    split = SequenceSplit(8 * cp, cp)
    fp32 = {
        "ring": _errors(
            lambda q, k, v: ring_attention(q, k, v, mesh, "dp", split),
            mesh,
            split,
            8 * cp,
            4,
            2,
            torch.float32,
        )[0],
        "ulysses": _errors(
            lambda q, k, v: ulysses_attention(q, k, v, mesh, "dp"),
            mesh,
            SequenceSplit(8 * cp, cp, "contiguous"),
            8 * cp,
            2 * cp,
            cp,
            torch.float32,
        )[0],
    }
    # planted bugs, on the even head-tail case
    split = SequenceSplit(8 * cp, cp)
    ring = lambda q, k, v: ring_attention(q, k, v, mesh, "dp", split)  # noqa: E731
    planted = {}
    keep_blocks, keep_lae = ring_mod._blocks, torch.logaddexp

    def every_block(split_, me, src):  # the causal skip dropped: blocks above the diagonal too
        off = [0]
        for a, b in split_.chunks(src):
            off.append(off[-1] + b - a)
        qo = 0
        got = []
        for qa, qb in split_.chunks(me):
            for i, (ka, kb) in enumerate(split_.chunks(src)):
                got.append((slice(qo, qo + qb - qa), slice(off[i], off[i + 1]), (ka, kb) == (qa, qb)))
            qo += qb - qa
        return got

    try:
        ring_mod._blocks = every_block
        planted["no causal skip"] = _errors(ring, mesh, split, 8 * cp, 4, 2)[0]
    finally:
        ring_mod._blocks = keep_blocks
    try:  # the merge without the log-sum-exp correction: partial outputs summed as they come
        ring_mod.torch.logaddexp = lambda a, b: torch.zeros_like(b)
        planted["no lse correction"] = _errors(ring, mesh, split, 8 * cp, 4, 2)[0]
    finally:
        ring_mod.torch.logaddexp = keep_lae
    return out, planted, fp32


@pytest.fixture(scope="module")
def world2():
    return run_ranks(_check_world, 2, args=(2,), timeout=240)


@pytest.fixture(scope="module")
def world4():
    return run_ranks(_check_world, 4, args=(4,), timeout=300)


def _expected_sends(cp, r, T, Hkv, layout):
    """The ring's sends on rank r, from the layout: forward K and V of the blocks it holds at
    steps 0..cp-2; backward those again plus dK and dV of the blocks it holds at steps 1..cp-1."""
    split = SequenceSplit(T, cp, layout)
    per_token = 2 * B * Hkv * D * 8  # K and V, float64
    kv = sum(split.local_len((r - s) % cp) for s in range(cp - 1)) * per_token
    dkv = sum(split.local_len((r - s) % cp) for s in range(1, cp)) * per_token
    return kv, kv + dkv


@pytest.mark.parametrize("world", ["world2", "world4"])
def test_ring_and_ulysses_equal_attention_from_its_equations(world, request):
    ranks = request.getfixturevalue(world)
    cp = len(ranks)
    for r, (out, _, _) in enumerate(ranks):
        for (style, layout, T), (errs, sent, a2a) in out.items():
            assert max(errs.values()) < TOL, (cp, r, style, layout, T, errs)
            H, Hkv = next((h, hk) for s, lay, t, h, hk in _cases(cp) if (s, lay, t) == (style, layout, T))
            if style == "ring":
                fwd, bwd = _expected_sends(cp, r, T, Hkv, layout)
                assert (sent[1], sent[2]) == (fwd, bwd), (cp, r, layout, T, sent, fwd, bwd)
                assert a2a == {1: 0, 2: 0}
            else:
                L = T // cp
                # four all-to-alls each way: q and the output (H heads), k and v (H_kv heads)
                want = (cp - 1) / cp * B * L * D * 8 * (2 * H + 2 * Hkv)
                assert a2a[1] == pytest.approx(want, rel=1e-12) and a2a[2] == pytest.approx(want, rel=1e-12)
                assert sent == {1: 0, 2: 0}


def test_the_even_ring_sends_the_issues_formula(world4):
    """Even split: forward 2(cp-1)·B·(T/cp)·h_kv·d·bytes, backward twice that (K, V and dK, dV)."""
    cp, T, Hkv = 4, 32, 2
    want = 2 * (cp - 1) * B * (T // cp) * Hkv * D * 8
    for out, _, _ in world4:
        _, sent, _ = out[("ring", "head-tail", T)]
        assert sent == {1: want, 2: 2 * want}


@pytest.mark.parametrize("world", ["world2", "world4"])
def test_planted_ring_bugs_are_seen(world, request):
    for _, planted, _ in request.getfixturevalue(world):
        for bug, errs in planted.items():
            assert max(errs.values()) > 3 * TOL * 1e6, (bug, errs)  # far beyond 3x the tolerance


@pytest.mark.parametrize("world", ["world2", "world4"])
def test_in_fp32_the_ring_and_ulysses_are_within_1e_5_of_the_reference(world, request):
    for _, _, fp32 in request.getfixturevalue(world):
        for style, errs in fp32.items():
            assert max(errs.values()) < 1e-5, (style, errs)


def test_head_tail_balances_the_causal_work():
    """Per-rank scores of one causal ring attention: head-tail gives every rank the same, the
    contiguous layout gives the last rank 2cp-1 times the first's (+ its diagonal)."""
    for cp in (2, 4, 8):
        T = 2 * cp * 16
        ht = ring_work(SequenceSplit(T, cp, "head-tail"))
        assert len(set(ht)) == 1 and sum(ht) == T * (T + 1) // 2
        co = ring_work(SequenceSplit(T, cp, "contiguous"))
        c = T // cp
        assert co == [r * c * c + c * (c + 1) // 2 for r in range(cp)] and sum(co) == T * (T + 1) // 2


def test_sequence_layouts():
    assert chunk_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    s = SequenceSplit(10, 2)
    assert s.chunks(0) == [(0, 3), (8, 10)] and s.chunks(1) == [(3, 6), (6, 8)]
    assert s.positions(0).tolist() == [0, 1, 2, 8, 9]
    x = torch.arange(20).view(2, 10)
    assert torch.equal(torch.cat([s.take(x, 0), s.take(x, 1)], 1).sort(1).values, x)
    with pytest.raises(ConfigError, match="cannot be split into the 8 chunks"):
        SequenceSplit(7, 4)
    with pytest.raises(ConfigError, match="layout 'zigzag' is not valid; valid: head-tail, contiguous"):
        SequenceSplit(16, 2, "zigzag")
    with pytest.raises(ConfigError, match="split sequences of 10 tokens, got 9"):
        s.take(torch.zeros(1, 9), 0)

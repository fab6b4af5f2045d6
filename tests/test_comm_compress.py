"""Gradient compressors: the quantiser's rule, packing, error feedback, top-k, and compressed DDP."""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from plait import comm
from plait.comm.compress import (
    FP16Compressor,
    OneBitCompressor,
    PowerSGDCompressor,
    TopKCompressor,
    column_groups,
    make_compressor,
    onebit_dequantize,
    onebit_quantize,
    pack_bits,
    unpack_bits,
)
from plait.data_parallel import DataParallel, GradBucket
from plait.errors import ConfigError
from plait.mesh import Mesh
from plait.testing import run_ranks


def _bucket(shapes, values=None, index=0) -> GradBucket:
    """DataParallel's own GradBucket over parameters of the given shapes, holding `values`."""
    bucket = GradBucket(index, [torch.empty(s) for s in shapes], [f"p{i}" for i in range(len(shapes))])
    if values is not None:
        bucket.buffer.copy_(values)
    return bucket


def test_onebit_reconstruction_is_the_column_means_rule():
    g = torch.tensor([[1.0, -2.0, 0.5], [3.0, -4.0, -0.5], [-1.0, -6.0, 0.0]])
    bits, pos, neg = onebit_quantize(g)
    # column 0: non-negative {1, 3} -> 2, negative {-1} -> -1; column 1: none >= 0 -> 0, {-2,-4,-6} -> -4;
    # column 2: {0.5, 0.0} -> 0.25, {-0.5} -> -0.5 (threshold 0: zero goes with the non-negative side)
    assert pos.tolist() == [2.0, 0.0, 0.25] and neg.tolist() == [-1.0, -4.0, -0.5]
    expected = torch.tensor([[2.0, -4.0, 0.25], [2.0, -4.0, -0.5], [-1.0, -4.0, 0.25]])
    assert torch.equal(onebit_dequantize(bits, pos, neg), expected)
    # these two values minimise the squared error among all two-level reconstructions of a column
    col = g[:, 0]
    best = ((col - expected[:, 0]) ** 2).sum()
    for a in torch.linspace(-3, 4, 29):
        for b in torch.linspace(-3, 4, 29):
            assert ((col - torch.where(col >= 0, a, b)) ** 2).sum() >= best - 1e-6
    # the compressor applies exactly this rule per column of a parameter (min_group=1: the paper),
    # on the parameter's own layout inside a bucket, with a bias (one column) beside it
    c = OneBitCompressor(min_group=1)
    bucket = _bucket([(3, 3), (2,)], torch.cat([g.reshape(-1), torch.tensor([0.5, -1.5])]))
    bits, scales = c.encode(bucket)
    out = torch.zeros(11)
    c.decode_into(out, bits, scales, bucket)
    assert torch.equal(out[:9].view(3, 3), expected) and out[9:].tolist() == [0.5, -1.5]
    assert torch.equal(c.residuals[0], bucket.buffer - out)  # error feedback keeps the difference


def test_small_columns_are_grouped_to_keep_the_scales_cheap():
    assert column_groups(torch.Size([4096, 16]), 2048) == (4096, 16, 4096)  # long columns: per column
    assert column_groups(torch.Size([128, 512]), 2048) == (128, 512, 2048)  # 16 columns per group
    assert column_groups(torch.Size([100]), 2048) == (100, 1, 2100)  # a vector: one group
    g = torch.randn(128, 40, generator=torch.Generator().manual_seed(3))
    c = OneBitCompressor(min_group=2048)  # groups of 16 columns: 2 full groups and one of 8 columns
    bucket = _bucket([(128, 40)], g.reshape(-1))
    bits, scales = c.encode(bucket)
    assert scales.numel() == 2 * 3
    out = torch.zeros(128 * 40)
    c.decode_into(out, bits, scales, bucket)
    for cols in (slice(0, 16), slice(16, 32), slice(32, 40)):
        block = g[:, cols]
        rec = out.view(128, 40)[:, cols]
        assert torch.allclose(rec[block >= 0], block[block >= 0].mean().expand(int((block >= 0).sum())))
        assert torch.allclose(rec[block < 0], block[block < 0].mean().expand(int((block < 0).sum())))


def test_bits_pack_eight_per_byte():
    bits = torch.rand(1001, generator=torch.Generator().manual_seed(0)) > 0.5
    packed = pack_bits(bits)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(1001 / 8)
    assert torch.equal(unpack_bits(packed, 1001), bits)
    assert pack_bits(torch.tensor([True] + [False] * 7)).tolist() == [128]


def test_onebit_message_is_a_32nd_of_fp32_plus_scales():
    shapes = [(256, 64), (64,)]
    b = _bucket(shapes, torch.randn(256 * 64 + 64))
    bits, scales = OneBitCompressor().encode(b)  # groups of 8 columns of 256, and the bias
    n = b.buffer.numel()
    message = pack_bits(bits).numel() + scales.numel() * 4
    assert scales.numel() == 2 * (8 + 1)  # two values per group
    assert message == math.ceil(n / 8) + 8 * 9
    assert 4 * n / message > 30


def test_error_feedback_keeps_the_running_sums_together():
    gen = torch.Generator().manual_seed(1)
    shapes = [(32, 16), (16,)]
    with_ef, without = OneBitCompressor(True), OneBitCompressor(False)
    true_sum = torch.zeros(32 * 16 + 16)
    sums = {id(with_ef): torch.zeros_like(true_sum), id(without): torch.zeros_like(true_sum)}
    gaps = {id(with_ef): [], id(without): []}
    for _ in range(200):
        g = torch.randn(true_sum.numel(), generator=gen) * 0.1 + 0.05  # a persistent small bias
        true_sum += g
        for c in (with_ef, without):
            b = _bucket(shapes, g)
            bits, scales = c.encode(b)
            out = torch.zeros_like(g)
            c.decode_into(out, bits, scales, b)
            sums[id(c)] += out
            gaps[id(c)].append(float((true_sum - sums[id(c)]).norm()))
    # with error feedback the gap is exactly the residual, and stays bounded
    assert torch.allclose(true_sum - sums[id(with_ef)], with_ef.residuals[0], atol=1e-4)
    assert max(gaps[id(with_ef)][100:]) < 2 * max(gaps[id(with_ef)][:100]) + 1e-3
    # without it the error accumulates
    assert gaps[id(without)][-1] > 5 * gaps[id(with_ef)][-1]


@pytest.mark.parametrize("make", [lambda: OneBitCompressor(True, min_group=64), lambda: TopKCompressor(0.05)])
def test_error_feedback_is_kept_in_units_of_the_step(make, monkeypatch):
    # Under a learning-rate schedule the residual holds lr-scaled gradients: the running sum of
    # scale_t x (what the hook returns) tracks that of scale_t x g_t, the gap being exactly the
    # residual, and what the optimizer receives is a gradient (the decoded values / scale_t).
    # The hook runs whole, on one rank: its all-gather copies the message.
    def gather(out, message, mesh, axis, async_op, logical_bytes):
        out.copy_(message)
        return SimpleNamespace(wait=lambda: None)

    monkeypatch.setattr(comm, "all_gather", gather)
    gen = torch.Generator().manual_seed(3)
    c, plain = make(), make()
    n = 32 * 16
    true_sum, sent_sum = torch.zeros(n), torch.zeros(n)
    for t in range(60):
        scale = (t + 1) / 20 if t < 20 else 1.0 - 0.9 * (t - 20) / 40  # warm-up, then decay
        g = torch.randn(n, generator=gen) + 0.3
        c.set_lr_scale(scale)
        out = _exchange(c, [(32, 16)], g)
        true_sum += scale * g
        sent_sum += scale * out
        torch.testing.assert_close(true_sum - sent_sum, c.residuals[0], atol=1e-4, rtol=0)
    # at scale 1 it is the compressor without scaling: a fresh one (default scale) gives the same
    c.set_lr_scale(1.0)
    c.residuals = {}
    g = torch.randn(n, generator=gen)
    torch.testing.assert_close(_exchange(c, [(32, 16)], g), _exchange(plain, [(32, 16)], g))
    # a zero learning rate keeps the previous scale instead of dividing by zero
    c.set_lr_scale(0.4)
    c.set_lr_scale(0.0)
    assert c.lr_scale == 0.4


def _exchange(c, shapes, g):
    """One rank's exchange through the whole hook; returns what it leaves in the bucket."""
    b = _bucket(shapes, g)
    return c(b, SimpleNamespace(size=lambda axis: 1), "dp").wait().clone()


def test_topk_keeps_exactly_ceil_rn_and_the_rest_stays():
    for n, r in [(1000, 0.01), (1001, 0.01), (37, 0.1), (5, 1.0)]:
        g = torch.randn(n, generator=torch.Generator().manual_seed(n))
        c = TopKCompressor(r)
        b = _bucket([(n,)], g)
        idx, values = c.select(b)
        k = math.ceil(r * n)
        assert idx.numel() == k == len(set(idx.tolist())) and idx.dtype == torch.int32
        assert values.abs().min() >= g.abs().sort(descending=True).values[k - 1] - 1e-7
        sent = torch.zeros(n).index_put_((idx.long(),), values)
        assert torch.allclose(sent + c.residuals[0], g)  # nothing lost: sent + residual = gradient
        assert (4 * n) / (8 * k) >= (40 if r == 0.01 and n >= 1000 else 0)


class _OneRank:
    """A mesh of one rank: plait.comm's collectives return at once."""

    def size(self, axis: str) -> int:
        return 1


def test_powersgd_reconstructs_a_low_rank_matrix_and_keeps_the_rest():
    torch.manual_seed(0)
    low = torch.randn(16, 2) @ torch.randn(2, 12)  # rank 2
    vec, full = torch.randn(5), torch.randn(16, 12)  # a vector is sent exactly
    c = PowerSGDCompressor(rank=2)
    b = _bucket([(16, 12), (5,)], torch.cat([low.reshape(-1), vec]))
    out = c(b, _OneRank(), "dp").wait()
    torch.testing.assert_close(out, torch.cat([low.reshape(-1), vec]), atol=1e-5, rtol=0)
    assert float(c.residuals[0].abs().max()) < 1e-5
    # a full-rank matrix: the decoded part and the residual add up to what was to be sent
    c = PowerSGDCompressor(rank=2)
    b = _bucket([(16, 12), (5,)], torch.cat([full.reshape(-1), vec]))
    sent = c(b, _OneRank(), "dp").wait().clone()
    torch.testing.assert_close(sent + c.residuals[0], torch.cat([full.reshape(-1), vec]), atol=1e-5, rtol=0)
    assert float(c.residuals[0][:192].norm()) > 0.3 * float(full.norm()) and not c.residuals[0][192:].any()
    # rank r <= min(n, m) only: a (4, 12) matrix at rank 4 has nothing to save and is sent exactly
    assert [i for i, *_ in PowerSGDCompressor(rank=4)._matrices(_bucket([(4, 12), (16, 12)]))] == [1]


def test_bad_compression_settings():
    with pytest.raises(ConfigError, match="none, fp16, onebit, topk, powersgd"):
        make_compressor("twobit")
    for r in (0.0, -0.1, 1.5):
        with pytest.raises(ConfigError, match="topk_ratio"):
            make_compressor("topk", topk_ratio=r)
    assert make_compressor("none") is None and isinstance(make_compressor("fp16"), FP16Compressor)
    with pytest.raises(ConfigError, match="powersgd_rank must be >= 1"):
        make_compressor("powersgd", powersgd_rank=0)


def _same_on_every_rank(flat: torch.Tensor, mesh: Mesh) -> bool:
    everyone = torch.empty(mesh.size("dp") * flat.numel())
    comm.all_gather(everyone, flat, mesh, "dp")
    rows = everyone.view(mesh.size("dp"), -1)
    return all(torch.equal(rows[0], row) for row in rows)


def _compressed_ddp():
    n = dist.get_world_size()
    mesh = Mesh(dp=n, timeout_s=60)
    results, final = {}, {}
    for name in ("fp16", "onebit", "topk", "powersgd", "none", "topk-all"):
        mesh.ledger.clear()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
        params = sum(p.numel() for p in model.parameters())
        # "topk-all" keeps every entry: under a changing lr scale it must equal plain DDP ("none")
        hook = make_compressor(
            name.split("-")[0], topk_ratio=1.0 if name == "topk-all" else 0.05, powersgd_rank=2
        )
        ddp = DataParallel(model, mesh, bucket_mb=0.004, comm_hook=hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(100 + dist.get_rank())  # different data on each rank
        for step in range(5):
            if hasattr(hook, "set_lr_scale"):  # as the trainer does: error feedback in step units
                hook.set_lr_scale(0.3 + 0.2 * step)
            mesh.ledger.set_step(step)
            x, y = torch.randn(16, 32, generator=gen), torch.randn(16, 8, generator=gen)
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
            opt.zero_grad()
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            mesh.ledger.set_step(-1)
            assert _same_on_every_rank(flat, mesh), f"{name}: replicas differ at {step}"
        final[name] = flat
        if name in ("none", "topk-all"):
            ddp.remove_hooks()
            continue
        ledger = mesh.ledger.rows(4)
        op = "all_reduce" if name in ("fp16", "powersgd") else "all_gather"
        row = ledger[(op, "dp")]
        calls = len(ddp.buckets)
        if name == "powersgd":  # P, then Q for every bucket holding a compressed matrix
            calls += sum(any(True for _ in hook._matrices(b)) for b in ddp.buckets)
        assert row.logical_bytes == 4 * params and row.count == calls
        results[name] = row.bus_bytes / (2 * (n - 1) / n * 4 * params)  # vs an fp32 all-reduce
        ddp.remove_hooks()
    torch.testing.assert_close(final["topk-all"], final["none"], atol=1e-6, rtol=0)
    mesh.close()
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_compressed_ddp_keeps_replicas_identical(world, request):
    ratios = request.getfixturevalue(f"ranks_{world}")[0]["ddp"]
    assert abs(ratios["fp16"] - 0.5) < 1e-9
    assert ratios["onebit"] < 1 / 20 * world / 2 + 0.05  # 1/32 of fp32 plus scales, gathered
    assert ratios["topk"] < 0.1 * world / 2 + 0.01  # 5% of entries, 8 bytes each, gathered
    # rank 2: (64 + 32) x 2 and (8 + 64) x 2 floats for the matrices, the 72 bias entries exactly
    assert abs(ratios["powersgd"] - (2 * 96 + 2 * 72 + 72) / (32 * 64 + 64 + 64 * 8 + 8)) < 1e-9


def _train_mlp(mesh: Mesh, stage: int, hook, steps: int = 4, **opts) -> torch.Tensor:
    """The MLP of these tests under `zero.wrap(stage, comm_hook=hook)`, trained `steps` SGD steps
    on per-rank data (ledger step = step index); its parameters, sorted by name, identical on
    every rank (asserted)."""
    from plait import zero

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
    engine = zero.wrap(
        model, mesh, stage, lambda g: torch.optim.SGD(g, lr=0.1), bucket_mb=0.004, comm_hook=hook, **opts
    )
    gen = torch.Generator().manual_seed(100 + dist.get_rank())  # different data on each rank
    for step in range(steps):
        if hasattr(hook, "set_lr_scale"):  # as the trainer does: error feedback in step units
            hook.set_lr_scale(0.3 + 0.2 * step)
        mesh.ledger.set_step(step)
        x, y = torch.randn(16, 32, generator=gen), torch.randn(16, 8, generator=gen)
        nn.functional.mse_loss(engine.module(x), y).backward()
        engine.step()
        engine.zero_grad()
    mesh.ledger.set_step(-1)
    full = engine.full_parameters()
    flat = torch.cat([full[k].reshape(-1) for k in sorted(full)])
    engine.close()
    assert _same_on_every_rank(flat, mesh), f"stage {stage} {type(hook).__name__} {opts}: replicas differ"
    return flat


def _compressed_zero():
    """ZeRO-1/2/3 with each compressor in place of the reduce-scatter, against DataParallel."""
    mesh = Mesh(dp=dist.get_world_size(), timeout_s=60)
    out = {}
    for stage in (0, 1, 2, 3):
        for name in ("none", "fp16", "onebit", "topk", "powersgd", "topk-all"):
            mesh.ledger.clear()
            hook = make_compressor(
                name.split("-")[0], topk_ratio=1.0 if name == "topk-all" else 0.05, powersgd_rank=2
            )
            flat = _train_mlp(mesh, stage, hook)
            ops = {op: (r.bus_bytes, r.logical_bytes) for (op, _), r in mesh.ledger.rows(3).items()}
            out[(stage, name)] = (flat, ops)
    mesh.close()
    for stage in (1, 2, 3):
        # a lossless top-k equals the uncompressed reduce-scatter; 1-bit, PowerSGD and fp16
        # compress each parameter on its own (ZeRO-3's one unit holds the buckets of the others),
        # so they train the parameters DataParallel trains
        torch.testing.assert_close(out[(stage, "topk-all")][0], out[(stage, "none")][0], atol=1e-6, rtol=0)
        # (PowerSGD's warm-start Q is seeded per bucket and parameter index: ZeRO-3's one unit
        # numbers them otherwise; its replicas are still checked equal in _train_mlp)
        for name in ("onebit", "fp16", "none") + (("powersgd",) if stage < 3 else ()):
            torch.testing.assert_close(
                out[(stage, name)][0],
                out[(0, name)][0],
                atol=1e-6,
                rtol=0,
                msg=lambda m, stage=stage, name=name: f"stage {stage} {name}: {m}",
            )
    return {f"{s}-{k}": v[1] for (s, k), v in out.items()}


@pytest.mark.parametrize("world", [2])
def test_compressors_replace_the_zero_reduce_scatter(world, request):
    ops = request.getfixturevalue(f"ranks_{world}")[0]["zero"]
    for stage in ("1", "2", "3"):
        plain = ops[f"{stage}-none"]["reduce_scatter"]
        half = ops[f"{stage}-fp16"]["reduce_scatter"]
        assert half[0] == plain[0] / 2 and half[1] == plain[1]  # half the bytes, standing for fp32
        for name in ("onebit", "topk"):  # gathered instead; ZeRO's parameter all-gather is the same in all
            assert "reduce_scatter" not in ops[f"{stage}-{name}"]
            sent, stands_for = (
                a - b
                for a, b in zip(ops[f"{stage}-{name}"]["all_gather"], ops[f"{stage}-none"]["all_gather"])
            )
            assert stands_for == plain[1], name  # the fp32 gradient buckets
            assert 0 < sent < plain[0] / 4, (
                name
            )  # 1-bit ~1/16, top-5% ~1/5 of the fp32 reduce-scatter at N = 2


def _compressed_hybrid():
    """Hybrid ZeRO-2 (shard over 2, replicate x2) with 1-bit against DataParallel with 1-bit."""
    mesh = Mesh(dp=dist.get_world_size(), dp_shard=2, timeout_s=60)
    ddp = _train_mlp(mesh, 0, make_compressor("onebit"))
    hybrid = _train_mlp(mesh, 2, make_compressor("onebit"), hybrid_shard=2)
    mesh.close()
    return float((ddp - hybrid).abs().max())


def _compressed_moe():
    """An MoE GPT under dp2 x ep2 with each compressor at stages 0, 2 and 3: the whole model
    (experts gathered over ep) is identical on every rank, a lossless top-k equals no
    compression, and each compressor trains the same parameters at every stage."""
    from plait import zero
    from plait.models import GPT, GPTConfig
    from plait.moe.parallel import apply_ep

    mesh = Mesh(dp=2, ep=2, timeout_s=60)
    cfg = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=16, experts=4, top_k=2)
    out = {}
    for stage in (0, 2, 3):
        for name in ("none", "onebit", "topk-all", "powersgd"):
            torch.manual_seed(0)
            model = apply_ep(GPT(cfg), mesh)
            hook = make_compressor(name.split("-")[0], topk_ratio=1.0, powersgd_rank=2)
            engine = zero.wrap(
                model,
                mesh,
                stage,
                lambda g: torch.optim.SGD(g, lr=0.5),
                bucket_mb=0.004,
                comm_hook=hook,
                data_axes=("dp", "ep"),
            )
            gen = torch.Generator().manual_seed(100 + dist.get_rank())  # each rank its own rows
            for step in range(3):
                if hasattr(hook, "set_lr_scale"):
                    hook.set_lr_scale(1.0 - 0.2 * step)
                x = torch.randint(0, 64, (4, 16), generator=gen)
                engine.module(x, x.roll(1, 1)).backward()
                engine.step()
                engine.zero_grad()
            full = engine.full_parameters()
            engine.close()
            flat = torch.cat([full[k].reshape(-1) for k in sorted(full)])
            everyone = torch.empty(mesh.world_size * flat.numel())
            comm.all_gather(everyone, flat, mesh, "world")
            rows = everyone.view(mesh.world_size, -1)
            assert all(torch.equal(rows[0], r) for r in rows), f"stage {stage} {name}: replicas differ"
            out[(stage, name)] = flat
    mesh.close()
    return {k: float((v - out[(0, "none")]).abs().max()) for k, v in out.items()} | {
        f"{s}-{n}-vs-0": float((out[(s, n)] - out[(0, n)]).abs().max()) for s, n in out
    }


def _two_ranks():
    return {"ddp": _compressed_ddp(), "zero": _compressed_zero()}


def _four_ranks():
    return {"ddp": _compressed_ddp(), "hybrid": _compressed_hybrid(), "moe": _compressed_moe()}


# One spawn per world size runs every check of that size in turn (a spawn costs seconds); each
# test reads its own check's per-rank results.
@pytest.fixture(scope="module")
def ranks_2():
    return run_ranks(_two_ranks, 2, timeout=420)


@pytest.fixture(scope="module")
def ranks_4():
    return run_ranks(_four_ranks, 4, timeout=360)


def test_compressor_under_hybrid_sharding_equals_data_parallel(ranks_4):
    # the shard group decodes its 2 messages, the replicas sum the shards: the same 4 messages
    assert max(r["hybrid"] for r in ranks_4) < 1e-6


def test_compressors_under_expert_parallelism_keep_replicas_identical(ranks_4):
    """dp2 x ep2 (replicas asserted equal on every rank inside the run): lossless top-k equals
    no compression at stages 0, 2, 3, and 1-bit SGD the same parameters at every stage; lossy
    compression does move the parameters."""
    got = ranks_4[0]["moe"]
    for stage in (0, 2, 3):
        assert got[(stage, "none")] < 1e-6 and got[(stage, "topk-all")] < 1e-6, stage
        assert got[f"{stage}-onebit-vs-0"] < 1e-6, stage
        assert got[(stage, "onebit")] > 1e-4, stage  # the compressor took part
    assert got["2-powersgd-vs-0"] < 1e-6


def test_onebit_sgd_converges_with_error_feedback_and_stalls_without():
    """Seide et al.'s claim on a least-squares problem: 2 simulated ranks, SGD on quantised
    gradients. With error feedback the error goes to ~0 like uncompressed SGD; without it, it stalls."""
    torch.manual_seed(0)
    target = torch.randn(16, 32)

    def run(mode: str) -> float:
        w = torch.zeros(16, 32)
        comps = [OneBitCompressor(error_feedback=(mode == "ef"), min_group=1) for _ in range(2)]
        gen = torch.Generator().manual_seed(1)
        for _ in range(300):
            total = torch.zeros(w.numel())
            for c in comps:
                x = torch.randn(32, 32, generator=gen)
                grad = ((x @ (w - target).T).T @ x / 32).reshape(-1) / 2
                if mode == "none":
                    total += grad
                    continue
                b = _bucket([(16, 32)], grad)
                bits, scales = c.encode(b)
                c.decode_into(total, bits, scales, b)
            w -= 0.05 * total.view(16, 32)
        return float(((w - target) ** 2).mean())

    none, ef, noef = run("none"), run("ef"), run("noef")
    assert none < 1e-8 and ef < 1e-8, (none, ef)
    assert noef > 1e3 * max(ef, 1e-12), (noef, ef)

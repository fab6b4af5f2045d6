"""Tensor-parallel layers and the vocab-parallel cross-entropy against their dense counterparts.

On every rank the dense reference (nn.Linear, nn.Embedding, F.cross_entropy) is computed from
the same full weights and inputs; the parallel layer built from them must give this rank's part
of the output and of every gradient, within 1e-6 (fp32). One spawn of 4 ranks runs every check
twice: at tp=4, then at tp=2 inside a dp=2 x tp=2 mesh.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait.errors import ConfigError
from plait.mesh import Mesh
from plait.placement import placement
from plait.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    allreduce_sequence_parallel_grads,
    pad_to_multiple,
    sequence_parallel_params,
    shard_range,
    vocab_parallel_cross_entropy,
)
from plait.testing import run_ranks

B, S, H = 2, 8, 16  # S divisible by every tp tested


def _data(seed, *shape, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * scale


def _close(name, actual, expected, rtol=0.0):
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=rtol, msg=lambda m: f"{name}: {m}")


def _counts(mesh, step):
    return {op: (row.count, row.payload_bytes) for (op, _), row in mesh.ledger.rows(step).items()}


def _dense(module, x, gy):
    """Output, input gradient and parameter gradients of `module` for upstream gradient `gy`."""
    x = x.clone().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    y = module(x)
    y.backward(gy)
    return y.detach(), x.grad, {n: p.grad for n, p in module.named_parameters()}


def _columns(mesh, tp):
    r = mesh.rank("tp")
    torch.manual_seed(10)
    dense = nn.Linear(H, 4 * H)
    rows = slice(r * 4 * H // tp, (r + 1) * 4 * H // tp)
    x, gy = _data(1, B, S, H), _data(2, B, S, 4 * H)
    y, gx, gp = _dense(dense, x, gy)
    for gather in (False, True):
        col = ColumnParallelLinear.from_linear(dense, mesh, gather_output=gather)
        assert col.weight.shape == (4 * H // tp, H) and col.bias.shape == (4 * H // tp,)
        xp = x.clone().requires_grad_(True)
        out = col(xp)
        out.backward(gy if gather else gy[..., rows])
        _close(f"column gather={gather} y", out, y if gather else y[..., rows])
        _close(f"column gather={gather} dx", xp.grad, gx)
        _close(f"column gather={gather} dW", col.weight.grad, gp["weight"][rows])
        _close(f"column gather={gather} db", col.bias.grad, gp["bias"][rows])
    # Sequence parallel, [b, s, h] layout: the input is this rank's slice of the sequence.
    col = ColumnParallelLinear.from_linear(dense, mesh, sequence_parallel=True, seq_dim=1)
    xp = x.chunk(tp, 1)[r].clone().requires_grad_(True)
    out = col(xp)
    out.backward(gy[..., rows])
    _close("column SP y", out, y[..., rows])
    _close("column SP dx", xp.grad, gx.chunk(tp, 1)[r])
    _close("column SP dW", col.weight.grad, gp["weight"][rows])
    assert sequence_parallel_params(col) == []  # its bias is sharded, not replicated


def _rows(mesh, tp):
    r = mesh.rank("tp")
    torch.manual_seed(11)
    dense = nn.Linear(4 * H, H)
    cols = slice(r * 4 * H // tp, (r + 1) * 4 * H // tp)
    x, gy = _data(3, S, B, 4 * H), _data(4, S, B, H)  # [s, b, h] layout
    y, gx, gp = _dense(dense, x, gy)
    for parallel_input in (True, False):
        row = RowParallelLinear.from_linear(dense, mesh, input_is_parallel=parallel_input)
        assert row.weight.shape == (H, 4 * H // tp) and row.bias.shape == (H,)
        xp = (x[..., cols] if parallel_input else x).clone().requires_grad_(True)
        out = row(xp)
        out.backward(gy)
        _close(f"row parallel_input={parallel_input} y", out, y)
        _close(f"row parallel_input={parallel_input} dx", xp.grad, gx[..., cols] if parallel_input else gx)
        _close(f"row parallel_input={parallel_input} dW", row.weight.grad, gp["weight"][:, cols])
        _close(f"row parallel_input={parallel_input} db", row.bias.grad, gp["bias"])
    row = RowParallelLinear.from_linear(dense, mesh, sequence_parallel=True, seq_dim=0)
    assert sequence_parallel_params(row) == [row.bias] and placement(row.bias).grad_partial == ("tp",)
    xp = x[..., cols].clone().requires_grad_(True)
    out = row(xp)
    out.backward(gy.chunk(tp, 0)[r])
    _close("row SP y", out, y.chunk(tp, 0)[r])
    _close("row SP dx", xp.grad, gx[..., cols])
    _close("row SP dW", row.weight.grad, gp["weight"][:, cols])
    partial = row.bias.grad.clone()
    allreduce_sequence_parallel_grads(row, mesh, "tp")
    _close("row SP db (after the tp all-reduce)", row.bias.grad, gp["bias"])
    assert (partial - gp["bias"]).abs().max() > 1e-3  # it really was partial before


def _mlp(mesh, step, seq_parallel):
    """Column -> GELU -> Row vs the dense MLP (Megatron §3, eq. 3-4), with the ledger per pass."""
    tp, r = mesh.size("tp"), mesh.rank("tp")
    torch.manual_seed(12)
    dense = nn.Sequential(nn.Linear(H, 4 * H), nn.GELU(), nn.Linear(4 * H, H))
    kw = dict(sequence_parallel=seq_parallel, seq_dim=1)
    par = nn.Sequential(
        ColumnParallelLinear.from_linear(dense[0], mesh, **kw),
        nn.GELU(),
        RowParallelLinear.from_linear(dense[2], mesh, **kw),
    )
    x, gy = _data(5, B, S, H), _data(6, B, S, H)
    y, gx, gp = _dense(dense, x, gy)
    mesh.ledger.clear()
    shard = (lambda t: t.chunk(tp, 1)[r]) if seq_parallel else (lambda t: t)
    xp = shard(x).clone().requires_grad_(True)
    mesh.ledger.set_step(step)
    out = par(xp)
    mesh.ledger.set_step(step + 1)
    out.backward(shard(gy))
    mesh.ledger.set_step(step + 2)
    allreduce_sequence_parallel_grads(par, mesh, "tp")
    what = f"MLP sp={seq_parallel}"
    _close(f"{what} y", out, shard(y))
    _close(f"{what} dx", xp.grad, shard(gx))
    rows = slice(r * 4 * H // tp, (r + 1) * 4 * H // tp)
    _close(f"{what} d fc.W", par[0].weight.grad, gp["0.weight"][rows])
    _close(f"{what} d fc.b", par[0].bias.grad, gp["0.bias"][rows])
    _close(f"{what} d proj.W", par[2].weight.grad, gp["2.weight"][:, rows])
    _close(f"{what} d proj.b", par[2].bias.grad, gp["2.bias"])
    act = B * S * H * 4  # bytes of one full activation
    if seq_parallel:  # each all-reduce becomes an all-gather + reduce-scatter of the same volume
        pair = {"all_gather": (1, act), "reduce_scatter": (1, act)}
        assert _counts(mesh, step) == pair and _counts(mesh, step + 1) == pair, _counts(mesh, step)
        assert _counts(mesh, step + 2) == {"all_reduce": (1, H * 4)}  # the row bias over tp
    else:  # one g forward, one f backward
        assert _counts(mesh, step) == _counts(mesh, step + 1) == {"all_reduce": (1, act)}
        assert _counts(mesh, step + 2) == {}


def _embedding(mesh, tp, step):
    r = mesh.rank("tp")
    D = 8
    # padding_idx in rank 0's rows, and in a later rank's (200: rank 3 of 4, rank 1 of 2)
    cases = ((64, False, None), (250, True, 3), (251, True, -51), (250, False, 200), (251, False, None))
    for V, seq_parallel, padding_idx in cases:
        torch.manual_seed(13)
        dense = nn.Embedding(V, D, padding_idx=padding_idx)
        if padding_idx is not None:  # a loaded table's padding row need not be zero: it is looked up
            with torch.no_grad():
                dense.weight[padding_idx] = torch.arange(1.0, D + 1)
        emb = VocabParallelEmbedding.from_embedding(dense, mesh, sequence_parallel=seq_parallel, seq_dim=1)
        padded = pad_to_multiple(V, tp)
        per = padded // tp
        assert (emb.num_embeddings, emb.padded_vocab) == (V, padded)
        assert (emb.vocab_start, emb.vocab_end) == (r * per, (r + 1) * per)
        assert emb.weight.shape == (per, D)
        lo, hi = shard_range(V, r, tp)
        assert lo == emb.vocab_start and hi == min(emb.vocab_end, V)
        _close(f"V={V} shard", emb.weight[: hi - lo], dense.weight[lo:hi].detach())
        assert not emb.weight[hi - lo :].any()  # padding rows are zero
        g = torch.Generator().manual_seed(14)
        ids = torch.randint(0, V, (B, S), generator=g)
        ids[0, :3] = torch.tensor([0, V - 1, 3])
        if padding_idx is not None:  # the padding id, several times: its row gets no gradient
            ids[1, :4] = padding_idx % V
        gy = _data(15, B, S, D)
        dense.zero_grad()
        y = dense(ids)
        y.backward(gy)
        out = emb(ids)
        shard = (lambda t: t.chunk(tp, 1)[r]) if seq_parallel else (lambda t: t)
        out.backward(shard(gy))
        _close(f"V={V} embedding y", out, shard(y.detach()))
        _close(f"V={V} embedding dW", emb.weight.grad[: hi - lo], dense.weight.grad[lo:hi])
        if padding_idx is not None and lo <= padding_idx % V < hi:
            assert not emb.weight.grad[padding_idx % V - lo].any() and emb.weight[padding_idx % V - lo].all()
        assert not emb.weight.grad[hi - lo :].any()  # padding rows never selected
    # The ledger: one all-reduce forward, nothing backward.
    mesh.ledger.clear()
    mesh.ledger.set_step(step)
    y = emb(ids)
    mesh.ledger.set_step(step + 1)
    y.sum().backward()
    assert _counts(mesh, step) == {"all_reduce": (1, B * S * D * 4)} and _counts(mesh, step + 1) == {}


def _loss(mesh, tp, step):
    r = mesh.rank("tp")
    mesh.ledger.clear()
    for V in (64, 250, 251):
        padded = pad_to_multiple(V, tp)
        part = padded // tp
        real = max(0, min(part, V - r * part))
        logits = _data(16, B, S, V, scale=3.0)
        # Padding columns hold huge values: if they were not masked they would dominate the loss.
        padded_logits = torch.cat([logits, torch.full((B, S, padded - V), 1e4)], dim=-1)
        target = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(17))
        target[0, :3] = torch.tensor([V - 1, 0, -100])
        target[1, -1] = -100
        for reduction, ignore_index in (("mean", -100), ("sum", -100), ("none", -100), ("mean", 5)):
            tgt = target.masked_fill(target == -100, ignore_index)  # class 5 and any 5s: ignored
            full = logits.clone().requires_grad_(True)
            ref = F.cross_entropy(
                full.reshape(-1, V), tgt.reshape(-1), reduction=reduction, ignore_index=ignore_index
            )
            shard = padded_logits[..., r * part : (r + 1) * part].clone().requires_grad_(True)
            step += 2
            mesh.ledger.set_step(step)
            loss = vocab_parallel_cross_entropy(
                shard, tgt, mesh, vocab_size=V, reduction=reduction, ignore_index=ignore_index
            )
            gl = _data(18, B, S) if reduction == "none" else torch.tensor(1.0)
            mesh.ledger.set_step(step + 1)
            loss.backward(gl)
            ref.backward(gl.reshape(-1) if reduction == "none" else gl)
            what = f"V={V} tp={tp} {reduction} ignore={ignore_index}"
            # A sum of ~30 losses of ~4 is ~100, where one fp32 ulp is 8e-6: compare it relatively.
            _close(f"{what} loss", loss.reshape(ref.shape), ref, rtol=1e-6 if reduction == "sum" else 0.0)
            _close(f"{what} dlogits", shard.grad[..., :real], full.grad[..., r * part : r * part + real])
            assert not shard.grad[..., real:].any(), f"{what}: gradient on padding columns"
            n = B * S * 4
            assert _counts(mesh, step) == {"all_reduce": (2, n + 2 * n)}, _counts(mesh, step)
            assert _counts(mesh, step + 1) == {}  # the gradient is local
    # 2-D logits and no padding: vocab_size defaults to the padded size.
    logits = _data(19, 6, 8 * tp)
    target = torch.arange(6) * 7 % (8 * tp)
    shard = logits[:, r * 8 : (r + 1) * 8].clone()
    _close("2-D", vocab_parallel_cross_entropy(shard, target, mesh), F.cross_entropy(logits, target))
    with pytest.raises(ConfigError, match="vocab_size=1000 does not fit"):
        vocab_parallel_cross_entropy(shard, target, mesh, vocab_size=1000)
    with pytest.raises(ConfigError, match="reduction"):
        vocab_parallel_cross_entropy(shard, target, mesh, reduction="avg")


def _embedding_to_loss(mesh, tp):
    """Vocab-parallel embedding -> column-parallel head over the padded vocabulary -> loss."""
    r, V, D = mesh.rank("tp"), 250, 8
    torch.manual_seed(20)
    emb, head = nn.Embedding(V, D), nn.Linear(D, V, bias=False)
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(21))
    target = ids.roll(-1, dims=1)
    F.cross_entropy(head(emb(ids)).reshape(-1, V), target.reshape(-1)).backward()
    pemb = VocabParallelEmbedding.from_embedding(emb, mesh)
    padded = pemb.padded_vocab
    full_w = torch.cat([head.weight.detach(), torch.zeros(padded - V, D)])
    phead = ColumnParallelLinear(D, padded, mesh, bias=False, full_weight=full_w)
    loss = vocab_parallel_cross_entropy(phead(pemb(ids)), target, mesh, vocab_size=V)
    loss.backward()
    ref = F.cross_entropy(head(emb(ids)).reshape(-1, V), target.reshape(-1))
    _close("embedding->head->loss", loss, ref)
    lo, hi = shard_range(V, r, tp)
    _close("head dW", phead.weight.grad[: hi - lo], head.weight.grad[lo:hi])
    _close("embedding dW", pemb.weight.grad[: hi - lo], emb.weight.grad[lo:hi])


def _init_and_errors(mesh, tp):
    # Built under the same seed, a parallel layer holds its slice of the dense layer.
    r = mesh.rank("tp")
    torch.manual_seed(30)
    dense = nn.Linear(8, 4 * tp)
    torch.manual_seed(30)
    col = ColumnParallelLinear(8, 4 * tp, mesh)
    assert torch.equal(col.weight, dense.weight[r * 4 : (r + 1) * 4])
    assert torch.equal(col.bias, dense.bias[r * 4 : (r + 1) * 4])
    torch.manual_seed(30)
    dense = nn.Linear(8 * tp, 4)
    torch.manual_seed(30)
    row = RowParallelLinear(8 * tp, 4, mesh)
    assert torch.equal(row.weight, dense.weight[:, r * 8 : (r + 1) * 8]) and torch.equal(row.bias, dense.bias)
    torch.manual_seed(31)
    dense = nn.Embedding(10, 4)
    torch.manual_seed(31)
    lo, hi = shard_range(10, r, tp)
    assert torch.equal(VocabParallelEmbedding(10, 4, mesh).weight[: hi - lo], dense.weight[lo:hi])

    bad = 4 * tp + 1
    with pytest.raises(ConfigError, match=f"out_features={bad} is not divisible by tp={tp}"):
        ColumnParallelLinear(8, bad, mesh)
    with pytest.raises(ConfigError, match=f"in_features={bad} is not divisible by tp={tp}"):
        RowParallelLinear(bad, 8, mesh)
    with pytest.raises(ConfigError, match="full_weight has shape"):
        ColumnParallelLinear(8, 4 * tp, mesh, full_weight=torch.zeros(3, 8))


def _layers():
    # tp=4 over the whole world, then tp=2 inside a dp=2 x tp=2 mesh (tp rank != global rank).
    for shape in (dict(tp=4), dict(dp=2, tp=2)):
        mesh = Mesh(**shape, timeout_s=60)
        tp = mesh.size("tp")
        _columns(mesh, tp)
        _rows(mesh, tp)
        _mlp(mesh, 10, seq_parallel=False)
        _mlp(mesh, 20, seq_parallel=True)
        _embedding(mesh, tp, 30)
        _loss(mesh, tp, 40)
        _embedding_to_loss(mesh, tp)
        _init_and_errors(mesh, tp)
        assert not any(axis != "tp" for step in mesh.ledger.steps() for _, axis in mesh.ledger.rows(step))
        mesh.close()
    return True


def test_parallel_layers_and_loss_match_dense_at_tp_4_and_2():
    assert all(run_ranks(_layers, 4, timeout=120))


def test_padding_helpers():
    assert [pad_to_multiple(n, 4) for n in (1, 4, 250, 252)] == [4, 4, 252, 252]
    assert [shard_range(250, r, 4) for r in range(4)] == [(0, 63), (63, 126), (126, 189), (189, 250)]
    assert [shard_range(5, r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]
    with pytest.raises(ConfigError):
        shard_range(8, 4, 4)

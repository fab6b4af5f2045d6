"""Ring attention (Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers"):
causal attention over a sequence split across the `cp` ranks of an axis, exact.

Each rank holds the queries, keys and values of its own tokens (`SequenceSplit`: head-tail by
default). The keys and values, with their grouped-query heads only (never repeated to the query
heads), travel round the ring: at step s = 0..cp−1 rank r holds those of rank (r − s) mod cp,
and sends them on to r + 1 while it computes its blocks against them. Blocks are pairs of a query
chunk and a key chunk: a key chunk wholly before the query chunk is attended in full, the chunk
itself under the causal mask, one wholly after it is skipped.

Each block gives partial outputs o_b and their log-sum-exp l_b = log Σ_j exp(s_ij); the partial
results of one query row merge exactly (the softmax's normaliser is the sum over blocks):

    l = log(exp(l_1) + exp(l_2)),   o = exp(l_1 − l)·o_1 + exp(l_2 − l)·o_2

Backward recomputes each block's probabilities p = exp(s − l) from the saved log-sum-exp (no
T×T matrix is kept) and follows the gradients of softmax attention, with D = rowsum(dO ∘ O):

    dV += pᵀ dO,   dP = dO Vᵀ,   dS = p ∘ (dP − D),   dQ += dS K · scale,   dK += dSᵀ Q · scale

The keys and values go round the ring again, and beside them an accumulator of their gradients:
rank r adds its share to the accumulator of the block it holds and passes it on, so after the
last step each accumulator reaches its owner. Traffic per call, on each rank (B batch, L the
rank's tokens, h_kv·d the key/value width, b bytes per element): forward (cp−1) sends of K and V
= 2(cp−1)·B·L·h_kv·d·b; backward the same for K and V plus (cp−1) sends of dK and dV.
"""

from __future__ import annotations

import torch

from plait import comm
from plait.context_parallel.sequence import SequenceSplit


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _blocks(split: SequenceSplit, me: int, src: int):
    """(query slice, key slice, causal) of every block rank `me` computes against rank `src`'s
    keys, slices local to each; blocks wholly above the diagonal are left out."""
    out = []
    qo = 0
    for qa, qb in split.chunks(me):
        ko = 0
        for ka, kb in split.chunks(src):
            if (ka, kb) == (qa, qb) or kb <= qa:
                out.append((slice(qo, qo + qb - qa), slice(ko, ko + kb - ka), (ka, kb) == (qa, qb)))
            ko += kb - ka
        qo += qb - qa
    return out


def _scores(q, k, scale, causal):
    """q (B, Hkv, g, Lq, d) against k (B, Hkv, Lk, d): (B, Hkv, g, Lq, Lk), -inf above the
    diagonal of a causal (square) block."""
    s = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale
    if causal:
        n = s.shape[-1]
        mask = torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    return s


def _exchange(mesh, axis, send, recv_shape, dtype, device):
    """Post the send of `send` to the next rank and the receive of a `recv_shape` tensor from the
    previous one; returns (handles, the receive buffer)."""
    n, r = mesh.size(axis), mesh.rank(axis)
    buf = torch.empty(recv_shape, dtype=dtype, device=device)
    ops = [("send", send, (r + 1) % n), ("recv", buf, (r - 1) % n)]
    return comm.batch_isend_irecv(ops, mesh, axis), buf


def _wait(handles):
    for h in handles:
        h.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mesh, axis, split, scale):
        n, me = mesh.size(axis), mesh.rank(axis)
        acc = _acc_dtype(q.dtype)
        B, H, L, d = q.shape
        hkv = k.shape[1]
        g = H // hkv
        qg = q.to(acc).view(B, hkv, g, L, d)
        out = torch.zeros(B, hkv, g, L, d, dtype=acc, device=q.device)
        lse = torch.full((B, hkv, g, L), float("-inf"), dtype=acc, device=q.device)
        kv = torch.stack((k, v)).contiguous()
        for s in range(n):
            src = (me - s) % n
            pending = None
            if s < n - 1:  # the next block travels while this one is computed
                shape = (2, B, hkv, split.local_len((me - s - 1) % n), d)
                pending = _exchange(mesh, axis, kv, shape, kv.dtype, kv.device)
            kc, vc = kv[0].to(acc), kv[1].to(acc)
            for qs, ks, causal in _blocks(split, me, src):
                sc = _scores(qg[..., qs, :], kc[:, :, ks], scale, causal)
                lb = torch.logsumexp(sc, dim=-1)
                ob = torch.matmul(torch.exp(sc - lb.unsqueeze(-1)), vc[:, :, ks].unsqueeze(2))
                la = lse[..., qs]
                new = torch.logaddexp(la, lb)
                out[..., qs, :] = out[..., qs, :] * torch.exp(la - new).unsqueeze(-1) + ob * torch.exp(
                    lb - new
                ).unsqueeze(-1)
                lse[..., qs] = new
            if pending is not None:
                _wait(pending[0])
                kv = pending[1]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mesh, ctx.axis, ctx.split, ctx.scale = mesh, axis, split, scale
        return out.view(B, H, L, d).to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        mesh, axis, split, scale = ctx.mesh, ctx.axis, ctx.split, ctx.scale
        n, me = mesh.size(axis), mesh.rank(axis)
        acc = out.dtype
        B, H, L, d = q.shape
        hkv = k.shape[1]
        g = H // hkv
        qg = q.to(acc).view(B, hkv, g, L, d)
        do = grad_out.to(acc).reshape(B, hkv, g, L, d)
        D = (do * out).sum(-1)  # rowsum(dO ∘ O)
        dq = torch.zeros_like(qg)
        kv = torch.stack((k, v)).contiguous()
        own = None  # this rank's share of its own block's dK, dV
        incoming = None  # (handles, buffer): the accumulator of the block this rank holds next
        for s in range(n):
            src = (me - s) % n
            pending = None
            if s < n - 1:
                shape = (2, B, hkv, split.local_len((me - s - 1) % n), d)
                pending = _exchange(mesh, axis, kv, shape, kv.dtype, kv.device)
            kc, vc = kv[0].to(acc), kv[1].to(acc)
            dkv = torch.zeros(2, B, hkv, kc.shape[2], d, dtype=acc, device=q.device)
            for qs, ks, causal in _blocks(split, me, src):
                sc = _scores(qg[..., qs, :], kc[:, :, ks], scale, causal)
                p = torch.exp(sc - lse[..., qs].unsqueeze(-1))
                dob = do[..., qs, :]
                dkv[1][:, :, ks] += torch.matmul(p.transpose(-1, -2), dob).sum(2)
                dp = torch.matmul(dob, vc[:, :, ks].unsqueeze(2).transpose(-1, -2))
                ds = p * (dp - D[..., qs].unsqueeze(-1))
                dq[..., qs, :] += torch.matmul(ds, kc[:, :, ks].unsqueeze(2)) * scale
                dkv[0][:, :, ks] += torch.matmul(ds.transpose(-1, -2), qg[..., qs, :]).sum(2) * scale
            if s == 0:
                own = dkv
            else:
                if incoming is not None:
                    _wait(incoming[0])
                    dkv = dkv + incoming[1].to(acc)
                # on to the next rank, which holds this block at the next step (or owns it)
                back = (2, B, hkv, split.local_len((me - s - 1) % n), d)
                incoming = _exchange(mesh, axis, dkv.to(kv.dtype).contiguous(), back, kv.dtype, kv.device)
            if pending is not None:
                _wait(pending[0])
                kv = pending[1]
        if incoming is not None:
            _wait(incoming[0])
            own = own + incoming[1].to(acc)
        dq = dq.view(B, H, L, d).to(q.dtype)
        return dq, own[0].to(k.dtype), own[1].to(v.dtype), None, None, None, None


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mesh, axis: str, split: SequenceSplit, scale=None
) -> torch.Tensor:
    """Causal attention of this rank's queries q (B, H, L, d) over the whole sequence, whose keys
    and values k, v (B, H_kv, L, d) are split over `axis` as `split` says (this rank's tokens in
    its local order); H a multiple of H_kv (grouped-query attention: key/value head j serves
    query heads j·H/H_kv ... (j+1)·H/H_kv − 1). Returns (B, H, L, d); differentiable."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} are not a multiple of key/value heads {k.shape[1]}")
    me = mesh.rank(axis)
    if q.shape[2] != split.local_len(me) or k.shape[2] != q.shape[2] or v.shape != k.shape:
        raise ValueError(
            f"ring attention: rank {me} holds {split.local_len(me)} tokens of the split, got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _RingAttention.apply(q, k, v, mesh, axis, split, scale)

"""Rank-r PowerSGD (Vogels, Karimireddy & Jaggi 2019) with error feedback; see
`plait.comm.compress`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from plait import comm
from plait.comm.residual import ResidualCompressor, Then, unscale
from plait.errors import ConfigError

if TYPE_CHECKING:
    from plait.gradsync import GradBucket
    from plait.mesh import Mesh


class PowerSGDCompressor(ResidualCompressor):
    """Rank-r PowerSGD (Vogels, Karimireddy & Jaggi 2019): one power-iteration step per matrix.

    Each parameter with two or more dimensions is seen as an (n, m) matrix M = scale·G + E
    (dim 0 by the rest). With Q (m, r) from the previous step (warm start; the first from a seed
    shared by every rank), P = M·Q is all-reduced, orthonormalised (P̂), and Q = Mᵀ·P̂ is
    all-reduced: every rank decodes P̂·Qᵀ, and keeps M - P̂·Q_iᵀ as its residual. Vectors, and
    matrices with min(n, m) <= r (nothing to save), are all-reduced exactly inside the first
    message. Two all-reduces per bucket; the second depends on the first, so only the first
    overlaps backward."""

    def __init__(self, rank: int = 4, error_feedback: bool = True, seed: int = 0):
        if rank < 1:
            raise ConfigError(f"comm.powersgd_rank must be >= 1, got {rank}")
        super().__init__(error_feedback)
        self.rank, self.seed = int(rank), seed
        self.qs: dict[tuple[int, int], torch.Tensor] = {}

    def _matrices(self, bucket: GradBucket):
        """(parameter index, offset, n, m) of the parameters compressed at rank r."""
        for i, (off, shape) in enumerate(zip(bucket.offsets, bucket.layout.shapes)):
            n = shape[0] if len(shape) >= 2 else 0
            m = shape.numel() // n if n else 0
            if min(n, m) > self.rank:
                yield i, off, n, m

    def _q(self, bucket: GradBucket, i: int, m: int, like: torch.Tensor) -> torch.Tensor:
        key = (bucket.index, i)
        if key not in self.qs:  # the same on every rank: a generator seeded by bucket and parameter
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + bucket.index * 10_007 + i)
            self.qs[key] = torch.randn(m, self.rank, generator=gen).to(like)
        return self.qs[key]

    def state_tensors(self, buckets) -> dict[str, torch.Tensor]:
        """The residuals and the warm-start Q of every compressed matrix (the same on every rank)."""
        out = super().state_tensors(buckets)
        for b in buckets:
            for i, _, _, m in self._matrices(b):
                out[f"q{b.index}_{i}"] = self._q(b, i, m, b.params[0])
        return out

    def __call__(self, bucket: GradBucket, mesh: Mesh, axis: str):
        flat = bucket.buffer
        acc, residual = self._accumulated(bucket)
        mats = list(self._matrices(bucket))
        exact = torch.ones(flat.numel(), dtype=torch.bool, device=flat.device)
        ps = []
        for i, off, n, m in mats:
            exact[off : off + n * m] = False
            ps.append(acc[off : off + n * m].view(n, m) @ self._q(bucket, i, m, acc))
        first = torch.cat([p.reshape(-1) for p in ps] + [acc[exact]])
        handle = comm.all_reduce(first, mesh, axis, async_op=True, logical_bytes=flat.numel() * 4)
        scale = self.lr_scale

        def finish() -> torch.Tensor:
            k, phats, qs = 0, [], []
            for (_, off, n, m), p in zip(mats, ps):
                phat = torch.linalg.qr(first[k : k + p.numel()].view(n, self.rank)).Q
                k += p.numel()
                phats.append(phat)
                qs.append(acc[off : off + n * m].view(n, m).t() @ phat)
            second = torch.cat([q.reshape(-1) for q in qs]) if qs else first[:0]
            if qs:
                comm.all_reduce(second, mesh, axis, logical_bytes=0)
            out = torch.empty_like(acc)
            out[exact] = first[k:]
            j = 0
            for (i, off, n, m), phat, q_local in zip(mats, phats, qs):
                q = second[j : j + q_local.numel()].view(m, self.rank)
                j += q_local.numel()
                out[off : off + n * m] = (phat @ q.t()).reshape(-1)
                if self.error_feedback:
                    residual[off : off + n * m] = (
                        acc[off : off + n * m].view(n, m) - phat @ q_local.t()
                    ).reshape(-1)
                self.qs[(bucket.index, i)].copy_(q)  # the next step's warm start (in place: checkpoints)
            if self.error_feedback:
                residual[exact] = 0
            flat.copy_(out)
            return unscale(flat, scale)

        return Then(handle, finish)

"""Gradient compressors that replace DataParallel's bucket all-reduce.

Each compressor is a DataParallel `comm_hook`: `compressor(bucket, mesh, axis)` starts the
exchange of one gradient bucket and returns a handle whose `wait()` leaves the reduced gradient
in `bucket.buffer`. The bucket already holds each gradient divided by the number of replicas,
so summing the ranks' (decompressed) contributions gives the mean. Every rank decodes the same
gathered bytes the same way, so the replicas stay identical.

* `FP16Compressor`: all-reduce in half precision (2x fewer bytes).
* `OneBitCompressor`: 1-bit SGD (Seide et al. 2014, "1-Bit Stochastic Gradient Descent and its
  Application to Data-Parallel Distributed Training of Speech DNNs"). Each column of a
  parameter's gradient (plus the carried error) is quantised at threshold 0 to one bit; the two
  reconstruction values of a column are the mean of its non-negative and of its negative entries,
  which minimise the squared error. The quantisation error is kept per parameter and added to the
  next step's gradient (error feedback, the paper's key to convergence). Bits are packed 8 per
  byte, so the wire carries 1/32 of fp32 plus two fp32 scales per column.
* `TopKCompressor`: sparse communication (Aji & Heafield 2017, "Sparse Communication for
  Distributed Gradient Descent"): only the ceil(r·n) entries of largest |gradient + residual|
  are sent as (int32 index, fp32 value) pairs, gathered from every rank and summed; the rest stays
  in the residual for later steps.
* `PowerSGDCompressor`: rank-r PowerSGD (Vogels, Karimireddy & Jaggi 2019): each weight matrix
  is sent as a rank-r approximation from one warm-started power-iteration step, in two
  all-reduces; vectors are sent exactly.

Each also has `reduce_scatter(bucket, out, lo, hi, mesh, axis)` for ZeRO-1/2 (`plait.zero.wrap(...,
comm_hook=...)`): fp16 reduce-scatters in half precision; the others exchange and decode the whole
bucket as above and keep the rank's shard.

Error feedback can be switched off (`error_feedback=False`) to show why it is needed. The
residual is kept in units of the step taken, not of the gradient: before each step the trainer
calls `set_lr_scale(lr_t / peak_lr)`, the compressor encodes ``scale·g + residual`` and divides
what it decodes by the scale, so the optimizer still receives gradients. This is error feedback as
Stich et al. (2018) and Karimireddy et al. (2019, "Error Feedback Fixes SignSGD") state it,
e_{t+1} = p_t - C(p_t) with p_t = γ_t·g_t + e_t: under a learning-rate schedule a gradient held back
during warm-up re-enters at the learning rate of its own step, not at the later, larger one
(measured in docs/compression.md: it is what brings top-1% within 5% of uncompressed under SGD).
The ledger records the bytes actually sent next to the fp32 bytes the bucket stands for.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from plait import comm
from plait.errors import ConfigError

if TYPE_CHECKING:
    from plait.gradsync import GradBucket
    from plait.mesh import Mesh

COMPRESSIONS = ("none", "fp16", "onebit", "topk", "powersgd")
_BIT_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


class _ErrorFeedback:
    """Per-bucket residuals in units of the step (see the module docstring)."""

    def __init__(self, error_feedback: bool):
        self.error_feedback = error_feedback
        self.residuals: dict[int, torch.Tensor] = {}
        self.lr_scale = 1.0

    def set_lr_scale(self, scale: float) -> None:
        """This step's learning rate relative to the peak. A scale <= 0 (a zero learning rate)
        keeps the previous one: the residual would otherwise be divided by zero."""
        if scale > 0:
            self.lr_scale = float(scale)

    def state_tensors(self, buckets) -> dict[str, torch.Tensor]:
        """This rank's compressor state for checkpoints, one residual per bucket (zeros where a
        bucket has none yet), keyed by bucket index. Loaded in place, so the tensors are the
        live ones."""
        return {
            str(b.index): self.residuals.setdefault(
                b.index, torch.zeros(b.numel, dtype=b.params[0].dtype, device=b.params[0].device)
            )
            for b in buckets
        }

    def reduce_scatter(self, bucket, out: torch.Tensor, lo: int, hi: int, mesh: Mesh, axis: str):
        """ZeRO-1/2's exchange: every rank's message is gathered and decoded whole, as for
        DataParallel (so the residual covers the whole bucket), and this rank keeps its shard
        ``buffer[lo:hi]`` in `out`."""
        handle = self(bucket, mesh, axis)
        return _Then(handle, lambda: out.copy_(bucket.buffer[lo:hi]))

    def _accumulated(self, bucket: GradBucket) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale·gradient + residual, the residual tensor to update)."""
        residual = self.residuals.setdefault(bucket.index, torch.zeros_like(bucket.buffer))
        return bucket.buffer * self.lr_scale + residual, residual


class _Then:
    """A handle that runs `finish()` after the underlying operation completes."""

    def __init__(self, handle, finish):
        self.handle, self.finish = handle, finish

    def wait(self) -> torch.Tensor:
        self.handle.wait()
        return self.finish()


# --- bit packing and the column-mean quantiser (pure functions, tested directly) -------------


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Pack a flat bool tensor into uint8, 8 per byte (most significant bit first)."""
    n = bits.numel()
    padded = torch.zeros(math.ceil(n / 8) * 8, dtype=torch.uint8, device=bits.device)
    padded[:n] = bits.to(torch.uint8)
    return (padded.view(-1, 8) * _BIT_WEIGHTS.to(bits.device)).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of `pack_bits`: the first `n` bits as a bool tensor."""
    weights = _BIT_WEIGHTS.to(packed.device)
    return ((packed.view(-1, 1) & weights) != 0).view(-1)[:n]


def column_groups(shape: torch.Size, min_group: int) -> tuple[int, int, int]:
    """(rows, cols, entries per quantisation group) of a parameter seen as a (rows, cols) matrix.

    Dim 0 is the row, so an nn.Linear weight (out, in) has `in` columns of `out` entries; a 1-D
    tensor is one column. Seide et al. quantise each column on its own. Their columns have
    thousands of entries; in a small layer two fp32 scales per short column would cost more than
    the bits save, so adjacent whole columns are grouped until a group has >= `min_group` entries
    (`min_group=1` is the paper's rule exactly)."""
    numel = math.prod(shape)
    rows = shape[0] if len(shape) > 1 else numel
    per = rows * max(1, math.ceil(min_group / max(rows, 1)))
    return rows, numel // max(rows, 1), per


def _column_major(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return t.view(rows, cols).t().reshape(-1)


def _split_groups(cm: torch.Tensor, per: int) -> list[torch.Tensor]:
    """The column-major vector as (per, G) full groups plus a (rest, 1) last group, as 2-D columns."""
    full = (cm.numel() // per) * per
    parts = []
    if full:
        parts.append(cm[:full].view(-1, per).t())
    if cm.numel() > full:
        parts.append(cm[full:].view(-1, 1))
    return parts


def onebit_quantize(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seide et al.'s quantiser for a (rows, cols) matrix: returns (bits, pos_means, neg_means),
    bits = g >= 0, and per column the mean of the entries on each side of the threshold 0."""
    bits = g >= 0
    pos = bits.to(g.dtype)
    n_pos = pos.sum(dim=0)
    n_neg = g.shape[0] - n_pos
    sum_pos = (g * pos).sum(dim=0)
    sum_neg = g.sum(dim=0) - sum_pos
    pos_mean = torch.where(n_pos > 0, sum_pos / n_pos.clamp_min(1), torch.zeros_like(sum_pos))
    neg_mean = torch.where(n_neg > 0, sum_neg / n_neg.clamp_min(1), torch.zeros_like(sum_neg))
    return bits, pos_mean, neg_mean


def onebit_dequantize(bits: torch.Tensor, pos_mean: torch.Tensor, neg_mean: torch.Tensor) -> torch.Tensor:
    return torch.where(bits, pos_mean, neg_mean)


# --- compressors ------------------------------------------------------------------------------


class FP16Compressor:
    """All-reduce the bucket in float16 (or bfloat16): half the bytes, no state."""

    def __init__(self, dtype: torch.dtype = torch.float16):
        self.dtype = dtype

    def __call__(self, bucket: GradBucket, mesh: Mesh, axis: str):
        flat = bucket.buffer
        half = flat.to(self.dtype)
        handle = comm.all_reduce(half, mesh, axis, async_op=True, logical_bytes=flat.numel() * 4)
        return _Then(handle, lambda: flat.copy_(half))

    def reduce_scatter(self, bucket, out: torch.Tensor, lo: int, hi: int, mesh: Mesh, axis: str):
        """ZeRO-1/2's exchange: a reduce-scatter in half precision; this rank's shard goes to `out`."""
        flat = bucket.buffer
        half, part = flat.to(self.dtype), torch.empty(hi - lo, dtype=self.dtype, device=flat.device)
        handle = comm.reduce_scatter(part, half, mesh, axis, async_op=True, logical_bytes=flat.numel() * 4)
        return _Then(handle, lambda: out.copy_(part))


class OneBitCompressor(_ErrorFeedback):
    """1-bit quantisation with column-mean reconstruction and error feedback (Seide et al. 2014)."""

    def __init__(self, error_feedback: bool = True, min_group: int = 2048):
        super().__init__(error_feedback)
        self.min_group = min_group

    def _layout(self, bucket: GradBucket):
        # the layout's shapes, not the parameters': a ZeRO-3 unit's parameters are empty
        # placeholders between uses
        for off, shape in zip(bucket.offsets, bucket.layout.shapes):
            yield off, shape.numel(), column_groups(shape, self.min_group)

    def encode(self, bucket: GradBucket) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantise (scale·gradient + residual); update the residual. Returns (all bits, all
        scales), the bits of each parameter in column-major order; decoded values are in units of
        the step (divide by the scale for gradients)."""
        acc, residual = self._accumulated(bucket)
        bits, scales = [], []
        for off, n, (rows, cols, per) in self._layout(bucket):
            decoded = []
            for g in _split_groups(_column_major(acc[off : off + n], rows, cols), per):
                b, pm, nm = onebit_quantize(g)
                bits.append(b.t().reshape(-1))
                scales += [pm, nm]
                decoded.append(onebit_dequantize(b, pm, nm).t().reshape(-1))
            if self.error_feedback:
                q = torch.cat(decoded).view(cols, rows).t()
                residual[off : off + n] = (acc[off : off + n].view(rows, cols) - q).reshape(-1)
        return torch.cat(bits), torch.cat(scales).to(torch.float32)

    def decode_into(
        self, out: torch.Tensor, bits: torch.Tensor, scales: torch.Tensor, bucket: GradBucket
    ) -> None:
        """Add one rank's decoded contribution to `out`."""
        s = 0
        for off, n, (rows, cols, per) in self._layout(bucket):
            n_full = n // per  # groups of `per` entries, then one shorter group if any is left
            b = bits[off : off + n]
            values = []
            if n_full:
                pm, nm = scales[s : s + n_full, None], scales[s + n_full : s + 2 * n_full, None]
                values.append(torch.where(b[: n_full * per].view(n_full, per), pm, nm).reshape(-1))
                s += 2 * n_full
            if n > n_full * per:
                values.append(torch.where(b[n_full * per :], scales[s], scales[s + 1]))
                s += 2
            out[off : off + n] += torch.cat(values).view(cols, rows).t().reshape(-1)

    def __call__(self, bucket: GradBucket, mesh: Mesh, axis: str):
        flat = bucket.buffer
        bits, scales = self.encode(bucket)
        packed = pack_bits(bits)
        # scales first and the message padded to 4 bytes, so each rank's scales stay float-aligned
        pad = torch.zeros(-packed.numel() % 4, dtype=torch.uint8, device=flat.device)
        message = torch.cat([scales.view(torch.uint8), packed, pad])
        n_scale_bytes = scales.numel() * 4
        n_ranks, scale = mesh.size(axis), self.lr_scale
        gathered = torch.empty(n_ranks * message.numel(), dtype=torch.uint8, device=flat.device)
        handle = comm.all_gather(gathered, message, mesh, axis, async_op=True, logical_bytes=flat.numel() * 4)

        def finish() -> torch.Tensor:
            flat.zero_()
            for chunk in gathered.view(n_ranks, -1):
                rank_scales = chunk[:n_scale_bytes].view(torch.float32)
                rank_bits = unpack_bits(chunk[n_scale_bytes : n_scale_bytes + packed.numel()], flat.numel())
                self.decode_into(flat, rank_bits, rank_scales, bucket)
            return flat.div_(scale) if scale != 1.0 else flat

        return _Then(handle, finish)


class TopKCompressor(_ErrorFeedback):
    """Send only the ceil(ratio·n) largest |gradient + residual| entries (Aji & Heafield 2017)."""

    def __init__(self, ratio: float = 0.01, error_feedback: bool = True):
        if not 0 < ratio <= 1:
            raise ConfigError(f"comm.topk_ratio must be in (0, 1], got {ratio}")
        super().__init__(error_feedback)
        self.ratio = ratio

    def k(self, n: int) -> int:
        return min(n, math.ceil(self.ratio * n))

    def select(self, bucket: GradBucket) -> tuple[torch.Tensor, torch.Tensor]:
        """(int32 indices, fp32 values) of the kept entries of scale·gradient + residual, in units
        of the step; the rest goes to the residual."""
        acc, residual = self._accumulated(bucket)
        idx = torch.topk(acc.abs(), self.k(acc.numel()), sorted=False).indices
        values = acc[idx]
        if self.error_feedback:
            acc[idx] = 0
            residual.copy_(acc)
        return idx.to(torch.int32), values.to(torch.float32)

    def __call__(self, bucket: GradBucket, mesh: Mesh, axis: str):
        flat = bucket.buffer
        idx, values = self.select(bucket)
        message = torch.cat([idx, values.view(torch.int32)])  # one gather: 4-byte index, 4-byte value
        n_ranks, scale = mesh.size(axis), self.lr_scale
        gathered = torch.empty(n_ranks * message.numel(), dtype=torch.int32, device=flat.device)
        handle = comm.all_gather(gathered, message, mesh, axis, async_op=True, logical_bytes=flat.numel() * 4)
        k = idx.numel()

        def finish() -> torch.Tensor:
            rows = gathered.view(n_ranks, 2 * k)
            flat.zero_()
            flat.index_add_(0, rows[:, :k].reshape(-1).long(), rows[:, k:].reshape(-1).view(torch.float32))
            return flat.div_(scale) if scale != 1.0 else flat

        return _Then(handle, finish)


class PowerSGDCompressor(_ErrorFeedback):
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
            return flat.div_(scale) if scale != 1.0 else flat

        return _Then(handle, finish)


def make_compressor(name: str, topk_ratio: float = 0.01, error_feedback: bool = True, powersgd_rank: int = 4):
    """The DataParallel comm_hook for a `[comm] compression` name (None for "none")."""
    if name == "none":
        return None
    if name == "fp16":
        return FP16Compressor()
    if name == "onebit":
        return OneBitCompressor(error_feedback=error_feedback)
    if name == "topk":
        return TopKCompressor(topk_ratio, error_feedback=error_feedback)
    if name == "powersgd":
        return PowerSGDCompressor(powersgd_rank, error_feedback=error_feedback)
    raise ConfigError(f"unknown compression {name!r}; valid: {', '.join(COMPRESSIONS)}")

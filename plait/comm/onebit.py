"""1-bit SGD (Seide et al. 2014, "1-Bit Stochastic Gradient Descent and its Application to
Data-Parallel Distributed Training of Speech DNNs"): the bit packing, the column-mean quantiser
(pure functions, tested directly) and the compressor; see `plait.comm.compress`."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from plait.comm.residual import ResidualCompressor, Then, unscale

if TYPE_CHECKING:
    from plait.gradsync import GradBucket
    from plait.mesh import Mesh

_BIT_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


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


class OneBitCompressor(ResidualCompressor):
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
        n_scale_bytes, scale = scales.numel() * 4, self.lr_scale
        gathered, handle = self._all_gather(message, bucket, mesh, axis)

        def finish() -> torch.Tensor:
            flat.zero_()
            for chunk in gathered:
                rank_scales = chunk[:n_scale_bytes].view(torch.float32)
                rank_bits = unpack_bits(chunk[n_scale_bytes : n_scale_bytes + packed.numel()], flat.numel())
                self.decode_into(flat, rank_bits, rank_scales, bucket)
            return unscale(flat, scale)

        return Then(handle, finish)

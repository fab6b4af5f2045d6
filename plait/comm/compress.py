"""Gradient compressors that replace DataParallel's bucket all-reduce.

Each compressor is a DataParallel `comm_hook`: `compressor(bucket, mesh, axis)` starts the
exchange of one gradient bucket and returns a handle whose `wait()` leaves the reduced gradient
in `bucket.buffer`. The bucket already holds each gradient divided by the number of replicas,
so summing the ranks' (decompressed) contributions gives the mean. Every rank decodes the same
gathered bytes the same way, so the replicas stay identical.

* `FP16Compressor`: all-reduce in half precision (2x fewer bytes).
* `OneBitCompressor` (`plait.comm.onebit`): 1-bit SGD (Seide et al. 2014, "1-Bit Stochastic
  Gradient Descent and its Application to Data-Parallel Distributed Training of Speech DNNs").
  Each column of a parameter's gradient (plus the carried error) is quantised at threshold 0 to
  one bit; the two reconstruction values of a column are the mean of its non-negative and of its
  negative entries, which minimise the squared error. The quantisation error is kept per
  parameter and added to the next step's gradient (error feedback, the paper's key to
  convergence). Bits are packed 8 per byte, so the wire carries 1/32 of fp32 plus two fp32 scales
  per column.
* `TopKCompressor` (`plait.comm.topk`): sparse communication (Aji & Heafield 2017, "Sparse
  Communication for Distributed Gradient Descent"): only the ceil(r·n) entries of largest
  |gradient + residual| are sent as (int32 index, fp32 value) pairs, gathered from every rank
  and summed; the rest stays in the residual for later steps.
* `PowerSGDCompressor` (`plait.comm.powersgd`): rank-r PowerSGD (Vogels, Karimireddy & Jaggi
  2019): each weight matrix is sent as a rank-r approximation from one warm-started
  power-iteration step, in two all-reduces; vectors are sent exactly.

Each also has `reduce_scatter(bucket, out, lo, hi, mesh, axis)` for ZeRO-1/2 (`plait.zero.wrap(...,
comm_hook=...)`): fp16 reduce-scatters in half precision; the others exchange and decode the whole
bucket as above and keep the rank's shard.

Error feedback (`plait.comm.residual`) can be switched off (`error_feedback=False`) to show why it
is needed. The residual is kept in units of the step taken, not of the gradient: before each step
the trainer calls `set_lr_scale(lr_t / peak_lr)`, the compressor encodes ``scale·g + residual``
and divides what it decodes by the scale, so the optimizer still receives gradients. This is error
feedback as Stich et al. (2018) and Karimireddy et al. (2019, "Error Feedback Fixes SignSGD")
state it, e_{t+1} = p_t - C(p_t) with p_t = γ_t·g_t + e_t: under a learning-rate schedule a
gradient held back during warm-up re-enters at the learning rate of its own step, not at the
later, larger one (measured in docs/compression.md: it is what brings top-1% within 5% of
uncompressed under SGD). The ledger records the bytes actually sent next to the fp32 bytes the
bucket stands for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from plait import comm
from plait.comm.onebit import (
    OneBitCompressor,
    column_groups,
    onebit_dequantize,
    onebit_quantize,
    pack_bits,
    unpack_bits,
)
from plait.comm.powersgd import PowerSGDCompressor
from plait.comm.residual import Then
from plait.comm.topk import TopKCompressor
from plait.errors import ConfigError

if TYPE_CHECKING:
    from plait.gradsync import GradBucket
    from plait.mesh import Mesh

__all__ = [
    "COMPRESSIONS",
    "FP16Compressor",
    "OneBitCompressor",
    "PowerSGDCompressor",
    "TopKCompressor",
    "column_groups",
    "make_compressor",
    "onebit_dequantize",
    "onebit_quantize",
    "pack_bits",
    "unpack_bits",
]

COMPRESSIONS = ("none", "fp16", "onebit", "topk", "powersgd")


class FP16Compressor:
    """All-reduce the bucket in float16 (or bfloat16): half the bytes, no state."""

    def __init__(self, dtype: torch.dtype = torch.float16):
        self.dtype = dtype

    def __call__(self, bucket: GradBucket, mesh: Mesh, axis: str):
        flat = bucket.buffer
        half = flat.to(self.dtype)
        handle = comm.all_reduce(half, mesh, axis, async_op=True, logical_bytes=flat.numel() * 4)
        return Then(handle, lambda: flat.copy_(half))

    def reduce_scatter(self, bucket, out: torch.Tensor, lo: int, hi: int, mesh: Mesh, axis: str):
        """ZeRO-1/2's exchange: a reduce-scatter in half precision; this rank's shard goes to `out`."""
        flat = bucket.buffer
        half, part = flat.to(self.dtype), torch.empty(hi - lo, dtype=self.dtype, device=flat.device)
        handle = comm.reduce_scatter(part, half, mesh, axis, async_op=True, logical_bytes=flat.numel() * 4)
        return Then(handle, lambda: out.copy_(part))


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

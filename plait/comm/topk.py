"""Sparse communication (Aji & Heafield 2017, "Sparse Communication for Distributed Gradient
Descent"): top-k entries with error feedback; see `plait.comm.compress`."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from plait.comm.residual import ResidualCompressor, Then, unscale
from plait.errors import ConfigError

if TYPE_CHECKING:
    from plait.gradsync import GradBucket
    from plait.mesh import Mesh


class TopKCompressor(ResidualCompressor):
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
        gathered, handle = self._all_gather(message, bucket, mesh, axis)
        k, scale = idx.numel(), self.lr_scale

        def finish() -> torch.Tensor:
            flat.zero_()
            flat.index_add_(
                0, gathered[:, :k].reshape(-1).long(), gathered[:, k:].reshape(-1).view(torch.float32)
            )
            return unscale(flat, scale)

        return Then(handle, finish)

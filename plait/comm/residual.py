"""Error feedback in units of the step (see `plait.comm.compress`): the residuals a compressor
keeps per bucket, and the handle that finishes an exchange once it completes."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from plait import comm

if TYPE_CHECKING:
    from plait.gradsync import GradBucket
    from plait.mesh import Mesh


class ResidualCompressor:
    """Per-bucket residuals in units of the step (see `plait.comm.compress`); a compressor
    subclasses it and calls itself on a bucket."""

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
        return Then(handle, lambda: out.copy_(bucket.buffer[lo:hi]))

    def _accumulated(self, bucket: GradBucket) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale·gradient + residual, the residual tensor to update)."""
        residual = self.residuals.setdefault(bucket.index, torch.zeros_like(bucket.buffer))
        return bucket.buffer * self.lr_scale + residual, residual

    def _all_gather(self, message: torch.Tensor, bucket: GradBucket, mesh: Mesh, axis: str):
        """Start gathering every rank's `message` (the ledger counts the fp32 bucket it stands
        for); returns (the gathered messages, one row per rank, once waited for; the handle)."""
        n_ranks = mesh.size(axis)
        flat = bucket.buffer
        gathered = torch.empty(n_ranks * message.numel(), dtype=message.dtype, device=flat.device)
        handle = comm.all_gather(gathered, message, mesh, axis, async_op=True, logical_bytes=flat.numel() * 4)
        return gathered.view(n_ranks, -1), handle


def unscale(flat: torch.Tensor, scale: float) -> torch.Tensor:
    """Decoded values are in units of the step: divided by the step's scale, gradients again."""
    return flat.div_(scale) if scale != 1.0 else flat


class Then:
    """A handle that runs `finish()` after the underlying operation completes."""

    def __init__(self, handle, finish):
        self.handle, self.finish = handle, finish

    def wait(self) -> torch.Tensor:
        self.handle.wait()
        return self.finish()

"""Data parallelism with bucketed gradient all-reduce overlapped with backward (Li et al. 2020).

The design of PyTorch DDP's paper (VLDB 2020, §3.2-3.3):

* At wrap time the parameters and buffers of dp rank 0 are broadcast, so every replica starts
  identical.
* Gradients are grouped into buckets of about `bucket_mb` megabytes in *reverse* registration
  order, which is roughly the order backward produces them.
* A hook on each parameter (fired after its gradient is accumulated) copies the gradient,
  divided by the number of replicas, into its bucket; when a bucket's last gradient arrives,
  the bucket's all-reduce is started asynchronously, so communication of late layers overlaps
  the backward of early ones. Buckets are launched strictly in index order: every rank must
  issue the collectives in the same order.
* At the end of backward (an autograd engine callback) all buckets are waited for (their sum
  is the mean) and the parameters' `.grad` become views of the reduced buckets: no copy back.
* `no_sync()` skips communication so gradients accumulate locally across micro-batches.

A parameter that received no gradient in a synchronised backward is an error naming it (other
ranks would otherwise wait forever for its bucket); `allow_unused=True` reduces zeros for it.
`comm_hook` replaces the bucket all-reduce, e.g. with a gradient compressor. The trigger is
pluggable too: per-parameter hooks (the default), or `trigger="manual"`, where the owner says
which gradients are complete (`grads_ready`) and when the step's are (`finish_grads`): a
pipeline stage's last backward. Under a compressor a bucket holds parameters of one placement
(`plait.placement.bucket_key`), so replicas over tp stay equal. Gradients partial over tp
(sequence-parallel LayerNorms, by their placements) are summed there after the all-reduce.

The buckets, hooks, launch order and waiting are plait's one gradient synchroniser
(`plait.gradsync.GradSync`, collective all-reduce); this module sets it up for a replica.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
from torch import nn

from plait import comm
from plait.engine import ScalesResiduals
from plait.errors import DataParallelError
from plait.gradsync import GradBucket, GradSync, build_buckets
from plait.mesh import Mesh
from plait.placement import bucket_key, reduce_axis

__all__ = ["DataParallel", "GradBucket", "allreduce_mean_hook", "build_buckets"]

CommHook = Callable[[GradBucket, Mesh, str], "comm.Handle"]


def allreduce_mean_hook(bucket: GradBucket, mesh: Mesh, axis: str) -> comm.Handle:
    """The default: an asynchronous all-reduce (sum) of the bucket. DataParallel has already
    divided each gradient by the axis size while copying it in, so the sum is the mean."""
    return comm.all_reduce(bucket.buffer, mesh, axis, async_op=True)


class DataParallel(nn.Module):
    """Wrap `module` for data parallelism over `axis` of `mesh`.

    Args:
        module: any nn.Module, already on the mesh's device.
        mesh: the plait Mesh; gradients are averaged over `axis` (default "dp").
        bucket_mb: bucket capacity in MB (1e6 bytes); the paper's default is 25.
        allow_unused: tolerate parameters that get no gradient (they are reduced as zeros).
        comm_hook: `hook(bucket, mesh, axis)` returning an object whose `wait()` gives the
            reduced `bucket.buffer`; replaces the default all-reduce (see `allreduce_mean_hook`
            and the compressors of `plait.comm.compress`). The buffer holds gradients already
            divided by the axis size: the hook sums them.
        trigger: "hook" (per-parameter hooks, overlapping backward) or "manual"
            (`grads_ready` / `finish_grads`).
    """

    def __init__(
        self,
        module: nn.Module,
        mesh: Mesh,
        axis: str = "dp",
        bucket_mb: float = 25.0,
        allow_unused: bool = False,
        comm_hook: CommHook | None = None,
        trigger: str = "hook",
        axes: tuple[str, ...] | None = None,
    ):
        super().__init__()
        if bucket_mb <= 0:
            raise DataParallelError(f"bucket_mb must be positive, got {bucket_mb}")
        if trigger not in ("hook", "manual"):
            raise DataParallelError(f"trigger {trigger!r} is not valid; valid: hook, manual")
        self.trigger = trigger
        self.module = module
        self.mesh = mesh
        self.axis = axis
        # the data axes: every gradient is averaged over all of them, and summed over those a
        # parameter is not sharded on (experts over ep: over dp alone; see reduce_axis)
        self.axes = tuple(axes or (axis,))
        self.allow_unused = allow_unused
        self.comm_hook = comm_hook or allreduce_mean_hook
        self._broadcast_state()
        self.buckets = self._build_buckets(int(bucket_mb * 1e6))
        self.sync = GradSync(
            self.buckets,
            mesh,
            axis,
            comm_hook=self.comm_hook,
            scale=1.0 / math.prod(mesh.size(a) for a in self.axes),
            trigger=trigger,
            missing="zeros" if allow_unused else "error",
        )

    # --- set-up ---------------------------------------------------------------------------

    @torch.no_grad()
    def _broadcast_state(self) -> None:
        """Make every replica start from dp rank 0's parameters and buffers (coalesced per dtype)."""
        tensors = [t for t in list(self.module.parameters()) + list(self.module.buffers())]
        by_kind: dict[tuple, list[torch.Tensor]] = {}
        seen = set()
        for t in tensors:
            if id(t) not in seen:
                seen.add(id(t))
                axis = reduce_axis(t, self.mesh, self.axes)  # an expert: over its replicas only
                by_kind.setdefault((t.dtype, t.device, axis), []).append(t)
        for (_, _, axis), group in by_kind.items():
            if self.mesh.size(axis) == 1:
                continue
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            comm.broadcast(flat, self.mesh, axis, src=0)
            offset = 0
            for t in group:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    def _build_buckets(self, capacity: int) -> list[GradBucket]:
        names = {id(p): n for n, p in self.module.named_parameters()}
        params = [p for p in self.module.parameters() if p.requires_grad]
        # reverse registration order ~ the order gradients are ready; one set of partial axes per
        # bucket, and under a compressor one placement (bucket_key)
        lossy = self.comm_hook is not allreduce_mean_hook
        buckets = build_buckets(
            list(reversed(params)),
            capacity,
            lambda p: names[id(p)],
            lambda p: (bucket_key(p, self.mesh, lossy), reduce_axis(p, self.mesh, self.axes)),
        )
        if len(self.axes) > 1:  # each bucket over the data axes its parameters are not sharded on
            for b in buckets:
                b.axis = reduce_axis(b.params[0], self.mesh, self.axes)
        return buckets

    # --- the backward path ----------------------------------------------------------------

    def grads_ready(self, params) -> None:
        """The manual trigger (`trigger="manual"`, a pipeline's: its schedule writes gradients
        itself, some outside autograd's hooks): `params`' gradients are complete for this step;
        their buckets are launched as soon as they fill, in bucket order. `finish_grads()`
        completes the step."""
        self.sync.grads_ready(params)

    def finish_grads(self) -> None:
        """The manual trigger's end of the step: wait for every bucket (parameters never made
        ready are reduced as zeros if `allow_unused`) and point `.grad` at the reduced buckets."""
        self.sync.finish()

    @property
    def last_hook_time(self) -> float:
        """When the last gradient of the last synchronised backward arrived (time.time())."""
        return self.sync.last_grad_time

    @property
    def backward_end_time(self) -> float:
        """When the last synchronised backward's reduction finished."""
        return self.sync.end_time

    # --- public ---------------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        if self.sync.pending and torch.is_grad_enabled():
            # The previous backward raised part-way (its end-of-backward callback never ran):
            # start clean rather than report its gradients as arriving twice.
            self.sync.reset()
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (no communication) inside this context."""
        with self.sync.no_sync():
            yield

    def set_lr_scale(self, scale: float) -> None:
        """The learning rate of the coming step over the peak, for a compressor keeping its
        error-feedback residual in units of the step (plait.engine.ScalesResiduals)."""
        if isinstance(self.comm_hook, ScalesResiduals):
            self.comm_hook.set_lr_scale(scale)

    def residual_buffers(self) -> dict[str, torch.Tensor] | None:
        """This rank's error-feedback residuals, one per bucket (zeros where none yet), for
        checkpoints; None without an error-feedback compressor."""
        hook = self.comm_hook
        if hasattr(hook, "residual_buffers"):  # 1-bit Adam's momentum compressor
            return hook.residual_buffers()
        if not hasattr(hook, "state_tensors"):
            return None
        return hook.state_tensors(self.buckets)

    def bucket_table(self) -> list[dict]:
        """Bucket index, size in bytes and parameter names, in launch order."""
        return [{"index": b.index, "bytes": b.nbytes, "params": list(b.names)} for b in self.buckets]

    def remove_hooks(self) -> None:
        self.sync.remove_hooks()

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
(`plait.placement.bucket_key`), so replicas over tp stay equal.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch
from torch import nn

from plait import comm
from plait.engine import ScalesResiduals
from plait.errors import DataParallelError
from plait.mesh import Mesh
from plait.placement import bucket_key

CommHook = Callable[["GradBucket", Mesh, str], "comm.Handle"]


def allreduce_mean_hook(bucket: GradBucket, mesh: Mesh, axis: str) -> comm.Handle:
    """The default: an asynchronous all-reduce (sum) of the bucket. DataParallel has already
    divided each gradient by the axis size while copying it in, so the sum is the mean."""
    return comm.all_reduce(bucket.buffer, mesh, axis, async_op=True)


class GradBucket:
    """One bucket: its index (launch order), parameters, their names and offsets in `buffer`."""

    def __init__(self, index: int, params: list[nn.Parameter], names: list[str]):
        self.index = index
        self.params = params
        self.names = names
        self.offsets = []
        total = 0
        for p in params:
            self.offsets.append(total)
            total += p.numel()
        self.numel = total
        self.buffer = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
        self.ready: set[int] = set()
        self.handle = None

    def view(self, i: int) -> torch.Tensor:
        p = self.params[i]
        return self.buffer[self.offsets[i] : self.offsets[i] + p.numel()].view_as(p)

    @property
    def nbytes(self) -> int:
        return self.numel * self.buffer.element_size()


def build_buckets(params: list[nn.Parameter], capacity: int, name=None, key=None) -> list[GradBucket]:
    """Consecutive runs of `params`, in the given order, of at most `capacity` bytes (a larger
    parameter gets a bucket of its own), one dtype and one `key(p)` each, as GradBuckets named
    by `name(p)`."""
    key = key or (lambda p: None)
    chunks, current, size = [], [], 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if current and (size + nbytes > capacity or (p.dtype, key(p)) != (current[0].dtype, key(current[0]))):
            chunks.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        chunks.append(current)
    name = name or (lambda p: f"param{id(p)}")
    return [GradBucket(i, ps, [name(p) for p in ps]) for i, ps in enumerate(chunks)]


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
        self.allow_unused = allow_unused
        self.comm_hook = comm_hook or allreduce_mean_hook
        self._scale = 1.0 / mesh.size(axis)
        self._sync = True
        self._queued = False
        self._next_launch = 0
        self.last_hook_time = 0.0
        self.backward_end_time = 0.0
        self._broadcast_state()
        self.buckets = self._build_buckets(int(bucket_mb * 1e6))
        self._where: dict[int, tuple[GradBucket, int]] = {}
        self._hooks = []
        for b in self.buckets:
            for i, p in enumerate(b.params):
                self._where[id(p)] = (b, i)
                if trigger == "hook":
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))

    # --- set-up ---------------------------------------------------------------------------

    @torch.no_grad()
    def _broadcast_state(self) -> None:
        """Make every replica start from dp rank 0's parameters and buffers (coalesced per dtype)."""
        if self.mesh.size(self.axis) == 1:
            return
        tensors = [t for t in list(self.module.parameters()) + list(self.module.buffers())]
        by_kind: dict[tuple, list[torch.Tensor]] = {}
        seen = set()
        for t in tensors:
            if id(t) not in seen:
                seen.add(id(t))
                by_kind.setdefault((t.dtype, t.device), []).append(t)
        for group in by_kind.values():
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            comm.broadcast(flat, self.mesh, self.axis, src=0)
            offset = 0
            for t in group:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    def _build_buckets(self, capacity: int) -> list[GradBucket]:
        names = {id(p): n for n, p in self.module.named_parameters()}
        params = [p for p in self.module.parameters() if p.requires_grad]
        # reverse registration order ~ the order gradients are ready; under a compressor, one
        # placement per bucket (bucket_key)
        lossy = self.comm_hook is not allreduce_mean_hook
        return build_buckets(
            list(reversed(params)),
            capacity,
            lambda p: names[id(p)],
            lambda p: bucket_key(p, self.mesh, lossy),
        )

    # --- the backward path ----------------------------------------------------------------

    def grads_ready(self, params) -> None:
        """The manual trigger (`trigger="manual"`, a pipeline's: its schedule writes gradients
        itself, some outside autograd's hooks): `params`' gradients are complete for this step;
        their buckets are launched as soon as they fill, in bucket order. `finish_grads()`
        completes the step."""
        for p in params:
            self._on_grad(p)

    def finish_grads(self) -> None:
        """The manual trigger's end of the step: wait for every bucket (parameters never made
        ready are reduced as zeros if `allow_unused`) and point `.grad` at the reduced buckets."""
        self._finish_backward()

    def _on_grad(self, p: nn.Parameter) -> None:
        if not self._sync:
            return
        if not self._queued and self.trigger == "hook":
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        bucket, i = self._where[id(p)]
        if i in bucket.ready:
            raise DataParallelError(
                f"parameter {bucket.names[i]} received its gradient twice in one backward; "
                "call backward once per forward (use no_sync() for accumulation)"
            )
        view = bucket.view(i)
        # Divide while copying (one pass over the gradient): the all-reduced sum is then the mean.
        if p.grad.data_ptr() == view.data_ptr():  # accumulated in place into last step's bucket view
            view.mul_(self._scale)
        else:
            torch.mul(p.grad, self._scale, out=view)
        bucket.ready.add(i)
        self.last_hook_time = time.time()
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets):
            b = self.buckets[self._next_launch]
            if len(b.ready) < len(b.params):
                return
            b.handle = self.comm_hook(b, self.mesh, self.axis)
            self._next_launch += 1

    def _finish_backward(self) -> None:
        self._queued = False
        missing = [b.names[i] for b in self.buckets for i in range(len(b.params)) if i not in b.ready]
        if missing:
            if not self.allow_unused:
                self._reset()
                shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
                raise DataParallelError(
                    f"{len(missing)} parameter(s) received no gradient in this backward: {shown}. "
                    "Make every parameter take part in the loss, or pass allow_unused=True "
                    "(or set requires_grad=False on parameters that are frozen)"
                )
            for b in self.buckets:
                for i in range(len(b.params)):
                    if i not in b.ready:
                        b.view(i).zero_()
                        b.ready.add(i)
            self._launch_ready()
        for b in self.buckets:
            reduced = b.handle.wait()
            if reduced is not b.buffer:
                b.buffer.copy_(reduced)
            for i, p in enumerate(b.params):
                p.grad = b.view(i)
        self.backward_end_time = time.time()
        self._reset()

    def _reset(self) -> None:
        for b in self.buckets:
            b.ready.clear()
            b.handle = None
        self._next_launch = 0

    # --- public ---------------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        if self._queued and torch.is_grad_enabled():
            # The previous backward raised part-way (its end-of-backward callback never ran):
            # start clean rather than report its gradients as arriving twice.
            self._queued = False
            self._reset()
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (no communication) inside this context."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

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
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

"""The gradient synchroniser: one bucketed, overlapped gradient reduction for every engine.

Plain data parallelism, ZeRO-1/2, ZeRO-3's units, every pipeline stage and the sum of a tied
parameter's copies over pipeline ranks all reduce gradients through `GradSync`. What differs
between them is three pluggable choices, not three copies of the machinery:

* **the collective**: an all-reduce (data parallelism: every rank keeps the whole mean) or a
  reduce-scatter (ZeRO: rank r keeps slice r of the padded bucket), or a compressor of
  `plait.comm.compress` in place of either (`comm_hook`);
* **the trigger**: a hook on each parameter fired when its gradient is accumulated
  (`trigger="hook"`, overlapping the reduction with the rest of backward), or the owner saying
  which gradients are complete (`trigger="manual"`: a pipeline's schedule after a stage's last
  backward, ZeRO-3's per-unit hook) and when the step's are (`finish()`);
* **the delivery**: what the owner does with each reduced bucket (`deliver(bucket, reduced)`):
  point `.grad` at it, add the shard into the optimizer's gradient shard, ...

Everything else is shared. Buckets (`GradBucket`) are flat, padded runs of parameters in the
order gradients become ready (reverse registration order), of one dtype and one placement key
(`plait.placement.bucket_key`); each gradient is scaled (1/N: the sum is then the mean) as it is
copied or added in. Buckets launch as soon as they are complete, strictly in index order
(`ordered`: every rank must issue collectives in one order; ZeRO-3's units are ordered by
autograd itself, which is the same on every rank). At the end, each bucket is waited for, summed
over the replicate axis (hybrid sharding) and, in the parts whose parameters' gradients are
partial over model axes (their placements: sequence-parallel LayerNorms over tp), over those
axes; then delivered. A parameter without a gradient is an error naming it, zeros (`missing=
"zeros"`) or, for a bucket whose gradient arrives whole (ZeRO-3), no collective at all
(`"skip"`: every rank skips it alike).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch

from plait import comm
from plait.errors import DataParallelError
from plait.flat import FlatLayout
from plait.mesh import Mesh
from plait.placement import placement


class GradBucket:
    """One bucket: its index (launch order), parameters, their names, their place in a flat
    gradient buffer padded to a multiple of `n` (`layout`, a `plait.flat.FlatLayout`; `offsets`
    and `numel` as compressors read them) and that buffer, allocated at first use."""

    def __init__(
        self, index: int, params: list, names: list[str], n: int = 1, dtype=None, device=None, axis=None
    ):
        self.index = index
        self.axis = axis  # the axis it is reduced over, when not the synchroniser's own
        self.params = list(params)
        self.names = list(names)
        self.layout = FlatLayout(self.names, [p.shape for p in self.params], n)
        self.offsets = list(self.layout.offsets)
        self.numel = self.layout.padded
        self.dtype = dtype or self.params[0].dtype
        self.device = device or self.params[0].device
        self._buffer: torch.Tensor | None = None
        self.ready: set[int] = set()
        self.handle = None
        self.out: torch.Tensor | None = None  # a reduce-scatter's shard
        self.sums: list[tuple[tuple[str, ...], list[tuple[int, int]]]] = []  # set by GradSync

    @property
    def buffer(self) -> torch.Tensor:
        if self._buffer is None:
            self._buffer = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        return self._buffer

    @buffer.setter
    def buffer(self, tensor: torch.Tensor | None) -> None:
        self._buffer = tensor

    @property
    def allocated(self) -> bool:
        return self._buffer is not None

    def release(self) -> None:
        """Free the buffer (allocated again, as zeros, at the next use)."""
        self._buffer = None

    def view(self, i: int) -> torch.Tensor:
        p = self.params[i]
        return self.buffer[self.offsets[i] : self.offsets[i] + p.numel()].view(p.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


def bucket_chunks(params: list, capacity: int, key=None, nbytes=None) -> list[list]:
    """Consecutive runs of `params`, in the given order, of at most `capacity` bytes (a larger
    parameter gets a run of its own), each of one dtype and one `key(p)`."""
    key = key or (lambda p: None)
    nbytes = nbytes or (lambda p: p.numel() * p.element_size())
    chunks, current, size = [], [], 0
    for p in params:
        k = nbytes(p)
        if current and (size + k > capacity or (p.dtype, key(p)) != (current[0].dtype, key(current[0]))):
            chunks.append(current)
            current, size = [], 0
        current.append(p)
        size += k
    if current:
        chunks.append(current)
    return chunks


def build_buckets(params: list, capacity: int, name=None, key=None) -> list[GradBucket]:
    """`bucket_chunks` as GradBuckets named by `name(p)` (unpadded: for an all-reduce)."""
    name = name or (lambda p: f"param{id(p)}")
    chunks = bucket_chunks(params, capacity, key)
    return [GradBucket(i, ps, [name(p) for p in ps]) for i, ps in enumerate(chunks)]


class _Reduced:
    """A finished reduction whose result is already in place."""

    def __init__(self, result: torch.Tensor):
        self.result = result

    def wait(self) -> torch.Tensor:
        return self.result


Deliver = Callable[[GradBucket, torch.Tensor], None]


class GradSync:
    """Reduce the gradients of `buckets` over `axis` of `mesh` (see the module doc).

    Args:
        reduce: "all_reduce" (the reduced bucket is the whole buffer) or "reduce_scatter" (this
            rank's shard of the padded buffer, `bucket.out`).
        comm_hook: replaces the collective: `hook(bucket, mesh, axis)` for an all-reduce,
            `hook.reduce_scatter(bucket, out, lo, hi, mesh, axis)` for a reduce-scatter; each
            returns an object whose `wait()` gives the result. The buffer holds gradients
            already scaled: the hook sums them.
        scale: the factor each gradient is multiplied by on its way in (default 1/N, N the size
            of `axis`, so the sum is the mean).
        accumulate: add gradients into the buffer (and drop `.grad`: ZeRO keeps them there,
            also inside `no_sync()`), instead of copying them in when the step's backward
            synchronises (data parallelism: `.grad` accumulates and becomes a view of the
            reduced buffer).
        replicate_axis: after the collective, all-reduce the result over this axis too (hybrid
            sharding's replicas).
        missing: what a bucket holding a parameter without a gradient does at `finish()`:
            "error", "zeros" (reduce zeros for it) or "skip" (a bucket none of whose gradients
            arrived is not reduced: every rank skips it alike).
        deliver: `deliver(bucket, reduced)` after a bucket is reduced; the default points each
            parameter's `.grad` at its view of the reduced buffer.
        check: called when a synchronised backward ends, before anything is reduced; an error
            it raises aborts the step's reduction (the owner's rule, e.g. ZeRO-1's one
            reduction per step).
    """

    def __init__(
        self,
        buckets: list[GradBucket],
        mesh: Mesh,
        axis: str,
        *,
        reduce: str = "all_reduce",
        comm_hook=None,
        scale: float | None = None,
        accumulate: bool = False,
        trigger: str = "hook",
        ordered: bool = True,
        replicate_axis: str | None = None,
        missing: str = "error",
        deliver: Deliver | None = None,
        check: Callable[[], None] | None = None,
    ):
        if reduce not in ("all_reduce", "reduce_scatter"):
            raise ValueError(f"reduce {reduce!r} is not valid; valid: all_reduce, reduce_scatter")
        if trigger not in ("hook", "manual"):
            raise DataParallelError(f"trigger {trigger!r} is not valid; valid: hook, manual")
        if missing not in ("error", "zeros", "skip"):
            raise ValueError(f"missing {missing!r} is not valid; valid: error, zeros, skip")
        self.buckets = buckets
        self.mesh = mesh
        self.axis = axis
        self.reduce = reduce
        self.comm_hook = comm_hook
        self.scale = 1.0 / mesh.size(axis) if scale is None else scale
        self.accumulate = accumulate
        self.trigger = trigger
        self.ordered = ordered
        self.replicate_axis = replicate_axis if replicate_axis and mesh.size(replicate_axis) > 1 else None
        self.missing = missing
        self.deliver = deliver or _point_grads
        self.check = check
        self.sync = True
        self._queued = False
        self._next = 0
        self._launched: list[GradBucket] = []
        self.last_grad_time = 0.0
        self.end_time = 0.0
        self._where: dict[int, tuple[GradBucket, int]] = {}
        self._hooks = []
        for b in buckets:
            b.sums = self._partial_runs(b)
            for i, p in enumerate(b.params):
                self._where[id(p)] = (b, i)
                if trigger == "hook":
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._on_hook))

    def _partial_runs(self, b: GradBucket) -> list[tuple[tuple[str, ...], list[tuple[int, int]]]]:
        """[(model axes, [(offset, length)])]: the runs of the reduced result (the whole buffer,
        or this rank's shard) whose parameters' gradients are partial over those axes."""
        axis = b.axis or self.axis
        scattered = self.reduce == "reduce_scatter"
        lo, hi = b.layout.shard_range(self.mesh.rank(axis)) if scattered else (0, b.numel)
        runs: dict[tuple[str, ...], list[tuple[int, int]]] = {}
        for p, off, k in zip(b.params, b.layout.offsets, b.layout.numels, strict=True):
            # (the synchronised axis itself is summed by the collective)
            axes = tuple(a for a in placement(p).grad_partial if self.mesh.size(a) > 1 and a != axis)
            s, e = max(lo, off), min(hi, off + k)
            if not axes or s >= e:
                continue
            mine = runs.setdefault(axes, [])
            if mine and mine[-1][0] + mine[-1][1] == s - lo:  # adjacent: one run
                mine[-1] = (mine[-1][0], mine[-1][1] + e - s)
            else:
                mine.append((s - lo, e - s))
        return list(runs.items())

    # --- gradients in -----------------------------------------------------------------------

    def _on_hook(self, p) -> None:
        if not self.sync and not self.accumulate:
            return  # no_sync: the gradient accumulates in .grad
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
        self.grad_ready(p)

    def grad_ready(self, p) -> None:
        """`p.grad` is complete for this backward: take it into its bucket (launching the
        buckets that are now complete)."""
        if not self.sync and not self.accumulate:
            return  # no_sync: the gradient accumulates in .grad
        b, i = self._where[id(p)]
        if self.sync and i in b.ready:
            raise DataParallelError(
                f"parameter {b.names[i]} received its gradient twice in one backward; call backward "
                "once per forward (use no_sync() for accumulation)"
            )
        view = b.buffer[b.offsets[i] : b.offsets[i] + b.layout.numels[i]]
        grad = p.grad.reshape(-1)
        if self.accumulate:
            view.add_(grad, alpha=self.scale)
            p.grad = None  # the bucket holds it now
        elif grad.data_ptr() == view.data_ptr():  # accumulated in place into last step's view
            view.mul_(self.scale)
        else:
            torch.mul(grad, self.scale, out=view)
        self.last_grad_time = time.time()
        if self.sync:
            b.ready.add(i)
            self._launch_ready(b)

    def grads_ready(self, params) -> None:
        """The manual trigger: each of `params`' gradients is complete."""
        for p in params:
            self.grad_ready(p)

    def bucket_ready(self, b: GradBucket, flat: torch.Tensor) -> None:
        """A bucket's whole gradient arrived as one flat tensor (ZeRO-3's unit): it becomes the
        buffer, scaled in place, and is launched."""
        b.buffer = flat.mul_(self.scale)
        b.ready.update(range(len(b.params)))
        self.last_grad_time = time.time()
        self._launch_ready(b)

    def _launch_ready(self, b: GradBucket) -> None:
        if not self.ordered:
            if len(b.ready) == len(b.params) and b.handle is None:
                self._launch(b)
            return
        while self._next < len(self.buckets):
            nxt = self.buckets[self._next]
            if len(nxt.ready) < len(nxt.params):
                return
            self._launch(nxt)
            self._next += 1

    def _launch(self, b: GradBucket) -> None:
        axis = b.axis or self.axis
        if self.reduce == "all_reduce":
            if self.comm_hook is not None:
                b.handle = self.comm_hook(b, self.mesh, axis)
            else:
                b.handle = comm.all_reduce(b.buffer, self.mesh, axis, async_op=True)
        else:
            b.out = torch.empty(b.layout.shard_numel, dtype=b.buffer.dtype, device=b.buffer.device)
            if self.comm_hook is not None:
                lo, hi = b.layout.shard_range(self.mesh.rank(axis))
                b.handle = self.comm_hook.reduce_scatter(b, b.out, lo, hi, self.mesh, axis)
            else:
                b.handle = comm.reduce_scatter(b.out, b.buffer, self.mesh, axis, async_op=True)
        self._launched.append(b)

    # --- the end of the step's backward ------------------------------------------------------

    def finish(self) -> None:
        """Every gradient of this backward is in (the hook trigger calls this at the end of
        backward): launch what remains, wait for every bucket in launch order, sum over the
        replicate and partial axes, deliver."""
        self._queued = False
        if not self.sync:
            return
        if self.check is not None:
            try:
                self.check()
            except Exception:
                self.reset()
                raise
        missing = [(b, i) for b in self.buckets for i in range(len(b.params)) if i not in b.ready]
        if missing and self.missing == "error":
            self.reset()
            names = [b.names[i] for b, i in missing]
            shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
            raise DataParallelError(
                f"{len(names)} parameter(s) received no gradient in this backward: {shown}. "
                "Make every parameter take part in the loss, or pass allow_unused=True "
                "(or set requires_grad=False on parameters that are frozen)"
            )
        if missing and self.missing == "zeros":
            for b, i in missing:
                if not self.accumulate:
                    b.view(i).zero_()
                b.ready.add(i)
            for b in self.buckets:
                self._launch_ready(b)
        for b in sorted(self._launched, key=lambda b: b.index) if self.ordered else list(self._launched):
            reduced = b.handle.wait()
            if self.reduce == "reduce_scatter":
                reduced = b.out
            elif reduced is not b.buffer:
                b.buffer.copy_(reduced)
                reduced = b.buffer
            if self.replicate_axis:
                comm.all_reduce(reduced, self.mesh, self.replicate_axis)
            for axes, runs in b.sums:
                _sum_runs(reduced, runs, axes, self.mesh)
            self.deliver(b, reduced)
        self.end_time = time.time()
        self.reset()

    def reset(self) -> None:
        """Forget this backward's progress (after `finish`, or a backward that raised)."""
        for b in self.buckets:
            b.ready.clear()
            b.handle = None
            b.out = None
        self._launched = []
        self._next = 0
        self._queued = False

    @property
    def pending(self) -> bool:
        """A hook-triggered backward started and its end never came (it raised part-way)."""
        return self._queued

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally, without communicating, inside this context."""
        previous, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = previous

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def _point_grads(b: GradBucket, reduced: torch.Tensor) -> None:
    for i, p in enumerate(b.params):
        p.grad = b.view(i)


def _sum_runs(t: torch.Tensor, runs: list[tuple[int, int]], axes: tuple[str, ...], mesh: Mesh) -> None:
    """All-reduce the runs [(offset, length)] of `t` over `axes`, in place, as one tensor."""
    whole = len(runs) == 1 and runs[0] == (0, t.numel())
    part = t if whole else torch.cat([t[o : o + k] for o, k in runs])
    for axis in axes:
        comm.all_reduce(part, mesh, axis)
    if not whole:
        offset = 0
        for o, k in runs:
            t[o : o + k].copy_(part[offset : offset + k])
            offset += k

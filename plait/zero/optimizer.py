"""ZeRO stages 1 and 2 (Rajbhandari et al. 2019, §5.1-5.2): sharded optimizer state and gradients.

Parameters stay whole on every rank; each is a view of a flat bucket buffer (reverse
registration order, about `bucket_mb` each, padded to a multiple of the shard count N). During
backward a hook adds each gradient (divided by the data-parallel degree) into its bucket's
gradient buffer; when a bucket is complete its reduce-scatter starts asynchronously, strictly in
bucket order, so communication overlaps the rest of backward (as DDP's all-reduce). Rank r keeps
slice r of every bucket's reduced gradient, steps that slice of the fp32 master weights, and the
updated slices are all-gathered back into the buckets: reduce-scatter Ψ + all-gather Ψ = 2Ψ per
step, as plain data parallelism.

* Stage 1 (P_os) keeps full gradient buffers between steps (gradient memory Ψ).
* Stage 2 (P_os+g) allocates a bucket's buffer at its first gradient and frees it once reduced:
  only the 1/N gradient shard stays (gradient memory Ψ/N).

Hybrid sharding: shards span `dp_shard` (a group of F ranks) and the reduced shards are then
all-reduced across `dp_replicate`. Tensor parallelism: parameters whose gradient is partial over
tp (their placement: LayerNorms under sequence parallelism) get buckets of their own, whose
reduced shards are also summed over tp. Mixed precision: parameters and gradients in the compute
dtype (bf16), fp32 master shards and optimizer state.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from plait import comm
from plait.engine import ScalesResiduals
from plait.errors import ConfigError, DataParallelError
from plait.mesh import Mesh
from plait.placement import bucket_key, placement
from plait.zero.engine import ShardedEngine
from plait.zero.flat import FlatLayout, storage_bytes
from plait.zero.sharded import OptimizerFactory, ShardedOptimizer, ShardGroup


class _Bucket:
    def __init__(self, index: int, params: list[nn.Parameter], names: list[str], n: int, dtype, sums=()):
        self.index = index
        self.params = params
        self.names = names
        self.sums = sums  # model axes its gradients are partial over (placements): summed there
        self.layout = FlatLayout(names, [p.shape for p in params], n)
        device = params[0].device
        self.flat = self.layout.flatten([p.detach() for p in params], dtype=dtype, device=device)
        self.grad_buf: torch.Tensor | None = None
        self.ready: set[int] = set()
        self.handle = None
        self.out: torch.Tensor | None = None

    def alloc_grad(self) -> torch.Tensor:
        if self.grad_buf is None:
            self.grad_buf = torch.zeros(self.layout.padded, dtype=self.flat.dtype, device=self.flat.device)
        return self.grad_buf


class _HookBucket:
    """A ZeRO bucket as a `plait.comm.compress` compressor reads it (DataParallel's GradBucket
    interface): its index, parameters, their offsets and the (padded) gradient buffer."""

    def __init__(self, bucket: _Bucket):
        self._bucket = bucket
        self.index, self.params = bucket.index, bucket.params
        self.offsets = list(bucket.layout.offsets)
        self.numel = bucket.layout.padded

    @property
    def buffer(self) -> torch.Tensor:
        return self._bucket.alloc_grad()


class ZeroOptimizer(ShardedEngine):
    """ZeRO stage 1 or 2 over `module` (use `plait.zero.wrap` rather than this class directly).

    After construction call `module` as usual, `loss.backward()`, then `step()` and `zero_grad()`.
    `optimizer` is the wrapped torch optimizer (give it to LR schedulers).

    `trigger`: "hook" (a hook per parameter feeds its gradient to its bucket as backward produces
    it, overlapping the reduction with backward) or "manual" (the owner calls `reduce_grads()`
    once the step's gradients are complete: a pipeline). `names`: parameter id -> the name
    checkpoints and `full_parameters` use (default: the module's own names).
    """

    def __init__(
        self,
        module: nn.Module,
        mesh: Mesh,
        factory: OptimizerFactory,
        stage: int = 2,
        param_groups: list[dict] | None = None,
        shard_axis: str = "dp",
        replicate_axis: str | None = None,
        bucket_mb: float = 25.0,
        compute_dtype: torch.dtype = torch.float32,
        offload: str = "none",
        offload_path=None,
        delayed_update: bool = False,
        allow_unused: bool = False,
        comm_hook=None,
        trigger: str = "hook",
        names: dict[int, str] | None = None,
    ):
        if trigger not in ("hook", "manual"):
            raise ConfigError(f"trigger {trigger!r} is not valid; valid: hook, manual")
        if stage not in (1, 2):
            raise ConfigError(f"ZeroOptimizer handles stages 1 and 2, got {stage}")
        if bucket_mb <= 0:
            raise ConfigError(f"bucket_mb must be positive, got {bucket_mb}")
        self._init_layout(module, mesh, shard_axis, replicate_axis, compute_dtype, offload, delayed_update)
        self.stage = stage
        self.allow_unused = allow_unused
        if comm_hook is not None and not hasattr(comm_hook, "reduce_scatter"):
            raise ConfigError(
                f"comm_hook {type(comm_hook).__name__} has no reduce_scatter(): ZeRO-1/2 takes the "
                "compressors of plait.comm.compress"
            )
        if comm_hook is not None and compute_dtype != torch.float32:
            raise ConfigError("gradient compression under ZeRO needs fp32 gradients (mixed_precision=None)")
        self.comm_hook = comm_hook
        self.trigger = trigger
        self._names = names or {}
        self._sync = True
        self._queued = False
        self._next_launch = 0
        self.buckets = self._build_buckets(int(bucket_mb * 1e6), compute_dtype)
        self._broadcast()
        groups = []
        for b in self.buckets:
            lo, hi = b.layout.shard_range(self.rank)
            master = b.flat[lo:hi]
            if self.master_is_separate:
                master = master.to(device=self.host, dtype=torch.float32, copy=True)
            # stage 1 keeps the reduced shard inside its full gradient buffer: no extra copy
            grad = b.alloc_grad()[lo:hi] if stage == 1 else None
            groups.append(
                ShardGroup(b.layout, self.rank, master, compute_dtype, grad=grad, device=mesh.device)
            )
        for b in self.buckets:  # the module's parameters become views of the flat buckets
            for p, v in zip(b.params, b.layout.views(b.flat), strict=True):
                p.data = v
        self._reduced = False  # stage 1: a synchronised backward happened since zero_grad()
        self.shards = ShardedOptimizer(
            groups,
            [b.params for b in self.buckets],
            factory,
            param_groups,
            mesh,
            shard_axis,
            self._publish,
            offload=offload,
            offload_path=offload_path,
            delayed_update=delayed_update,
        )
        self.optimizer = self.shards.optimizer
        self._where = {}
        self._hooks = []
        for b in self.buckets:
            for i, p in enumerate(b.params):
                self._where[id(p)] = (b, i)
                if trigger == "hook":
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def _build_buckets(self, capacity: int, dtype) -> list[_Bucket]:
        names = {id(p): self._names.get(id(p), n) for n, p in self.module.named_parameters()}
        params = [p for p in self.module.parameters() if p.requires_grad]
        if not params:
            raise ConfigError("the module has no trainable parameters to shard")
        lossy = self.comm_hook is not None  # a compressor: one placement per bucket
        key = lambda p: bucket_key(p, self.mesh, lossy)  # noqa: E731  partial gradients apart
        chunks, current, size = [], [], 0
        for p in reversed(params):  # reverse registration order ~ the order gradients are ready
            nbytes = p.numel() * torch.finfo(dtype).bits // 8
            if current and (size + nbytes > capacity or key(p) != key(current[0])):
                chunks.append(current)
                current, size = [], 0
            current.append(p)
            size += nbytes
        chunks.append(current)
        return [
            _Bucket(i, ps, [names[id(p)] for p in ps], self.n, dtype, self._sums(ps[0]))
            for i, ps in enumerate(chunks)
        ]

    def _sums(self, p: nn.Parameter) -> tuple[str, ...]:
        """The model axes (of size > 1) over which `p`'s gradient is partial (its placement)."""
        return tuple(a for a in placement(p).grad_partial if self.mesh.size(a) > 1)

    @torch.no_grad()
    def _broadcast(self) -> None:
        """Every replica starts from data-parallel rank 0's parameters and buffers."""
        axis = "dp"
        for b in self.buckets:
            comm.broadcast(b.flat, self.mesh, axis, src=0)
        for buf in self.module.buffers():
            comm.broadcast(buf, self.mesh, axis, src=0)

    # --- backward -------------------------------------------------------------------------

    def reduce_grads(self) -> None:
        """The manual trigger (`trigger="manual"`, a pipeline's: its schedule writes the
        gradients itself, some outside autograd's hooks): take every parameter's accumulated
        `.grad` into its bucket and reduce the buckets, in bucket order."""
        for b in self.buckets:
            for p in b.params:
                if p.grad is not None:
                    self._on_grad(p)
        self._finish_backward()

    def _on_grad(self, p: nn.Parameter) -> None:
        if not self._queued and self.trigger == "hook":
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        b, i = self._where[id(p)]
        if self._sync and i in b.ready:
            raise DataParallelError(
                f"parameter {b.names[i]} received its gradient twice in one backward; call backward "
                "once per forward (use no_sync() for accumulation)"
            )
        off, k = b.layout.offsets[i], b.layout.numels[i]
        b.alloc_grad()[off : off + k].add_(p.grad.reshape(-1), alpha=self.scale)
        p.grad = None  # the bucket holds it now
        if self._sync:
            b.ready.add(i)
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets):
            b = self.buckets[self._next_launch]
            if len(b.ready) < len(b.params):
                return
            b.out = torch.empty(b.layout.shard_numel, dtype=b.grad_buf.dtype, device=b.grad_buf.device)
            if self.comm_hook is None:
                b.handle = comm.reduce_scatter(b.out, b.grad_buf, self.mesh, self.shard_axis, async_op=True)
            else:  # a compressor (plait.comm.compress) in place of the reduce-scatter
                lo, hi = b.layout.shard_range(self.rank)
                b.handle = self.comm_hook.reduce_scatter(
                    _HookBucket(b), b.out, lo, hi, self.mesh, self.shard_axis
                )
            self._next_launch += 1

    def _finish_backward(self) -> None:
        self._queued = False
        if not self._sync:
            return
        if self.stage == 1 and self._reduced:
            self._reset()
            raise DataParallelError(
                "ZeRO-1 reduces the full gradient once per step: a second synchronised backward came "
                "before step()/zero_grad(); accumulate micro-batches inside no_sync()"
            )
        missing = [b.names[i] for b in self.buckets for i in range(len(b.params)) if i not in b.ready]
        if missing and not self.allow_unused:
            self._reset()
            raise DataParallelError(
                f"{len(missing)} parameter(s) received no gradient in this backward: "
                f"{', '.join(missing[:8])}. Make every parameter take part in the loss or pass "
                "allow_unused=True"
            )
        for b in self.buckets:
            b.alloc_grad()
            b.ready.update(range(len(b.params)))
        self._launch_ready()
        for b, g in zip(self.buckets, self.shards.groups, strict=True):
            b.handle.wait()
            for axis in ((self.replicate_axis,) if self.replicate_axis else ()) + b.sums:
                comm.all_reduce(b.out, self.mesh, axis)
            if self.stage == 2:
                g.grad.add_(b.out)
                b.grad_buf = None
            else:  # the buffer is clean for the next step except for this rank's reduced shard
                b.grad_buf.zero_()
                g.grad.copy_(b.out)
        self._reduced = True
        self._reset()

    def _reset(self) -> None:
        for b in self.buckets:
            b.ready.clear()
            b.handle = None
            b.out = None
        self._next_launch = 0

    # --- step -------------------------------------------------------------------------------

    @torch.no_grad()
    def _publish(self) -> None:
        """Copy the updated master shards into the buckets and all-gather them."""
        for b, g in zip(self.buckets, self.shards.groups, strict=True):
            lo, hi = b.layout.shard_range(self.rank)
            if self.master_is_separate:
                b.flat[lo:hi].copy_(g.master)
            comm.all_gather(b.flat, b.flat[lo:hi].clone(), self.mesh, self.shard_axis)

    def set_lr_scale(self, scale: float) -> None:
        if isinstance(self.comm_hook, ScalesResiduals):
            self.comm_hook.set_lr_scale(scale)

    def residual_buffers(self) -> dict[str, torch.Tensor] | None:
        """This rank's error-feedback residuals, one per bucket (zeros where none yet), for
        checkpoints; None without an error-feedback compressor."""
        if not hasattr(self.comm_hook, "state_tensors"):
            return None
        return self.comm_hook.state_tensors([_HookBucket(b) for b in self.buckets])

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.shards.zero_grad()
        self._reduced = False

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients in the full bucket buffers without communicating (stage 2 then
        holds full gradients until the next synchronised backward)."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def memory(self) -> dict:
        """Model-state bytes held by this rank, counted from tensor storage."""
        params = storage_bytes([b.flat for b in self.buckets])
        grads = storage_bytes([b.grad_buf for b in self.buckets] + [g.grad for g in self.shards.groups])
        optim = self.shards.optimizer_bytes(self.master_is_separate)
        return {"params": params, "grads": grads, "optimizer": optim, "total": params + grads + optim}

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        super().close()

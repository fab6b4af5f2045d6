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

The buckets, hooks, launch order, the reduce-scatter (or a compressor's) and the sums over the
replicate and tp axes are plait's one gradient synchroniser (`plait.gradsync.GradSync`); this
module adds the flat parameter buffers, the sharded step and the all-gather.
"""

from __future__ import annotations

import torch
from torch import nn

from plait import comm
from plait.errors import ConfigError, DataParallelError
from plait.flat import alloc_storage, free_storage, storage_bytes
from plait.gradsync import GradBucket, GradSync, bucket_chunks
from plait.mesh import Mesh
from plait.placement import bucket_key
from plait.zero.engine import ShardedEngine
from plait.zero.sharded import OptimizerFactory, ShardedOptimizer, ShardGroup


class _Bucket(GradBucket):
    """A gradient bucket that also holds its parameters: `flat`, the padded flat buffer the
    module's parameters are views of (and, resharded between steps, `shard`: what is gathered)."""

    def __init__(self, index: int, params: list, names: list[str], mesh: Mesh, axis: str, dtype):
        super().__init__(index, params, names, mesh.size(axis), dtype=dtype, axis=axis)
        self.rank = mesh.rank(axis)  # this rank's shard of the bucket
        self.flat = self.layout.flatten([p.detach() for p in params], dtype=dtype, device=self.device)
        self.shard: torch.Tensor | None = None


class ZeroOptimizer(ShardedEngine):
    """ZeRO stage 1 or 2 over `module` (use `plait.zero.wrap` rather than this class directly).

    After construction call `module` as usual, `loss.backward()`, then `step()` and `zero_grad()`.
    `optimizer` is the wrapped torch optimizer (give it to LR schedulers).

    `trigger`: "hook" (a hook per parameter feeds its gradient to its bucket as backward produces
    it, overlapping the reduction with backward) or "manual" (the owner calls `reduce_grads()`
    once the step's gradients are complete: a pipeline). `names`: parameter id -> the name
    checkpoints and `full_parameters` use (default: the module's own names).

    `reshard_after_step` (stage 2; ZeRO-3 within pipeline stages): between steps only this rank's
    parameter shard is kept; `gather_params()` all-gathers them once before the next use and the
    step frees them again. A pipeline runs many micro-batches through a stage per step, so the
    parameters are gathered once per step, not once per micro-batch (2Ψ per step, as ZeRO-2).
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
        reshard_after_step: bool = False,
        data_axes: tuple[str, ...] = ("dp",),
    ):
        if trigger not in ("hook", "manual"):
            raise ConfigError(f"trigger {trigger!r} is not valid; valid: hook, manual")
        if stage not in (1, 2):
            raise ConfigError(f"ZeroOptimizer handles stages 1 and 2, got {stage}")
        if bucket_mb <= 0:
            raise ConfigError(f"bucket_mb must be positive, got {bucket_mb}")
        if reshard_after_step and (stage != 2 or delayed_update):
            raise ConfigError(
                "reshard_after_step (ZeRO-3 within pipeline stages) runs on stage 2 without delayed_update"
            )
        self._init_layout(
            module, mesh, shard_axis, replicate_axis, compute_dtype, offload, delayed_update, data_axes
        )
        self.stage = stage
        self.reshard = reshard_after_step
        self.allow_unused = allow_unused
        self._check_hook(comm_hook, compute_dtype, stage)
        self.comm_hook = comm_hook
        self.trigger = trigger
        self._names = names or {}
        self.buckets = self._build_buckets(int(bucket_mb * 1e6), compute_dtype)
        self._broadcast()
        groups = [self._shard_group(b, compute_dtype) for b in self.buckets]
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
            axes=self.group_axes(),
        )
        self.optimizer = self.shards.optimizer
        self._gathered = True
        self.release_params()
        self.sync = GradSync(
            self.buckets,
            mesh,
            shard_axis,
            reduce="reduce_scatter",
            comm_hook=comm_hook,
            scale=self.scale,
            accumulate=True,
            trigger=trigger,
            replicate_axis=replicate_axis,
            missing="zeros" if allow_unused else "error",
            deliver=self._deliver,
            check=self._check_once,
        )

    def _shard_group(self, b: _Bucket, compute_dtype) -> ShardGroup:
        """This rank's shard of bucket `b`: its fp32 master (a view of the flat bucket unless the
        master is separate or the parameters are resharded) and, when resharded, what is gathered."""
        lo, hi = b.layout.shard_range(b.rank)
        master = b.flat[lo:hi]
        if self.master_is_separate or self.reshard:  # (resharded: the flat is freed)
            master = master.to(device=self.host, dtype=torch.float32, copy=True)
        if self.reshard:  # what is gathered: the master itself, or its compute-dtype copy
            same = not self.master_is_separate
            b.shard = master if same else b.flat[lo:hi].to(compute_dtype, copy=True)
        # stage 1 keeps the reduced shard inside its full gradient buffer: no extra copy
        grad = b.buffer[lo:hi] if self.stage == 1 else None
        return ShardGroup(
            b.layout, b.rank, master, compute_dtype, grad=grad, device=self.mesh.device, axis=b.axis
        )

    def _build_buckets(self, capacity: int, dtype) -> list[_Bucket]:
        names = {id(p): self._names.get(id(p), n) for n, p in self.module.named_parameters()}
        params = [p for p in self.module.parameters() if p.requires_grad]
        if not params:
            raise ConfigError("the module has no trainable parameters to shard")
        lossy = self.comm_hook is not None  # a compressor: one placement per bucket
        chunks = bucket_chunks(
            list(reversed(params)),  # reverse registration order ~ the order gradients are ready
            capacity,
            # partial gradients apart, and each bucket over one shard axis (experts' and dense
            # parameters' differ under expert parallelism)
            key=lambda p: (bucket_key(p, self.mesh, lossy), self.axis_of(p)),
            nbytes=lambda p: p.numel() * torch.finfo(dtype).bits // 8,
        )
        return [
            _Bucket(i, ps, [names[id(p)] for p in ps], self.mesh, self.axis_of(ps[0]), dtype)
            for i, ps in enumerate(chunks)
        ]

    @torch.no_grad()
    def _broadcast(self) -> None:
        """Every replica starts from data-parallel rank 0's parameters and buffers (each over the
        axis its replicas lie on: its shard axis; buffers are replicated over every data axis)."""
        for b in self.buckets:
            comm.broadcast(b.flat, self.mesh, self.replicas_of(b.axis), src=0)
        for buf in self.module.buffers():
            comm.broadcast(buf, self.mesh, self.replicas_of(self.axis_of(buf)), src=0)

    # --- backward -------------------------------------------------------------------------

    def reduce_grads(self) -> None:
        """The manual trigger (`trigger="manual"`, a pipeline's: its schedule writes the
        gradients itself, some outside autograd's hooks): take every parameter's accumulated
        `.grad` into its bucket and reduce the buckets, in bucket order."""
        self.sync.grads_ready([p for b in self.buckets for p in b.params if p.grad is not None])
        self.sync.finish()

    def _check_once(self) -> None:
        if self.stage == 1 and self._reduced:
            raise DataParallelError(
                "ZeRO-1 reduces the full gradient once per step: a second synchronised backward came "
                "before step()/zero_grad(); accumulate micro-batches inside no_sync()"
            )

    def _deliver(self, b: _Bucket, shard: torch.Tensor) -> None:
        """A bucket's reduced shard becomes (stage 1) or is added to (stage 2) the gradient
        shard the optimizer steps."""
        g = self.shards.groups[b.index]
        if self.stage == 2:
            g.grad.add_(shard)
            b.release()
        else:  # the buffer is clean for the next step except for this rank's reduced shard
            b.buffer.zero_()
            g.grad.copy_(shard)
        self._reduced = True

    # --- step -------------------------------------------------------------------------------

    @torch.no_grad()
    def _publish(self) -> None:
        """Copy the updated master shards into the buckets and all-gather them (resharded:
        refresh the shards that are gathered before the next use, and free the parameters)."""
        if self.reshard:
            for b, g in zip(self.buckets, self.shards.groups, strict=True):
                if b.shard is not g.master:
                    b.shard.copy_(g.master)
            self.release_params()
            return
        for b, g in zip(self.buckets, self.shards.groups, strict=True):
            lo, hi = b.layout.shard_range(b.rank)
            if self.master_is_separate:
                b.flat[lo:hi].copy_(g.master)
            comm.all_gather(b.flat, b.flat[lo:hi].clone(), self.mesh, b.axis)

    @torch.no_grad()
    def gather_params(self) -> bool:
        """`reshard_after_step`: all-gather the parameters from the shards before they are used
        (a pipeline's step, an evaluation). Returns whether it gathered (they were free)."""
        if not self.reshard or self._gathered:
            return False
        handles = []
        for b in self.buckets:
            alloc_storage(b.flat)
            handles.append(comm.all_gather(b.flat, b.shard, self.mesh, b.axis, async_op=True))
        for h in handles:
            h.wait()
        self._gathered = True
        return True

    def release_params(self) -> None:
        """`reshard_after_step`: free the whole parameters; only this rank's shards stay."""
        if self.reshard and self._gathered:
            for b in self.buckets:
                free_storage(b.flat)
            self._gathered = False

    # the manual trigger's interface (plait.data_parallel.engine has the same): the gradients are
    # reduce-scattered once the step's are complete, not as a pipeline's stages finish
    overlaps_backward = False

    def grads_ready(self, params) -> None:
        pass

    def skip_in_norm(self, names) -> None:
        """Leave these parameters out of the gradient norm (another rank counts them)."""
        self.shards.norm_skip.update(names)

    def finish_grads(self) -> None:
        self.reduce_grads()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.shards.zero_grad()
        self._reduced = False

    def no_sync(self):
        """Accumulate gradients in the full bucket buffers without communicating (stage 2 then
        holds full gradients until the next synchronised backward)."""
        return self.sync.no_sync()

    def memory(self) -> dict:
        """Model-state bytes held by this rank, counted from tensor storage."""
        params = storage_bytes(
            [b.flat for b in self.buckets] + [getattr(b, "shard", None) for b in self.buckets]
        )
        grads = storage_bytes(
            [b.buffer for b in self.buckets if b.allocated] + [g.grad for g in self.shards.groups]
        )
        optim = self.shards.optimizer_bytes(self.master_is_separate)
        return {"params": params, "grads": grads, "optimizer": optim, "total": params + grads + optim}

    def close(self) -> None:
        self.sync.remove_hooks()
        super().close()

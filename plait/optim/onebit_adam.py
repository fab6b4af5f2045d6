"""1-bit Adam (Tang et al. 2021, "1-bit Adam: Communication Efficient Large-Scale Training with
Adam's Convergence Speed"): compress Adam's momentum, not its gradient.

Error feedback on compressed *gradients* breaks Adam: the per-coordinate scale 1/sqrt(v) is
learned from the compressed gradients themselves, and a coordinate that is silent for many steps
and then sent in a burst gets a full-size step (measured in docs/compression.md). Tang et al.
observe that Adam's variance settles early in training, so after a warm-up it can be frozen;
Adam with a frozen variance is momentum SGD with a fixed per-coordinate preconditioner, and
error feedback works for that. The algorithm:

1. **Warm-up** (the first `freeze_step` steps): plain AdamW on uncompressed, all-reduced
   gradients.
2. **Compression stage**: the variance v (and its bias correction) is frozen. Each rank forms
   its local momentum m_i = β1·m + (1-β1)·g_i from the shared momentum m of the last step and
   its own gradient, and the ranks exchange m_i through a plait compressor (`OneBitCompressor`
   is the paper's; `TopKCompressor` works the same way) with error feedback; the decoded mean is
   the new shared m, identical on every rank. The step is AdamW's with that m:
   x <- x·(1 - lr·wd) - lr/(1-β1^t) · m / (sqrt(v/(1-β2^T)) + eps), T = freeze_step.

`OneBitAdam` is the optimizer and `MomentumHook` the DataParallel `comm_hook` that goes with it:
during the warm-up the hook all-reduces gradients as usual; in the compression stage it leaves
each rank's own gradient in place (no communication in backward) and the exchange happens in
`OneBitAdam.step`. The compressor's error-feedback residuals are per rank, kept in units of the
step (`set_lr_scale`), and saved with checkpoints like the gradient compressors' residuals.

    hook = MomentumHook(OneBitCompressor(), freeze_step=100)
    model = DataParallel(net, mesh, comm_hook=hook)
    opt = OneBitAdam(model.parameters(), hook, mesh, lr=3e-3)

Under ZeRO-1/2 the same pair is given to `plait.zero.wrap`, the hook as the `comm_hook` (it
replaces the bucket reduce-scatter) and the optimizer through the factory:

    engine = plait.zero.wrap(net, mesh, 2, lambda g: OneBitAdam(g, hook, mesh, lr=3e-3), comm_hook=hook)

The warm-up is then ZeRO's: reduce-scatter of the mean gradient, AdamW on this rank's shard.
After the freeze the hook's `reduce_scatter` communicates nothing and keeps the bucket's whole
local gradient (`_Message`); the optimizer, told the flat layout of its shards by
`ShardedOptimizer` (`bind_shards`), forms and exchanges the local momentum bucket by bucket as
above and updates only this rank's shard, whose new parameters ZeRO all-gathers as usual. The
fp32 master weights and the frozen variance stay sharded; the momentum is kept *whole* on every
rank from the freeze on (each rank's message needs every coordinate of β1·m), all-gathered once
from the shards at the first compressed step: 4Ψ bytes per rank that ZeRO-1/2 would otherwise
shard, plus the whole message buffer (4Ψ) and the compressor's residual (4Ψ). The exp_avg state
of each shard segment is a view of the whole momentum, so checkpoints save it as ZeRO shards
(every rank its part) and a load gathers it again.

Departures from the paper: its second compression (a server-side error-compensated re-compression
of each chunk of the average, for its all-to-all + all-gather scheme) is replaced by one
all-gather of every rank's message, decoded identically everywhere, as plait's gradient
compressors do; the bytes each rank sends are then the message times (N-1), not 2x the message.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from plait import comm
from plait.combinations import refuse
from plait.errors import ConfigError
from plait.gradsync import GradBucket, build_buckets


class _Local:
    """A finished exchange: the bucket keeps this rank's own gradient."""

    def __init__(self, buffer: torch.Tensor):
        self.buffer = buffer

    def wait(self) -> torch.Tensor:
        return self.buffer


class _Message:
    """Under ZeRO, after the freeze: one bucket's whole buffer, in the layout of ZeRO's bucket
    (the interface the compressors read: index, params, layout, offsets, numel, buffer). Backward leaves
    this rank's own gradient in it; the step turns it into the local momentum message, and the
    compressor's exchange into the decoded mean momentum."""

    def __init__(self, bucket):
        self.index, self.params, self.numel = bucket.index, list(bucket.params), bucket.numel
        self.offsets, self.layout = list(bucket.offsets), bucket.layout
        self.buffer = torch.zeros(bucket.numel, dtype=bucket.params[0].dtype, device=bucket.params[0].device)

    def grads(self) -> list[torch.Tensor]:
        """Each parameter's part of the buffer (its gradient between backward and the step)."""
        return [self.buffer[o : o + p.numel()] for o, p in zip(self.offsets, self.params, strict=True)]


class MomentumHook:
    """DataParallel `comm_hook` of `OneBitAdam`: all-reduce during the warm-up, nothing after it.

    In the compression stage the bucket (which DataParallel filled with gradient / N) is
    multiplied back by N, so `.grad` holds this rank's own gradient: gradient clipping and the
    logged gradient norm then see the local gradient. The optimizer exchanges the momentum.
    Under ZeRO-1/2 `reduce_scatter` plays the same part (see the module docstring)."""

    def __init__(self, compressor, freeze_step: int):
        if not hasattr(compressor, "state_tensors"):
            raise ConfigError(
                "1-bit Adam needs an error-feedback compressor (OneBitCompressor, TopKCompressor or "
                f"PowerSGDCompressor), got {type(compressor).__name__}"
            )
        if freeze_step < 1:
            raise ConfigError(
                f"comm.freeze_step must be >= 1 (uncompressed warm-up steps), got {freeze_step}"
            )
        self.compressor = compressor
        self.freeze_step = int(freeze_step)
        self.optimizer: OneBitAdam | None = None
        self.messages: dict[int, _Message] = {}  # ZeRO: by bucket index, from the freeze on
        self.filled: set[int] = set()  # ZeRO: buckets whose gradient this step's backward left

    @property
    def compressing(self) -> bool:
        """True once the optimizer has taken `freeze_step` steps."""
        return self.optimizer is not None and self.optimizer.steps_done >= self.freeze_step

    def __call__(self, bucket: GradBucket, mesh, axis: str):
        if not self.compressing:  # the plain data-parallel all-reduce (its buffer holds grads / n)
            return comm.all_reduce(bucket.buffer, mesh, axis, async_op=True)
        return _Local(bucket.buffer.mul_(mesh.size(axis)))

    def reduce_scatter(self, bucket, out: torch.Tensor, lo: int, hi: int, mesh, axis: str):
        """ZeRO-1/2's exchange of one bucket (`ZeroOptimizer(comm_hook=...)`). During the
        warm-up, the plain reduce-scatter of the mean gradient. In the compression stage nothing
        is sent: the bucket (gradient / N) times N, this rank's own whole gradient, is kept for
        the step's momentum exchange, and `out` (the reduced shard's slot) gets its shard."""
        if not self.compressing:
            return comm.reduce_scatter(out, bucket.buffer, mesh, axis, async_op=True)
        msg = self.messages.get(bucket.index)
        if msg is None:
            msg = self.messages[bucket.index] = _Message(bucket)
        # each synchronised backward replaces the last one's gradient (accumulate in no_sync())
        msg.buffer.copy_(bucket.buffer).mul_(mesh.size(axis))
        self.filled.add(bucket.index)
        return _Local(out.copy_(msg.buffer[lo:hi]))

    def local_messages(self, n_buckets: int) -> list[_Message]:
        """The ZeRO buckets' messages holding this step's local gradients, in bucket order."""
        if len(self.filled) != n_buckets:
            raise ConfigError(
                "1-bit Adam under ZeRO: the compressed step found no local gradient for "
                f"{n_buckets - len(self.filled)} of {n_buckets} bucket(s). Pass the MomentumHook as "
                "the comm_hook of ZeRO stage 1 or 2 (plait.zero.wrap(..., comm_hook=hook)) and run "
                "a synchronised backward before every step"
            )
        return [self.messages[i] for i in range(n_buckets)]

    def state_tensors(self, buckets) -> dict[str, torch.Tensor]:
        """ZeRO-1/2's checkpoint view of the compressor's state: its residuals keyed by ZeRO
        bucket (the messages have the ZeRO buckets' layout)."""
        return self.compressor.state_tensors(buckets)

    def set_lr_scale(self, scale: float) -> None:
        """Error feedback in units of the step (see plait.comm.compress)."""
        self.compressor.set_lr_scale(scale)

    def residual_buffers(self) -> dict[str, torch.Tensor]:
        """This rank's compressor state (residuals, one per momentum bucket; PowerSGD's warm-start
        matrices), for checkpoints."""
        if self.optimizer is None:
            return {}
        return self.compressor.state_tensors(self.optimizer.buckets)


class OneBitAdam(torch.optim.Optimizer):
    """AdamW that, after `hook.freeze_step` uncompressed steps, freezes its variance and exchanges
    its momentum through `hook.compressor` with error feedback (Tang et al. 2021).

    Before the freeze it equals `torch.optim.AdamW` (decoupled weight decay, bias correction).
    `params` may be param groups (per-group lr, betas, eps, weight_decay). Every rank of `axis`
    must step the same parameters in the same order (the momentum is exchanged in buckets of up
    to `bucket_mb` MB, in parameter order). In the compression stage a parameter without a
    gradient contributes a zero gradient to its momentum, which keeps decaying and moving it; a
    parameter that had no gradient in the whole warm-up has no variance and is left unchanged.
    The variance's bias correction is frozen at 1 - β2^freeze_step, exact for parameters that
    had a gradient in every warm-up step (all of them, in plait's trainer).

    Under ZeRO-1/2 (built by `plait.zero.wrap`'s factory) it steps shard segments; `bind_shards`
    gives it their flat layout, and the momentum is exchanged in ZeRO's buckets (see the module
    docstring).
    """

    def __init__(
        self,
        params: Iterable,
        hook: MomentumHook,
        mesh,
        axis: str = "dp",
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        bucket_mb: float = 25.0,
    ):
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(
                f"invalid OneBitAdam hyperparameters: lr={lr}, betas={betas}, eps={eps}, wd={weight_decay}"
            )
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        if hook.optimizer is not None:
            raise ConfigError("this MomentumHook already belongs to another OneBitAdam")
        hook.optimizer = self
        self.hook, self.mesh, self.axis = hook, mesh, axis
        self._n = mesh.size(axis)
        self._capacity = int(bucket_mb * 1e6)
        self._buckets: list[GradBucket] | None = None
        self._group_of = {id(p): g for g in self.param_groups for p in g["params"]}
        self._shards = None  # ZeRO-1/2: the ShardGroups whose segments are this optimizer's params
        self._momentum: list[torch.Tensor] | None = None  # ZeRO: the whole momentum, per bucket

    @property
    def buckets(self) -> list[GradBucket]:
        """The momentum buckets of the DataParallel path, in parameter order (built at first use)."""
        if self._buckets is None:
            params = [p for g in self.param_groups for p in g["params"]]
            self._buckets = build_buckets(params, self._capacity)
        return self._buckets

    def bind_shards(self, groups, shard_axis: str) -> None:
        """Called by `plait.zero.ShardedOptimizer` once this optimizer is built over the segments
        of `groups` (ZeRO-1/2's flat buckets, in bucket order): the layout the momentum exchange
        needs. The momentum is exchanged over `self.axis`, so the shards must span it."""
        if shard_axis != self.axis:
            raise refuse("1-bit-adam-hybrid", hybrid_shard=self.mesh.size(shard_axis))
        self._shards = list(groups)

    def shards_loaded(self) -> None:
        """A checkpoint was loaded into the shards' state: the whole momentum is gathered again
        from the (loaded) shards at the next compressed step."""
        self._momentum = None

    def local_grads(self) -> list[torch.Tensor] | None:
        """Under ZeRO after the freeze, between backward and the step: this rank's own whole
        gradient, per parameter (what the step uses; `ShardedOptimizer` clips and measures it in
        place of the reduced shards, as each rank's `.grad` under DataParallel). Else None."""
        if self._shards is None or not self.hook.compressing or len(self.hook.filled) != len(self._shards):
            return None
        return [g for m in self.hook.local_messages(len(self._shards)) for g in m.grads()]

    @property
    def steps_done(self) -> int:
        """Steps taken so far: the most any parameter has taken (read from the optimizer state,
        so it survives checkpoints)."""
        return max((int(st["step"]) for st in self.state.values() if "step" in st), default=0)

    def _state(self, p: torch.Tensor) -> dict:
        st = self.state[p]
        if not st:
            st["step"] = torch.tensor(0.0)
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return st

    @torch.no_grad()
    def _exchange_momentum(self) -> None:
        """m <- decoded mean over ranks of compress(β1·m + (1-β1)·g_i), with error feedback."""
        handles = []
        for b in self.buckets:
            for i, p in enumerate(b.params):
                local = b.view(i)
                st = self.state.get(p)
                if not st:  # no variance from the warm-up: never stepped, sends zeros
                    local.zero_()
                    continue
                beta1 = self._group_of[id(p)]["betas"][0]
                local.copy_(st["exp_avg"])
                if p.grad is not None:
                    local.lerp_(p.grad, 1 - beta1)
                else:
                    local.mul_(beta1)
                local.div_(self._n)  # the compressors sum the ranks' contributions
            handles.append(self.hook.compressor(b, self.mesh, self.axis))
        for b, h in zip(self.buckets, handles):
            h.wait()
            for i, p in enumerate(b.params):
                if self.state.get(p):
                    self.state[p]["exp_avg"].copy_(b.view(i))

    @torch.no_grad()
    def _gather_momentum(self) -> list[torch.Tensor]:
        """Under ZeRO: the whole momentum of each bucket, all-gathered from the shards' exp_avg
        (once, at the first compressed step, or after a load); each segment's exp_avg becomes a
        view of it, so checkpoints keep saving it as shards."""
        whole = []
        for g in self._shards:
            shard = torch.zeros(g.layout.shard_numel, dtype=torch.float32, device=g.master.device)
            for seg, p in zip(g.segments, g.seg_params, strict=True):
                if seg.length:
                    shard[seg.shard_offset : seg.shard_offset + seg.length].copy_(self._state(p)["exp_avg"])
            full = torch.empty(g.layout.padded, dtype=torch.float32, device=g.master.device)
            comm.all_gather(full, shard, self.mesh, self.axis)
            lo, _ = g.layout.shard_range(g.rank)
            for seg, p in zip(g.segments, g.seg_params, strict=True):
                start = lo + seg.shard_offset
                self._state(p)["exp_avg"] = full[start : start + seg.length]
            whole.append(full)
        return whole

    @torch.no_grad()
    def _exchange_sharded(self) -> None:
        """`_exchange_momentum` under ZeRO: in each of ZeRO's buckets the message is formed from the
        whole momentum and the whole local gradient that backward left with the hook; every rank
        decodes the same mean, whose part in this rank's shard is its segments' exp_avg."""
        messages = self.hook.local_messages(len(self._shards))
        self.hook.filled.clear()
        if self._momentum is None:
            self._momentum = self._gather_momentum()
        handles = []
        for g, msg, m in zip(self._shards, messages, self._momentum, strict=True):
            if msg.numel != g.layout.padded:  # bucket index i must be shard group i
                raise RuntimeError(f"1-bit Adam: ZeRO bucket {msg.index} is not shard group {msg.index}")
            for i, p in enumerate(g.seg_params):  # every parameter of the bucket (p: its segment)
                beta1 = self._group_of[id(p)]["betas"][0]
                off, k = g.layout.offsets[i], g.layout.numels[i]
                local = msg.buffer[off : off + k]
                local.copy_(torch.lerp(m[off : off + k], local, 1 - beta1))  # β1·m + (1-β1)·g_i
            msg.buffer.div_(self._n)  # the compressors sum the ranks' contributions
            handles.append(self.hook.compressor(msg, self.mesh, self.axis))
        for msg, m, h in zip(messages, self._momentum, handles, strict=True):
            h.wait()
            m.copy_(msg.buffer)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        compressing = self.steps_done >= self.hook.freeze_step
        if compressing and self._shards is not None:
            self._exchange_sharded()
        elif compressing:
            self._exchange_momentum()
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                # AdamW skips gradient-less parameters; without a variance there is no compressed step
                if (p.grad is None) if not compressing else not self.state.get(p):
                    continue
                st = self._state(p)
                st["step"] += 1
                t = float(st["step"])
                p.mul_(1 - lr * wd)
                if compressing:  # exp_avg is the exchanged momentum; the variance stays frozen
                    bc2 = 1 - beta2**self.hook.freeze_step
                else:
                    st["exp_avg"].lerp_(p.grad, 1 - beta1)
                    st["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                    bc2 = 1 - beta2**t
                denom = (st["exp_avg_sq"].sqrt() / math.sqrt(bc2)).add_(eps)
                p.addcdiv_(st["exp_avg"], denom, value=-lr / (1 - beta1**t))
        return loss

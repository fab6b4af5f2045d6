"""1-bit SGD with error feedback after the momentum: momentum SGD whose momentum, not its
gradient, is exchanged compressed (the scheme of 1-bit Adam, `plait.optim.onebit_adam`, without
a variance to freeze).

Error feedback on the *gradient* under momentum SGD (Seide et al. 2014's 1-bit SGD followed by
torch's momentum) carries the quantisation error Δ into later gradients, and the momentum then
multiplies whatever is sent by up to 1/(1-μ): the parameters drift from the intended trajectory
by up to lr·|Δ|/(1-μ), ten times the error at μ = 0.9. On plait's default GPT that residual is
several times the gradient (the quantiser keeps two values for 2048 entries), and 1-bit SGD with
error feedback ends at 1.6x the uncompressed held-out loss (docs/compression.md). Compressing the
momentum with error feedback after it, as 1-bit Adam (Tang et al. 2021) and error-feedback SGD
with momentum (Zheng et al. 2019) do, leaves the parameters off by lr·|Δ| only.

Each rank forms its local momentum buf_i = μ·buf + g_i (+ weight decay ·p, torch's coupled decay)
from the shared buf of the last step, the ranks exchange it through the compressor with error
feedback, and the decoded mean is the new shared buf; then p <- p - lr·buf, torch's SGD step.
The first `freeze_step` steps are plain momentum SGD on all-reduced gradients (equal to
`torch.optim.SGD`). Internally the momentum is kept as 1-bit Adam's exp_avg = (1-μ)·buf, so the
exchange, the ZeRO-1/2 path, the hook and the checkpoints are 1-bit Adam's.
"""

from __future__ import annotations

import torch

from plait.errors import ConfigError
from plait.optim.onebit_adam import MomentumHook, OneBitAdam

__all__ = ["OneBitSGD", "MomentumHook"]


class OneBitSGD(OneBitAdam):
    """torch's momentum SGD (dampening 0, no Nesterov, coupled weight decay) whose momentum is
    exchanged through `hook.compressor` with error feedback after `hook.freeze_step` steps."""

    def __init__(
        self, params, hook: MomentumHook, mesh, axis: str = "dp", lr: float = 0.1, momentum: float = 0.9,
        weight_decay: float = 0.0, bucket_mb: float = 25.0,
    ):  # fmt: skip
        if not 0 < momentum < 1:
            raise ConfigError(
                f"1-bit SGD compresses the momentum: optim.momentum must be in (0, 1), got {momentum}"
            )
        super().__init__(
            params, hook, mesh, axis, lr=lr, betas=(momentum, 0.0), eps=0.0, weight_decay=weight_decay,
            bucket_mb=bucket_mb,
        )  # fmt: skip

    def _state(self, p: torch.Tensor) -> dict:
        st = self.state[p]
        if not st:  # no variance
            st["step"] = torch.tensor(0.0)
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return st

    def bind_shards(self, groups, shard_axis: str) -> None:
        if any(g["weight_decay"] for g in self.param_groups):
            raise ConfigError(
                "1-bit SGD under ZeRO forms each rank's momentum from ZeRO's buckets, without weight "
                "decay; set train.weight_decay = 0, or use parallel.zero_stage = 0"
            )
        super().bind_shards(groups, shard_axis)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:  # torch's coupled weight decay: g <- g + wd·p
            if group["weight_decay"]:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.add_(p, alpha=group["weight_decay"])
        compressing = self.steps_done >= self.hook.freeze_step
        if compressing and self._shards is not None:
            self._exchange_sharded()
        elif compressing:
            self._exchange_momentum()  # exp_avg <- decoded mean of μ·exp_avg + (1-μ)·g_i
        for group in self.param_groups:
            lr, mu = group["lr"], group["betas"][0]
            for p in group["params"]:
                if (p.grad is None) if not compressing else not self.state.get(p):
                    continue
                st = self._state(p)
                st["step"] += 1
                if not compressing:
                    st["exp_avg"].lerp_(p.grad, 1 - mu)
                p.add_(st["exp_avg"], alpha=-lr / (1 - mu))  # buf = exp_avg / (1-μ)
        return loss

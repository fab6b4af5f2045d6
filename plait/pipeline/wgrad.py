"""The backward split into B (input gradient) and W (weight gradient) of Zero Bubble
(Qi et al. 2023, §2): for a linear layer y = x Wᵀ + b, B computes ∂L/∂x = ∂L/∂y · W and W
computes ∂L/∂W = (∂L/∂y)ᵀ x and ∂L/∂b = Σ ∂L/∂y, which nothing downstream waits for.

While a stage runs under `DeferredLinears(store)`, every ``F.linear`` call (nn.Linear and the
tensor-parallel layers alike) goes through an autograd Function whose backward returns the
input gradient at once and, when the store is collecting, queues the weight-gradient products
under the current (micro-batch, stage) key instead of computing them. Everything else in the
backward (LayerNorm, embeddings, attention) runs in B as usual; the queued products run when
the schedule reaches W. Outside collection the same Function returns all gradients at once, so
a BW action is an ordinary backward. Under autocast the ordinary ``F.linear`` is used (weight
gradients then come with B): correct, without the split's gain.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


class WeightGradStore:
    """Weight-gradient work queued by B actions, run by W actions, per (micro-batch, stage)."""

    def __init__(self) -> None:
        self._current: list | None = None
        self._pending: dict[tuple[int, int], list] = {}

    @property
    def collecting(self) -> bool:
        return self._current is not None

    @contextlib.contextmanager
    def collect(self, key: tuple[int, int]):
        """Queue the weight gradients of the backward run inside this context under `key`."""
        self._current = []
        try:
            yield
            self._pending[key] = self._current
        finally:
            self._current = None

    def put(self, work) -> None:
        self._current.append(work)

    def flush(self, key: tuple[int, int]) -> None:
        """Run the weight-gradient work queued under `key` (the W action)."""
        for work in self._pending.pop(key):
            work()

    def __len__(self) -> int:
        return len(self._pending)

    def clear(self) -> None:
        self._pending.clear()


def _accumulate(param: torch.Tensor | None, grad: torch.Tensor | None) -> None:
    if param is None or grad is None:
        return
    grad = grad.to(param.dtype)
    if param.grad is None:
        param.grad = grad.contiguous()
    else:
        param.grad.add_(grad)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, store):
        ctx.save_for_backward(x, weight)
        # the parameters themselves, to accumulate into: under activation checkpointing the
        # saved tensors come back as recomputed aliases whose .grad nobody reads
        ctx.param, ctx.bias, ctx.store = weight, bias, store
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, gy):
        x, weight = ctx.saved_tensors
        param, bias = ctx.param, ctx.bias
        gx = gy.matmul(weight) if ctx.needs_input_grad[0] else None
        need_w, need_b = ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]

        def weight_grads():
            g2, x2 = gy.reshape(-1, gy.shape[-1]), x.reshape(-1, x.shape[-1])
            return (g2.t().matmul(x2) if need_w else None), (g2.sum(0) if need_b else None)

        if ctx.store.collecting:

            def work():
                # accumulate in place (addmm_): no weight-sized temporary per micro-batch
                with torch.no_grad():
                    g2, x2 = gy.reshape(-1, gy.shape[-1]), x.reshape(-1, x.shape[-1])
                    if need_w:
                        if param.grad is None:
                            param.grad = g2.t().mm(x2)
                        else:
                            param.grad.addmm_(g2.t(), x2)
                    if need_b:
                        _accumulate(bias, g2.sum(0))

            ctx.store.put(work)
            return gx, None, None, None
        gw, gb = weight_grads()
        return gx, gw, gb, None


class DeferredLinears(TorchFunctionMode):
    """Route ``F.linear`` through the splittable Function (see the module docstring)."""

    def __init__(self, store: WeightGradStore):
        super().__init__()
        self.store = store

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and torch.is_grad_enabled() and not torch.is_autocast_enabled():
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            # only leaf parameters: a computed weight's gradient must flow on through autograd
            leaves = weight.is_leaf and (bias is None or bias.is_leaf)
            if leaves and (weight.requires_grad or (bias is not None and bias.requires_grad)):
                return _Linear.apply(x, weight, bias, self.store)
        return func(*args, **kwargs)

"""The engine contract: what every way of training (data parallel, ZeRO 1-3, pipelines) offers
the trainer, so that the step loop never asks which one it drives.

An engine owns a model's parallel wrapping and its optimizer. One training step is

    loss_sum = engine.forward_backward(micro_batches, loss_scale)   # gradients synchronised
    norm = engine.clip_grad_norm_(max_norm)                         # global norm, every axis
    engine.step(); engine.zero_grad()

`forward_backward` runs forward and backward over the step's micro-batches (accumulating, with
communication only after the last one, or by a pipeline schedule) on a loss that is the *sum*
of token losses times `loss_scale` (the trainer passes 1 / tokens per dp rank per step, so the
gradient is that of the mean loss over the global batch whatever the layout), and returns this
rank's unscaled loss sum as a float64 scalar.

Optional capabilities are protocols of their own, checked with isinstance: `ErrorFeedback`
(the gradient exchange keeps per-rank residuals: saved with checkpoints, and kept in units of
the step, so the trainer tells it the learning-rate ratio) and `RecordsTimeline` (a pipeline's
measured action timeline).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from plait import comm

MicroBatches = Sequence[tuple[torch.Tensor, torch.Tensor]]
Autocast = Callable[[], contextlib.AbstractContextManager] | None

# The scale of the objective an engine backpropagates (`loss_scale` times the summed token
# losses), for losses added where they arise (a mixture-of-experts layer's auxiliary losses,
# plait.moe.parallel): they must be weighted as the main loss.
_SCALE: contextvars.ContextVar[float | None] = contextvars.ContextVar("plait_objective_scale", default=None)


@contextlib.contextmanager
def objective_scale(scale: float):
    """Within this context the objective is `scale` times the summed token losses."""
    token = _SCALE.set(float(scale))
    try:
        yield
    finally:
        _SCALE.reset(token)


def current_objective_scale() -> float | None:
    """The scale set by `objective_scale`, or None (a mean loss per forward)."""
    return _SCALE.get()


@runtime_checkable
class Engine(Protocol):
    """The contract every engine implements (see the module docstring)."""

    module: nn.Module  # the model to call, wrapped as the engine needs
    optimizer: torch.optim.Optimizer  # the torch optimizer (for learning-rate schedulers)

    def forward_backward(self, micro_batches: MicroBatches, loss_scale: float, autocast: Autocast = None):
        """Forward and backward over the step's micro-batches; returns the float64 loss sum."""

    def eval_loss_sum(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward only (no gradients): the summed token loss of this rank's rows."""

    def grad_norm(self) -> float:
        """The global gradient norm over every axis that shards or splits parameters."""

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale the gradients to a global norm of at most `max_norm`; returns the norm before."""

    def step(self) -> None: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def memory(self) -> dict[str, int]:
        """Model-state bytes held by this rank: params, grads, optimizer, total."""

    def checkpoint_state(self) -> tuple[dict, dict]:
        """(model, optimizer) state for a sharded checkpoint (plait.zero.state's layout-free form)."""

    def checkpoint_loaded(self) -> None:
        """Called after the state returned by checkpoint_state was loaded in place."""

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter of the model, whole, on the CPU, on every rank (collective; a pipeline
        gathers the other stages' too)."""

    def finish(self) -> None:
        """Complete any step still in flight (before evaluating or saving)."""

    def close(self) -> None: ...


@runtime_checkable
class ErrorFeedback(Protocol):
    """An engine whose gradient exchange may keep per-rank error-feedback residuals."""

    def residual_buffers(self) -> dict[str, torch.Tensor] | None:
        """This rank's residuals by bucket, for checkpoints; None when its exchange keeps none."""

    def set_lr_scale(self, scale: float) -> None:
        """The learning rate of the coming step over the peak (residuals in units of the step)."""


@runtime_checkable
class ScalesResiduals(Protocol):
    """A compressor keeping its residual in units of the step (plait.comm.compress)."""

    def set_lr_scale(self, scale: float) -> None: ...


@runtime_checkable
class OuterSteps(Protocol):
    """An engine with work of its own at the end of a step, taken or skipped (DiLoCo's outer
    exchange, plait.train.diloco): the trainer calls it after every step."""

    def end_step(self, step: int, loss: float) -> dict:
        """After step `step` (whose global loss was `loss`): returns entries for its record."""


@runtime_checkable
class RecordsTimeline(Protocol):
    """An engine that can time one step's actions and gather them from every rank."""

    def record_next_step(self) -> None: ...

    def gather_events(self) -> list: ...


class AccumulatingEngine:
    """`forward_backward` and `eval_loss_sum` for engines whose `module(x, y, reduction="sum")`
    is the whole model on every rank (data parallel, ZeRO): the micro-batches accumulate inside
    `no_sync()` and the last one's backward synchronises the gradients."""

    module: nn.Module

    def no_sync(self):
        """Defer gradient synchronisation. By default there is none to defer: engines whose
        gradients live in shards (ZeRO-3) synchronise every backward."""
        return contextlib.nullcontext()

    def forward_backward(self, micro_batches: MicroBatches, loss_scale: float, autocast: Autocast = None):
        total = None
        for i, (x, y) in enumerate(micro_batches):
            sync = contextlib.nullcontext() if i == len(micro_batches) - 1 else self.no_sync()
            with sync, objective_scale(loss_scale):
                with autocast() if autocast is not None else contextlib.nullcontext():
                    loss_sum = self.module(x, y, reduction="sum")
                (loss_sum * loss_scale).backward()
            part = loss_sum.detach().double()
            total = part if total is None else total + part
        return total

    @torch.no_grad()
    def eval_loss_sum(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.module(x, y, reduction="sum")


def model_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks a model declares (`model.plait_blocks()`: its repeated layers, e.g. plait's GPT
    blocks), plus torch's own Transformer layers: what the parallelize step treats one at a time
    (ZeRO-3 units, activation checkpointing) without knowing the model."""
    declared = list(model.plait_blocks()) if callable(getattr(model, "plait_blocks", None)) else []
    ids = {id(b) for b in declared}
    kinds = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)
    return declared + [m for m in model.modules() if isinstance(m, kinds) and id(m) not in ids]


def global_grad_norm(mesh, parts) -> float:
    """The 2-norm of the whole model's gradient, the one rule every engine uses: float64, each
    gradient counted once. `parts` pairs lists of gradients with the mesh axes they are split
    over; their squares are summed over those axes (a gradient replicated over an axis is counted
    once by not naming it). Parts that share an axis are reduced together: one small all-reduce
    per axis at most."""
    parts = [(list(grads), tuple(axes)) for grads, axes in parts]
    sq = torch.zeros(len(parts), dtype=torch.float64, device=mesh.device)
    for i, (grads, _) in enumerate(parts):
        for g in grads:
            sq[i] += torch.linalg.vector_norm(g.detach(), dtype=torch.float64).to(sq.device) ** 2
    for axis in sorted({a for _, axes in parts for a in axes}):  # the same order on every rank
        idx = [i for i, (_, axes) in enumerate(parts) if axis in axes]
        if len(idx) == len(parts):
            comm.all_reduce(sq, mesh, axis)
        else:
            sel = torch.tensor(idx, device=sq.device)
            sq[sel] = comm.all_reduce(sq[sel].clone(), mesh, axis)
    return float(sq.sum().sqrt())

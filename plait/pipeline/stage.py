"""Cutting a model into pipeline stages (GPipe, Huang et al. 2018, §2.2: a sequence of layers
partitioned into consecutive cells, one per accelerator).

`split_model` is what the pipeline engine calls: a model that knows how to cut itself
(``model.pipeline_split(n_stages, split)``; plait's GPT does, in `plait.models.gpt_parallel`),
or an ``nn.Sequential`` (`split_sequential`; its ``loss_fn`` attribute, if any, is the loss).
Nothing here knows a particular model. `stage_bounds` is the cut any model's own split can
use: layers divided evenly ("uniform", the count must divide) or balanced so the most
expensive stage is as cheap as possible ("params": by parameter count, or any
``cost(name, module)``), with pieces such as embeddings and a head weighing on the first and
the last stage.

A stage keeps the model's own submodules (no copies) under the model's own names, so
``stage.named_parameters()`` yields ``blocks.3.attn.qkv.weight`` or ``layers.2.weight`` as the
whole model would and checkpoints stay layout-free. A parameter shared by two stages (a tied
embedding and head) is one Parameter; when those stages live on different pipeline ranks each
rank steps its own copy and the runtime sums the two gradients (Megatron-LM's embedding group).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from plait.errors import PipelineError

SPLITS = ("uniform", "params")


def param_cost(name: str, module: nn.Module) -> float:
    """The default balancing cost of a piece: its parameter count."""
    return float(sum(p.numel() for p in module.parameters()))


def balanced_bounds(costs: Sequence[float], n: int) -> list[int]:
    """Cut `costs` into `n` non-empty consecutive runs minimising the largest run's sum.

    Returns the n+1 boundaries (0 = b[0] < b[1] < ... < b[n] = len(costs)). Exact dynamic
    programme, O(n·k²) for k items: k is the number of layers, a few hundred at most.
    """
    k = len(costs)
    if n > k:
        raise PipelineError(f"cannot cut {k} layers into {n} non-empty stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[j][i]: the smallest possible max-stage cost for the first i items in j stages
    best = [[inf] * (k + 1) for _ in range(n + 1)]
    cut = [[0] * (k + 1) for _ in range(n + 1)]
    best[0][0] = 0.0
    for j in range(1, n + 1):
        for i in range(j, k - (n - j) + 1):
            for h in range(j - 1, i):
                value = max(best[j - 1][h], prefix[i] - prefix[h])
                if value < best[j][i]:
                    best[j][i], cut[j][i] = value, h
    bounds = [k]
    for j in range(n, 0, -1):
        bounds.append(cut[j][bounds[-1]])
    return bounds[::-1]


def stage_bounds(
    layers: Sequence[tuple[str, nn.Module]],
    n_stages: int,
    split: str | Callable,
    *,
    what: str,
    unit: str = "layer",
    first: Sequence[tuple[str, nn.Module]] = (),
    last: Sequence[tuple[str, nn.Module]] = (),
) -> list[int]:
    """The n_stages+1 boundaries that cut consecutive `layers` ((name, module) pairs) into
    `n_stages` non-empty stages.

    `split`: "uniform" (equal layer counts; the count must divide), "params" (balanced by
    parameter count, `param_cost`) or a function ``cost(name, module) -> float`` to balance.
    A layer costs at least 1 (parameter-free layers are not free). `first` and `last` are the
    pieces that go with the first and the last stage around the layers (embeddings, a head):
    their costs weigh on those stages. `what` names the whole in errors ("an nn.Sequential of 5
    layers"), `unit` one layer.
    """
    k = len(layers)
    if n_stages < 1:
        raise PipelineError(f"the number of pipeline stages must be >= 1, got {n_stages}")
    if k < n_stages:
        raise PipelineError(
            f"cannot cut {what} into {n_stages} pipeline stages (pp x virtual_stages): every stage "
            f"needs at least one {unit}; use at most {k} stages"
        )
    if split == "uniform":
        if k % n_stages:
            valid = [s for s in range(1, k + 1) if k % s == 0]
            raise PipelineError(
                f"{what} is not divisible into {n_stages} pipeline stages (pp x virtual_stages) of "
                f"equal size: use a stage count from {valid}, or split = 'params'"
            )
        return [i * (k // n_stages) for i in range(n_stages + 1)]
    cost = param_cost if split == "params" else split
    if not callable(cost):
        raise PipelineError(f"split = {split!r} is not valid; valid: {', '.join(SPLITS)} or a cost function")
    costs = [max(float(cost(name, m)), 1.0) for name, m in layers]
    costs[0] += sum(float(cost(name, m)) for name, m in first)
    costs[-1] += sum(float(cost(name, m)) for name, m in last)
    return balanced_bounds(costs, n_stages)


class SequentialStage(nn.Module):
    """Consecutive layers of an ``nn.Sequential``; the last stage applies ``loss_fn``."""

    def __init__(self, layers: nn.Sequential, index: int, n_stages: int, lo: int, hi: int, loss_fn=None):
        super().__init__()
        self.index, self.n_stages, self.is_first, self.is_last = (
            index,
            n_stages,
            index == 0,
            index == n_stages - 1,
        )
        self.layers = nn.ModuleDict({str(i): layers[i] for i in range(lo, hi)})
        self._loss_fn = loss_fn

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        if self.is_last and targets is not None:
            if self._loss_fn is None:
                raise PipelineError("the last stage got targets but split_sequential was given no loss_fn")
            return self._loss_fn(x, targets)
        return x


class ModuleStage(nn.Module):
    """One stage given as a module (`stages=[...]` of `plait.parallelize`), kept as the child
    ``stages.<index>`` so a rank holding several stages keeps them apart. It is called on the
    previous stage's output; the last stage given targets applies ``loss_fn(output, targets)``,
    or, without one, is the user's module called as ``module(x, targets)`` (the summed loss)."""

    def __init__(self, module: nn.Module, index: int, n_stages: int, loss_fn=None):
        super().__init__()
        self.index, self.is_last = index, index == n_stages - 1
        self.stages = nn.ModuleDict({str(index): module})
        self._loss_fn = loss_fn

    def forward(self, x: torch.Tensor, targets=None) -> torch.Tensor:
        module = self.stages[str(self.index)]
        if not (self.is_last and targets is not None):
            return module(x)
        return module(x, targets) if self._loss_fn is None else self._loss_fn(module(x), targets)


def split_model(model: nn.Module, n_stages: int, split: str | Callable = "uniform") -> list[nn.Module]:
    """Cut `model` into `n_stages` stage modules: by its own ``pipeline_split(n_stages, split)``,
    or, for an ``nn.Sequential``, by `split_sequential` (with ``model.loss_fn``, if set, as the
    summed loss). Anything else: cut it yourself and give the stages to the engine."""
    if callable(getattr(model, "pipeline_split", None)):
        return model.pipeline_split(n_stages, split)
    if isinstance(model, nn.Sequential):
        return split_sequential(model, n_stages, getattr(model, "loss_fn", None), split)
    raise PipelineError(
        f"cannot cut a {type(model).__name__} into pipeline stages: give it a pipeline_split(n_stages, "
        "split) method, make it an nn.Sequential, or pass the stage modules (stages=[...])"
    )


def split_sequential(
    seq: nn.Sequential,
    n_stages: int,
    loss_fn: Callable | None = None,
    split: str | Callable = "params",
) -> list[SequentialStage]:
    """Cut any ``nn.Sequential`` into `n_stages` consecutive pieces, balanced by `split`
    ("uniform": equal layer counts, len(seq) must divide; "params"; or a cost function).
    `loss_fn(output, targets)` must return the *summed* loss over the micro-batch."""
    layers = [(str(i), m) for i, m in enumerate(seq)]
    bounds = stage_bounds(layers, n_stages, split, what=f"an nn.Sequential of {len(seq)} layers")
    return [SequentialStage(seq, i, n_stages, bounds[i], bounds[i + 1], loss_fn) for i in range(n_stages)]

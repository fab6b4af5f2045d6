"""Cutting a model into pipeline stages (GPipe, Huang et al. 2018, §2.2: a sequence of layers
partitioned into consecutive cells, one per accelerator).

`split_gpt` cuts plait's GPT into ``n_stages`` stages by transformer blocks: the embeddings go
with the first stage, the final LayerNorm, the head and the loss with the last. Blocks are
divided evenly ("uniform", which requires n_layer to divide) or balanced so the most expensive
stage is as cheap as possible ("params": by parameter count, or any ``cost(name, module)``).
`split_sequential` does the same for any ``nn.Sequential``. `split_model` is what the pipeline
engine calls: a model that knows how to cut itself (``model.pipeline_split(n_stages, split)``,
as plait's GPT does), or an ``nn.Sequential`` (its ``loss_fn`` attribute, if any, is the loss).

A stage keeps the model's own submodules (no copies) under the model's own names, so
``stage.named_parameters()`` yields ``blocks.3.attn.qkv.weight`` as the whole model would and
checkpoints stay layout-free. A GPT with tied embedding and head shares one Parameter between
the first and the last stage; when those stages live on different pipeline ranks each rank
steps its own copy and the runtime sums the two gradients (Megatron-LM's embedding group).
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


def _block_bounds(model, n_stages: int, split: str | Callable) -> list[int]:
    n_layer = len(model.blocks)
    if n_stages < 1:
        raise PipelineError(f"the number of pipeline stages must be >= 1, got {n_stages}")
    if n_layer < n_stages:
        raise PipelineError(
            f"a GPT with n_layer = {n_layer} cannot be cut into {n_stages} pipeline stages (pp x "
            f"virtual_stages): every stage needs at least one block; use at most {n_layer} stages"
        )
    if split == "uniform":
        if n_layer % n_stages:
            valid = [s for s in range(1, n_layer + 1) if n_layer % s == 0]
            raise PipelineError(
                f"n_layer = {n_layer} is not divisible into {n_stages} pipeline stages (pp x "
                f"virtual_stages) of equal size: use a stage count from {valid}, or split = 'params'"
            )
        per = n_layer // n_stages
        return [i * per for i in range(n_stages + 1)]
    cost = param_cost if split == "params" else split
    if not callable(cost):
        raise PipelineError(f"split = {split!r} is not valid; valid: {', '.join(SPLITS)} or a cost function")
    costs = [cost(f"blocks.{i}", b) for i, b in enumerate(model.blocks)]
    # The embeddings and the head weigh on the first and last stages: count them there.
    first = cost("wte", model.wte) + cost("wpe", model.wpe)
    last = cost("ln_f", model.ln_f) + (0.0 if model.cfg.tie_weights else cost("lm_head", model.lm_head))
    costs[0] += first
    costs[-1] += last
    return balanced_bounds(costs, n_stages)


class GPTStage(nn.Module):
    """Blocks ``lo..hi-1`` of a GPT; with the embeddings if first, ln_f, head and loss if last.

    ``forward(x, targets)`` takes token ids on the first stage and the previous stage's hidden
    states otherwise; the last stage returns the *summed* token loss (the runtime scales it),
    or the logits when ``targets`` is None.
    """

    def __init__(self, model, index: int, n_stages: int, lo: int, hi: int):
        super().__init__()
        self.index, self.n_stages, self.lo, self.hi = index, n_stages, lo, hi
        self.is_first, self.is_last = index == 0, index == n_stages - 1
        if self.is_first:
            self.wte, self.wpe, self.drop = model.wte, model.wpe, model.drop
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(lo, hi)})
        if self.is_last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head
            # looked up at split time: a tensor-parallel plan replaces them (vocab-parallel loss)
            self._loss_fn, self._output_fn = model.loss_fn, model.output_fn

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if self.is_first:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.wte(x) + self.wpe(pos))
        for block in self.blocks.values():
            x = block(x)
        if not self.is_last:
            return x
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return self._output_fn(logits)
        return self._loss_fn(logits, targets, "sum")

    def extra_repr(self) -> str:
        parts = (["embeddings"] if self.is_first else []) + [f"blocks {self.lo}..{self.hi - 1}"]
        return f"stage {self.index} of {self.n_stages}: " + ", ".join(
            parts + (["head"] if self.is_last else [])
        )


def split_gpt(model, n_stages: int, split: str | Callable = "uniform") -> list[GPTStage]:
    """Cut a plait GPT into `n_stages` GPTStage modules sharing the model's submodules.

    `split`: "uniform" (n_layer must divide; the error lists the valid stage counts),
    "params" (balanced by parameter count, embeddings counted on the first stage and the head
    on the last) or a function ``cost(name, module) -> float`` to balance.
    """
    bounds = _block_bounds(model, n_stages, split)
    return [GPTStage(model, i, n_stages, bounds[i], bounds[i + 1]) for i in range(n_stages)]


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
    k = len(seq)
    if n_stages < 1 or n_stages > k:
        raise PipelineError(f"cannot cut an nn.Sequential of {k} layers into {n_stages} non-empty stages")
    if split == "uniform":
        if k % n_stages:
            valid = [s for s in range(1, k + 1) if k % s == 0]
            raise PipelineError(f"{k} layers are not divisible into {n_stages} equal stages; valid: {valid}")
        bounds = [i * (k // n_stages) for i in range(n_stages + 1)]
    else:
        cost = param_cost if split == "params" else split
        if not callable(cost):
            raise PipelineError(
                f"split = {split!r} is not valid; valid: {', '.join(SPLITS)} or a cost function"
            )
        bounds = balanced_bounds([max(cost(str(i), m), 1.0) for i, m in enumerate(seq)], n_stages)
    return [SequentialStage(seq, i, n_stages, bounds[i], bounds[i + 1], loss_fn) for i in range(n_stages)]

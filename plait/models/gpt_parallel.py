"""How plait's GPT is cut for parallelism: its pipeline stages and its tensor-parallel plan.

`plait.models.gpt` stays plain PyTorch; its ``pipeline_split`` and ``tp_plan`` delegate here.
This module is the GPT-specific half: which modules go with which pipeline stage, and how each
layer is split over tp. The generic halves (the boundary computation, the pipeline engine and
runtime; `apply_tp` and its styles) live in `plait.pipeline` and `plait.tensor_parallel` and
know no particular model.

`split_gpt` cuts a GPT into ``n_stages`` stages by transformer blocks: the embeddings go with
the first stage, the final LayerNorm, the head and the loss with the last. Blocks are divided
evenly ("uniform", which requires n_layer to divide) or balanced so the most expensive stage is
as cheap as possible ("params": by parameter count, or any ``cost(name, module)``), the
embeddings counted on the first stage and an untied head on the last (`stage_bounds`).

A stage keeps the model's own submodules (no copies) under the model's own names, so
``stage.named_parameters()`` yields ``blocks.3.attn.qkv.weight`` as the whole model would and
checkpoints stay layout-free. With tied embedding and head the first and the last stage share
one Parameter (the pipeline engine sums its gradients when they live on different ranks).

`gpt_plan` is Megatron-LM's tensor-parallel split of the GPT (Shoeybi et al. 2019, §3), with
sequence parallelism (Korthikanti et al. 2022) on the LayerNorms, dropouts and positions: data,
the records of `plait.tp_plan`, which `plait.tensor_parallel.apply_tp` applies.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from plait.context_parallel import positions
from plait.pipeline.stage import stage_bounds
from plait.tp_plan import (
    Colwise,
    ExpertsReplicated,
    ParallelRandom,
    PositionSharded,
    Rowwise,
    SequenceSharded,
    VocabEmbedding,
    VocabHead,
)


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
            pos = positions(x.shape[1], x.device)
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
    blocks = [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)]
    # a tied head is the embedding's weight: counted once, with the embeddings
    head = [] if model.cfg.tie_weights else [("lm_head", model.lm_head)]
    bounds = stage_bounds(
        blocks,
        n_stages,
        split,
        what=f"a GPT with n_layer = {len(blocks)}",
        unit="block",
        first=[("wte", model.wte), ("wpe", model.wpe)],
        last=[("ln_f", model.ln_f), *head],
    )
    return [GPTStage(model, i, n_stages, bounds[i], bounds[i + 1]) for i in range(n_stages)]


def gpt_plan(tie_weights: bool = True, moe_layers: tuple[int, ...] = (), n_layer: int = 0) -> dict:
    """Megatron-LM's tensor-parallel split of plait's GPT (`plait.tensor_parallel.apply_tp`):
    heads (qkv column, projection row), MLP (column then row), vocabulary-parallel embedding and
    head (sharing the embedding's shard when `tie_weights`); with sequence parallelism the
    LayerNorms, dropouts and position embedding work on sequence shards. The named dims ("vocab",
    "heads", "d_ff") are what layout rules map. Blocks `moe_layers` (of `n_layer`) have a
    mixture-of-experts MLP, kept whole (`ExpertsReplicated`). `GPT.tp_plan()` returns this for
    its config."""
    plan = _dense_plan(tie_weights)
    if not moe_layers:
        return plan
    mlp = {k: plan.pop(k) for k in [k for k in plan if k.startswith("blocks.*.mlp.")]}
    for i in range(n_layer):
        if i in moe_layers:
            plan[f"blocks.{i}.mlp"] = ExpertsReplicated()
        else:
            plan.update({k.replace("*", str(i)): style for k, style in mlp.items()})
    return plan


def _dense_plan(tie_weights: bool) -> dict:
    return {
        "wte": VocabEmbedding(dim="vocab"),
        "wpe": PositionSharded(),
        "drop": SequenceSharded(),
        "blocks.*.ln_1": SequenceSharded(),
        "blocks.*.attn.qkv": Colwise(fused=3, dim="heads"),
        "blocks.*.attn.core": ParallelRandom(dim="heads"),
        "blocks.*.attn.proj": Rowwise(dim="heads"),
        "blocks.*.attn.resid_dropout": SequenceSharded(),
        "blocks.*.ln_2": SequenceSharded(),
        "blocks.*.mlp.fc": Colwise(dim="d_ff"),
        "blocks.*.mlp.proj": Rowwise(dim="d_ff"),
        "blocks.*.mlp.dropout": SequenceSharded(),
        "ln_f": SequenceSharded(),
        "lm_head": VocabHead(tie="wte" if tie_weights else None, dim="vocab"),
    }

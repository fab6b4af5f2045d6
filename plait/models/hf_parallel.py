"""How a Hugging Face model (`plait.models.hf.HFCausalLM`) is cut for parallelism: its
tensor-parallel plan and its pipeline stages. The generic halves are `plait.tensor_parallel`
and `plait.pipeline`, as for plait's GPT (`plait.models.gpt_parallel`).

`hf_plan` is Megatron-LM's split (Shoeybi et al. 2019, §3) in transformers' module names, with
sequence parallelism (Korthikanti et al. 2022) on the norms, dropouts and GPT-2's positions:

* Llama: q_proj, k_proj, v_proj column-parallel by heads (with grouped-query attention each rank
  takes n_kv_head / tp key/value heads, the ones its n_head / tp query heads read), o_proj
  row-parallel; gate_proj and up_proj column-parallel, down_proj row-parallel;
* GPT-2: the fused c_attn column-parallel as three blocks [q | k | v], c_proj row-parallel;
  c_fc column-parallel, mlp.c_proj row-parallel; the attention's head counts patched to the
  rank's share (`LocalHeads`);
* both: the token embedding and the head vocabulary-parallel (the loss then vocab-parallel),
  sharing the embedding's shard when the weights are tied.

`split_hf` cuts by decoder layers: the embeddings with the first stage, the final norm, head and
loss with the last; each stage keeps the model's own modules under the model's own names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from plait.models.hf_blocks import embed, final_norm
from plait.pipeline.stage import stage_bounds
from plait.tp_plan import (
    Colwise,
    PositionSharded,
    Rowwise,
    SequenceSharded,
    VocabEmbedding,
    VocabHead,
)


@dataclasses.dataclass
class LocalHeads:
    """GPT-2's attention module: its head count and split sizes become the rank's share, so that
    transformers' own attention code, if called on the module, sees the local shapes. Applied
    with the heads' split (its dim is "heads")."""

    dim: str | None = "heads"

    def apply(self, name: str, m: nn.Module, ctx) -> nn.Module:
        t = ctx.mesh.size(ctx.axis)
        m.num_heads //= t
        m.split_size //= t
        m.embed_dim //= t
        return m


def hf_plan(arch: str, tie_weights: bool) -> dict:
    """The tensor-parallel plan of an hf model (module docstring); named dims "vocab", "heads",
    "d_ff" as for plait's GPT."""
    if arch == "llama":
        layer = "model.layers.*."
        return {
            "model.embed_tokens": VocabEmbedding(dim="vocab"),
            layer + "input_layernorm": SequenceSharded(),
            layer + "self_attn.q_proj": Colwise(dim="heads"),
            layer + "self_attn.k_proj": Colwise(dim="heads"),
            layer + "self_attn.v_proj": Colwise(dim="heads"),
            layer + "self_attn.o_proj": Rowwise(dim="heads"),
            layer + "post_attention_layernorm": SequenceSharded(),
            layer + "mlp.gate_proj": Colwise(dim="d_ff"),
            layer + "mlp.up_proj": Colwise(dim="d_ff"),
            layer + "mlp.down_proj": Rowwise(dim="d_ff"),
            "model.norm": SequenceSharded(),
            "lm_head": VocabHead(tie="model.embed_tokens" if tie_weights else None, dim="vocab"),
        }
    block = "transformer.h.*."
    return {
        "transformer.wte": VocabEmbedding(dim="vocab"),
        "transformer.wpe": PositionSharded(),
        "transformer.drop": SequenceSharded(),
        block + "ln_1": SequenceSharded(),
        block + "attn.c_attn": Colwise(fused=3, dim="heads"),
        block + "attn.c_proj": Rowwise(dim="heads"),
        block + "attn": LocalHeads(),
        block + "attn.resid_dropout": SequenceSharded(),
        block + "ln_2": SequenceSharded(),
        block + "mlp.c_fc": Colwise(dim="d_ff"),
        block + "mlp.c_proj": Rowwise(dim="d_ff"),
        block + "mlp.dropout": SequenceSharded(),
        "transformer.ln_f": SequenceSharded(),
        "lm_head": VocabHead(tie="transformer.wte" if tie_weights else None, dim="vocab"),
    }


_FIRST = {"llama": ("embed_tokens",), "gpt2": ("wte", "wpe", "drop")}
_LAST = {"llama": "norm", "gpt2": "ln_f"}
_ROOT = {"llama": "model", "gpt2": "transformer"}
_LAYERS = {"llama": "layers", "gpt2": "h"}


class HFStage(nn.Module):
    """Decoder layers ``lo..hi-1`` of an HFCausalLM; with the embeddings if first, the final norm,
    head and loss if last. Names as in the whole model (``model.layers.3...``)."""

    def __init__(self, model, index: int, n_stages: int, lo: int, hi: int):
        super().__init__()
        arch = self.arch = model.cfg.arch
        self.index, self.n_stages, self.lo, self.hi = index, n_stages, lo, hi
        self.is_first, self.is_last = index == 0, index == n_stages - 1
        src, root = model.root, nn.Module()
        if self.is_first:
            for name in _FIRST[arch]:
                setattr(root, name, getattr(src, name))
        setattr(root, _LAYERS[arch], nn.ModuleDict({str(i): model.layers[i] for i in range(lo, hi)}))
        if self.is_last:
            setattr(root, _LAST[arch], getattr(src, _LAST[arch]))
            self.lm_head = model.lm_head
            self._loss_fn, self._output_fn = model.loss_fn, model.output_fn  # after apply_tp
        setattr(self, _ROOT[arch], root)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        root = getattr(self, _ROOT[self.arch])
        if self.is_first:
            x = embed(self.arch, root, x)
        for layer in getattr(root, _LAYERS[self.arch]).values():
            x = layer(x)
        if not self.is_last:
            return x
        logits = self.lm_head(final_norm(self.arch, root)(x))
        if targets is None:
            return self._output_fn(logits)
        return self._loss_fn(logits, targets, "sum")

    def extra_repr(self) -> str:
        return f"stage {self.index} of {self.n_stages}: layers {self.lo}..{self.hi - 1}"


def split_hf(model, n_stages: int, split: str | Callable = "uniform") -> list[HFStage]:
    """Cut an HFCausalLM into `n_stages` stages by decoder layers ("uniform", "params" or a cost
    function, as `plait.pipeline.stage.stage_bounds` takes)."""
    arch, root = model.cfg.arch, model.root
    prefix = f"{_ROOT[arch]}.{_LAYERS[arch]}"
    layers = [(f"{prefix}.{i}", m) for i, m in enumerate(model.layers)]
    head = [] if model.cfg.tie_weights else [("lm_head", model.lm_head)]
    bounds = stage_bounds(
        layers,
        n_stages,
        split,
        what=f"an hf:{arch} model with n_layer = {len(layers)}",
        unit="layer",
        first=[(f"{_ROOT[arch]}.{n}", getattr(root, n)) for n in _FIRST[arch]],
        last=[(f"{_ROOT[arch]}.{_LAST[arch]}", getattr(root, _LAST[arch])), *head],
    )
    return [HFStage(model, i, n_stages, bounds[i], bounds[i + 1]) for i in range(n_stages)]

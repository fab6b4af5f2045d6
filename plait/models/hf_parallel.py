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

Any other architecture (the generic path, `plait.models.hf_generic`): `generic_plan` maps
transformers' own ``base_model_tp_plan`` (the strings its ``tp_plan="auto"`` applies) onto plait's
styles, in the base model's names: ``colwise`` -> `Colwise`, ``rowwise`` -> `Rowwise` (dim "heads"
under the attention, "d_ff" elsewhere), ``embedding_rowwise`` on the token embedding ->
`VocabEmbedding`, ``replicated_with_grad_allreduce`` (a norm inside attention that sees the rank's
heads only) -> `GradPartial`; ``colwise_gather_output`` / ``rowwise_split_input`` (a layer whose
output or input stays whole, e.g. Phi-3's fused qkv) are kept replicated over tp. Any other
string is refused (`PlanError`, a ConfigError naming it). The token embedding and the head are
vocabulary-parallel as above whatever the plan says. A fused projection that transformers splits
"colwise" is laid out per head (GPT-NeoX's query_key_value rows are ``[h0: q k v | h1: q k v |
...]``), so the plain row split holds whole heads of q, k and v once heads divide tp. An
architecture with no plan keeps its layers replicated over tp (`plan_warning` says so).

`split_hf` cuts by decoder layers: the embeddings with the first stage, the final norm, head and
loss with the last (the rotary embedding, buffers only, on every stage); each stage keeps the
model's own modules under the model's own names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from plait.errors import ConfigError
from plait.models.hf_generic import Parts, embed, run_layers
from plait.pipeline.stage import stage_bounds
from plait.placement import set_grad_partial
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


@dataclasses.dataclass
class GradPartial:
    """transformers' ``replicated_with_grad_allreduce``: a module kept whole on every tp rank whose
    input is the rank's share of a split dim (Qwen3's per-head q_norm sees the rank's heads), so
    its parameters' gradients are partial over tp (summed by the trainer, `plait.placement`)."""

    dim: str | None = "heads"

    def apply(self, name: str, m: nn.Module, ctx) -> nn.Module:
        for p in m.parameters():
            set_grad_partial(p, ctx.axis)
        return m


class PlanError(ConfigError):
    """transformers' tensor-parallel plan of an architecture holds a style plait does not map."""


MAPPED = ("colwise", "rowwise", "embedding_rowwise", "replicated_with_grad_allreduce")
REPLICATED = ("colwise_gather_output", "rowwise_split_input")
"""transformers' styles that `generic_plan` maps, and those it keeps replicated over tp."""


def hf_plan(cfg, parts: Parts, hf_config=None) -> dict:
    """The tensor-parallel plan of an hf model (module docstring); named dims "vocab", "heads",
    "d_ff" as for plait's GPT."""
    if cfg.generic:
        return generic_plan(cfg, parts, getattr(hf_config, "base_model_tp_plan", None))
    tie_weights = cfg.tie_weights
    if cfg.arch == "llama":
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


def _dim(key: str) -> str:
    """The named dim a split of transformers' module `key` is along: "heads" in attention."""
    return "heads" if "attn" in key or "attention" in key else "d_ff"


def generic_plan(cfg, parts: Parts, tp_plan: dict | None) -> dict:
    """transformers' `tp_plan` (its config's base_model_tp_plan, names relative to the base model)
    in plait's styles, with the embedding and head vocabulary-parallel (module docstring)."""
    root, embedding = parts.root, f"{parts.root}.{parts.embedding}"
    plan = {embedding: VocabEmbedding(dim="vocab")}
    for key, style in (tp_plan or {}).items():
        name = f"{root}.{key}"
        if style in REPLICATED or name == embedding:
            continue  # replicated over tp; the token embedding is vocabulary-parallel above
        if style == "colwise":
            plan[name] = Colwise(dim=_dim(key))
        elif style == "rowwise":
            plan[name] = Rowwise(dim=_dim(key))
        elif style == "replicated_with_grad_allreduce":
            plan[name] = GradPartial(dim=_dim(key))
        else:
            raise PlanError(
                f"model.source = 'hf:{cfg.arch}' with parallel.tp > 1: transformers' tensor-parallel plan "
                f"splits {key} as {style!r}, which plait does not map (it maps {', '.join(MAPPED)} and keeps "
                f"{', '.join(REPLICATED)} replicated): set parallel.tp = 1"
            )
    plan[parts.head] = VocabHead(tie=embedding if cfg.tie_weights else None, dim="vocab")
    return plan


def plan_warning(cfg, hf_config) -> str:
    """What `plait train` warns of for a generic architecture under tp: '' when transformers ships
    its tensor-parallel plan, else that its decoder layers stay replicated over tp."""
    if not cfg.generic or getattr(hf_config, "base_model_tp_plan", None):
        return ""
    return (
        f"model.source = 'hf:{cfg.arch}': transformers ships no tensor-parallel plan "
        "(base_model_tp_plan) for it: its decoder layers are replicated over parallel.tp (every tp rank "
        "computes them whole); only the embedding and head are split"
    )


class HFStage(nn.Module):
    """Decoder layers ``lo..hi-1`` of an HFCausalLM; with the embeddings if first, the final norm,
    head and loss if last. Names as in the whole model (``model.layers.3...``)."""

    def __init__(self, model, index: int, n_stages: int, lo: int, hi: int):
        super().__init__()
        self.cfg, parts = model.cfg, model.parts
        self.parts = parts
        self.index, self.n_stages, self.lo, self.hi = index, n_stages, lo, hi
        self.is_first, self.is_last = index == 0, index == n_stages - 1
        src, root = model.root, nn.Module()
        if self.is_first:
            for name in parts.first:
                setattr(root, name, getattr(src, name))
        if parts.rotary is not None:  # buffers only: every stage computes the positions' angles
            setattr(root, parts.rotary, getattr(src, parts.rotary))
        setattr(root, parts.layers, nn.ModuleDict({str(i): model.layers[i] for i in range(lo, hi)}))
        if self.is_last:
            setattr(root, parts.last, getattr(src, parts.last))
            setattr(self, parts.head, model.head)
            self._loss_fn, self._output_fn = model.loss_fn, model.output_fn  # after apply_tp
        setattr(self, parts.root, root)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        parts = self.parts
        root = getattr(self, parts.root)
        if self.is_first:
            x = embed(self.cfg, parts, root, x)
        x = run_layers(self.cfg, parts, root, getattr(root, parts.layers).values(), x)
        if not self.is_last:
            return x
        logits = getattr(self, parts.head)(getattr(root, parts.last)(x))
        if targets is None:
            return self._output_fn(logits)
        return self._loss_fn(logits, targets, "sum")

    def extra_repr(self) -> str:
        return f"stage {self.index} of {self.n_stages}: layers {self.lo}..{self.hi - 1}"


def split_hf(model, n_stages: int, split: str | Callable = "uniform") -> list[HFStage]:
    """Cut an HFCausalLM into `n_stages` stages by decoder layers ("uniform", "params" or a cost
    function, as `plait.pipeline.stage.stage_bounds` takes)."""
    parts, root = model.parts, model.root
    prefix = f"{parts.root}.{parts.layers}"
    layers = [(f"{prefix}.{i}", m) for i, m in enumerate(model.layers)]
    head = [] if model.cfg.tie_weights else [(parts.head, model.head)]
    bounds = stage_bounds(
        layers,
        n_stages,
        split,
        what=f"an hf:{model.cfg.arch} model with n_layer = {len(layers)}",
        unit="layer",
        first=[(f"{parts.root}.{n}", getattr(root, n)) for n in parts.first],
        last=[(f"{parts.root}.{parts.last}", getattr(root, parts.last)), *head],
    )
    return [HFStage(model, i, n_stages, bounds[i], bounds[i + 1]) for i in range(n_stages)]

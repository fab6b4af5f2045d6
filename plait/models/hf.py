"""Hugging Face `transformers` causal LMs (GPT-2, Llama, and any architecture transformers
records a ``base_model_pp_plan`` for) behind plait's model contract.

`HFCausalLM` wraps a model that ``AutoModelForCausalLM.from_config`` builds from plait's size keys
(`HFConfig.to_hf_config`, `plait.models.hf_config`; nothing is downloaded) and drives it itself:
the embeddings, each decoder layer, the final norm and the head. Driving the layers here, rather
than calling the model's ``forward``, is what lets the rest of plait cut and split it like its
own GPT:

* each decoder layer is replaced by a block of ours (`LlamaBlock`, `GPT2Block`) that keeps the
  layer's own submodules under their own names, so parameter names stay transformers' names
  (``model.layers.3.self_attn.q_proj.weight``) and an export is a ``save_pretrained`` directory;
  the blocks are what ZeRO-3 wraps and activation checkpointing recomputes (`plait_blocks`);
* attention reads the number of heads from the projections' outputs, so a tensor-parallel rank
  that holds some heads of q, k and v (grouped-query: a proportional share of the key/value heads)
  computes attention on them with no other change;
* Llama's rotary embedding is computed for the whole sequence inside each attention (from the
  length of q, which a sequence-parallel column layer has gathered), so sequence shards and
  pipeline stages need no position bookkeeping;
* the loss goes through the ``loss_fn`` / ``output_fn`` hooks that a vocabulary-parallel head
  replaces (`plait.tensor_parallel.apply_tp`), as for plait's GPT.

GPT-2's ``Conv1D`` layers (a transposed Linear) become ``nn.Linear`` at build time so the generic
Colwise/Rowwise styles split them; `to_hf_state_dict` transposes them back for export. Attention
is ``torch.nn.functional.scaled_dot_product_attention`` with a causal mask, as transformers'
"sdpa" implementation computes it. The blocks are in `plait.models.hf_blocks`, the parallel layouts
in `plait.models.hf_parallel`.

Any other architecture (``hf:gpt_neox``, ``hf:mistral``, ``hf:qwen2``, ...) takes the generic path
(`plait.models.hf_generic`): its decoder layers stay transformers' modules, called with the
rotary embedding and no mask (causal attention); `driving_error` checks, before a run starts,
that this gives the model's own logits. Its tensor-parallel plan is transformers' own
``base_model_tp_plan`` mapped onto plait's styles (`plait.models.hf_parallel.generic_plan`).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from plait.models.gpt import GPT, _identity, cross_entropy
from plait.models.hf_blocks import (
    CONV1D,
    GPT2Block,
    LlamaBlock,
    _linear_from_conv1d,
    hf_model_class,
    hf_state_from,
)
from plait.models.hf_config import HFConfig
from plait.models.hf_generic import OWN_PARTS, embed, find_parts, run_layers
from plait.models.hf_parallel import hf_plan, split_hf
from plait.models.hf_weights import load_weights

__all__ = ["HFCausalLM", "HFConfig", "build_hf", "config_fields", "driving_error", "hf_model_class"]


class HFCausalLM(nn.Module):
    """A transformers causal LM under plait's model contract (module docstring). Parameter names
    are the transformers model's (``model.*``/``transformer.*`` and ``lm_head.weight``)."""

    def __init__(self, hf_model: nn.Module, cfg: HFConfig):
        super().__init__()
        self.cfg = cfg
        self.hf_config = hf_model.config  # for export and the tp plan; not a module
        parts = self.parts = find_parts(hf_model, cfg.arch) if cfg.generic else OWN_PARTS[cfg.arch]
        setattr(self, parts.root, getattr(hf_model, parts.root))
        if cfg.generic:
            pass  # the layers stay transformers' own (plait.models.hf_generic.run_layers)
        elif cfg.arch == "llama":
            rotary = self.model.rotary_emb
            for i, layer in enumerate(self.model.layers):
                self.model.layers[i] = LlamaBlock(layer, rotary)
        else:
            for i, block in enumerate(self.transformer.h):
                for name in CONV1D:
                    parent, _, child = name.rpartition(".")
                    owner = block.get_submodule(parent)
                    setattr(owner, child, _linear_from_conv1d(getattr(owner, child)))
                self.transformer.h[i] = GPT2Block(block)
        setattr(self, parts.head, getattr(hf_model, parts.head))
        self.loss_fn = cross_entropy  # hooks a vocabulary-parallel head replaces, as in GPT
        self.output_fn = _identity

    @property
    def root(self) -> nn.Module:
        """The transformers base model: ``model`` (Llama), ``transformer`` (GPT-2), ``gpt_neox``..."""
        return getattr(self, self.parts.root)

    @property
    def layers(self) -> nn.ModuleList:
        return getattr(self.root, self.parts.layers)

    @property
    def head(self) -> nn.Module:
        """The output layer (``lm_head``)."""
        return getattr(self, self.parts.head)

    def plait_blocks(self) -> list[nn.Module]:
        """The decoder layers: ZeRO-3's units and activation checkpointing's."""
        return list(self.layers)

    def pipeline_split(self, n_stages: int, split="uniform") -> list[nn.Module]:
        return split_hf(self, n_stages, split)

    def tp_plan(self) -> dict:
        return hf_plan(self.cfg, self.parts, self.hf_config)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, reduction: str = "mean"
    ) -> torch.Tensor:
        """Logits (B, T, vocab), or given ``targets`` the cross-entropy ("mean" or "sum")."""
        if idx.shape[1] > self.cfg.seq_len:
            raise ValueError(f"sequence of {idx.shape[1]} tokens is longer than seq_len={self.cfg.seq_len}")
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
        root = self.root
        x = run_layers(self.cfg, self.parts, root, self.layers, embed(self.cfg, self.parts, root, idx))
        logits = self.head(getattr(root, self.parts.last)(x))
        if targets is None:
            return self.output_fn(logits)
        return self.loss_fn(logits, targets, reduction)

    generate = GPT.generate  # the same sampling loop: it only calls forward and reads cfg.seq_len

    def to_hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The parameters in transformers' names and layouts (GPT-2's Conv1D weights transposed
        back) of this one-process (unsplit) model."""
        return hf_state_from(self.cfg.arch, dict(self.named_parameters(remove_duplicate=False)))


def build_hf(cfg: HFConfig) -> HFCausalLM:
    """A fresh transformers model of `cfg` (initialised by transformers under the current torch
    seed, or loaded from ``cfg.weights``) wrapped as an `HFCausalLM`."""
    hf = hf_model_class(cfg.arch)(cfg.to_hf_config())
    if cfg.weights:
        load_weights(hf, cfg.weights)
    return HFCausalLM(hf, cfg)


def config_fields() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(HFConfig))


@torch.no_grad()
def driving_error(cfg: HFConfig) -> float:
    """The largest difference between plait's layer-by-layer logits (`HFCausalLM`) and the model's
    own ``forward`` on one sequence of min(seq_len, 8) tokens, for a model of `cfg` with at most 2
    layers (the check that the generic path computes the architecture's function)."""
    small = dataclasses.replace(cfg, n_layer=min(cfg.n_layer, 2), weights="")
    hf = hf_model_class(small.arch)(small.to_hf_config()).eval()
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, small.vocab_size, (1, min(small.seq_len, 8)), generator=g)
    want = hf(x).logits
    return float((HFCausalLM(hf, small)(x) - want).abs().max())

"""Hugging Face `transformers` models (GPT-2, Llama) behind plait's model contract.

`HFCausalLM` wraps a ``GPT2LMHeadModel`` or ``LlamaForCausalLM`` built from its config class with
plait's size keys (`HFConfig.to_hf_config`; nothing is downloaded) and drives it itself: token
(and, for GPT-2, position) embeddings, each decoder layer, the final norm and the head. Driving
the layers here, rather than calling the model's ``forward``, is what lets the rest of plait cut
and split it like its own GPT:

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
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from plait.models.gpt import GPT, _identity, cross_entropy
from plait.models.hf_blocks import (
    CONV1D,
    GPT2Block,
    LlamaBlock,
    _linear_from_conv1d,
    embed,
    final_norm,
    hf_model_class,
    hf_state_from,
)
from plait.models.hf_parallel import hf_plan, split_hf
from plait.models.hf_weights import load_weights

HF_ARCHS = ("gpt2", "llama")


@dataclass
class HFConfig:
    """A Hugging Face model in plait's size keys (what ``model.cfg`` of an `HFCausalLM` is)."""

    arch: str
    """'gpt2' or 'llama'."""
    vocab_size: int = 256
    seq_len: int = 128
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    d_ff: int | None = None
    """MLP inner size; None means 4 * d_model (for Llama too: its gate/up/down width)."""
    n_kv_head: int | None = None
    """Llama's key/value heads (grouped-query attention); None means n_head."""
    tie_weights: bool = True
    """transformers' tie_word_embeddings."""
    weights: str = ""
    """A save_pretrained directory loaded into the model at build time ("" = initialise)."""
    dropout: float = 0.0  # the keys the trainer reads of any model config: hf models are dense
    experts: int = 0
    top_k: int = 1

    @property
    def ff_dim(self) -> int:
        return self.d_ff if self.d_ff is not None else 4 * self.d_model

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head if self.n_kv_head is not None else self.n_head

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def bias(self) -> bool:
        return self.arch == "gpt2"

    n_moe_layers = 0

    def is_moe(self, layer: int) -> bool:
        return False

    def n_params(self) -> int:
        """Distinct parameters of the model (a tied head once)."""
        d, f, V, hd = self.d_model, self.ff_dim, self.vocab_size, self.head_dim
        head = 0 if self.tie_weights else V * d
        if self.arch == "gpt2":
            block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
            return V * d + self.seq_len * d + self.n_layer * block + 2 * d + head
        attn = d * self.n_head * hd + 2 * d * self.kv_heads * hd + self.n_head * hd * d
        return V * d + self.n_layer * (2 * d + attn + 3 * d * f) + d + head

    def train_flops_per_token(self) -> float:
        """Model FLOPs of forward + backward per token: 6 x the matrix parameters a token meets
        (Kaplan et al. 2020, C = 6N) plus the attention scores and their weighted sum (3 passes of
        4 s h per layer, Narayanan et al. 2021 §5.1)."""
        d, f, hd = self.d_model, self.ff_dim, self.head_dim
        if self.arch == "gpt2":
            per_layer = 4 * d * d + 2 * d * f
        else:
            per_layer = 2 * d * self.n_head * hd + 2 * d * self.kv_heads * hd + 3 * d * f
        matmuls = self.n_layer * per_layer + d * self.vocab_size
        return float(6 * matmuls + 12 * self.n_layer * self.seq_len * d)

    def to_hf_config(self):
        """The transformers config of these sizes (sdpa attention, no dropout)."""
        if self.arch == "gpt2":
            from transformers import GPT2Config

            return GPT2Config(
                vocab_size=self.vocab_size,
                n_positions=self.seq_len,
                n_embd=self.d_model,
                n_layer=self.n_layer,
                n_head=self.n_head,
                n_inner=self.d_ff,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
                tie_word_embeddings=self.tie_weights,
                bos_token_id=None,
                eos_token_id=None,
                attn_implementation="sdpa",
            )
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.d_model,
            intermediate_size=self.ff_dim,
            num_hidden_layers=self.n_layer,
            num_attention_heads=self.n_head,
            num_key_value_heads=self.kv_heads,
            max_position_embeddings=self.seq_len,
            tie_word_embeddings=self.tie_weights,
            attention_dropout=0.0,
            bos_token_id=None,
            eos_token_id=None,
            attn_implementation="sdpa",
        )


class HFCausalLM(nn.Module):
    """A transformers causal LM under plait's model contract (module docstring). Parameter names
    are the transformers model's (``model.*``/``transformer.*`` and ``lm_head.weight``)."""

    def __init__(self, hf_model: nn.Module, cfg: HFConfig):
        super().__init__()
        self.cfg = cfg
        self.hf_config = hf_model.config  # for export; not a module
        if cfg.arch == "llama":
            self.model = hf_model.model
            rotary = self.model.rotary_emb
            for i, layer in enumerate(self.model.layers):
                self.model.layers[i] = LlamaBlock(layer, rotary)
        else:
            self.transformer = hf_model.transformer
            for i, block in enumerate(self.transformer.h):
                for name in CONV1D:
                    parent, _, child = name.rpartition(".")
                    owner = block.get_submodule(parent)
                    setattr(owner, child, _linear_from_conv1d(getattr(owner, child)))
                self.transformer.h[i] = GPT2Block(block)
        self.lm_head = hf_model.lm_head
        self.loss_fn = cross_entropy  # hooks a vocabulary-parallel head replaces, as in GPT
        self.output_fn = _identity

    @property
    def root(self) -> nn.Module:
        """The transformers base model: ``model`` (Llama) or ``transformer`` (GPT-2)."""
        return self.model if self.cfg.arch == "llama" else self.transformer

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers if self.cfg.arch == "llama" else self.transformer.h

    def plait_blocks(self) -> list[nn.Module]:
        """The decoder layers: ZeRO-3's units and activation checkpointing's."""
        return list(self.layers)

    def pipeline_split(self, n_stages: int, split="uniform") -> list[nn.Module]:
        return split_hf(self, n_stages, split)

    def tp_plan(self) -> dict:
        return hf_plan(self.cfg.arch, self.cfg.tie_weights)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, reduction: str = "mean"
    ) -> torch.Tensor:
        """Logits (B, T, vocab), or given ``targets`` the cross-entropy ("mean" or "sum")."""
        if idx.shape[1] > self.cfg.seq_len:
            raise ValueError(f"sequence of {idx.shape[1]} tokens is longer than seq_len={self.cfg.seq_len}")
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
        x = embed(self.cfg.arch, self.root, idx)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(final_norm(self.cfg.arch, self.root)(x))
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

"""`HFConfig`: a Hugging Face causal LM in plait's size keys, and the transformers config it builds.

``model.source = "hf:ARCH"`` names a transformers ``model_type``: ``gpt2`` and ``llama`` are driven by
plait's own blocks (`plait.models.hf_blocks`); any other architecture that
``AutoModelForCausalLM.from_config`` builds and whose config declares a ``base_model_pp_plan`` (its
embeddings, decoder layers and final norm, in order) is driven layer by layer through the layers' own
``forward`` (the "generic" path, `plait.models.hf_generic`). ``model.hf_config`` gives the
architecture's other keys: the path of a ``config.json`` (or of the directory holding one) or an
inline JSON object; plait's size keys that are set override it, and without it the named size's
dimensions are used, as for plait's GPT.

Nothing is downloaded; transformers is imported when a config is built (an optional dependency).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from plait.errors import ConfigError

OWN_BLOCKS = ("gpt2", "llama")
"""The architectures plait drives with its own blocks (sequence parallelism included)."""

HF_KEYS = {
    "n_layer": "num_hidden_layers",
    "n_head": "num_attention_heads",
    "d_model": "hidden_size",
    "vocab_size": "vocab_size",
    "d_ff": "intermediate_size",
    "n_kv_head": "num_key_value_heads",
}
"""plait's size key -> the transformers config attribute it sets (the ones every decoder names so)."""


@functools.cache
def causal_lm_types() -> tuple[str, ...]:
    """Every ``model_type`` that AutoModelForCausalLM builds (transformers' own mapping)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return tuple(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))


def read_hf_config(value: str) -> dict:
    """``model.hf_config``: '' -> {}, an inline JSON object, or the path of a config.json (or of a
    directory holding one) -> its keys. A ConfigError says what is wrong with it."""
    if not value:
        return {}
    text, where = value, "model.hf_config"
    if not value.lstrip().startswith("{"):
        path = Path(value)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise ConfigError(
                f"model.hf_config = {value!r}: no such file (give a config.json, the directory holding one, "
                "or an inline JSON object such as '{\"use_parallel_residual\": false}')"
            )
        text, where = path.read_text(), f"model.hf_config = {value!r}"
    try:
        keys = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(keys, dict):
        raise ConfigError(f"{where}: expected a JSON object of config keys, got {type(keys).__name__}")
    return keys


@dataclass
class HFConfig:
    """A Hugging Face model in plait's size keys (what ``model.cfg`` of an `HFCausalLM` is)."""

    arch: str
    """transformers' model_type: 'gpt2', 'llama', 'gpt_neox', 'mistral', 'qwen2', ..."""
    vocab_size: int = 256
    seq_len: int = 128
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    d_ff: int | None = None
    """MLP inner size; None means 4 * d_model (for Llama too: its gate/up/down width)."""
    n_kv_head: int | None = None
    """Key/value heads (grouped-query attention); None means n_head."""
    tie_weights: bool = True
    """transformers' tie_word_embeddings."""
    weights: str = ""
    """A save_pretrained directory loaded into the model at build time ("" = initialise)."""
    hf_config: str = ""
    """``model.hf_config``: the architecture's other keys (a config.json path or inline JSON)."""
    dropout: float = 0.0  # the keys the trainer reads of any model config: hf models are dense
    experts: int = 0
    top_k: int = 1

    @property
    def generic(self) -> bool:
        """Driven through the layers' own forward (any architecture but plait's own two, and those
        two when model.hf_config gives keys plait's blocks would not honour)."""
        return self.arch not in OWN_BLOCKS or bool(self.hf_config)

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
        if self.generic:
            return _meta_counts(self)[0]
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
        if self.generic:  # the decoder layers' Linear weights, counted on the meta device
            per_layer = _meta_counts(self)[1] / self.n_layer
        elif self.arch == "gpt2":
            per_layer = 4 * d * d + 2 * d * f
        else:
            per_layer = 2 * d * self.n_head * hd + 2 * d * self.kv_heads * hd + 3 * d * f
        matmuls = self.n_layer * per_layer + d * self.vocab_size
        return float(6 * matmuls + 12 * self.n_layer * self.seq_len * d)

    def to_hf_config(self):
        """The transformers config of these sizes (sdpa attention, no dropout)."""
        if self.generic:
            return _generic_config(self)
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


def default_hf_config(arch: str):
    """transformers' default config of `arch` (its class's defaults)."""
    from transformers import AutoConfig

    return AutoConfig.for_model(arch)


def _generic_config(c: HFConfig):
    """`c` as the config of its architecture: model.hf_config's keys, then plait's sizes over them
    (the keys the default config has), every dropout 0, token ids outside the vocabulary unset."""
    from transformers import AutoConfig

    base = read_hf_config(c.hf_config)
    for key in ("model_type", "dtype", "torch_dtype"):  # parameters are fp32 (train.bf16 is autocast)
        base.pop(key, None)
    default = default_hf_config(c.arch)
    sizes = {
        "num_hidden_layers": c.n_layer,
        "num_attention_heads": c.n_head,
        "hidden_size": c.d_model,
        "vocab_size": c.vocab_size,
        "tie_word_embeddings": c.tie_weights,
    }
    if hasattr(default, "intermediate_size"):
        sizes["intermediate_size"] = c.ff_dim
    if hasattr(default, "num_key_value_heads"):
        sizes["num_key_value_heads"] = c.kv_heads
    if "head_dim" not in base and getattr(default, "head_dim", None) is not None:  # follow d_model
        sizes["head_dim"] = c.head_dim
    if not c.hf_config or "max_position_embeddings" not in base:
        sizes["max_position_embeddings"] = c.seq_len
    if isinstance(base.get("layer_types"), list):  # one per layer: the first n_layer of the file's
        base["layer_types"] = base["layer_types"][: c.n_layer]
    keys = {**base, **sizes}
    unset = {}  # token ids outside the vocabulary (the defaults of a larger one), where the config allows
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        token = keys.get(name, getattr(default, name, None))
        if isinstance(token, int) and not 0 <= token < c.vocab_size:
            unset[name] = None
    try:
        try:
            cfg = AutoConfig.for_model(c.arch, **keys, **unset, attn_implementation="sdpa")
        except Exception:
            cfg = AutoConfig.for_model(c.arch, **keys, attn_implementation="sdpa")
    except Exception as exc:  # transformers' own validation of the keys
        reason = " ".join(str(exc).split())[:300]
        raise ConfigError(
            f"model.source = 'hf:{c.arch}': transformers refuses the config ({reason})"
        ) from None
    for name, value in cfg.to_dict().items():  # hf models train without dropout (plait's rule)
        if ("dropout" in name or "pdrop" in name) and isinstance(value, float):
            setattr(cfg, name, 0.0)
    return cfg


@functools.lru_cache(maxsize=32)
def _meta_counts_of(key: tuple) -> tuple[int, int]:
    c = HFConfig(**dict(key))
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(c.to_hf_config())
    distinct = {id(p): p.numel() for p in hf.parameters()}
    root = getattr(hf, hf.base_model_prefix)
    layers = root.get_submodule("layers") if hasattr(root, "layers") else root
    matmul = sum(m.weight.numel() for m in layers.modules() if isinstance(m, nn.Linear))
    return sum(distinct.values()), matmul


def _meta_counts(c: HFConfig) -> tuple[int, int]:
    """(distinct parameters, decoder-layer Linear weights) of the model `c` builds, on the meta device."""
    return _meta_counts_of(tuple(sorted(vars(c).items())))

"""The model a run's `[model]` keys describe: the named size with the overrides applied.

`cfg` is a run's configuration (`plait.train.config.Config`), read by its sections' field names
only, so plait.models depends on no training code.
"""

from __future__ import annotations

from plait.data.tokenizer import tokenizer_vocab_size
from plait.models.gpt import GPTConfig, gpt_config
from plait.models.hf_config import HF_KEYS, HFConfig, default_hf_config, read_hf_config

SIZE_KEYS = ("n_layer", "n_head", "d_model", "seq_len", "vocab_size")
MOE_KEYS = ("experts", "moe_every", "top_k", "capacity_factor", "aux_loss_coef", "z_loss_coef")


def model_config(cfg) -> GPTConfig | HFConfig:
    """The model config the run builds: the named size with the overrides applied (the vocabulary,
    when not set, follows a tokenizer other than bytes; for a Hugging Face source, its
    `plait.models.hf.HFConfig`: the same size fields, read the same way)."""
    m = cfg.model
    if m.source.startswith("hf:"):
        return hf_model_config(cfg)
    overrides = {k: getattr(m, k) for k in (*SIZE_KEYS, "d_ff") if getattr(m, k) is not None}
    if m.vocab_size is None and cfg.data.tokenizer != "bytes":
        overrides["vocab_size"] = tokenizer_vocab_size(cfg.data)
    moe = {k: getattr(m, k) for k in MOE_KEYS}
    return gpt_config(m.name, dropout=m.dropout, tie_weights=m.tie_weights, **overrides, **moe)


def hf_model_config(cfg) -> HFConfig:
    """The `HFConfig` of an hf source: each size key as set, else (with ``model.hf_config``) the
    file's value, else the named size's; the vocabulary, when not set, follows a tokenizer other
    than bytes."""
    m = cfg.model
    arch = m.source.removeprefix("hf:")
    base = gpt_config(m.name)
    sizes = {k: getattr(m, k) if getattr(m, k) is not None else getattr(base, k) for k in SIZE_KEYS}
    extra = {"d_ff": m.d_ff, "n_kv_head": m.n_kv_head}
    if m.hf_config:  # the file's sizes where [model] sets none (seq_len stays plait's)
        given = read_hf_config(m.hf_config)
        aliases = default_hf_config(arch).attribute_map if given else {}  # e.g. hidden_size -> n_embd
        for key, hf_key in HF_KEYS.items():
            value = given.get(hf_key, given.get(aliases.get(hf_key, hf_key)))
            if getattr(m, key) is None and isinstance(value, int):
                (sizes if key in sizes else extra)[key] = value
    if m.vocab_size is None and cfg.data.tokenizer != "bytes":  # the vocabulary follows the tokenizer
        sizes["vocab_size"] = tokenizer_vocab_size(cfg.data)
    return HFConfig(
        arch=arch,
        tie_weights=m.tie_weights,
        weights=m.weights,
        hf_config=m.hf_config,
        **extra,
        **sizes,
    )

"""Where the model of a run comes from: `[model] source` -> `build_model(cfg)`.

* ``"plait"``: plait's GPT (`plait.models.gpt`) of ``model.name`` with the size overrides;
* ``"hf:gpt2"``, ``"hf:llama"``: transformers' GPT2LMHeadModel / LlamaForCausalLM built from its
  config class with plait's size keys (no download), optionally loaded from ``model.weights``,
  wrapped in `plait.models.hf.HFCausalLM`;
* ``"python:PKG.MODULE:FUNC"``: a user's factory (`plait.models.python_source`).

`validate_source` is called by `plait.train.config.validate`, in the launching process: it refuses
an unknown source, a missing transformers, keys that do not apply to the source, heads (and
key/value heads) that do not divide tp, and a weights directory that is missing or does not fit
the model. Which of plait's features a source cannot take is data in the table of combinations
(`plait.combinations.SOURCE_LIMITS`), which plait.layout checks with the other rows.
"""

from __future__ import annotations

import importlib.util

import torch

from plait.errors import ConfigError
from plait.models.gpt import GPT
from plait.models.hf import build_hf, hf_model_class
from plait.models.hf_weights import check_weights, weights_file
from plait.models.python_source import build_python_model, model_args
from plait.models.resolve import hf_model_config, model_config

HF_SOURCES = ("hf:gpt2", "hf:llama")
SOURCES = ("plait", *HF_SOURCES, "python:PKG.MODULE:FUNC")


def source_kind(source: str) -> str:
    """'plait', 'hf' or 'python': the kind of a model.source (the combination table's feature)."""
    return source.partition(":")[0] if source.startswith(("hf:", "python:")) else "plait"


def is_hf(cfg) -> bool:
    return cfg.model.source in HF_SOURCES


def build_model(cfg):
    """The run's model, initialised under the current torch seed (every rank builds the same)."""
    source = cfg.model.source
    if source == "plait":
        return GPT(model_config(cfg))
    if source in HF_SOURCES:
        return build_hf(hf_model_config(cfg))
    if source.startswith("python:"):
        return build_python_model(source, model_args(cfg))
    raise ConfigError(f"model.source = {source!r} is unknown; valid: {', '.join(SOURCES)}")


def _refuse_hf_keys(m) -> None:
    """n_kv_head and weights are hf keys: a plait or python: source refuses them."""
    for key, value in (("n_kv_head", m.n_kv_head), ("weights", m.weights)):
        if value in (None, ""):
            continue
        if m.source.startswith("python:"):
            raise ConfigError(
                f"model.{key} = {value!r} applies to hf sources only; a python: factory builds its "
                f"own model: remove model.{key}"
            )
        raise ConfigError(
            f"model.{key} = {value!r} applies to hf sources only; set model.source = 'hf:llama' "
            f"{'or hf:gpt2 ' if key == 'weights' else ''}or remove model.{key}"
        )


def validate_source(cfg) -> None:
    """The checks of `[model] source` and the hf keys (module docstring); the rest of the model's
    keys are `validate`'s, the python: factory's own `python_source.check_source`'s."""
    m, p = cfg.model, cfg.parallel
    if not m.source.startswith("python:") and m.source != "plait" and m.source not in HF_SOURCES:
        raise ConfigError(f"model.source = {m.source!r} is unknown; valid: {', '.join(SOURCES)}")
    if m.source not in HF_SOURCES:
        _refuse_hf_keys(m)
        return
    if importlib.util.find_spec("transformers") is None:
        raise ConfigError(
            f"model.source = {m.source!r} needs the transformers package: pip install plait[hf]"
        )
    c = hf_model_config(cfg)
    if c.arch == "gpt2" and m.n_kv_head not in (None, c.n_head):
        raise ConfigError(
            f"model.n_kv_head = {m.n_kv_head} does not apply to hf:gpt2 (no grouped-query attention); "
            "remove it or use model.source = 'hf:llama'"
        )
    if c.n_head < 1 or c.d_model % c.n_head:
        raise ConfigError(f"model.d_model = {c.d_model} is not divisible by model.n_head = {c.n_head}")
    if c.kv_heads < 1 or c.n_head % c.kv_heads:
        divisors = [k for k in range(1, c.n_head + 1) if c.n_head % k == 0]
        raise ConfigError(
            f"model.n_kv_head = {c.kv_heads} does not divide model.n_head = {c.n_head}; valid: {divisors}"
        )
    if c.arch == "llama" and c.head_dim % 2:
        raise ConfigError(f"hf:llama: the head size d_model / n_head = {c.head_dim} must be even (rotary)")
    if c.n_head % p.tp:
        raise ConfigError(
            f"model.n_head = {c.n_head} is not divisible by parallel.tp = {p.tp}: each tensor-parallel rank "
            "holds whole heads; choose n_head a multiple of tp"
        )
    if c.kv_heads % p.tp:
        raise ConfigError(
            f"model.n_kv_head = {c.kv_heads} is not divisible by parallel.tp = {p.tp}: each tensor-parallel "
            "rank holds whole key/value heads; choose n_kv_head a multiple of tp"
        )
    if c.weights:
        weights_file(c.weights)  # the directory and its file exist; shapes are checked below
        _check_weight_shapes(c)


def _check_weight_shapes(c) -> None:
    """The weights file's names and shapes against the configured model, built on the meta device."""
    with torch.device("meta"):
        hf = hf_model_class(c.arch)(c.to_hf_config())
    check_weights(hf, c.weights)

"""Where the model of a run comes from: `[model] source` -> `build_model(cfg)`.

* ``"plait"``: plait's GPT (`plait.models.gpt`) of ``model.name`` with the size overrides;
* ``"hf:ARCH"``: transformers' causal LM of model_type ARCH (``hf:gpt2``, ``hf:llama``,
  ``hf:gpt_neox``, ``hf:mistral``, ``hf:qwen2``, ...) built from its config class with plait's size
  keys and ``model.hf_config`` (no download), optionally loaded from ``model.weights``, wrapped in
  `plait.models.hf.HFCausalLM`;
* ``"python:PKG.MODULE:FUNC"``: a user's factory (`plait.models.python_source`).

`validate_source` is called by `plait.train.config.validate`, in the launching process: it refuses
an unknown source, a missing transformers, keys that do not apply to the source, heads (and
key/value heads) that do not divide tp, and a weights directory that is missing or does not fit
the model. For an architecture on the generic path it also builds the model on the meta device to
find its parts and map its tensor-parallel plan (each split must divide tp), refuses sequence
parallelism and a sliding window shorter than the sequence, and checks on a 2-layer copy that
plait's layer-by-layer forward gives the model's own logits (`plait.models.hf.driving_error`).
Which of plait's features a source cannot take is data in the table of combinations
(`plait.combinations.SOURCE_LIMITS`), which plait.layout checks with the other rows.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import warnings

import torch
from torch import nn

from plait.errors import ConfigError
from plait.models.gpt import GPT
from plait.models.hf import HFCausalLM, build_hf, driving_error, hf_model_class
from plait.models.hf_config import causal_lm_types, default_hf_config
from plait.models.hf_parallel import plan_warning
from plait.models.hf_weights import check_weights, weights_file
from plait.models.python_source import build_python_model, model_args
from plait.models.resolve import hf_model_config, model_config
from plait.tp_plan import Colwise, Rowwise, VocabEmbedding, VocabHead

HF_SOURCES = ("hf:gpt2", "hf:llama", "hf:<causal LM model_type: gpt_neox, mistral, qwen2, ...>")
SOURCES = ("plait", *HF_SOURCES, "python:PKG.MODULE:FUNC")
TESTED = ("gpt2", "llama", "gpt_neox", "mistral", "qwen2")
"""The architectures tests/test_hf_models.py trains under every layout (docs/your-model.md)."""
DRIVING_TOLERANCE = 1e-4
"""The largest logit difference from the model's own forward the generic path may show (fp32)."""
DRIVING_CHECK_PARAMS = 50_000_000
"""Above this many parameters (of the 2-layer copy) the driving check is left out: too slow to build."""


def source_kind(source: str) -> str:
    """'plait', 'hf' or 'python': the kind of a model.source (the combination table's feature)."""
    return source.partition(":")[0] if source.startswith(("hf:", "python:")) else "plait"


def is_hf(cfg) -> bool:
    return cfg.model.source.startswith("hf:")


def build_model(cfg):
    """The run's model, initialised under the current torch seed (every rank builds the same)."""
    source = cfg.model.source
    if source == "plait":
        return GPT(model_config(cfg))
    if source.startswith("hf:"):
        return build_hf(hf_model_config(cfg))
    if source.startswith("python:"):
        return build_python_model(source, model_args(cfg))
    raise ConfigError(f"model.source = {source!r} is unknown; valid: {', '.join(SOURCES)}")


def _refuse_hf_keys(m) -> None:
    """n_kv_head, weights and hf_config are hf keys: a plait or python: source refuses them."""
    for key, value in (("n_kv_head", m.n_kv_head), ("weights", m.weights), ("hf_config", m.hf_config)):
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
    if not m.source.startswith(("python:", "hf:")) and m.source != "plait":
        raise ConfigError(f"model.source = {m.source!r} is unknown; valid: {', '.join(SOURCES)}")
    if not m.source.startswith("hf:"):
        _refuse_hf_keys(m)
        return
    if importlib.util.find_spec("transformers") is None:
        raise ConfigError(
            f"model.source = {m.source!r} needs the transformers package: pip install plait[hf]"
        )
    arch = m.source.removeprefix("hf:")
    if arch not in causal_lm_types():
        raise ConfigError(f"model.source = {m.source!r} is unknown; valid: {', '.join(SOURCES)}")
    if arch == "gpt2" and m.hf_config:
        raise ConfigError(
            f"model.hf_config = {m.hf_config!r} does not apply to hf:gpt2 (plait's own GPT-2 block reads "
            "the size keys only): remove it"
        )
    c = hf_model_config(cfg)
    gqa = arch == "llama" or hasattr(default_hf_config(arch), "num_key_value_heads")
    if not gqa and m.n_kv_head not in (None, c.n_head):
        raise ConfigError(
            f"model.n_kv_head = {m.n_kv_head} does not apply to hf:{arch} (no grouped-query attention); "
            "remove it or use model.source = 'hf:llama'"
        )
    if c.n_head < 1 or c.d_model % c.n_head:
        raise ConfigError(f"model.d_model = {c.d_model} is not divisible by model.n_head = {c.n_head}")
    if c.kv_heads < 1 or c.n_head % c.kv_heads:
        divisors = [k for k in range(1, c.n_head + 1) if c.n_head % k == 0]
        raise ConfigError(
            f"model.n_kv_head = {c.kv_heads} does not divide model.n_head = {c.n_head}; valid: {divisors}"
        )
    if arch == "llama" and c.head_dim % 2:
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
    if c.generic:
        _check_generic(c, p)
    if c.weights:
        weights_file(c.weights)  # the directory and its file exist; shapes are checked below
        _check_weight_shapes(c)


def _check_generic(c, p) -> None:
    """What the generic path needs (module docstring), checked on the meta device and a 2-layer copy."""
    where = f"model.source = 'hf:{c.arch}'"
    if p.sequence_parallel:
        raise ConfigError(
            f"parallel.sequence_parallel = true is not available with {where}: plait drives this "
            "architecture's own decoder layers, whose attention reads the sequence length of its input "
            "(only hf:llama and hf:gpt2 run on plait's blocks); set parallel.sequence_parallel = false"
        )
    hf_cfg = c.to_hf_config()
    window = getattr(hf_cfg, "sliding_window", None)
    types = getattr(hf_cfg, "layer_types", None) or ["sliding_attention"]
    if (
        isinstance(window, int)
        and window < c.seq_len
        and getattr(hf_cfg, "use_sliding_window", True) is not False
        and "sliding_attention" in types
    ):
        raise ConfigError(
            f"{where}: sliding_window = {window} is shorter than model.seq_len = {c.seq_len}, and plait's "
            "attention is causal over the whole sequence: set sliding_window >= seq_len (or null) in "
            "model.hf_config, or model.seq_len <= sliding_window"
        )
    limit = getattr(hf_cfg, "max_position_embeddings", None)
    if isinstance(limit, int) and limit < c.seq_len:
        raise ConfigError(
            f"{where}: model.seq_len = {c.seq_len} exceeds the config's max_position_embeddings = {limit}"
        )
    with torch.device("meta"):
        model = _attempt(where, "building it", lambda: HFCausalLM(hf_model_class(c.arch)(hf_cfg), c))
    if p.tp > 1:
        _check_plan(model, p.tp)
        warning = plan_warning(c, hf_cfg)
        if warning:
            warnings.warn(warning, stacklevel=2)
    small = sum(x.numel() for x in model.parameters()) * min(c.n_layer, 2) / max(c.n_layer, 1)
    if small <= DRIVING_CHECK_PARAMS:
        err = _attempt(where, "running a 2-layer copy", lambda: driving_error(c))
        if not err <= DRIVING_TOLERANCE:
            raise ConfigError(
                f"{where}: plait's layer-by-layer forward does not reproduce {type(model.root).__name__}'s "
                f"own logits (max difference {err:.3g} on a 2-layer copy; its forward does more than "
                "embeddings, layers and final norm): train it through a python: factory (docs/your-model.md)"
            )


def _attempt(where: str, what: str, fn):
    """fn(), with any failure of transformers' code one ConfigError that names the source."""
    try:
        return fn()
    except ConfigError:
        raise
    except Exception as exc:
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        raise ConfigError(
            f"{where}: {what} failed ({reason}): this architecture is not driven by plait's generic path; "
            "train it through a python: factory (docs/your-model.md)"
        ) from None


_TARGETS = {Colwise: nn.Linear, Rowwise: nn.Linear, VocabEmbedding: nn.Embedding, VocabHead: nn.Linear}


def _check_plan(model: nn.Module, tp: int) -> None:
    """The model's plan fits it (a ConfigError naming the module, before any rank starts): every
    pattern names a module, of the kind its style splits, whose split features divide by tp."""
    what = f"model.source = 'hf:{model.cfg.arch}' with parallel.tp = {tp}"
    names = [n for n, _ in model.named_modules() if n]
    for pattern, style in model.tp_plan().items():
        matched = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not matched:
            raise ConfigError(
                f"{what}: the tensor-parallel plan names {pattern}, which is no module of the model (a "
                "parameter, e.g. of fused experts, is not split by plait): set parallel.tp = 1"
            )
        kind = _TARGETS.get(type(style))
        for name in matched if kind is not None else ():
            m = model.get_submodule(name)
            if not isinstance(m, kind):
                raise ConfigError(
                    f"{what}: {name} is a {type(m).__name__}, but its split ({type(style).__name__}) takes "
                    f"an nn.{kind.__name__}: set parallel.tp = 1"
                )
            if isinstance(style, Colwise | Rowwise):
                features = m.out_features if isinstance(style, Colwise) else m.in_features
                if features % tp:
                    which = "output" if isinstance(style, Colwise) else "input"
                    raise ConfigError(
                        f"{what}: {name} has {features} {which} features, not divisible by tp (choose "
                        "model.d_ff and d_model multiples of tp)"
                    )


def _check_weight_shapes(c) -> None:
    """The weights file's names and shapes against the configured model, built on the meta device."""
    with torch.device("meta"):
        hf = hf_model_class(c.arch)(c.to_hf_config())
    check_weights(hf, c.weights)

"""Weights of Hugging Face models: `model.weights = DIR` (a ``save_pretrained`` directory loaded
into the model at build time) and the export of a run as such a directory.

A directory holds ``model.safetensors`` (one file; sharded checkpoints are not read yet) in
transformers' names and layouts. Loading checks every tensor's name and shape against the model
the config describes before copying anything; a tied head may be absent from the file (transformers
saves a tie once). The export writes ``config.json`` and ``model.safetensors`` through transformers'
own ``save_pretrained``, so ``AutoModelForCausalLM.from_pretrained(DIR)`` loads it directly.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from plait.errors import ConfigError
from plait.models.hf_blocks import hf_model_class, hf_state_from

WEIGHTS_FILE = "model.safetensors"


def weights_file(path: str | Path) -> Path:
    """DIR/model.safetensors, or a ConfigError saying what is missing."""
    d = Path(path)
    if not d.is_dir():
        raise ConfigError(
            f"model.weights = {str(path)!r}: no such directory (give a save_pretrained directory, e.g. "
            "one written by plait export of an hf run)"
        )
    f = d / WEIGHTS_FILE
    if not f.is_file():
        found = ", ".join(sorted(p.name for p in d.iterdir())[:6]) or "nothing"
        raise ConfigError(
            f"model.weights = {str(path)!r} holds no {WEIGHTS_FILE} (found: {found}); "
            "sharded checkpoints are not read: save with save_pretrained(..., max_shard_size='100GB')"
        )
    return f


def _renamer(hf_model):
    """name in the file -> name in the model, by the renamings transformers applies when loading."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
    except ImportError:  # a transformers without conversion mappings: names are the model's
        return lambda key: key
    transforms = get_model_conversion_mapping(hf_model)
    converting = [t for t in transforms if not isinstance(t, WeightRenaming)]

    def rename(key: str) -> str:
        for t in transforms:
            if isinstance(t, WeightRenaming):
                key, _ = t.rename_source_key(key)
        return key

    if converting:
        sources = ", ".join(str(p) for t in converting[:2] for p in t.source_patterns[:2])
        raise ConfigError(
            f"model.weights: transformers converts the tensors of {type(hf_model).__name__} when loading "
            f"({sources}), which plait's loader does not: load it with from_pretrained in a python: factory"
        )
    return rename


def _expected(hf_model) -> tuple[dict[str, tuple], set[str]]:
    """{name: shape} of every state entry and the names that may be absent (a tie's second name)."""
    shapes = {k: tuple(v.shape) for k, v in hf_model.state_dict().items()}
    seen, optional = {}, set()
    for name, p in hf_model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            optional.add(name)
        seen.setdefault(id(p), name)
    return shapes, optional


def check_weights(hf_model, path: str | Path) -> None:
    """The file's names and shapes are those of `hf_model` (read from the header only)."""
    f = weights_file(path)
    rename = _renamer(hf_model)
    try:
        with safe_open(str(f), framework="pt") as fh:
            have = {rename(k): tuple(fh.get_slice(k).get_shape()) for k in fh.keys()}
    except Exception as exc:
        raise ConfigError(f"model.weights: {f} is not a readable safetensors file ({exc})") from None
    want, optional = _expected(hf_model)
    missing = sorted(set(want) - set(have) - optional)
    unknown = sorted(set(have) - set(want))
    wrong = [f"{k} {have[k]} (model: {want[k]})" for k in sorted(set(have) & set(want)) if have[k] != want[k]]
    if missing or unknown or wrong:
        parts = [
            f"missing {', '.join(missing[:3])}" if missing else "",
            f"unknown {', '.join(unknown[:3])}" if unknown else "",
            f"shape {', '.join(wrong[:3])}" if wrong else "",
        ]
        what = "; ".join(p for p in parts if p)
        raise ConfigError(
            f"model.weights = {str(path)!r} does not fit the configured model ({what}): "
            "set model.source and the size keys (n_layer, n_head, n_kv_head, d_model, d_ff, seq_len, "
            "vocab_size, tie_weights) to those the weights were trained with"
        )


def load_weights(hf_model, path: str | Path) -> None:
    """Copy the weights of DIR into `hf_model` (a transformers model), names and shapes checked."""
    check_weights(hf_model, path)
    rename = _renamer(hf_model)
    state = {rename(k): v for k, v in load_file(str(weights_file(path))).items()}
    params = dict(hf_model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for k, v in state.items():
            params[k].copy_(v) if k in params else hf_model.get_buffer(k).copy_(v)


def save_hf(cfg, state: dict[str, torch.Tensor], out: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write `state` (plait's layout of an hf model of config `cfg`, transformers' names) as a
    save_pretrained directory at `out`: config.json and model.safetensors."""
    hf = hf_model_class(cfg.arch)(cfg.to_hf_config())
    hf.load_state_dict(hf_state_from(cfg.arch, state), strict=True)
    hf.to(dtype)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(out))
    return out

"""Where the pieces of a transformers causal LM are, and how plait drives its decoder layers.

`Parts` names them: the base model (``model``, ``transformer``, ``gpt_neox``: the attribute
``base_model_prefix`` names), the modules the tokens go through before the layers (embeddings,
an embedding dropout), the ModuleList of decoder layers, the final norm, the output layer and the
rotary embedding the layers share. GPT-2's and Llama's are fixed (`OWN_PARTS`: plait's own blocks
drive their layers); any other architecture's are read from its config's ``base_model_pp_plan``
(transformers' own record of that order, for its pipeline support) by `find_parts`.

`run_layers` is the generic path's loop, what the base model's ``forward`` does between the
embeddings and the final norm when no mask, cache or padding is involved: the rotary embedding of
positions ``0..T-1`` once, then each layer called with ``attention_mask=None`` (transformers' sdpa
attention is then causal: ``is_causal`` when there is no mask). `driving_error` compares the whole
of it with the model's own ``forward`` on a few tokens, so an architecture whose forward does more
(a scaled embedding outside its module, a sliding window, per-layer masks) is refused, not trained
as a different function (`plait.models.hf.driving_error`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from plait.context_parallel import positions
from plait.errors import ConfigError


@dataclass(frozen=True)
class Parts:
    root: str
    """The wrapper's attribute holding the base model (transformers' base_model_prefix)."""
    first: tuple[str, ...]
    """The base model's modules the tokens pass before the layers, in order (the embedding first)."""
    layers: str
    """The base model's ModuleList of decoder layers."""
    last: str
    """The base model's final norm."""
    head: str = "lm_head"
    """The wrapper's attribute holding the output layer."""
    rotary: str | None = None
    """The base model's rotary embedding, computed once per forward and given to every layer
    (generic path only; plait's Llama block computes its own)."""

    @property
    def embedding(self) -> str:
        """The token embedding, by its name in the base model."""
        return self.first[0]


OWN_PARTS = {
    "gpt2": Parts("transformer", ("wte", "wpe", "drop"), "h", "ln_f"),
    "llama": Parts("model", ("embed_tokens",), "layers", "norm"),
}


def find_parts(hf_model: nn.Module, arch: str) -> Parts:
    """The `Parts` of a transformers causal LM from its config's base_model_pp_plan (module
    docstring); a ConfigError says why an architecture cannot be driven so."""
    plan = getattr(hf_model.config, "base_model_pp_plan", None)
    what = f"model.source = 'hf:{arch}'"
    if not plan:
        raise ConfigError(
            f"{what}: transformers declares no base_model_pp_plan for {type(hf_model).__name__} (the order "
            "of its embeddings, decoder layers and final norm, by which plait drives it): train it through "
            "a python: factory (docs/your-model.md)"
        )
    prefix = hf_model.base_model_prefix
    root = getattr(hf_model, prefix, None)
    names = list(plan)
    lists = [n for n in names if isinstance(getattr(root, n, None), nn.ModuleList)]
    if root is None or len(lists) != 1 or names.index(lists[0]) == 0 or names[-1] == lists[0]:
        raise ConfigError(
            f"{what}: its base_model_pp_plan {names} is not embeddings, one list of decoder layers and a "
            "final norm: train it through a python: factory (docs/your-model.md)"
        )
    i = names.index(lists[0])
    if len(names) != i + 2:
        raise ConfigError(f"{what}: more than a final norm after the decoder layers ({names[i + 1 :]})")
    out = hf_model.get_output_embeddings()
    heads = [n for n, m in hf_model.named_children() if m is out]
    if len(heads) != 1 or not isinstance(out, nn.Linear):
        raise ConfigError(f"{what}: no output layer (an nn.Linear child of {type(hf_model).__name__}) found")
    rotary = "rotary_emb" if isinstance(getattr(root, "rotary_emb", None), nn.Module) else None
    return Parts(prefix, tuple(names[:i]), names[i], names[i + 1], heads[0], rotary)


def embed(cfg, parts: Parts, root: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    """The first stage's work: the tokens through `parts.first` in order (GPT-2: token plus
    learned position embeddings, then its dropout)."""
    if cfg.arch == "gpt2" and not cfg.generic:
        pos = positions(idx.shape[1], idx.device)  # this rank's own under context parallelism
        return root.drop(root.wte(idx) + root.wpe(pos))
    x = idx
    for name in parts.first:
        x = getattr(root, name)(x)
    return x


def run_layers(cfg, parts: Parts, root: nn.Module, layers, x: torch.Tensor) -> torch.Tensor:
    """`x` (B, T, d) through decoder `layers`: plait's own blocks take it alone; transformers'
    layers (the generic path, module docstring) positions 0..T-1, their rotary embedding computed
    once, and no mask (causal attention)."""
    if not cfg.generic:
        for layer in layers:
            x = layer(x)
        return x
    positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
    kwargs = {"attention_mask": None, "position_ids": positions}
    if parts.rotary is not None:
        kwargs["position_embeddings"] = getattr(root, parts.rotary)(x, positions)
    for layer in layers:
        out = layer(x, **kwargs)
        x = out[0] if isinstance(out, tuple) else out
    return x

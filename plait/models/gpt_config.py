"""The sizes and switches of plait's GPT (`GPTConfig`) and its named sizes (`gpt_config`).

A module of its own: the planner, the estimator's callers and the config parser read a model's
sizes without building (or importing) the model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from plait.errors import ConfigError


@dataclass
class GPTConfig:
    """Sizes and switches of a :class:`GPT` model."""

    vocab_size: int = 256
    """Number of token ids; 256 for the byte-level corpora of plait.data."""
    seq_len: int = 128
    """Longest context the model accepts (rows of the position embedding)."""
    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide d_model."""
    d_model: int = 128
    """Hidden size h."""
    d_ff: int | None = None
    """Inner size of the MLP; None means 4 * d_model as in GPT-2."""
    dropout: float = 0.0
    """Dropout on embeddings, attention probabilities and residual branches."""
    tie_weights: bool = True
    """Share lm_head.weight with wte.weight."""
    bias: bool = True
    """Biases in the linear layers and LayerNorms."""
    experts: int = 0
    """Experts per mixture-of-experts layer; 0 = a dense model (plait.moe)."""
    moe_every: int = 2
    """With experts: every moe_every-th block (the 2nd, 4th, ... for 2) has a MoE layer as its MLP."""
    top_k: int = 2
    """Experts per token: 1 (Switch) or 2 (GShard)."""
    capacity_factor: float = 1.25
    """Expert capacity per group of one sequence: ceil(top_k x factor x seq_len / experts); 0 = dropless."""
    aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss (Switch's alpha), per MoE layer."""
    z_loss_coef: float = 0.001
    """Weight of the router z-loss (ST-MoE), per MoE layer."""

    def __post_init__(self) -> None:
        for field in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"GPTConfig.{field} must be a positive integer, got {value!r}")
        if self.d_ff is not None and (not isinstance(self.d_ff, int) or self.d_ff < 1):
            raise ConfigError(f"GPTConfig.d_ff must be a positive integer or None, got {self.d_ff!r}")
        if self.d_model % self.n_head:
            divisors = [n for n in range(1, self.d_model + 1) if self.d_model % n == 0 and n <= 64]
            raise ConfigError(
                f"GPTConfig.n_head={self.n_head} does not divide d_model={self.d_model}; "
                f"choose n_head from {divisors} or change d_model"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")
        if not isinstance(self.experts, int) or self.experts < 0:
            raise ConfigError(f"GPTConfig.experts must be an integer >= 0 (0 = dense), got {self.experts!r}")
        if self.experts:
            if self.top_k not in (1, 2) or self.top_k > self.experts:
                raise ConfigError(
                    f"GPTConfig.top_k = {self.top_k} is not valid with {self.experts} experts; valid: 1, 2 "
                    "(and at most experts)"
                )
            if self.capacity_factor < 0:
                raise ConfigError(
                    f"GPTConfig.capacity_factor must be >= 0 (0 = dropless), got {self.capacity_factor}"
                )
            if not isinstance(self.moe_every, int) or self.moe_every < 1:
                raise ConfigError(f"GPTConfig.moe_every must be a positive integer, got {self.moe_every!r}")
            if self.aux_loss_coef < 0 or self.z_loss_coef < 0:
                raise ConfigError("GPTConfig.aux_loss_coef and z_loss_coef must be >= 0")

    def is_moe(self, layer: int) -> bool:
        """Whether block `layer` (0-based) has a mixture-of-experts MLP."""
        return self.experts > 0 and (layer + 1) % self.moe_every == 0

    @property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe(i) for i in range(self.n_layer))

    @property
    def ff_dim(self) -> int:
        """The MLP inner size actually used."""
        return self.d_ff if self.d_ff is not None else 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def n_params(self) -> int:
        """Exact number of distinct parameters that ``GPT(self)`` creates (tied weights once)."""
        d, f, b = self.d_model, self.ff_dim, int(self.bias)
        layer_norm = d + b * d
        mlp = (d * f + b * f) + (f * d + b * d)  # mlp.fc, mlp.proj (one expert's, with experts)
        block = (
            2 * layer_norm
            + (d * 3 * d + b * 3 * d)  # attn.qkv
            + (d * d + b * d)  # attn.proj
            + mlp
        )
        moe = self.n_moe_layers * ((self.experts - 1) * mlp + d * self.experts)  # more experts, router
        embeddings = self.vocab_size * d + self.seq_len * d
        head = 0 if self.tie_weights else self.vocab_size * d
        return embeddings + self.n_layer * block + moe + layer_norm + head


# Named sizes, kept as constructor arguments so that every call hands out a fresh config.
# "3m" and "20m" are byte-level models sized for CPU and single-GPU runs; the gpt2* rows are
# the four GPT-2 sizes (Radford et al. 2019, Table 2) with the 50257-token BPE vocabulary.
_PRESETS: tuple[tuple[str, tuple[tuple[str, int], ...]], ...] = (
    ("tiny", (("vocab_size", 256), ("seq_len", 32), ("n_layer", 2), ("n_head", 2), ("d_model", 32))),
    ("small", (("vocab_size", 256), ("seq_len", 128), ("n_layer", 4), ("n_head", 4), ("d_model", 128))),
    ("3m", (("vocab_size", 256), ("seq_len", 256), ("n_layer", 4), ("n_head", 4), ("d_model", 256))),
    ("20m", (("vocab_size", 256), ("seq_len", 512), ("n_layer", 6), ("n_head", 8), ("d_model", 512))),
    ("gpt2", (("vocab_size", 50257), ("seq_len", 1024), ("n_layer", 12), ("n_head", 12), ("d_model", 768))),
    (
        "gpt2-medium",
        (("vocab_size", 50257), ("seq_len", 1024), ("n_layer", 24), ("n_head", 16), ("d_model", 1024)),
    ),
    (
        "gpt2-large",
        (("vocab_size", 50257), ("seq_len", 1024), ("n_layer", 36), ("n_head", 20), ("d_model", 1280)),
    ),
    (
        "gpt2-xl",
        (("vocab_size", 50257), ("seq_len", 1024), ("n_layer", 48), ("n_head", 25), ("d_model", 1600)),
    ),
)

GPT_CONFIG_NAMES: tuple[str, ...] = tuple(name for name, _ in _PRESETS)


def gpt_config(name: str, **overrides) -> GPTConfig:
    """A fresh :class:`GPTConfig` of the named size, with any field overridden.

    >>> gpt_config("tiny", dropout=0.1).n_layer
    2
    """
    presets = dict(_PRESETS)
    if name not in presets:
        raise ConfigError(f"unknown model config {name!r}; valid names: {', '.join(GPT_CONFIG_NAMES)}")
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ConfigError(f"unknown GPTConfig field(s) {unknown}; valid fields: {sorted(fields)}")
    return GPTConfig(**{**dict(presets[name]), **overrides})

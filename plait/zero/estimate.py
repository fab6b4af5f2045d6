"""Per-device memory of ZeRO training, from the formulas rather than from a run.

Model states follow the accounting of ZeRO (Rajbhandari et al. 2019, "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models", §3.1 and Figure 1). Ψ parameters trained with
mixed-precision Adam hold 2Ψ bytes of fp16/bf16 parameters, 2Ψ bytes of gradients and KΨ bytes
of optimizer state with K = 12 (fp32 master copy, momentum, variance), 16Ψ in all. Sharded over
N data-parallel ranks:

======================  ================================
baseline (stage 0)      (2 + 2 + K) Ψ
P_os     (stage 1)      2Ψ + 2Ψ + KΨ/N
P_os+g   (stage 2)      2Ψ + (2 + K)Ψ/N
P_os+g+p (stage 3)      (2 + 2 + K)Ψ/N
======================  ================================

With hybrid sharding (FSDP's HYBRID_SHARD, Zhao et al. 2023) states are sharded within groups of
F ranks and replicated across the N/F groups, so F, not N, divides them. The paper counts a GB
as 1e9 bytes, and so does this module.

Activations follow Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models" (arXiv:2205.05198), §4.
"""

from __future__ import annotations

import math
from typing import Protocol

from plait.errors import ConfigError

GB = 1e9
"""Bytes in a gigabyte, as the ZeRO paper counts them."""

MAX_RANKS = 2**20
"""The largest data-parallel degree the estimator takes."""

ZERO_STAGES = (0, 1, 2, 3)
STAGE_NAMES = {0: "baseline", 1: "P_os", 2: "P_os+g", 3: "P_os+g+p"}
PRECISIONS = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("adam", "adamw", "sgd", "lamb", "lars")

# Optimizer state in fp32 bytes per parameter, without the master copy: Adam, AdamW and LAMB keep
# momentum and variance (You et al. 2020 keep Adam's moments in LAMB); SGD with momentum and LARS
# (You et al. 2017) keep one momentum buffer.
_STATE_BYTES = {"adam": 8, "adamw": 8, "lamb": 8, "sgd": 4, "lars": 4}
_MASTER_BYTES = 4  # the fp32 copy of the weights that mixed precision updates


class ModelShape(Protocol):
    """What the estimator reads of a model, given by the caller (`plait.models.GPTConfig` is one):
    its exact parameter count and its transformer layers' sizes."""

    seq_len: int
    d_model: int
    n_head: int
    n_layer: int

    def n_params(self) -> int: ...


def _valid(values) -> str:
    return ", ".join(str(v) for v in values)


def dtype_preset(precision: str, optimizer: str) -> tuple[int, int, int]:
    """``(param_bytes, grad_bytes, K)`` per parameter for a precision and an optimizer.

    Mixed precision ("bf16" or "fp16", Micikevicius et al. 2018) computes with 16-bit parameters
    and gradients (2 + 2 bytes) and keeps an fp32 master copy of the weights in the optimizer
    state, so K = 4 (master) + the optimizer's own fp32 state: 12 for Adam/AdamW/LAMB (momentum
    and variance, the paper's K = 12), 8 for SGD with momentum and LARS. Plain fp32 training has
    no separate master copy: the parameters (4 bytes) are the weights the optimizer updates,
    gradients take 4 bytes, and K is the optimizer state alone: 8 for Adam, 4 for SGD.
    """
    if precision not in PRECISIONS:
        raise ConfigError(f"precision {precision!r} is not known; valid: {_valid(PRECISIONS)}")
    if optimizer not in OPTIMIZERS:
        raise ConfigError(f"optimizer {optimizer!r} is not known; valid: {_valid(OPTIMIZERS)}")
    state = _STATE_BYTES[optimizer]
    if precision == "fp32":
        return 4, 4, state
    return 2, 2, _MASTER_BYTES + state


def _divisors(n: int) -> list[int]:
    """The divisors of n in increasing order, in O(sqrt(n)) steps (n may be a huge rank count)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _positive_int(name: str, value, what: str = "a positive integer") -> int:
    # bool is an int to Python but never a size; floats are accepted when whole (7.5e9).
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{name} must be {what}, got {value!r}")
    if isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise ConfigError(f"{name} must be {what}, got {value!r}")
        value = int(value)
    if value < 1:
        raise ConfigError(f"{name} must be {what}, got {value!r}")
    return value


def _check_sharding(dp, zero_stage, shard) -> tuple[int, int, int]:
    if isinstance(zero_stage, bool) or zero_stage not in ZERO_STAGES:
        raise ConfigError(f"zero_stage must be one of {_valid(ZERO_STAGES)}, got {zero_stage!r}")
    dp = _positive_int("dp", dp, "an integer >= 1")
    if dp > MAX_RANKS:
        raise ConfigError(f"dp must be at most {MAX_RANKS:,} (2**20 ranks), got {dp}")
    if shard is None:
        return dp, int(zero_stage), dp
    shard = _positive_int("shard", shard, "an integer >= 1")
    if dp % shard:
        divisors = _divisors(dp)
        raise ConfigError(
            f"shard={shard} does not divide dp={dp}; the shard group size must be one of {_valid(divisors)}"
        )
    return dp, int(zero_stage), shard


def model_state_bytes_formula(
    params: int,
    dp: int,
    zero_stage: int,
    *,
    param_bytes: int = 2,
    grad_bytes: int = 2,
    optimizer_k: int = 12,
    shard: int | None = None,
) -> dict[str, int]:
    """Bytes per device of parameters, gradients and optimizer state under a ZeRO stage.

    The defaults are the paper's mixed-precision Adam (2 + 2 + K bytes, K = 12); for fp32 Adam
    pass ``param_bytes=4, grad_bytes=4, optimizer_k=8`` (no master copy: momentum and variance
    only), or take the three numbers from :func:`dtype_preset`. ``shard`` is the shard group size
    F of hybrid sharding (default: ``dp``, i.e. shard over all data-parallel ranks); a sharded
    state takes ``ceil(params / F)`` elements per device, as a flat buffer right-padded to a
    multiple of F does. Returns ``{"params", "grads", "optimizer", "total"}`` in bytes.

    >>> model_state_bytes_formula(7_500_000_000, 64, 3)["total"] / 1e9
    1.875
    """
    params = _positive_int("params", params)
    dp, zero_stage, shard = _check_sharding(dp, zero_stage, shard)
    for name, value in (
        ("param_bytes", param_bytes),
        ("grad_bytes", grad_bytes),
        ("optimizer_k", optimizer_k),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{name} must be an integer >= 0, got {value!r}")
    sharded = -(-params // shard)
    # Stage s shards the optimizer state from 1 on, gradients from 2 on, parameters at 3.
    p_elems = sharded if zero_stage >= 3 else params
    g_elems = sharded if zero_stage >= 2 else params
    o_elems = sharded if zero_stage >= 1 else params
    out = {
        "params": p_elems * param_bytes,
        "grads": g_elems * grad_bytes,
        "optimizer": o_elems * optimizer_k,
    }
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def activation_bytes(
    cfg: ModelShape,
    batch: int,
    seq: int | None = None,
    *,
    precision: str = "bf16",
    recompute: bool = False,
    tp: int = 1,
    sequence_parallel: bool = False,
    stored_scores: bool = True,
) -> int:
    """Activation bytes kept for backward by the transformer layers of one micro-batch.

    Korthikanti et al. 2022 (arXiv:2205.05198), §4: with 16-bit activations, one transformer layer
    stores ``s·b·h·(34 + 5·a·s/h)`` bytes for a micro-batch of b sequences of s tokens, hidden
    size h and a heads (§4.1; 34 counts the inputs of the GEMMs, LayerNorms, GeLU and the 1-byte
    dropout masks, 5as/h the attention scores, their softmax and its dropout mask). Tensor
    parallelism of degree t splits all but the LayerNorm and dropout inputs:
    ``s·b·h·(10 + 24/t + 5·a·s/(h·t))`` (§4.2.1); with sequence parallelism everything is split:
    ``s·b·h·(34 + 5·a·s/h)/t`` (§4.2.2). Full activation recomputation keeps only each layer's
    input, ``2·s·b·h`` bytes (§4.3; divided by t under sequence parallelism).

    ``precision="fp32"`` doubles every term, a slight overestimate since dropout masks stay one
    byte. Only the ``n_layer`` transformer layers are counted: the embedding output, the final
    LayerNorm and the logits (which the paper treats separately and which matter for small
    models with large vocabularies) are left out. The 5as/h term assumes the attention scores
    are stored; fused attention (``F.scaled_dot_product_attention``, which plait's GPT uses) does
    not store them, so for plait the figure is an upper bound; ``stored_scores=False`` leaves the
    term out (what fused attention keeps). ``seq`` defaults to ``cfg.seq_len``.
    """
    if precision not in PRECISIONS:
        raise ConfigError(f"precision {precision!r} is not known; valid: {_valid(PRECISIONS)}")
    b = _positive_int("batch", batch)
    s = cfg.seq_len if seq is None else _positive_int("seq", seq)
    if s > cfg.seq_len:
        raise ConfigError(
            f"seq={s} is longer than the model's seq_len={cfg.seq_len}; use seq <= {cfg.seq_len}"
        )
    t = _positive_int("tp", tp)
    h, a, L = cfg.d_model, cfg.n_head, cfg.n_layer
    if a % t:
        divisors = _divisors(a)
        raise ConfigError(f"tp={t} does not divide n_head={a}; valid tp: {_valid(divisors)}")
    sbh = s * b * h
    scores = 5 * a * s / h if stored_scores else 0.0  # scores, softmax and its dropout mask
    if recompute:
        per_layer = 2 * sbh / (t if sequence_parallel else 1)
    elif sequence_parallel:
        per_layer = sbh * (34 + scores) / t
    else:
        per_layer = sbh * (10 + 24 / t + scores / t)
    scale = 2 if precision == "fp32" else 1
    return round(scale * L * per_layer)


def estimate_memory(
    params: int | None = None,
    model: ModelShape | None = None,
    dp: int = 1,
    zero_stage: int = 0,
    optimizer: str = "adam",
    precision: str = "bf16",
    shard: int | None = None,
    batch: int | None = None,
    seq: int | None = None,
    recompute: bool = False,
    name: str | None = None,
    cp: int = 1,
) -> dict:
    """Per-device memory estimate for ``params`` parameters or a ``model``.

    Give exactly one of ``params`` and ``model`` (its config, e.g. ``plait.models.gpt_config("gpt2")``,
    whose exact parameter count is used; `name` labels it in the result). ``optimizer`` and
    ``precision`` pick the bytes per parameter (:func:`dtype_preset`); ``shard`` is the
    hybrid-sharding group size (default ``dp``). With ``batch`` (micro-batch size) and a model,
    the activations of :func:`activation_bytes` are added; ``seq`` defaults to the model's
    ``seq_len``. ``cp`` is context parallelism's degree: each device holds ceil(seq / cp) tokens of
    every sequence (its activations fall as 1/cp) and the weights are replicated over dp x cp, so
    ZeRO shards over dp x cp. Returns a JSON-able dict; sizes ending in ``_gb`` are in units of 1e9
    bytes, as in the ZeRO paper.
    """
    cp = _positive_int("cp", cp)
    if (params is None) == (model is None):
        raise ConfigError("give exactly one of params (a parameter count) and model (a model's config)")
    cfg = model
    if cfg is not None:
        params = cfg.n_params()
    params = _positive_int("params", params)
    param_bytes, grad_bytes, k = dtype_preset(precision, optimizer)
    if shard is not None and cp > 1:
        raise ConfigError("hybrid sharding (shard) with context parallelism (cp > 1) is not available")
    dp, zero_stage, shard = _check_sharding(dp, zero_stage, shard)
    data = dp * cp  # ZeRO shards over dp x cp
    shard = data if cp > 1 else shard
    states = model_state_bytes_formula(
        params, data, zero_stage, param_bytes=param_bytes, grad_bytes=grad_bytes, optimizer_k=k, shard=shard
    )
    out = {
        "params": params,
        "model": name,
        "dp": dp,
        "cp": cp,
        "zero_stage": zero_stage,
        "stage_name": STAGE_NAMES[zero_stage],
        "shard": shard,
        "precision": precision,
        "optimizer": optimizer,
        "param_bytes": param_bytes,
        "grad_bytes": grad_bytes,
        "K": k,
        "model_state_bytes": states,
        "model_state_gb": states["total"] / GB,
    }
    if batch is None:
        if seq is not None or recompute:
            raise ConfigError("seq and recompute describe activations: give batch as well")
        return out
    if cfg is None:
        raise ConfigError("activations need the model's shape: give model (its config) instead of params")
    seq = cfg.seq_len if seq is None else seq
    local = -(-seq // cp)  # a device's tokens of each sequence
    act = activation_bytes(cfg, batch, local, precision=precision, recompute=recompute)
    out.update(
        batch=_positive_int("batch", batch),
        seq=seq,
        seq_per_device=local,
        recompute=bool(recompute),
        activation_bytes=act,
        activation_gb=act / GB,
        total_gb=(states["total"] + act) / GB,
    )
    return out


def format_estimate(result: dict) -> str:
    """A readable table of :func:`estimate_memory`'s ``result``: the four ZeRO stages side by side
    for its dp (as in Table 1 of the ZeRO paper), the chosen stage marked, then activations."""
    p, g, k = result["param_bytes"], result["grad_bytes"], result["K"]
    cp = result.get("cp", 1)
    dp, shard = result["dp"] * cp, result["shard"]  # the data ranks ZeRO shards over: dp x cp
    what = f"model {result['model']!r}, " if result["model"] else ""
    degrees = f"dp={result['dp']}" + (f" x cp={cp} (ZeRO shards over {dp})" if cp > 1 else "")
    lines = [
        f"{what}{result['params']:,} parameters, {degrees}, {result['precision']} with "
        f"{result['optimizer']}: {p} + {g} + K bytes per parameter, K={k}",
    ]
    if shard != dp:
        lines.append(
            f"hybrid sharding: states sharded over groups of {shard}, replicated across {dp // shard}"
        )
    lines.append("model states per device, GB (1e9 bytes):")
    lines.append(f"  {'stage':<14}{'params':>10}{'grads':>10}{'optimizer':>11}{'total':>10}")
    for stage in ZERO_STAGES:
        b = model_state_bytes_formula(
            result["params"], dp, stage, param_bytes=p, grad_bytes=g, optimizer_k=k, shard=shard
        )
        mark = "  <- chosen" if stage == result["zero_stage"] else ""
        cells = "".join(
            f"{b[key] / GB:>{w}.2f}"
            for key, w in (("params", 10), ("grads", 10), ("optimizer", 11), ("total", 10))
        )
        lines.append(f"  {stage} {STAGE_NAMES[stage]:<12}{cells}{mark}")
    if "activation_gb" in result:
        how = "full recomputation" if result["recompute"] else "no recomputation"
        lines.append(
            f"activations per device: {result['activation_gb']:.2f} GB "
            f"(micro-batch {result['batch']} x {result['seq_per_device']} tokens"
            + (f", 1/{cp} of {result['seq']}" if cp > 1 else "")
            + f", {how}, Korthikanti et al. 2022)"
        )
        lines.append(f"total for stage {result['zero_stage']}: {result['total_gb']:.2f} GB")
    return "\n".join(lines)

"""Analytical parameter and FLOP counts of a GPT model (Narayanan et al. 2021, §5.1).

Notation as in the paper: l layers, h hidden size, s sequence length, V vocabulary.
Only matrix multiplications are counted (2 FLOPs per multiply-add); LayerNorm, softmax,
GELU and the optimizer step are negligible at scale and left out. The formulas assume an
MLP of width 4h and an lm_head tied to the token embedding, as in GPT-2.
"""

from __future__ import annotations

from plait.models.gpt import GPTConfig


def gpt_param_estimate(cfg: GPTConfig) -> float:
    """Approximate parameter count, ``12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h))``.

    Per layer: 12h^2 weights of the four GEMMs plus 13h biases and LayerNorm parameters;
    (V + s) h for the token and position embeddings. Only the final LayerNorm (2h) is missing
    from the exact count of a biased, tied model.
    """
    L, h, s, V = cfg.n_layer, cfg.d_model, cfg.seq_len, cfg.vocab_size
    # The formula multiplied out, in integers so that no rounding creeps in.
    return float(12 * L * h * h + 13 * L * h + (V + s) * h)


def gpt_train_flops_per_token(cfg: GPTConfig, recompute: bool = False) -> float:
    """Model FLOPs of one training step (forward + backward), per token of the batch.

    The paper's count per iteration of B sequences is
    ``72 B s l h^2 (1 + s/(6h) + V/(12 l h))`` and, with full activation recomputation (one
    extra forward pass of every transformer layer, not of the logit layer),
    ``96 B s l h^2 (1 + s/(6h) + V/(16 l h))``; dividing by the B s tokens gives this value.
    Use the ``recompute=False`` figure for MFU: recomputation is work the hardware does but
    not work the model needs.
    """
    L, h, s, V = cfg.n_layer, cfg.d_model, cfg.seq_len, cfg.vocab_size
    # Multiplied out: 72 L h^2 + 12 L s h + 6 h V (resp. 96 L h^2 + 16 L s h + 6 h V), in
    # integers so that the value is exact; the terms are the GEMMs, attention scores and logits.
    layer_passes = 4 if recompute else 3
    # Mixture of experts counts the active parameters: a MoE layer's token goes through top_k
    # experts (k - 1 more MLPs of 2 x 2·h·d_ff FLOPs forward) and the router (2·h·E).
    moe = (
        cfg.n_moe_layers * ((cfg.top_k - 1) * 4 * h * cfg.ff_dim + 2 * h * cfg.experts) if cfg.experts else 0
    )
    return float(layer_passes * (24 * L * h * h + 4 * L * s * h + moe) + 6 * h * V)

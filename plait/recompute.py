"""Activation checkpointing applied from outside the model (Chen et al. 2016, "sublinear memory").

Each chosen submodule keeps only its input during forward and recomputes its activations in
backward. The module tree and parameter names are unchanged (the instance's `forward` is
wrapped), so checkpoints and parallel plans see the same names with or without it.
"""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

from plait.engine import model_blocks


def apply_activation_checkpointing(model: nn.Module, blocks: list[nn.Module] | None = None) -> int:
    """Recompute each of `blocks` (default: the blocks the model declares,
    `plait.engine.model_blocks`) in backward.

    Returns how many modules were wrapped. Non-reentrant checkpointing is used, so it composes
    with autograd hooks (data parallelism) and keeps dropout's random stream identical.
    """
    ids = {id(b) for b in (model_blocks(model) if blocks is None else blocks)}
    count = 0
    for module in model.modules():
        if id(module) in ids and not getattr(module, "_plait_recompute", False):
            module.forward = functools.partial(checkpoint, module.forward, use_reentrant=False)
            module._plait_recompute = True
            count += 1
    return count

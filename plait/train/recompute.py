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


def apply_activation_checkpointing(model: nn.Module, block_types: tuple[type, ...] | None = None) -> int:
    """Recompute every submodule of one of `block_types` in backward (default: the blocks the
    model declares, `plait.engine.model_blocks`).

    Returns how many modules were wrapped. Non-reentrant checkpointing is used, so it composes
    with autograd hooks (data parallelism) and keeps dropout's random stream identical.
    """
    if block_types is None:
        ids = {id(b) for b in model_blocks(model)}
        chosen = lambda m: id(m) in ids  # noqa: E731
    else:
        chosen = lambda m: isinstance(m, block_types)  # noqa: E731
    count = 0
    for module in model.modules():
        if chosen(module) and not getattr(module, "_plait_recompute", False):
            module.forward = functools.partial(checkpoint, module.forward, use_reentrant=False)
            module._plait_recompute = True
            count += 1
    return count

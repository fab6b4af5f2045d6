"""A plain multi-layer perceptron, the smallest model the parallel wrappers are tested on."""

from __future__ import annotations

import torch.nn as nn

from plait.errors import ConfigError


def _activation(name: str) -> nn.Module:
    # Built per layer rather than from a shared table so no module instance is reused.
    factories = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh, "silu": nn.SiLU}
    if name not in factories:
        raise ConfigError(f"unknown activation {name!r}; valid: {', '.join(sorted(factories))}")
    return factories[name]()


class MLP(nn.Sequential):
    """``Linear(sizes[0], sizes[1]) -> act -> ... -> Linear(sizes[-2], sizes[-1])``.

    No activation follows the last layer, so the output can feed a loss directly. Being an
    ``nn.Sequential``, the layers can be indexed and sliced, e.g. to split it into pipeline
    stages; the linear layers are at the even indices.
    """

    def __init__(self, sizes: list[int], activation: str = "relu", bias: bool = True) -> None:
        sizes = list(sizes)
        if len(sizes) < 2 or any(not isinstance(n, int) or n < 1 for n in sizes):
            raise ConfigError(f"MLP sizes must be at least two positive integers, got {sizes}")
        # Checked up front so that a bad name fails even for a single-layer MLP.
        _activation(activation)
        layers: list[nn.Module] = []
        for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers.append(nn.Linear(n_in, n_out, bias=bias))
            if i < len(sizes) - 2:
                layers.append(_activation(activation))
        super().__init__(*layers)
        self.sizes = sizes

"""A small convolutional network for 8x8 grey images (scikit-learn's digits), in plain PyTorch.

The model has the two-part shape that Krizhevsky's "one weird trick" (2014) relies on: a
convolutional ``features`` part that holds most of the computation and few parameters, and a
fully connected ``classifier`` part that holds most of the parameters and little computation.
``forward(x)`` is exactly ``classifier(features(x))``; ``features`` ends with ``nn.Flatten`` so
the boundary between the two carries one vector per example. Nothing here knows about
parallelism (see ``plait.tensor_parallel.hybrid`` for the hybrid split).

Module names (part of the interface)::

    features.0  Conv2d(1, c1, 3, padding=1)      features.1  ReLU
    features.2  Conv2d(c1, c2, 3, padding=1)     features.3  ReLU
    ...                                          then MaxPool2d(2), Flatten
    classifier.0  Linear(c_last * 4 * 4, h1)     classifier.1  ReLU
    ...                                          classifier.2k  Linear(h_k, n_classes)
"""

from __future__ import annotations

import torch
import torch.nn as nn

from plait.errors import ConfigError


def _positive_ints(name: str, values, allow_empty: bool) -> tuple[int, ...]:
    values = tuple(values)
    if (not values and not allow_empty) or any(
        not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in values
    ):
        need = "a tuple of positive integers" + ("" if allow_empty else " (at least one)")
        raise ConfigError(f"DigitsCNN {name} must be {need}, got {values!r}")
    return values


class DigitsCNN(nn.Module):
    """Convolutions (3x3, padding 1, ReLU) on 1x`image_size`x`image_size` images, one 2x2 max
    pooling, then a ReLU MLP to `n_classes` logits.

    Args:
        n_classes: number of output logits.
        channels: output channels of each convolution; the defaults give 4.8k conv parameters.
        hidden: widths of the hidden fully connected layers; the defaults give 74.6k FC
            parameters (94% of the model, as in the paper's networks where FC layers hold ~95%).
        image_size: side of the square input images (even, so the pooling halves it exactly).
    """

    def __init__(
        self,
        n_classes: int = 10,
        channels: tuple[int, ...] = (16, 32),
        hidden: tuple[int, ...] = (128, 64),
        image_size: int = 8,
    ) -> None:
        super().__init__()
        (n_classes,) = _positive_ints("n_classes", (n_classes,), allow_empty=False)
        channels = _positive_ints("channels", channels, allow_empty=False)
        hidden = _positive_ints("hidden", hidden, allow_empty=True)
        if not isinstance(image_size, int) or image_size < 2 or image_size % 2:
            raise ConfigError(f"DigitsCNN image_size must be an even integer >= 2, got {image_size!r}")
        convs: list[nn.Module] = []
        c_in = 1
        for c_out in channels:
            convs += [nn.Conv2d(c_in, c_out, kernel_size=3, padding=1), nn.ReLU()]
            c_in = c_out
        convs += [nn.MaxPool2d(2), nn.Flatten()]
        self.features = nn.Sequential(*convs)
        self.feature_dim = c_in * (image_size // 2) ** 2
        fcs: list[nn.Module] = []
        n_in = self.feature_dim
        for width in hidden:
            fcs += [nn.Linear(n_in, width), nn.ReLU()]
            n_in = width
        fcs.append(nn.Linear(n_in, n_classes))
        self.classifier = nn.Sequential(*fcs)
        self.n_classes = n_classes
        self.image_size = image_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of shape (batch, n_classes) for images of shape (batch, 1, size, size)."""
        return self.classifier(self.features(x))

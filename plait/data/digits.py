"""The 8x8 handwritten digits that ship inside scikit-learn: a real image dataset with no download.

``sklearn.datasets.load_digits`` reads 1,797 greyscale images (16 intensity levels, 10 classes,
from the UCI "Optical Recognition of Handwritten Digits" set) from a file bundled in the
scikit-learn package. scikit-learn is an optional dependency: ``pip install 'plait[digits]'``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from plait.errors import ConfigError

N_CLASSES = 10
IMAGE_SIZE = 8
_MAX_INTENSITY = 16.0  # the bundled images take the values 0..16


class DigitsSplit(NamedTuple):
    """Training and held-out parts; images (n, 1, 8, 8) float32 in [0, 1], labels (n,) int64."""

    train_images: torch.Tensor
    train_labels: torch.Tensor
    val_images: torch.Tensor
    val_labels: torch.Tensor


def load_digits_dataset(held_out_fraction: float = 0.2, seed: int = 0) -> DigitsSplit:
    """scikit-learn's digits, shuffled with `seed` and split into train and held-out parts.

    The held-out part is ``round(1797 * held_out_fraction)`` images; the same seed gives the same
    split on every machine (a torch generator draws the permutation).
    """
    if isinstance(held_out_fraction, bool) or not 0.0 < float(held_out_fraction) < 1.0:
        raise ConfigError(f"held_out_fraction must be between 0 and 1 (exclusive), got {held_out_fraction!r}")
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise ConfigError(
            "the digits dataset needs scikit-learn, which is not installed: "
            "pip install 'plait[digits]' (or pip install scikit-learn)"
        ) from exc
    bunch = load_digits()
    images = torch.as_tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / _MAX_INTENSITY
    labels = torch.as_tensor(bunch.target, dtype=torch.int64)
    n = len(labels)
    n_val = round(n * float(held_out_fraction))
    if not 0 < n_val < n:
        raise ConfigError(f"held_out_fraction={held_out_fraction} leaves an empty part of {n} images")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(int(seed)))
    val, train = order[:n_val], order[n_val:]
    return DigitsSplit(images[train], labels[train], images[val], labels[val])

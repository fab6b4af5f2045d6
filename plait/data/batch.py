"""Cutting a batch into row ranges: a data-parallel rank's share of a global batch, or the
micro-batches of gradient accumulation. A batch is a tensor or a tuple, list or dict of them (any
nesting) whose tensors share their first dimension, the rows."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from plait.errors import ConfigError


def map_tensors(batch, fn):
    """`fn` applied to every tensor of a batch (a tensor, or tuples, lists and dicts of them)."""
    if torch.is_tensor(batch):
        return fn(batch)
    if isinstance(batch, Mapping):
        return type(batch)({k: map_tensors(v, fn) for k, v in batch.items()})
    if isinstance(batch, (tuple, list)):
        return type(batch)(map_tensors(v, fn) for v in batch)
    return batch  # a non-tensor leaf (a flag, a string) goes to every part unchanged


def _rows(batch) -> int:
    """The rows (dim 0) of a batch's tensors, which must agree."""
    found = set()
    map_tensors(batch, lambda t: found.add(t.shape[0] if t.dim() else None))
    found.discard(None)
    if len(found) != 1:
        raise ConfigError(
            f"a batch's tensors must share their first dimension (rows) to be split; found {sorted(found)}"
        )
    return found.pop()


def split_batch(batch, parts: int, index: int):
    """Rows [index * n / parts, (index + 1) * n / parts) of every tensor of `batch` (n rows, which
    `parts` must divide): rank `index`'s share of a global batch, or a micro-batch."""
    n = _rows(batch)
    if n % parts:
        raise ConfigError(f"a batch of {n} rows does not split into {parts} equal parts: make it a multiple")
    k = n // parts
    return map_tensors(batch, lambda t: t[index * k : (index + 1) * k])

"""How a tensor-parallel layer cuts a full tensor: the padded equal slices of Megatron-LM, the
checks of the full tensors a layer is built from, and the parameter a slice becomes (with its
placement, `plait.placement`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from plait.errors import ConfigError
from plait.placement import Shard, set_shard

if TYPE_CHECKING:
    from plait.mesh import Mesh


def pad_to_multiple(n: int, k: int) -> int:
    """The smallest multiple of `k` that is >= `n` (Megatron pads the vocabulary this way)."""
    if k < 1:
        raise ConfigError(f"pad_to_multiple: k must be >= 1, got {k}")
    return -(-n // k) * k


def shard_range(n: int, rank: int, t: int) -> tuple[int, int]:
    """[start, end) of rank `rank`'s slice when `n` items are padded to a multiple of `t` and cut
    into `t` equal slices; both ends are clipped to `n`, so the padding is never in the range
    (the last ranks' ranges may be shorter, or empty)."""
    if not 0 <= rank < t:
        raise ConfigError(f"shard_range: rank {rank} is outside [0, {t})")
    per = pad_to_multiple(n, t) // t
    return min(rank * per, n), min((rank + 1) * per, n)


def require_divisible(cls: str, name: str, value: int, mesh: Mesh, axis: str) -> int:
    """`value` / the size of `axis`, or a ConfigError naming the nearest valid values."""
    t = mesh.size(axis)
    if value % t:
        lower, upper = value - value % t, value - value % t + t
        hint = f"{lower} or {upper}" if lower > 0 else f"{upper}"
        raise ConfigError(
            f"{cls}: {name}={value} is not divisible by {axis}={t}; "
            f"choose {name} a multiple of {t} (e.g. {hint}) or a different {axis}"
        )
    return value // t


def check_full(cls: str, name: str, tensor: Tensor | None, shape: tuple[int, ...]) -> None:
    if tensor is not None and tuple(tensor.shape) != shape:
        raise ConfigError(f"{cls}: {name} has shape {tuple(tensor.shape)}, expected {shape}")


def sharded_param(t: Tensor, device, dtype, shard_dim: int | None = None, axis: str = "tp") -> nn.Parameter:
    """A parameter holding a copy of `t`; with `shard_dim`, placed as a shard of that dim over `axis`."""
    p = nn.Parameter(t.detach().to(device=device, dtype=dtype).clone(memory_format=torch.contiguous_format))
    if shard_dim is not None:
        set_shard(p, axis, Shard(shard_dim))
    return p

"""Large-batch optimizers: LAMB (You et al. 2020) and LARS (You et al. 2017), and their helpers.

Both scale each layer's step by a layer-wise trust ratio computed from whole-layer norms. When
parameters are shards of larger layers (ZeRO-1/2), pass ``norm_reducer=allreduce_norms(mesh,
"dp")`` so that each shard uses its whole layer's norms: one all-reduce per step. See
docs/optimizers.md.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

import torch

from plait import comm
from plait.errors import ConfigError
from plait.optim.lamb import LAMB, NormReducer
from plait.optim.lars import LARS

OPTIMIZER_NAMES: tuple[str, ...] = ("adamw", "lamb", "lars", "sgd")

__all__ = [
    "LAMB",
    "LARS",
    "NormReducer",
    "OPTIMIZER_NAMES",
    "allreduce_norms",
    "build_optimizer",
    "param_groups",
]


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two param groups: matrices (dim >= 2: decayed, trust-ratio adapted) and vectors.

    Vectors (dim < 2: biases, LayerNorm/BatchNorm gains and shifts) get ``weight_decay=0`` and
    ``adapt=False``: decaying a gain towards 0 fights the normalisation it belongs to, and a
    bias's norm (often 0 at init) says nothing about a safe step, so common practice excludes
    them from both (BERT's optimizer excludes "bias" and "LayerNorm" from decay; LAMB
    implementations offer the same list for the layer adaptation). The ``adapt`` key is
    read by LAMB and LARS and ignored by torch's AdamW and SGD. Tied parameters appear once;
    frozen ones (requires_grad False) are left out. Both groups are returned even if one is
    empty, so group i always means the same thing.
    """
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay, "adapt": True},
        {"params": no_decay, "weight_decay": 0.0, "adapt": False},
    ]


class _AllReduceNorms:
    """A `norm_reducer` that sums partial sums of squares over one mesh axis via plait.comm."""

    def __init__(self, mesh, axis: str) -> None:
        mesh.size(axis)  # fail now, naming the valid axes, rather than at the first step
        self.mesh, self.axis = mesh, axis

    def __call__(self, partial_sq: torch.Tensor) -> torch.Tensor:
        return comm.all_reduce(partial_sq, self.mesh, self.axis, op="sum")

    def __repr__(self) -> str:
        return f"allreduce_norms(axis={self.axis!r})"


def allreduce_norms(mesh, axis: str = "dp") -> NormReducer:
    """A `norm_reducer` for LAMB/LARS whose parameters are shards split over `axis` of `mesh`.

    It all-reduces (sum) the stacked partial sums of squares of the step, so every shard sees
    its whole layer's ‖w‖ and ‖update‖ and the trust ratio equals the unsharded one. Every rank
    of the axis must step the same ordered list of (shards of the) layers, holding a shard of
    each (possibly empty). Over an axis of size 1 it does nothing.
    """
    return _AllReduceNorms(mesh, axis)


def build_optimizer(
    name: str,
    params: Iterable,
    lr: float,
    weight_decay: float | None = None,
    betas: tuple[float, float] = (0.9, 0.999),
    momentum: float = 0.9,
    eps: float | None = None,
    norm_reducer: NormReducer | None = None,
) -> torch.optim.Optimizer:
    """The optimizer called `name`: "adamw", "lamb", "lars" or "sgd".

    ``weight_decay`` and ``eps`` default (None) to each optimizer's own default (AdamW 0.01,
    LAMB 0.01, LARS 5e-4, SGD 0). ``betas`` is read by AdamW and LAMB, ``momentum`` by LARS and
    SGD. ``norm_reducer`` is passed to LAMB and LARS; AdamW and SGD are element-wise, so a
    sharded parameter needs no reduction there and it is ignored. Per-group values in
    ``params`` (e.g. from `param_groups`) override these. Bad hyperparameters raise ValueError.
    """
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in OPTIMIZER_NAMES:
        close = difflib.get_close_matches(str(key), OPTIMIZER_NAMES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"unknown optimizer {name!r}{hint}; valid names: {', '.join(OPTIMIZER_NAMES)}")
    kw = {} if weight_decay is None else {"weight_decay": weight_decay}
    if eps is not None and key != "sgd":
        kw["eps"] = eps
    if key == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=betas, fused=True, **kw)
    if key == "lamb":
        return LAMB(params, lr=lr, betas=betas, norm_reducer=norm_reducer, **kw)
    if key == "lars":
        return LARS(params, lr=lr, momentum=momentum, norm_reducer=norm_reducer, **kw)
    return torch.optim.SGD(params, lr=lr, momentum=momentum, **kw)

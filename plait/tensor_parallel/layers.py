"""Tensor-parallel layers: Megatron-LM's column/row split of linear layers and the vocab split.

Shoeybi et al. 2019 (Megatron-LM, §3) split a linear layer Y = X A^T + b over the t ranks of the
"tp" axis in one of two ways:

* **column-parallel**: A is split along its output features, A = [A_1; ...; A_t], so rank i
  computes Y_i = X A_i^T + b_i, its slice of the output features (eq. 3). X must be whole on
  every rank: Megatron's `f` (identity forward, all-reduce backward) enters the region.
* **row-parallel**: A is split along its input features, A = [A_1, ..., A_t], and the input
  arrives split the same way, so Y = Σ_i X_i A_i^T (eq. 4): the partial products are summed by
  Megatron's `g` (all-reduce forward, identity backward), then the replicated bias is added.

A column-parallel layer followed by an elementwise function and a row-parallel layer (the MLP,
eq. 3-4; attention with heads split is the same pattern) therefore costs one all-reduce forward
and one backward. With sequence parallelism (Korthikanti et al. 2022, §4.2.2) the activations
outside these regions are split along the sequence dim: `f` becomes an all-gather along the
sequence (reduce-scatter backward) and `g` a reduce-scatter (all-gather backward).

The embedding is split along the vocabulary (Shoeybi et al. 2019, §3, "input embedding"): rank i
holds rows [i·V'/t, (i+1)·V'/t) of the table padded to V' (a multiple of t), looks up the ids
that fall in its range, writes zeros for the others, and `g` sums the result.

**Replicated parameters under sequence parallelism.** A parameter that is replicated over tp but
applied to a sequence shard (the row-parallel bias here, LayerNorm weights in a model) receives
only a partial gradient on each rank. Their placement (`plait.placement`) says so
(``grad_partial`` over tp): the engines sum their gradients over tp with the batch axes (or
`allreduce_sequence_parallel_grads` does it by hand). Sharded parameters' placements record the
dim of the full tensor they are a slice of, so a global gradient norm can tell shards, which are
summed over tp, from replicas, which are counted once.

**Initialisation.** Without ``full_weight`` a layer draws the full-size weight exactly as
``nn.Linear`` / ``nn.Embedding`` would (same RNG calls, same device) and keeps its slice, so a
model built under the same seed on every rank equals the dense model built under that seed,
whatever t is. This materialises the full tensor once per layer; on the meta device nothing is
drawn.

The linear layers live in `plait.tensor_parallel.linear`, the embedding in
`plait.tensor_parallel.embedding`, the slicing in `plait.tensor_parallel.shards`; this module
names them and sums the replicated parameters' gradients.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from plait.gradsync import GradSync, build_buckets
from plait.placement import placement
from plait.tensor_parallel.embedding import VocabParallelEmbedding
from plait.tensor_parallel.linear import ColumnParallelLinear, RowParallelLinear
from plait.tensor_parallel.shards import pad_to_multiple, shard_range

if TYPE_CHECKING:
    from plait.mesh import Mesh

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "allreduce_sequence_parallel_grads",
    "pad_to_multiple",
    "sequence_parallel_params",
    "shard_range",
]


def sequence_parallel_params(module: nn.Module, axis: str = "tp") -> list[nn.Parameter]:
    """The parameters of `module` whose gradient is partial over `axis` (their placement):
    replicated over tp but applied to a sequence slice, so their gradients must be summed over tp
    (Korthikanti et al. 2022, §4.2.2). Each parameter once, in `module.parameters()` order."""
    return [p for p in module.parameters() if axis in placement(p).grad_partial]


def allreduce_sequence_parallel_grads(module: nn.Module, mesh: Mesh, axis: str = "tp") -> None:
    """Sum the gradients of `sequence_parallel_params(module)` over `axis`, in place.

    Call after backward, before clipping and the optimizer step, when no engine does it (every
    plait engine sums them in its gradient synchroniser, by their placements). Gradients of one
    dtype travel as one flat bucket of `plait.gradsync.GradSync` (all-reduce over `axis`, no
    scaling): one all-reduce per dtype, not one per parameter."""
    params = [p for p in sequence_parallel_params(module, axis) if p.grad is not None]
    if mesh.size(axis) == 1 or not params:
        return
    sync = GradSync(build_buckets(params, 1 << 62), mesh, axis, scale=1.0, trigger="manual")
    sync.grads_ready(params)
    sync.finish()

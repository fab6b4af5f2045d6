"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) with sequence parallelism (Korthikanti et
al. 2022): column/row-parallel linear layers, the vocab-parallel embedding and cross-entropy.

The differentiable collectives they are built from live in `plait.comm.autograd`.
"""

from plait.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    allreduce_sequence_parallel_grads,
    pad_to_multiple,
    sequence_parallel_params,
    shard_range,
)
from plait.tensor_parallel.loss import vocab_parallel_cross_entropy

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "allreduce_sequence_parallel_grads",
    "pad_to_multiple",
    "sequence_parallel_params",
    "shard_range",
    "vocab_parallel_cross_entropy",
]

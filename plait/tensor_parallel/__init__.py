"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) with sequence parallelism (Korthikanti et
al. 2022): column/row-parallel linear layers, the vocab-parallel embedding and cross-entropy,
`apply_tp` with plans, and Krizhevsky's hybrid (data-parallel convolutions, model-parallel
fully connected layers).

The differentiable collectives they are built from live in `plait.comm.autograd`.
"""

from plait.tensor_parallel.apply import (
    Colwise,
    ExpertsReplicated,
    LocalWidths,
    ParallelRandom,
    PositionSharded,
    Rowwise,
    SequenceSharded,
    VocabEmbedding,
    VocabHead,
    apply_tp,
    tp_named_parameters,
    without_sequence_parallel,
)
from plait.tensor_parallel.hybrid import KrizhevskyHybrid, apply_krizhevsky, check_krizhevsky, krizhevsky_comm
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
    "KrizhevskyHybrid",
    "apply_krizhevsky",
    "check_krizhevsky",
    "krizhevsky_comm",
    "Colwise",
    "ExpertsReplicated",
    "LocalWidths",
    "ParallelRandom",
    "PositionSharded",
    "Rowwise",
    "SequenceSharded",
    "VocabEmbedding",
    "VocabHead",
    "apply_tp",
    "tp_named_parameters",
    "without_sequence_parallel",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "allreduce_sequence_parallel_grads",
    "pad_to_multiple",
    "sequence_parallel_params",
    "shard_range",
    "vocab_parallel_cross_entropy",
]

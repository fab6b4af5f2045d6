"""Context parallelism: one sequence split over the ranks of a mesh axis, attention exact.

* `plait.context_parallel.sequence`: the layouts (head-tail, contiguous), each rank's positions
  and the causal work per rank (`ring_work`).
* `plait.context_parallel.ring`: ring attention with the log-sum-exp merge, K/V (and in backward
  their gradients) passed round the ring with isend/irecv through plait.comm.
* `plait.context_parallel.ulysses`: DeepSpeed-Ulysses, all-to-all between the sequence split and
  a head split.
* `plait.context_parallel.interface`: `attention` and `positions`, what a model calls in place of
  scaled dot-product attention and ``arange(T)`` (plait's GPT and Hugging Face blocks do; a
  user's own attention module opts in the same way).
* `plait.context_parallel.engine`: `ContextParallelEngine`, the cp axis around any engine.
"""

from plait.context_parallel.engine import ContextParallelEngine
from plait.context_parallel.interface import STYLES, active, attention, positions, sequence_split, split_for
from plait.context_parallel.ring import ring_attention
from plait.context_parallel.sequence import LAYOUTS, SequenceSplit, chunk_bounds, ring_work
from plait.context_parallel.ulysses import check_heads, sdpa_gqa, ulysses_attention

__all__ = [
    "LAYOUTS",
    "STYLES",
    "ContextParallelEngine",
    "active",
    "attention",
    "positions",
    "sequence_split",
    "split_for",
    "SequenceSplit",
    "check_heads",
    "chunk_bounds",
    "ring_attention",
    "ring_work",
    "sdpa_gqa",
    "ulysses_attention",
]

"""The styles of a tensor-parallel plan, as records: how a model says each of its layers splits.

A plan maps module names (fnmatch patterns, e.g. ``"blocks.*.mlp.fc"``) to these records; a
model declares its own (``model.tp_plan()``) without importing the technique, and
`plait.tensor_parallel.apply_tp` applies them (Megatron-LM, Shoeybi et al. 2019, §3; sequence
parallelism, Korthikanti et al. 2022). ``dim`` names the tensor dim a style splits ("heads",
"d_ff", "vocab"), which layout rules map to the tp axis or leave whole.

* `Colwise(fused=1)`: an nn.Linear split by output features. ``fused=k`` says the outputs are k
  blocks laid end to end (a fused qkv: ``[q | k | v]``): each rank takes its slice of each block,
  so it holds whole heads of q, k and v.
* `Rowwise()`: an nn.Linear split by input features (its input arrives split).
* `VocabEmbedding()`: an nn.Embedding split by vocabulary rows.
* `VocabHead(tie=name)`: the output layer split by vocabulary, sharing the embedding `name`'s
  shard when the weights are tied; the model's loss becomes the vocab-parallel cross-entropy.
* `ParallelRandom()`: a parameter-free module (dropout, attention core) whose randomness differs
  across tp ranks.
* `SequenceSharded()`: a module applied to sequence shards under sequence parallelism whose
  parameters stay whole (LayerNorm): their gradients are partial over tp.
* `PositionSharded()`: a position embedding that returns the rows of the rank's sequence shard.
* `ExpertsReplicated()`: a mixture-of-experts MLP kept whole on every tp rank (its experts are
  split over ep, not tp).
* `LocalWidths("n_head", "n_embd")`: a module (an attention written against its own sizes) whose
  integer attributes count what tp splits: each becomes the rank's share (n_head 12 at tp 4: 3).
  Its code must then take every width from them or from its tensors' shapes, never from a config.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Colwise:
    fused: int = 1
    gather_output: bool = False
    dim: str | None = None  # the named tensor dim it splits (layout rules)


@dataclasses.dataclass
class Rowwise:
    dim: str | None = None


@dataclasses.dataclass
class VocabEmbedding:
    dim: str | None = "vocab"


@dataclasses.dataclass
class VocabHead:
    tie: str | None = None  # the VocabEmbedding module whose shard this head shares
    dim: str | None = "vocab"


@dataclasses.dataclass
class ParallelRandom:
    dim: str | None = None  # random per rank only where this dim is split


@dataclasses.dataclass
class SequenceSharded:
    """Parameters stay whole; with sequence parallelism their gradients are partial (summed
    over tp by the trainer); its dropouts draw per-rank masks."""


@dataclasses.dataclass
class PositionSharded:
    """A position embedding that, under sequence parallelism, returns its sequence shard's rows."""


@dataclasses.dataclass
class ExpertsReplicated:
    """A mixture-of-experts MLP (`plait.models.gpt.MoEFeedForward`): its router and experts stay
    whole on every tp rank and every tp rank routes the same tokens. Under sequence parallelism
    its input is a sequence shard: the whole sequences are gathered (so the routing groups are
    those of one process) and its output cut back to the rank's shard before its last step, the
    module's ``dropout``; each rank's parameter gradients then come from its own shard's tokens
    only, so they are partial over tp, and the auxiliary losses join the objective 1/tp per rank
    (the module's ``loss_share``)."""

    dim: str | None = None


@dataclasses.dataclass
class LocalWidths:
    """The module's integer attributes `attrs` (head counts, widths) become the rank's share under
    tp: ``LocalWidths("n_head", "n_embd")`` on nanoGPT's attention."""

    attrs: tuple[str, ...] = ()
    dim: str | None = "heads"

    def __init__(self, *attrs: str, dim: str | None = "heads") -> None:
        self.attrs, self.dim = tuple(attrs), dim

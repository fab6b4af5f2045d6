"""Megatron-LM's vocab-parallel embedding (Shoeybi et al. 2019, §3, "input embedding"), with
sequence parallelism (Korthikanti et al. 2022, §4.2.2); see `plait.tensor_parallel.layers`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from plait.comm.autograd import reduce_from_parallel, reduce_scatter_to_sequence
from plait.errors import ConfigError
from plait.tensor_parallel.shards import check_full, pad_to_multiple, sharded_param

if TYPE_CHECKING:
    from plait.mesh import Mesh


class VocabParallelEmbedding(nn.Module):
    """Embedding table split along the vocabulary (Megatron-LM, Shoeybi et al. 2019, §3).

    The vocabulary of ``num_embeddings`` (V) ids is padded to ``padded_vocab`` (V', a multiple of
    t); this rank holds rows [``vocab_start``, ``vocab_end``) = [r·V'/t, (r+1)·V'/t) of the
    padded table as ``weight``. Padding rows are zero and never selected. ``forward(ids)`` looks
    up the ids in this rank's range, writes zeros for the others, and sums over `axis`
    (all-reduce, or with ``sequence_parallel`` a reduce-scatter along ``seq_dim`` of the output,
    so this rank returns its sequence slice: Korthikanti et al. 2022, §4.2.2).

    Ids outside [0, V) give a zero vector instead of an error: checking would cost a host sync.
    ``full_weight``: the full [V, D] table to take this rank's rows of; by default it is drawn
    as ``nn.Embedding`` draws it (N(0, 1)).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        mesh: Mesh,
        axis: str = "tp",
        padding_idx: int | None = None,
        sequence_parallel: bool = False,
        seq_dim: int = 0,
        device=None,
        dtype=None,
        full_weight: Tensor | None = None,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        check_full(name, "full_weight", full_weight, (num_embeddings, embedding_dim))
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ConfigError(f"{name}: padding_idx={padding_idx} is outside the vocabulary")
            padding_idx %= num_embeddings
        t, r = mesh.size(axis), mesh.rank(axis)
        self.mesh, self.axis = mesh, axis
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = padding_idx
        self.padded_vocab = pad_to_multiple(num_embeddings, t)
        self.vocab_per_rank = self.padded_vocab // t
        self.vocab_start = r * self.vocab_per_rank
        self.vocab_end = self.vocab_start + self.vocab_per_rank
        self.sequence_parallel, self.seq_dim = sequence_parallel, seq_dim
        if full_weight is None:
            full_weight = torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype)
            nn.init.normal_(full_weight)
            if padding_idx is not None:
                with torch.no_grad():
                    full_weight[padding_idx].zero_()
        dtype = full_weight.dtype if dtype is None else dtype
        device = full_weight.device if device is None else device
        real_end = min(self.vocab_end, num_embeddings)
        shard = torch.zeros(self.vocab_per_rank, embedding_dim, device=device, dtype=dtype)
        if real_end > self.vocab_start:
            shard[: real_end - self.vocab_start] = full_weight[self.vocab_start : real_end].detach()
        self.weight = sharded_param(shard, device, dtype, shard_dim=0, axis=axis)

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, mesh: Mesh, axis: str = "tp", **kw) -> VocabParallelEmbedding:
        """This rank's rows of `emb` (which must be identical on every rank of `axis`)."""
        if emb.max_norm is not None or emb.scale_grad_by_freq or emb.sparse:
            raise ConfigError(
                "VocabParallelEmbedding.from_embedding: max_norm, scale_grad_by_freq and sparse "
                "are not supported; build the nn.Embedding without them"
            )
        kw.setdefault("device", emb.weight.device)
        kw.setdefault("dtype", emb.weight.dtype)
        kw.setdefault("padding_idx", emb.padding_idx)
        return cls(emb.num_embeddings, emb.embedding_dim, mesh, axis, full_weight=emb.weight.detach(), **kw)

    def forward(self, ids: Tensor) -> Tensor:
        # Ids of other ranks (and, on the last rank, the padding ids >= V) are masked: they look
        # up local row 0 and are zeroed, so their rows get no gradient here.
        outside = (ids < self.vocab_start) | (ids >= min(self.vocab_end, self.num_embeddings))
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        pad = self.padding_idx
        mine = pad is not None and self.vocab_start <= pad < self.vocab_end
        local_pad = pad - self.vocab_start if mine else None
        out = F.embedding(local, self.weight, padding_idx=local_pad)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(out, self.mesh, self.axis, dim=self.seq_dim)
        return reduce_from_parallel(out, self.mesh, self.axis)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start}, {self.vocab_end}) "
            f"of {self.padded_vocab} over '{self.axis}', sequence_parallel={self.sequence_parallel}"
        )

"""Flat parameters: tensors laid end to end in one 1-D buffer, padded, split into equal shards.

The layout every ZeRO stage uses (ZeRO §5; FSDP §3.2.1, "FlatParameter"): the parameters of a
group (a ZeRO-1/2 bucket, a ZeRO-3 wrapping unit) are flattened and concatenated in order, the
buffer is right-padded to a multiple of the shard count N, and rank r owns the slice
[r·S, (r+1)·S) with S = padded / N. Collectives then move equal, contiguous chunks, and each
parameter's part of a shard (its *segment*, possibly empty) is a view of that shard.

Segments are what the optimizer steps: one tensor per parameter per rank, in the same order on
every rank (empty where the rank holds none of it), so per-parameter options (weight decay off
for biases) and per-layer reductions (LAMB's trust ratio over a sharded layer) still apply.
"""

from __future__ import annotations

import dataclasses
import math

import torch


@dataclasses.dataclass(frozen=True)
class Segment:
    """The part of parameter `index` (named `name`) that one shard holds.

    Elements [start, start + length) of the flattened parameter sit at [shard_offset,
    shard_offset + length) of the shard. `length` may be 0.
    """

    index: int
    name: str
    start: int
    length: int
    shard_offset: int


class FlatLayout:
    """Where each of `shapes` lives in a flat buffer padded to a multiple of `n` shards."""

    def __init__(self, names: list[str], shapes: list[torch.Size], n: int):
        if n < 1:
            raise ValueError(f"shard count must be positive, got {n}")
        self.names = list(names)
        self.shapes = [torch.Size(s) for s in shapes]
        self.numels = [math.prod(s) for s in self.shapes]
        self.offsets = []
        total = 0
        for k in self.numels:
            self.offsets.append(total)
            total += k
        self.numel = total
        self.n = n
        self.shard_numel = max(1, math.ceil(total / n))
        self.padded = self.shard_numel * n

    @property
    def padding(self) -> int:
        return self.padded - self.numel

    def shard_range(self, rank: int) -> tuple[int, int]:
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def segments(self, rank: int) -> list[Segment]:
        """Each parameter's intersection with `rank`'s shard, in parameter order."""
        lo, hi = self.shard_range(rank)
        out = []
        for i, (name, off, k) in enumerate(zip(self.names, self.offsets, self.numels, strict=True)):
            a, b = max(lo, off), min(hi, off + k)
            if a < b:
                out.append(Segment(i, name, a - off, b - a, a - lo))
            else:
                out.append(Segment(i, name, 0, 0, 0))
        return out

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter as a view of the full flat buffer (no copy, no autograd record)."""
        return [
            flat[off : off + k].view(shape)
            for off, k, shape in zip(self.offsets, self.numels, self.shapes, strict=True)
        ]

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter as a view of `flat` through one `split` (its backward is one `cat`,
        so the gradient of a leaf flat buffer is assembled without a full-size zero per view)."""
        parts = torch.split(flat, self.numels + [self.padding])
        return [p.view(shape) for p, shape in zip(parts, self.shapes, strict=False)]

    def flatten(self, tensors: list[torch.Tensor], dtype=None, device=None) -> torch.Tensor:
        """Concatenate `tensors` (in layout order) into a new padded flat buffer."""
        ref = tensors[0]
        flat = torch.zeros(self.padded, dtype=dtype or ref.dtype, device=device or ref.device)
        for t, off, k in zip(tensors, self.offsets, self.numels, strict=True):
            flat[off : off + k].copy_(t.detach().reshape(-1))
        return flat


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        st = t.untyped_storage()
        key = st.data_ptr()
        if st.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += st.nbytes()
    return total


def free_storage(t: torch.Tensor) -> None:
    """Release `t`'s memory but keep the tensor object (and every view of it) alive."""
    st = t.untyped_storage()
    if st.nbytes() != 0:
        st.resize_(0)


def alloc_storage(t: torch.Tensor) -> None:
    """Give back the storage `free_storage` released (contents undefined)."""
    st = t.untyped_storage()
    want = t.numel() * t.element_size()
    if st.nbytes() != want:
        st.resize_(want)

"""How context parallelism lays one sequence over the `cp` ranks of a group.

The sequence of T positions is cut into contiguous chunks whose lengths differ by at most one
(`chunk_bounds`: the first T mod n chunks are one longer). Two layouts:

* **head-tail** (ring attention's): 2·cp chunks; rank r holds chunks r and 2·cp−1−r. Under the
  causal mask a rank's queries then meet as many keys in total as every other rank's, so every
  step of the ring costs each rank the same (`ring_work`).
* **contiguous** (Ulysses', and the naive ring): cp chunks; rank r holds chunk r. Under a causal
  ring, rank r computes r full blocks and one diagonal block, so the last rank does about
  2·cp−1 times the first's work.

`SequenceSplit(T, cp, layout)` answers, for any rank: its chunks as global [start, stop) ranges,
its local length, the global positions of its tokens (what position embeddings and rotary angles
must use) and the index that takes its tokens out of a whole (B, T, ...) batch.
"""

from __future__ import annotations

import dataclasses

import torch

from plait.errors import ConfigError

LAYOUTS = ("head-tail", "contiguous")


def chunk_bounds(T: int, n: int) -> list[tuple[int, int]]:
    """[start, stop) of `n` contiguous chunks covering 0..T-1, lengths T//n or T//n + 1 (the
    longer first)."""
    base, extra = divmod(T, n)
    out, start = [], 0
    for i in range(n):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


@dataclasses.dataclass(frozen=True)
class SequenceSplit:
    """A sequence of `T` positions over `cp` ranks in `layout` ("head-tail" or "contiguous")."""

    T: int
    cp: int
    layout: str = "head-tail"

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ConfigError(
                f"context parallel layout {self.layout!r} is not valid; valid: {', '.join(LAYOUTS)}"
            )
        if self.cp < 1:
            raise ConfigError(f"parallel.cp must be >= 1, got {self.cp}")
        if self.T < self.n_chunks:
            raise ConfigError(
                f"a sequence of {self.T} tokens cannot be split into the {self.n_chunks} chunks that "
                f"parallel.cp = {self.cp} needs ({self.layout}: "
                f"{'2 x cp' if self.layout == 'head-tail' else 'cp'}): use longer sequences or a smaller cp"
            )

    @property
    def n_chunks(self) -> int:
        return 2 * self.cp if self.layout == "head-tail" else self.cp

    def chunks(self, rank: int) -> list[tuple[int, int]]:
        """The global [start, stop) ranges rank `rank` holds, in its local order."""
        bounds = chunk_bounds(self.T, self.n_chunks)
        if self.layout == "head-tail":
            return [bounds[rank], bounds[2 * self.cp - 1 - rank]]
        return [bounds[rank]]

    def local_len(self, rank: int) -> int:
        return sum(b - a for a, b in self.chunks(rank))

    def positions(self, rank: int, device=None) -> torch.Tensor:
        """The global positions of rank `rank`'s tokens, in its local order (int64)."""
        return torch.cat([torch.arange(a, b, device=device) for a, b in self.chunks(rank)])

    def take(self, x: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
        """Rank `rank`'s tokens of a whole sequence batch `x` (positions along `dim`)."""
        if x.shape[dim] != self.T:
            raise ConfigError(f"context parallelism split sequences of {self.T} tokens, got {x.shape[dim]}")
        return torch.cat([x.narrow(dim, a, b - a) for a, b in self.chunks(rank)], dim=dim)


def ring_work(split: SequenceSplit) -> list[int]:
    """Query-key scores each rank computes in one causal ring attention (forward), from the
    layout alone: a block of queries against keys wholly before them counts |Q|·|K|, a block
    against its own chunk |Q|(|Q|+1)/2, a block wholly after them nothing (skipped)."""
    work = []
    for r in range(split.cp):
        total = 0
        for qa, qb in split.chunks(r):
            for src in range(split.cp):
                for ka, kb in split.chunks(src):
                    if (ka, kb) == (qa, qb):
                        n = qb - qa
                        total += n * (n + 1) // 2
                    elif kb <= qa:
                        total += (qb - qa) * (kb - ka)
        work.append(total)
    return work

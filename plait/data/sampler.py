"""Deterministic, resumable batches for data-parallel training.

The token stream is cut into non-overlapping windows of ``seq_len + 1`` tokens; a window ``w``
gives the input ``w[:-1]`` and the next-token targets ``w[1:]``. Each epoch visits the windows in
a permutation drawn from a generator seeded by ``(seed, epoch)`` only, and global batch ``i`` is
the slice ``perm[i*G:(i+1)*G]``. A data-parallel rank takes a contiguous block of that slice's
rows, so the union of all ranks' rows, in rank order, is the same global batch whatever the
data-parallel degree: training on 1 or N ranks with the same seed sees the same data, which is
what makes parity tests against single-device training possible (Li et al. 2020: DDP is
equivalent to local training only if the ranks together consume the same global batch).
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from plait.errors import CheckpointError, ConfigError

Batch = tuple[torch.Tensor, torch.Tensor]


def _epoch_seed(seed: int, epoch: int) -> int:
    # A hash rather than seed + epoch, so that (seed=1, epoch=0) and (seed=0, epoch=1) differ.
    digest = hashlib.blake2b(f"plait.sampler:{seed}:{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _windows(tokens: torch.Tensor | np.ndarray, starts: torch.Tensor, seq_len: int) -> Batch:
    index = starts[:, None] + torch.arange(seq_len + 1)
    if isinstance(tokens, np.ndarray):  # a memmap: the fancy index reads just these windows' pages
        rows = torch.from_numpy(tokens[index.numpy()].astype(np.int64))
    else:
        rows = tokens[index].long()
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


class DistributedBatchSampler:
    """This rank's share of every global batch, split into micro-batches.

    Args:
        tokens: 1-D token ids (``Corpus.train``): a tensor, or a numpy array such as the memmap
            of the token cache, read window by window and never whole.
        seq_len: tokens per training sequence.
        global_batch: sequences per optimizer step, summed over all data-parallel ranks.
        dp_rank, dp_size: this rank's position on the data-parallel axis and its size.
        seed: the only source of randomness; no global RNG is read.
        micro_batches: gradient-accumulation steps (or pipeline micro-batches) per step.
        shift_windows: from epoch 1 on, start the windows at a random offset in
            ``[0, seq_len]`` so later epochs see different window boundaries; epoch 0 starts at
            the beginning of the stream.
    """

    def __init__(
        self,
        tokens: torch.Tensor | np.ndarray,
        seq_len: int,
        global_batch: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        micro_batches: int = 1,
        shift_windows: bool = True,
    ) -> None:
        if tokens.ndim != 1:
            raise ConfigError(f"tokens must be a 1-D stream, got shape {tuple(tokens.shape)}")
        for name, value in (
            ("seq_len", seq_len),
            ("global_batch", global_batch),
            ("dp_size", dp_size),
            ("micro_batches", micro_batches),
        ):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if not 0 <= dp_rank < dp_size:
            raise ConfigError(f"dp_rank={dp_rank} is outside [0, dp_size={dp_size})")
        unit = dp_size * micro_batches
        if global_batch % unit:
            nearest = sorted(
                {max(unit, global_batch - global_batch % unit), (global_batch // unit + 1) * unit}
            )
            raise ConfigError(
                f"global_batch={global_batch} must be divisible by dp_size * micro_batches = "
                f"{dp_size} * {micro_batches} = {unit}; use global_batch="
                f"{' or '.join(map(str, nearest))}, or change dp_size / micro_batches"
            )
        self.tokens = tokens
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.micro_batches = micro_batches
        self.shift_windows = shift_windows
        max_offset = seq_len if shift_windows else 0
        fewest = (len(tokens) - max_offset) // (seq_len + 1)
        if fewest < global_batch:
            raise ConfigError(
                f"{len(tokens)} tokens give only {max(fewest, 0)} windows of seq_len+1={seq_len + 1}"
                f"{' (allowing for the per-epoch shift)' if shift_windows else ''}, fewer than one "
                f"global_batch={global_batch}; lower global_batch or seq_len, or use a larger corpus"
            )
        self.epoch = 0
        self.index = 0
        self._plan: tuple[tuple[int, int], int, torch.Tensor] | None = None  # (seed, epoch), offset, perm

    @property
    def local_batch(self) -> int:
        """Sequences this rank processes per step (all its micro-batches together)."""
        return self.global_batch // self.dp_size

    @property
    def micro_batch_size(self) -> int:
        """Sequences per micro-batch on this rank."""
        return self.global_batch // (self.dp_size * self.micro_batches)

    def _epoch_plan(self, seed: int | None = None, epoch: int | None = None) -> tuple[int, torch.Tensor]:
        """Window offset and window order of an epoch (the current one by default), cached."""
        key = (self.seed if seed is None else seed, self.epoch if epoch is None else epoch)
        if self._plan is None or self._plan[0] != key:
            g = torch.Generator().manual_seed(_epoch_seed(*key))
            offset = 0
            if self.shift_windows and key[1] > 0:
                offset = int(torch.randint(0, self.seq_len + 1, (1,), generator=g))
            n_windows = (len(self.tokens) - offset) // (self.seq_len + 1)
            self._plan = (key, offset, torch.randperm(n_windows, generator=g))
        return self._plan[1], self._plan[2]

    def batches_per_epoch(self, epoch: int | None = None) -> int:
        """Full global batches in an epoch, the current one by default (a partial one is dropped).

        It can differ by one between epochs when ``shift_windows`` moves the window boundaries.
        """
        return len(self._epoch_plan(epoch=epoch)[1]) // self.global_batch

    def next_batch(self) -> list[Batch]:
        """This rank's ``micro_batches`` (x, y) pairs for the next step, then advance.

        Each tensor is int64 of shape ``(micro_batch_size, seq_len)``; the micro-batches are
        this rank's rows of the global batch in order.
        """
        offset, perm = self._epoch_plan()
        first = self.index * self.global_batch + self.dp_rank * self.local_batch
        starts = offset + perm[first : first + self.local_batch] * (self.seq_len + 1)
        x, y = _windows(self.tokens, starts, self.seq_len)
        self.index += 1
        if self.index == self.batches_per_epoch():
            self.epoch, self.index = self.epoch + 1, 0
        return list(zip(x.split(self.micro_batch_size), y.split(self.micro_batch_size)))

    def __iter__(self):
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        """The position of the next batch, as plain ints (safe for any checkpoint format)."""
        return {"epoch": int(self.epoch), "index": int(self.index), "seed": int(self.seed)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume so that the next batch is the one that would have followed ``state_dict()``.

        The seed is restored from the state as well: it determines every later batch.
        """
        missing = {"epoch", "index", "seed"} - set(state)
        if missing:
            raise CheckpointError(f"sampler state lacks {sorted(missing)}; got keys {sorted(state)}")
        seed, epoch, index = int(state["seed"]), int(state["epoch"]), int(state["index"])
        if epoch < 0 or index < 0:
            raise CheckpointError(f"sampler state has negative position epoch={epoch}, index={index}")
        n_batches = len(self._epoch_plan(seed, epoch)[1]) // self.global_batch
        if index >= n_batches:
            raise CheckpointError(
                f"sampler state index={index} is past the {n_batches} batches of epoch {epoch}; "
                "it was saved with a different corpus, seq_len or global_batch"
            )
        self.seed, self.epoch, self.index = seed, epoch, index


def eval_batches(
    tokens: torch.Tensor | np.ndarray, seq_len: int, batch_size: int, n_batches: int | None = None
) -> list[Batch]:
    """Deterministic evaluation batches: consecutive windows from the start of ``tokens``.

    Returns ``n_batches`` batches of (x, y), each ``(batch_size, seq_len)`` int64, or fewer if
    the stream holds fewer full batches (all of them when ``n_batches`` is None). The same
    windows come back on every call and every rank, so evaluation losses are comparable.
    """
    available = len(tokens) // (seq_len + 1) // batch_size
    if available < 1:
        raise ConfigError(
            f"{len(tokens)} held-out tokens do not fill one eval batch of {batch_size} x "
            f"(seq_len+1={seq_len + 1}); lower the eval batch size or seq_len, or hold out more"
        )
    n = available if n_batches is None else min(n_batches, available)
    starts = torch.arange(n * batch_size) * (seq_len + 1)
    x, y = _windows(tokens, starts, seq_len)
    return list(zip(x.split(batch_size), y.split(batch_size)))

"""A sparse problem from the embedded corpus: is the next byte whitespace?

Hogwild (Niu et al. 2011, "HOGWILD!: A Lock-Free Approach to Parallelizing Stochastic Gradient
Descent", §2) pays off when each example touches a few of many weights, so that two processes
rarely write the same coordinate at once: their "sparse SVM" and "text classification" problems.
This module builds such a problem from plait's embedded text (``plait.data.load_corpus``) with no
download: every byte position of the corpus is an example, its label is whether the byte there
is whitespace (space, newline, tab: a word boundary), and its features are the hashed byte
n-grams (n = 1..``max_n``) ending at each of the ``context`` bytes before it, each tagged with
its distance from the position. An example is a fixed-length list of ``context * max_n``
feature indices into a weight vector of ``n_features`` entries (the "hashing trick" of
Weinberger et al. 2009): with the defaults 18 of 2**18 weights, so any two examples share few
coordinates apart from the frequent short n-grams.

There is no bias feature on purpose: a weight every example touches is a guaranteed collision
on every update; the unigram features carry the base rate instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plait.errors import ConfigError

WHITESPACE = (ord(" "), ord("\n"), ord("\t"), ord("\r"))
"""The bytes whose positions are positive examples."""
_HASH_MULT = 2654435761
"""Knuth's multiplicative-hash constant (2**32 / golden ratio, odd): spreads the packed n-gram
keys, which differ in their low bytes, over all 32 bits before the reduction modulo the table."""
MAX_CONTEXT, MAX_N = 16, 3
"""Bounds that keep the packed key (distance, n, up to 3 bytes) below 2**30, so that key x
_HASH_MULT stays exact in int64."""


@dataclass(eq=False)
class SparseProblem:
    """Examples as rows of feature indices, with 0/1 labels, split into train and held-out."""

    train_x: torch.Tensor
    """int64 [examples, nnz]: the feature indices of each training example (all values 1)."""
    train_y: torch.Tensor
    """float32 [examples]: 1.0 where the byte is whitespace."""
    val_x: torch.Tensor
    """int64 [held-out examples, nnz], from the corpus's held-out tail."""
    val_y: torch.Tensor
    """float32 [held-out examples]."""
    n_features: int
    """Length of the weight vector the indices point into."""

    @property
    def nnz(self) -> int:
        """Weights each example touches (with repeats, if two n-grams hash alike)."""
        return self.train_x.shape[1]

    def share_memory_(self) -> SparseProblem:
        """Move every tensor to shared memory, so spawned workers map it instead of copying it."""
        for t in (self.train_x, self.train_y, self.val_x, self.val_y):
            t.share_memory_()
        return self


def hashed_ngram_features(
    data: torch.Tensor, n_features: int, context: int = 6, max_n: int = 3
) -> torch.Tensor:
    """int64 [len(data) - context - max_n + 1, context * max_n]: the features of every position
    ``i >= context + max_n - 1`` of the byte tensor ``data`` (row j is position j + context + max_n - 1).

    Feature (d, n) of position i is the n bytes ending at byte i - 1 - d, packed (the last byte
    highest) with d and n into one integer key, multiplicatively hashed and reduced modulo
    ``n_features``.
    """
    if not 1 <= context <= MAX_CONTEXT or not 1 <= max_n <= MAX_N:
        raise ConfigError(f"context must be in [1, {MAX_CONTEXT}] and max_n in [1, {MAX_N}]")
    b = data.long()
    first = context + max_n - 1
    n_pos = b.numel() - first
    if n_pos < 1:
        raise ConfigError(f"{b.numel()} bytes are too few for {context} bytes of context")
    # grams[n - 1][j]: the n bytes ending at byte j + max_n - 1, one integer (the last byte highest)
    grams, code = [], torch.zeros(b.numel() - max_n + 1, dtype=torch.long)
    for n in range(1, max_n + 1):
        code = (code << 8) | b[max_n - n : max_n - n + code.numel()]
        grams.append(code.clone())
    cols = []
    for d in range(context):
        start = first - 1 - d - (max_n - 1)  # where position `first`'s n-gram at distance d ends, in grams
        for n in range(1, max_n + 1):
            key = grams[n - 1][start : start + n_pos] + ((d * MAX_N + n - 1) << 24)
            cols.append(((key * _HASH_MULT) & 0xFFFFFFFF) % n_features)
    return torch.stack(cols, dim=1)


def _labels(data: torch.Tensor, first: int) -> torch.Tensor:
    y = torch.zeros(data.numel() - first, dtype=torch.float32)
    tail = data[first:]
    for byte in WHITESPACE:
        y[tail == byte] = 1.0
    return y


def build_problem(
    n_features: int = 2**18, context: int = 6, max_n: int = 3, corpus: str = "pydoc"
) -> SparseProblem:
    """The whitespace-prediction problem over the corpus's training bytes, held out over its tail."""
    from plait.data import load_corpus

    if not 2**8 <= n_features <= 2**26:
        raise ConfigError(f"n_features must be from 256 to {2**26:,}, got {n_features:,}")
    c = load_corpus(corpus)
    first = context + max_n - 1
    return SparseProblem(
        train_x=hashed_ngram_features(c.train, n_features, context, max_n),
        train_y=_labels(c.train, first),
        val_x=hashed_ngram_features(c.val, n_features, context, max_n),
        val_y=_labels(c.val, first),
        n_features=n_features,
    )


def logistic_loss(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> float:
    """Mean logistic loss (nats) of the linear model ``w`` on examples ``x`` (index rows), labels ``y``."""
    z = w.index_select(0, x.reshape(-1)).view(x.shape).sum(dim=1, dtype=torch.float64)
    return float(torch.nn.functional.binary_cross_entropy_with_logits(z, y.double()))

"""Byte-level text corpora that need no download.

The default corpus, ``"pydoc"``, is the help text that ships with CPython itself
(``pydoc_data.topics.topics``: ~79 topics, ~465k characters of English prose and code), so a
training run works offline and every machine sees the same bytes. Tokens are UTF-8 bytes,
a vocabulary of 256 that needs no tokenizer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from plait.errors import ConfigError

CORPUS_NAMES = ("pydoc", "file:PATH")


@dataclass(eq=False)
class Corpus:
    """A byte stream split into a training part and a contiguous held-out tail."""

    name: str
    """The name it was loaded by, e.g. ``"pydoc"`` or ``"file:notes.txt"``."""
    train: torch.Tensor
    """1-D uint8 tensor of training bytes."""
    val: torch.Tensor
    """1-D uint8 tensor of held-out bytes (the end of the stream)."""
    vocab_size: int = 256

    def encode(self, text: str) -> torch.Tensor:
        """UTF-8 bytes of ``text`` as a 1-D int64 tensor of token ids."""
        return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)

    def decode(self, tokens: torch.Tensor | list[int]) -> str:
        """Text of a sequence of byte ids; invalid UTF-8 (e.g. a cut multi-byte char) becomes U+FFFD."""
        ids = tokens.reshape(-1).tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        return bytes(ids).decode("utf-8", errors="replace")

    def unigram_entropy_bits(self) -> float:
        """Shannon entropy of the training bytes' frequency distribution, in bits per byte.

        A model that ignores context can do no better than this, so a trained language model's
        loss (converted to bits, loss / ln 2) should end well below it.
        """
        counts = torch.bincount(self.train.long(), minlength=self.vocab_size).double()
        p = counts[counts > 0] / counts.sum()
        return float(-(p * torch.log2(p)).sum())


def _pydoc_bytes() -> bytes:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics)).encode("utf-8")


def _file_bytes(path: str) -> bytes:
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as err:
        raise ConfigError(
            f"cannot read corpus file {path!r}: {err.strerror}; pass an existing text file"
        ) from err


def load_corpus(name: str = "pydoc", held_out_fraction: float = 0.05) -> Corpus:
    """Load a corpus by name: ``"pydoc"`` (default) or ``"file:PATH"`` for any text file.

    The last ``held_out_fraction`` of the byte stream (rounded up, at least one byte) is held
    out as a contiguous block rather than sampled, so no training window overlaps it except
    at the single boundary.
    """
    if not isinstance(held_out_fraction, int | float) or not 0 < held_out_fraction <= 0.5:
        raise ConfigError(f"held_out_fraction must be in (0, 0.5], got {held_out_fraction!r}")
    if name == "pydoc":
        data = _pydoc_bytes()
    elif name.startswith("file:") and len(name) > len("file:"):
        data = _file_bytes(name[len("file:") :])
    else:
        raise ConfigError(f"unknown corpus {name!r}; valid names: {', '.join(CORPUS_NAMES)}")
    n_val = math.ceil(len(data) * held_out_fraction)
    if len(data) - n_val < 1:
        raise ConfigError(
            f"corpus {name!r} has only {len(data)} bytes; too small to split off a held-out part"
        )
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    # clone() so each split owns just its bytes: a view would pin, and torch.save would write,
    # the whole buffer.
    return Corpus(name=name, train=tokens[:-n_val].clone(), val=tokens[-n_val:].clone())

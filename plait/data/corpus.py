"""Text corpora split into training tokens and a held-out tail.

The default corpus, ``"pydoc"``, is the help text that ships with CPython itself
(``pydoc_data.topics.topics``: ~79 topics, ~465k characters of English prose and code), so a
training run works offline and every machine sees the same bytes. ``data.corpus`` may also name a
text file or a directory of .txt / .jsonl files (plait.data.sources).

Tokens are UTF-8 bytes (a vocabulary of 256, no tokenizer) or the ids of a BPE tokenizer
(plait.data.tokenizer). A byte corpus of up to ``IN_MEMORY_MAX_BYTES`` is held in memory as a
uint8 tensor; anything else is tokenized once into memory-mapped files of the token cache
(plait.data.tokens) that later runs reuse, and the sampler reads its windows from those.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from plait.data import sources
from plait.data import tokens as cache
from plait.data.tokenizer import ByteTokenizer, load_tokenizer_file
from plait.errors import ConfigError

CORPUS_NAMES = ("pydoc", "file:PATH", "PATH (a text file or a directory of .txt / .jsonl files)")
TOKENIZERS = ("bytes", "bpe", "PATH (a tokenizer.json)")
IN_MEMORY_MAX_BYTES = 64 << 20
"""A byte-tokenized corpus up to this size stays in memory; above it, and for any other tokenizer,
the tokens go to the memory-mapped cache."""


@dataclass(eq=False)
class Corpus:
    """A token stream split into a training part and a contiguous held-out tail."""

    name: str
    """The name it was loaded by, e.g. ``"pydoc"`` or ``"file:notes.txt"``."""
    train: torch.Tensor | np.ndarray
    """1-D training token ids: a uint8 tensor in memory, or a read-only numpy memmap of the cache."""
    val: torch.Tensor | np.ndarray
    """1-D held-out token ids (the end of the stream), of the same kind."""
    vocab_size: int = 256
    tokenizer: object = field(default_factory=ByteTokenizer)
    """Encodes and decodes text (plait.data.tokenizer)."""
    train_bytes: int | None = None
    """Bytes of text the training split holds (None: one per token)."""
    val_bytes: int | None = None
    """Bytes of text the held-out split holds (None: one per token)."""
    cache_path: Path | None = None
    """The token-cache entry the splits are mapped from (None: in memory)."""

    def encode(self, text: str) -> torch.Tensor:
        """Token ids of ``text`` as a 1-D int64 tensor."""
        return torch.tensor(self.tokenizer.encode(text), dtype=torch.long)

    def decode(self, tokens: torch.Tensor | list[int]) -> str:
        """Text of a sequence of ids; invalid UTF-8 (e.g. a cut multi-byte char) becomes U+FFFD."""
        ids = tokens.reshape(-1).tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        return self.tokenizer.decode(ids)

    def token_bytes(self) -> np.ndarray:
        """Bytes of text each token id spells (all ones for the byte tokenizer)."""
        return self.tokenizer.token_bytes()

    def unigram_entropy_bits(self) -> float:
        """Shannon entropy of the training tokens' frequency distribution, in bits per token.

        A model that ignores context can do no better than this, so a trained language model's
        loss (converted to bits, loss / ln 2) should end well below it. Counted in chunks, so a
        memory-mapped split is never read into memory whole.
        """
        counts = np.zeros(self.vocab_size, dtype=np.int64)
        step = 1 << 24
        for i in range(0, len(self.train), step):
            chunk = self.train[i : i + step]
            chunk = chunk.numpy() if isinstance(chunk, torch.Tensor) else np.asarray(chunk)
            counts += np.bincount(chunk, minlength=self.vocab_size)[: self.vocab_size]
        p = counts[counts > 0] / counts.sum()
        return float(-(p * np.log2(p)).sum())


def load_corpus(
    name: str = "pydoc",
    held_out_fraction: float = 0.05,
    tokenizer: str = "bytes",
    vocab_size: int = 4096,
    cache_dir: str | Path | None = None,
    progress: bool = False,
) -> Corpus:
    """Load a corpus (``"pydoc"``, ``"file:PATH"`` or a file or directory path) and tokenize it.

    The last ``held_out_fraction`` of the byte stream (rounded up, at least one byte) is held
    out as a contiguous block rather than sampled, so no training window overlaps it except
    at the single boundary; for a tokenizer other than bytes the cut moves back to the start of a
    UTF-8 character. ``tokenizer``: ``"bytes"``, ``"bpe"`` (trained on the training split, at most
    ``vocab_size`` ids, cached) or the path of a tokenizer.json. ``cache_dir``: the token cache
    (plait.data.tokens; default $PLAIT_CACHE_DIR or ~/.cache/plait). ``progress``: a progress bar
    while tokenizing (shown by one process only).
    """
    if not isinstance(held_out_fraction, int | float) or not 0 < held_out_fraction <= 0.5:
        raise ConfigError(f"held_out_fraction must be in (0, 0.5], got {held_out_fraction!r}")
    files = sources.corpus_files(name)  # an unknown name, a bad path, an empty directory: ConfigError
    size = sum(p.stat().st_size for p, _ in files) if files is not None else 0
    if tokenizer == "bytes" and size <= IN_MEMORY_MAX_BYTES:
        data = sources.read_corpus(name)
        cut = _split_point(name, data, held_out_fraction, utf8=False)
        tokens = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if data
            else torch.zeros(0, dtype=torch.uint8)
        )
        # clone() so each split owns just its bytes: a view would pin, and torch.save would write,
        # the whole buffer.
        return Corpus(name=name, train=tokens[:cut].clone(), val=tokens[cut:].clone())

    root = cache.cache_root(cache_dir)
    fingerprint = sources.fingerprint(name)
    text = _LazySplits(name, held_out_fraction, utf8=tokenizer != "bytes")
    if tokenizer == "bytes":
        tok = ByteTokenizer()
    elif tokenizer == "bpe":
        key = cache.cache_key("bpe", fingerprint, held_out_fraction, vocab_size)
        tok = cache.cached_bpe(root, key, lambda: text.get()[0], vocab_size, progress)
        tok.name = "bpe"
    else:
        tok = load_tokenizer_file(tokenizer)
    entry = root / "tokens" / cache.cache_key(fingerprint, held_out_fraction, tok.fingerprint)
    found = cache.open_entry(entry)
    if found is None:
        train, val, train_bytes, val_bytes = text.get()
        meta = {
            "corpus": name,
            "corpus_fingerprint": fingerprint,
            "held_out_fraction": held_out_fraction,
            "tokenizer": tok.name,
            "tokenizer_fingerprint": tok.fingerprint,
            "train_bytes": train_bytes,
            "val_bytes": val_bytes,
        }
        cache.write_entry(entry, {"train": train, "val": val}, tok, meta, progress)
        found = cache.open_entry(entry)
    train, val, meta = found
    return Corpus(
        name=name,
        train=train,
        val=val,
        vocab_size=tok.vocab_size,
        tokenizer=tok,
        train_bytes=meta["train_bytes"],
        val_bytes=meta["val_bytes"],
        cache_path=entry,
    )


def _split_point(name: str, data: bytes, held_out_fraction: float, utf8: bool) -> int:
    """Where the held-out tail starts: the last fraction of the bytes, at a character start."""
    n_val = math.ceil(len(data) * held_out_fraction)
    cut = len(data) - n_val
    while utf8 and 0 < cut < len(data) and data[cut] & 0xC0 == 0x80:  # a UTF-8 continuation byte
        cut -= 1
    if cut < 1:
        raise ConfigError(
            f"corpus {name!r} has only {len(data)} bytes; too small to split off a held-out part"
        )
    return cut


class _LazySplits:
    """The corpus's two splits, read (and decoded to text for BPE) only when first needed: a cache
    hit never reads the corpus beyond hashing it."""

    def __init__(self, name: str, held_out_fraction: float, utf8: bool):
        self.name, self.fraction, self.utf8 = name, held_out_fraction, utf8
        self._splits = None

    def get(self):
        """(train, val, train bytes, val bytes): train and val as str (utf8) or bytes."""
        if self._splits is None:
            data = sources.read_corpus(self.name)
            cut = _split_point(self.name, data, self.fraction, self.utf8)
            train, val = data[:cut], data[cut:]
            if self.utf8:
                try:
                    data.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise ConfigError(
                        f"data.corpus = {self.name!r} is not UTF-8 text (byte 0x{data[exc.start]:02x} at "
                        f"offset {exc.start}); a BPE tokenizer reads text: use data.tokenizer = 'bytes'"
                    ) from None
                train, val = train.decode("utf-8"), val.decode("utf-8")
            self._splits = (train, val, cut, len(data) - cut)
        return self._splits

"""Tokenizers: UTF-8 bytes (no training, 256 ids) or a Hugging Face `tokenizers` model.

``data.tokenizer = "bpe"`` trains a byte-level BPE (Sennrich et al. 2016, "Neural Machine
Translation of Rare Words with Subword Units", on the bytes of GPT-2's tokenizer, Radford et al.
2019 §2.2) with Hugging Face ``tokenizers``: the 256 byte values are the initial alphabet, so
every text encodes with no unknown token and decodes back exactly. ``data.tokenizer = PATH``
loads any ``tokenizer.json``.

Bits per byte make held-out losses of different tokenizers comparable: a loss of L nats per token
over T predicted tokens that spell B bytes of text is ``L * T / B / ln 2`` bits per byte; for the
byte tokenizer T = B and it is L / ln 2.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import uuid
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from plait.errors import ConfigError

CHUNK_CHARS = 1 << 20
"""Text is encoded in pieces of about this many characters (for the progress bar and memory)."""
MAX_BPE_VOCAB = 2**20
"""data.vocab_size: the largest byte-level BPE vocabulary a run may train."""


class ByteTokenizer:
    """Token i is the byte value i: 256 ids, nothing to train or store."""

    name = "bytes"
    vocab_size = 256
    fingerprint = "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        """Invalid UTF-8 (e.g. a multi-byte character cut in half) becomes U+FFFD."""
        return bytes(ids).decode("utf-8", errors="replace")

    def token_bytes(self) -> np.ndarray:
        return np.ones(self.vocab_size, dtype=np.int64)


class HFTokenizer:
    """A Hugging Face ``tokenizers.Tokenizer`` behind plait's small tokenizer interface."""

    def __init__(self, tok, name: str):
        self.tok = tok
        self.name = name
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self._json = tok.to_str()
        self.fingerprint = hashlib.blake2b(self._json.encode(), digest_size=16).hexdigest()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def encode_pieces(self, pieces: list[str]) -> np.ndarray:
        """The ids of several pieces of one text, concatenated (pieces cut by `text_pieces`)."""
        out = self.tok.encode_batch(pieces, add_special_tokens=False)
        return np.fromiter((i for e in out for i in e.ids), dtype=np.int64)

    def token_bytes(self) -> np.ndarray:
        """UTF-8 bytes each token id spells. A byte-level vocabulary writes each byte as one
        character (GPT-2's byte-to-unicode table), so a token's length in characters is its length
        in bytes, exactly; for other tokenizers it is the length of the id decoded alone."""
        spec = json.loads(self._json)
        byte_level = "ByteLevel" in json.dumps(spec.get("decoder"))
        added = {t["id"]: t["content"] for t in spec.get("added_tokens") or []}
        sizes = np.zeros(self.vocab_size, dtype=np.int64)
        for i in range(self.vocab_size):
            if i in added:
                sizes[i] = len(added[i].encode("utf-8"))
            elif byte_level:
                sizes[i] = len(self.tok.id_to_token(i) or "")
            else:
                sizes[i] = len(self.tok.decode([i]).encode("utf-8"))
        return sizes

    def save(self, path: str | Path) -> Path:
        """Write tokenizer.json atomically (a temporary file renamed over it)."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        tmp.write_text(self._json)
        os.replace(tmp, path)
        return path


def text_pieces(text: str, size: int = CHUNK_CHARS) -> list[str]:
    """`text` cut into pieces of about `size` characters, each cut just after a newline that a
    non-space character follows. Byte-level BPE's pre-tokenizer (GPT-2's pattern) never joins a
    newline to a following non-space character, so encoding the pieces one by one gives exactly
    the ids of encoding the whole text."""
    out, start, n = [], 0, len(text)
    while start < n:
        cut, pos = n, start + size - 1
        while pos < n - 1:
            i = text.find("\n", pos)
            if i < 0 or i + 1 >= n:
                break
            if not text[i + 1].isspace():
                cut = i + 1
                break
            pos = i + 1
        out.append(text[start:cut])
        start = cut
    return out


def train_bpe(texts, vocab_size: int, progress: bool = False) -> HFTokenizer:
    """A byte-level BPE of at most `vocab_size` ids trained on `texts` (strings: pieces of the
    training split). Deterministic: the same text and size give the same tokenizer.json."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # exact round trip
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=progress,  # tokenizers' own bar
    )
    tok.train_from_iterator(texts, trainer)
    out = HFTokenizer(tok, "bpe")
    assert out.vocab_size <= vocab_size, (out.vocab_size, vocab_size)
    return out


def load_tokenizer_file(path: str | Path) -> HFTokenizer:
    """A ``tokenizer.json`` (Hugging Face `tokenizers` format), or a ConfigError naming the key."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise ConfigError(
            f"data.tokenizer = {str(path)!r}: no such tokenizer.json; valid: 'bytes', 'bpe', or the path "
            "of a Hugging Face tokenizer.json"
        )
    try:
        tok = Tokenizer.from_file(str(p))
    except Exception as exc:  # tokenizers raises a bare Exception for a malformed file
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"data.tokenizer = {str(path)!r} is not a valid tokenizer.json ({first})") from None
    return HFTokenizer(tok, str(p))


def bits_per_byte(loss_nats_per_token: float, tokens: int, nbytes: int) -> float:
    """Bits per byte of text from a mean loss in nats per token over `tokens` tokens that spell
    `nbytes` bytes. With one byte per token (the byte tokenizer) the ratio is exactly 1."""
    return loss_nats_per_token * (tokens / nbytes) / math.log(2)


def target_bytes(batches, token_bytes: np.ndarray) -> tuple[int, int]:
    """(tokens, bytes) of the targets of evaluation batches [(x, y), ...]: what the held-out loss
    is the mean over, and how many bytes of text those tokens spell."""
    sizes = torch.from_numpy(np.asarray(token_bytes, dtype=np.int64))
    tokens = nbytes = 0
    for _, y in batches:
        tokens += y.numel()
        nbytes += int(sizes[y.reshape(-1)].sum())
    return tokens, nbytes


def tokenizer_vocab_size(d) -> int:
    """Token ids of the tokenizer a run's [data] section (`d`) configures: 256 bytes,
    data.vocab_size for a BPE to train (it may learn fewer), or the size of the tokenizer.json at
    data.tokenizer."""
    if d.tokenizer == "bytes":
        return 256
    if d.tokenizer == "bpe":
        return d.vocab_size
    path = Path(d.tokenizer).expanduser()
    try:
        stamp = path.stat().st_mtime_ns
    except OSError:
        stamp = None
    return _tokenizer_file_size(str(path), stamp)


@functools.lru_cache(maxsize=16)
def _tokenizer_file_size(path: str, stamp) -> int:
    # keyed by the file's mtime too: validation asks often, and a rewritten file is read again
    return load_tokenizer_file(path).vocab_size  # missing or malformed: a ConfigError naming the key

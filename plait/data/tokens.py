"""The token cache: a corpus tokenized once into memory-mapped files that later runs reuse.

An entry is a directory ``<cache>/tokens/<key>/`` holding ``train.bin`` and ``val.bin`` (the
token ids of the two splits, raw little-endian uint8 / uint16 / uint32 by vocabulary size: up to
256, 65,536, more) and ``meta.json`` (counts of tokens and bytes, the dtype, what it was made
from). The key hashes the corpus content's fingerprint (plait.data.sources), the held-out
fraction and the tokenizer's fingerprint (the hash of its tokenizer.json), so any change to one
of them makes a new entry and nothing stale is ever read. A trained BPE is cached beside it as
``<cache>/bpe/<key>.json``, keyed by the corpus, the fraction and the vocabulary size.

``<cache>`` is ``data.cache_dir``, else ``$PLAIT_CACHE_DIR``, else ``~/.cache/plait``.

Writers never race: an entry is written into a private temporary directory and renamed into
place in one step (POSIX rename is atomic); a process that finds the name taken keeps the entry
already there (the same content) and drops its own. Readers therefore see a whole entry or none.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import uuid
from pathlib import Path

import numpy as np
from tqdm import tqdm

from plait.data.tokenizer import load_tokenizer_file, text_pieces, train_bpe

STATS = {"tokenized": 0, "bpe_trained": 0}
"""How many times this process tokenized a corpus split pair / trained a BPE (for tests)."""
_VERSION = 1


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """The cache directory: `cache_dir`, else $PLAIT_CACHE_DIR, else ~/.cache/plait."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    env = os.environ.get("PLAIT_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "plait"


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned type that holds every id of the vocabulary."""
    if vocab_size <= 1 << 8:
        return np.dtype(np.uint8)
    if vocab_size <= 1 << 16:
        return np.dtype(np.uint16)
    return np.dtype(np.uint32)


def cache_key(*parts) -> str:
    raw = json.dumps([_VERSION, *parts]).encode()
    return hashlib.blake2b(raw, digest_size=12).hexdigest()


def _private_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


def publish(tmp: Path, final: Path) -> Path:
    """Rename `tmp` (a file or a whole directory) to `final`; if another process got there first,
    keep theirs and delete ours."""
    try:
        os.rename(tmp, final)  # a directory: fails if `final` exists and is not empty
    except OSError:
        if not final.exists():
            raise
        shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()
    return final


def show_progress() -> bool:
    """Only one process shows a progress bar: the launcher or global rank 0."""
    return os.environ.get("RANK", "0") == "0"


def write_entry(entry: Path, splits: dict, tokenizer, meta: dict, progress: bool) -> None:
    """Tokenize `splits` ({"train": text or bytes, "val": ...}) into the cache entry `entry`."""
    dtype = token_dtype(tokenizer.vocab_size)
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = _private_name(entry)
    tmp.mkdir()
    total = sum(len(v) for v in splits.values())
    bar = tqdm(
        total=total,
        desc="tokenize",
        unit="char" if tokenizer.name != "bytes" else "B",
        unit_scale=True,
        disable=not (progress and show_progress()),
        file=sys.stderr,
        mininterval=1.0,
    )
    counts = {}
    try:
        for split, data in splits.items():
            n = 0
            with open(tmp / f"{split}.bin", "wb") as fh:
                if isinstance(data, bytes):  # the byte tokenizer: the bytes are the ids
                    fh.write(data)
                    n = len(data)
                    bar.update(len(data))
                else:
                    pieces = text_pieces(data)
                    for i in range(0, len(pieces), 16):
                        group = pieces[i : i + 16]
                        ids = tokenizer.encode_pieces(group)
                        fh.write(ids.astype(dtype).tobytes())
                        n += len(ids)
                        bar.update(sum(map(len, group)))
            counts[split] = n
    finally:
        bar.close()
    meta = {**meta, "dtype": dtype.name, "train_tokens": counts["train"], "val_tokens": counts["val"]}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    STATS["tokenized"] += 1
    publish(tmp, entry)


def open_entry(entry: Path) -> tuple[np.memmap, np.memmap, dict] | None:
    """The memory-mapped splits and meta of a cache entry, or None if there is none."""
    try:
        meta = json.loads((entry / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    maps = []
    for split in ("train", "val"):
        n = meta[f"{split}_tokens"]
        if n == 0:  # np.memmap cannot map an empty file
            maps.append(np.zeros(0, dtype=meta["dtype"]))
        else:
            maps.append(np.memmap(entry / f"{split}.bin", dtype=meta["dtype"], mode="r", shape=(n,)))
    return maps[0], maps[1], meta


def cached_bpe(cache: Path, key: str, train_text, vocab_size: int, progress: bool = False):
    """The BPE trained on the training split (`train_text()` gives it), from the cache or trained
    now and cached."""
    path = cache / "bpe" / f"{key}.json"
    if path.is_file():
        return load_tokenizer_file(path)
    tok = train_bpe(text_pieces(train_text()), vocab_size, progress and show_progress())
    STATS["bpe_trained"] += 1
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _private_name(path)
    tok.save(tmp)
    publish(tmp, path)
    return load_tokenizer_file(path)  # every process uses the file that won, byte for byte

"""Where a corpus's text comes from: the embedded default, a text file, or a directory of files.

``data.corpus`` names one of:

* ``"pydoc"``: the help text bundled with CPython (see plait.data.corpus), no download;
* a path to a text file (``.jsonl`` files are read as JSON lines, anything else as raw text), or
  ``"file:PATH"``, the same with an explicit prefix;
* a path to a directory: every ``.txt`` and ``.jsonl`` file under it, recursively, in sorted order
  of their relative paths; names starting with ``.`` (hidden files, plait's cache) are skipped and
  other extensions ignored.

A ``.txt`` file is one document; a ``.jsonl`` file holds one document per non-blank line, a JSON
object whose ``"text"`` field is a string. Documents are joined with a blank line (``"\\n\\n"``,
as the embedded corpus joins its topics) rather than with a special token, so the same stream
works for the byte tokenizer, which has no room for one, and for BPE.

The fingerprint of a corpus hashes the raw content of its files (and their relative names), not
their paths or times, so a copy of the same data hits the same token cache.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from plait.errors import ConfigError

SEPARATOR = b"\n\n"
"""Between two documents (files of a directory, lines of a .jsonl file)."""
EXTENSIONS = (".txt", ".jsonl")
_FORMAT = b"plait.data.sources v1"  # bump when the way files become a stream changes


def _bad(spec: str, why: str) -> ConfigError:
    return ConfigError(f"data.corpus = {spec!r}: {why}")


def corpus_files(spec: str) -> list[tuple[Path, str]] | None:
    """The files ``spec`` names with their names relative to it, in stream order (None for the
    embedded default), or a ConfigError."""
    if spec == "pydoc":
        return None
    raw = spec[len("file:") :] if spec.startswith("file:") else spec
    if not raw:
        raise _bad(spec, "no path after 'file:'; give file:PATH")
    path = Path(raw).expanduser()
    if path.is_dir():
        files = sorted(
            (
                p
                for p in path.rglob("*")
                if p.suffix in EXTENSIONS
                and p.is_file()
                and not any(part.startswith(".") for part in p.relative_to(path).parts)
            ),
            key=lambda p: p.relative_to(path).as_posix(),
        )
        if not files:
            raise _bad(spec, f"the directory holds no {' or '.join(EXTENSIONS)} files")
        return [(p, p.relative_to(path).as_posix()) for p in files]
    if path.is_file():
        return [(path, "." + path.suffix)]  # a single file: only its kind (.jsonl or not) matters
    if spec.startswith("file:"):
        raise ConfigError(f"cannot read corpus file {raw!r}: no such file; pass an existing text file")
    raise _bad(
        spec,
        "no such file or directory; valid: 'pydoc' (the embedded default), a text file, "
        "a directory of .txt / .jsonl files, or file:PATH",
    )


def _read(spec: str, path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:
        raise ConfigError(
            f"cannot read corpus file {str(path)!r}: {err.strerror}; pass an existing text file"
        ) from err


def _jsonl_documents(spec: str, path: Path, raw: bytes) -> list[bytes]:
    docs = []
    for number, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as err:
            raise _bad(spec, f"{path}:{number} is not a JSON line ({err.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise _bad(
                spec,
                f'{path}:{number} has no string "text" field; each line of a .jsonl file '
                'must be a JSON object like {"text": "..."}',
            )
        docs.append(record["text"].encode("utf-8"))
    return docs


def _pydoc_bytes() -> bytes:
    # Here: a megabyte of text that only this corpus reads, and some Python builds leave it out.
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics)).encode("utf-8")


def read_corpus(spec: str) -> bytes:
    """The corpus as one byte stream: its documents joined by SEPARATOR."""
    files = corpus_files(spec)
    if files is None:
        return _pydoc_bytes()
    docs: list[bytes] = []
    for path, _ in files:
        raw = _read(spec, path)
        docs.extend(_jsonl_documents(spec, path, raw) if path.suffix == ".jsonl" else [raw])
    return SEPARATOR.join(docs)


_SNIFF = 1 << 16  # bytes of each file looked at


def binary_note(spec: str) -> str | None:
    """A line saying that the corpus does not look like text (a NUL byte, or bytes that are not
    UTF-8, in the first 64 KiB of one of its files), or None. The bytes tokenizer trains on any
    bytes, so a wrong file (an archive, a binary) would train without complaint."""
    for path, _ in corpus_files(spec) or []:
        try:
            with open(path, "rb") as fh:
                head = fh.read(_SNIFF)
        except OSError:
            continue
        bad = head.find(b"\0")
        if bad < 0:
            try:
                head.decode("utf-8")
            except UnicodeDecodeError as exc:
                # a multi-byte character cut by the 64 KiB window is still text
                bad = exc.start if exc.start < len(head) - 3 else -1
        if bad >= 0:
            return (
                f"data.corpus = {spec!r}: {path} does not look like text (byte 0x{head[bad]:02x} at offset "
                f"{bad}); the bytes tokenizer trains on its raw bytes: is it the right file?"
            )
    return None


def fingerprint(spec: str) -> str:
    """A hash of the corpus content: the raw bytes and relative names of its files (hex, 32 chars)."""
    h = hashlib.blake2b(_FORMAT, digest_size=16)
    files = corpus_files(spec)
    if files is None:
        h.update(b"pydoc\0" + _pydoc_bytes())
        return h.hexdigest()
    for path, name in files:
        h.update(f"\0{len(name)}:{name}\0".encode())
        try:
            with open(path, "rb") as fh:
                while chunk := fh.read(1 << 22):
                    h.update(chunk)
        except OSError as err:
            raise ConfigError(f"cannot read corpus file {str(path)!r}: {err.strerror}") from err
        h.update(b"\0end")
    return h.hexdigest()

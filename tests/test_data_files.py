"""Corpora from files and directories, BPE tokenizers, the memory-mapped token cache and bits per
byte (plait.data.sources, plait.data.tokenizer, plait.data.tokens), and their config checks."""

import json
import math
import os
import shutil
import sys

import numpy as np
import pytest
import torch

from plait.data import DistributedBatchSampler, eval_batches, load_corpus
from plait.data import corpus as corpus_module
from plait.data import tokens as token_cache
from plait.data.sources import read_corpus
from plait.data.tokenizer import ByteTokenizer, bits_per_byte, load_tokenizer_file, target_bytes, text_pieces
from plait.errors import ConfigError
from plait.train.config import load_config, model_config

VOCAB = 512


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def bpe(cache):
    """The embedded corpus under a BPE of 512 ids, trained once for the module."""
    return load_corpus("pydoc", tokenizer="bpe", vocab_size=VOCAB, cache_dir=cache)


def _splits(corpus) -> tuple[str, str]:
    data = read_corpus(corpus.name)
    return data[: corpus.train_bytes].decode(), data[corpus.train_bytes :].decode()


def test_bpe_round_trips_the_corpus_exactly(bpe):
    train_text, val_text = _splits(bpe)
    assert bpe.tokenizer.name == "bpe" and 256 < bpe.vocab_size <= VOCAB
    assert isinstance(bpe.train, np.memmap) and bpe.train.dtype == np.uint16
    # the cached ids (encoded piece by piece, with a progress bar) are those of one whole encode
    whole = bpe.tokenizer.encode(train_text)
    assert bpe.train.tolist() == whole
    assert bpe.val.tolist() == bpe.tokenizer.encode(val_text)
    assert len(whole) < 0.5 * len(train_text.encode())  # it did learn merges
    assert bpe.decode(torch.tensor(whole)) == train_text
    assert bpe.decode(bpe.val.tolist()) == val_text
    tricky = "naïve café — ünïcode ✓ 🐍\n\n\tdef f(x):\r\n    return x ** 2  "
    assert bpe.decode(bpe.encode(tricky)) == tricky
    # every id spells a known number of bytes: the splits' sums are their byte counts
    sizes = bpe.token_bytes()
    assert int(sizes[np.asarray(bpe.train)].sum()) == bpe.train_bytes == len(train_text.encode())
    assert int(sizes[np.asarray(bpe.val)].sum()) == bpe.val_bytes == len(val_text.encode())


def test_text_pieces_cut_where_the_tokens_do_not_change(bpe):
    text = _splits(bpe)[0][:60_000]
    for size in (1, 7, 500, 10_000):
        pieces = text_pieces(text, size)
        assert "".join(pieces) == text and len(pieces) > 1
        assert bpe.tokenizer.encode_pieces(pieces).tolist() == bpe.tokenizer.encode(text)


def test_bpe_is_trained_on_the_training_split_only(tmp_path):
    # a word that is frequent in the held-out tail and absent before it: a BPE trained on the whole
    # text would merge it into a token of its own
    text = "the cat sat on the mat. " * 400 + "zqxv " * 200
    (tmp_path / "c.txt").write_text(text)
    c = load_corpus(str(tmp_path / "c.txt"), 0.25, "bpe", 400, tmp_path / "cache")
    train_text, val_text = _splits(c)
    assert "zqxv" not in train_text and val_text.count("zqxv") == 200
    vocab = c.tokenizer.tok.get_vocab()
    assert not [t for t in vocab if "zq" in t or "xv" in t]
    assert any("cat" in t for t in vocab)  # the training text's words were merged
    assert c.decode(c.val.tolist()) == val_text


def test_bpe_training_is_deterministic(bpe):
    from plait.data.tokenizer import train_bpe

    again = train_bpe(text_pieces(_splits(bpe)[0]), VOCAB)
    assert again.fingerprint == bpe.tokenizer.fingerprint


def _batches(tokens, steps: int, dp: int = 2, shift: bool = True):
    out = []
    for rank in range(dp):
        s = DistributedBatchSampler(tokens, 16, 8, rank, dp, seed=3, micro_batches=2, shift_windows=shift)
        epoch_len = s.batches_per_epoch()
        out.append([s.next_batch() for _ in range(steps or epoch_len + 3)])
    return out


def _assert_same(a, b):
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        for step_a, step_b in zip(ra, rb):
            for (xa, ya), (xb, yb) in zip(step_a, step_b):
                assert xa.dtype == xb.dtype == torch.long
                assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_memmap_batches_equal_in_memory_batches(bpe, tmp_path, monkeypatch):
    # BPE ids: the sampler reads windows of the memmap; in memory: the same ids as a tensor
    in_memory = torch.from_numpy(np.array(bpe.train, dtype=np.int64))
    assert isinstance(bpe.train, np.memmap)
    _assert_same(_batches(bpe.train, 5), _batches(in_memory, 5))
    small = bpe.train[:2000]  # past an epoch boundary (shifted windows from epoch 1)
    _assert_same(_batches(small, 0), _batches(torch.from_numpy(np.array(small, dtype=np.int64)), 0))
    ev_map = eval_batches(bpe.val, 16, 8, 3)
    ev_mem = eval_batches(torch.from_numpy(np.array(bpe.val, dtype=np.int64)), 16, 8, 3)
    _assert_same([[ev_map]], [[ev_mem]])

    # bytes: a corpus above the in-memory limit goes to the cache, and gives the same batches
    path = tmp_path / "bytes.txt"
    path.write_bytes(read_corpus("pydoc")[:50_000])
    held = load_corpus(str(path), 0.1)
    assert isinstance(held.train, torch.Tensor) and held.cache_path is None
    monkeypatch.setattr(corpus_module, "IN_MEMORY_MAX_BYTES", 0)
    mapped = load_corpus(str(path), 0.1, cache_dir=tmp_path / "cache")
    assert isinstance(mapped.train, np.memmap) and mapped.train.dtype == np.uint8
    assert mapped.train_bytes == len(held.train) and mapped.val_bytes == len(held.val)
    _assert_same(_batches(mapped.train, 0), _batches(held.train, 0))
    _assert_same([[eval_batches(mapped.val, 16, 8)]], [[eval_batches(held.val, 16, 8)]])


def test_directory_of_txt_and_jsonl(tmp_path):
    d = tmp_path / "data"
    (d / "sub").mkdir(parents=True)
    (d / ".hidden").mkdir()
    (d / "b.txt").write_text("bee text\n")
    (d / "a.jsonl").write_text(
        json.dumps({"text": "first doc", "id": 1}) + "\n\n" + json.dumps({"text": "second ✓"}) + "\n"
    )
    (d / "sub" / "c.txt").write_text("sea")
    (d / ".hidden" / "x.txt").write_text("never")
    (d / "notes.md").write_text("ignored")
    expected = "first doc\n\nsecond ✓\n\nbee text\n\n\nsea".encode()
    assert read_corpus(str(d)) == read_corpus(f"file:{d}") == expected
    c = load_corpus(str(d), 0.25)
    assert bytes(torch.cat([c.train, c.val]).tolist()) == expected
    assert len(c.val) == math.ceil(0.25 * len(expected))
    # one .jsonl file on its own
    assert read_corpus(str(d / "a.jsonl")) == "first doc\n\nsecond ✓".encode()
    # BPE over the directory: the cut moves back to a character start (✓ is three bytes)
    c = load_corpus(str(d), 0.5, "bpe", 300, tmp_path / "cache")
    train_text, val_text = _splits(c)
    assert (train_text + val_text).encode() == expected
    assert c.decode(c.train.tolist()) == train_text and c.decode(c.val.tolist()) == val_text


def test_the_cache_is_reused_not_retokenized(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    (d / "one.txt").write_text("hello world, hello tokens. " * 300)
    (d / "two.jsonl").write_text(json.dumps({"text": "more words " * 50}) + "\n")
    cache = tmp_path / "cache"
    before = dict(token_cache.STATS)
    first = load_corpus(str(d), 0.1, "bpe", 300, cache)
    assert token_cache.STATS == {
        "tokenized": before["tokenized"] + 1,
        "bpe_trained": before["bpe_trained"] + 1,
    }
    meta = first.cache_path / "meta.json"
    stamp = (meta.stat().st_mtime_ns, (first.cache_path / "train.bin").stat().st_mtime_ns)
    second = load_corpus(str(d), 0.1, "bpe", 300, cache)
    assert second.cache_path == first.cache_path
    assert (meta.stat().st_mtime_ns, (first.cache_path / "train.bin").stat().st_mtime_ns) == stamp
    assert token_cache.STATS["tokenized"] == before["tokenized"] + 1  # neither retokenized ...
    assert token_cache.STATS["bpe_trained"] == before["bpe_trained"] + 1  # ... nor retrained
    assert np.array_equal(first.train, second.train)
    # the same content elsewhere is the same entry (the key hashes content, not paths)
    shutil.copytree(d, tmp_path / "copy")
    assert load_corpus(str(tmp_path / "copy"), 0.1, "bpe", 300, cache).cache_path == first.cache_path
    # the saved tokenizer.json, given as a path, finds the same entry too
    saved = first.tokenizer.save(tmp_path / "tokenizer.json")
    by_path = load_corpus(str(d), 0.1, str(saved), cache_dir=cache)
    assert (
        by_path.cache_path == first.cache_path
        and by_path.tokenizer.fingerprint == first.tokenizer.fingerprint
    )
    assert token_cache.STATS["tokenized"] == before["tokenized"] + 1
    # new content, a new fraction or a new vocabulary: new entries, none stale
    (d / "one.txt").write_text("hello world, hello tokens! " * 300)
    assert load_corpus(str(d), 0.1, "bpe", 300, cache).cache_path != first.cache_path
    assert load_corpus(str(tmp_path / "copy"), 0.2, "bpe", 300, cache).cache_path != first.cache_path
    assert load_corpus(str(tmp_path / "copy"), 0.1, "bpe", 260, cache).cache_path != first.cache_path
    assert token_cache.STATS["tokenized"] == before["tokenized"] + 4


def test_a_second_writer_keeps_the_first_entry(tmp_path):
    """Two processes that miss the cache at once both tokenize; the rename that comes second
    finds the entry in place, keeps it and deletes its own temporary directory."""
    entry = tmp_path / "tokens" / "k"
    tok = ByteTokenizer()
    token_cache.write_entry(entry, {"train": b"abc", "val": b"d"}, tok, {"n": 1}, False)
    token_cache.write_entry(entry, {"train": b"xyz", "val": b"w"}, tok, {"n": 2}, False)
    train, val, meta = token_cache.open_entry(entry)
    assert bytes(train) == b"abc" and bytes(val) == b"d" and meta["n"] == 1
    assert sorted(p.name for p in entry.parent.iterdir()) == ["k"]
    assert token_cache.token_dtype(256) == np.uint8
    assert token_cache.token_dtype(65_536) == np.uint16 and token_cache.token_dtype(65_537) == np.uint32


def test_bits_per_byte():
    # by hand: 4 target tokens spelling 2 + 3 + 4 + 1 = 10 bytes at 2 nats per token
    # = 8 nats over 10 bytes = 0.8 / ln 2 bits per byte
    batches = [(torch.zeros(2, 2, dtype=torch.long), torch.tensor([[1, 2], [3, 0]]))]
    tokens, nbytes = target_bytes(batches, np.array([1, 2, 3, 4]))
    assert (tokens, nbytes) == (4, 10)
    assert bits_per_byte(2.0, tokens, nbytes) == pytest.approx(0.8 / math.log(2), rel=1e-15)
    # the byte tokenizer: one byte per token, so bits per byte is the loss / ln 2, exactly
    ev = eval_batches(load_corpus().val, 32, 4, 2)
    counts = target_bytes(ev, ByteTokenizer().token_bytes())
    assert counts == (2 * 4 * 32,) * 2
    for loss in (0.1, 1.7345, 5.5451774444795625):
        assert bits_per_byte(loss, *counts) == loss / math.log(2)


def _config(tmp_path, *pairs):
    args = [("data.cache_dir", str(tmp_path / "cache")), ("model.name", "tiny"), ("train.global_batch", "8")]
    return load_config(None, args + [tuple(p.split("=", 1)) for p in pairs])


def test_model_vocab_follows_the_tokenizer(tmp_path, bpe):
    cfg = _config(tmp_path, "data.tokenizer=bpe", "data.vocab_size=300")
    assert model_config(cfg).vocab_size == 300
    assert model_config(_config(tmp_path)).vocab_size == 256  # bytes: the named size's
    path = bpe.tokenizer.save(tmp_path / "tok.json")
    cfg = _config(tmp_path, f"data.tokenizer={path}", "data.corpus=pydoc")
    assert model_config(cfg).vocab_size == bpe.vocab_size == load_tokenizer_file(path).vocab_size
    assert (
        model_config(_config(tmp_path, f"data.tokenizer={path}", "model.vocab_size=1024")).vocab_size == 1024
    )


def _refused(tmp_path, match: str, *pairs):
    with pytest.raises(ConfigError, match=match) as err:
        _config(tmp_path, *pairs)
    assert "\n" not in str(err.value)  # one line
    return str(err.value)


def test_bad_inputs_are_one_config_error_before_start(tmp_path, monkeypatch):
    d = tmp_path / "d"
    d.mkdir()
    _refused(
        tmp_path, r"data.corpus = .*no such file or directory.*pydoc", f"data.corpus={tmp_path / 'nope'}"
    )
    _refused(tmp_path, r"cannot read corpus file", f"data.corpus=file:{tmp_path / 'nope.txt'}")
    _refused(tmp_path, r"data.corpus = .*no \.txt or \.jsonl files", f"data.corpus={d}")
    (d / "readme.md").write_text("not a corpus")
    _refused(tmp_path, r"no \.txt or \.jsonl files", f"data.corpus={d}")
    (d / "a.jsonl").write_text('{"text": "fine"}\n{"body": "no text"}\n')
    msg = _refused(tmp_path, r'data.corpus = .*a.jsonl:2 has no string "text" field', f"data.corpus={d}")
    assert str(d / "a.jsonl") in msg
    (d / "a.jsonl").write_text('{"text": "fine"}\nnot json\n')
    _refused(tmp_path, r"a.jsonl:2 is not a JSON line", f"data.corpus={d}")
    (d / "a.jsonl").write_text('{"text": 7}\n')
    _refused(tmp_path, r'a.jsonl:1 has no string "text"', f"data.corpus={d}")

    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\xe9 ".encode("latin-1") * 3000)
    _refused(
        tmp_path, r"not UTF-8 text .*data.tokenizer = 'bytes'", f"data.corpus={latin}", "data.tokenizer=bpe"
    )
    _config(tmp_path, f"data.corpus={latin}")  # bytes read anything

    _refused(tmp_path, r"data.tokenizer = .*no such tokenizer.json.*'bytes', 'bpe'", "data.tokenizer=bep")
    bad = tmp_path / "bad.json"
    bad.write_text('{"not": "a tokenizer"}')
    _refused(tmp_path, r"data.tokenizer = .*is not a valid tokenizer.json", f"data.tokenizer={bad}")
    for size in ("100", str(2**20 + 1)):
        _refused(
            tmp_path,
            r"data.vocab_size = .* out of range: .*256",
            "data.tokenizer=bpe",
            f"data.vocab_size={size}",
        )
    _refused(
        tmp_path,
        r"model.vocab_size = 256 is smaller than the 4096 ids of data.tokenizer = 'bpe'",
        "data.tokenizer=bpe",
        "model.vocab_size=256",
    )
    _refused(tmp_path, r"ps.servers = 1 with data.tokenizer = 'bpe'", "data.tokenizer=bpe", "ps.servers=1")
    _refused(tmp_path, r"unknown key 'log.tensorbord'", "log.tensorbord=true")
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed
    _refused(tmp_path, r"log.tensorboard = true .* pip install plait\[tensorboard\]", "log.tensorboard=true")


def test_unigram_entropy_of_a_memmap_matches_in_memory(bpe):
    as_tensor = corpus_module.Corpus(
        "t", torch.from_numpy(np.array(bpe.train, dtype=np.int64)), bpe.val, VOCAB
    )
    counts = np.bincount(np.asarray(bpe.train), minlength=VOCAB)
    p = counts[counts > 0] / counts.sum()
    assert bpe.unigram_entropy_bits() == pytest.approx(float(-(p * np.log2(p)).sum()), rel=1e-12)
    assert as_tensor.unigram_entropy_bits() == pytest.approx(bpe.unigram_entropy_bits(), rel=1e-12)
    assert os.path.getsize(bpe.cache_path / "train.bin") == 2 * len(bpe.train)

"""The embedded byte-level corpus of plait.data."""

import pytest
import torch

from plait.data import Corpus, load_corpus
from plait.errors import ConfigError


@pytest.fixture(scope="module")
def pydoc() -> Corpus:
    return load_corpus()


def test_pydoc_corpus_size_and_split(pydoc):
    total = len(pydoc.train) + len(pydoc.val)
    assert 440_000 < total < 500_000
    assert pydoc.train.dtype == torch.uint8 and pydoc.train.ndim == 1
    assert pydoc.vocab_size == 256
    assert abs(len(pydoc.val) - 0.05 * total) <= 1
    # The held-out part is the contiguous tail: train + val is the whole stream in order.
    from pydoc_data.topics import topics

    stream = "\n\n".join(topics[k] for k in sorted(topics)).encode()
    assert bytes(torch.cat([pydoc.train, pydoc.val]).tolist()) == stream
    assert pydoc.train.data_ptr() != pydoc.val.data_ptr()


def test_encode_decode_round_trip(pydoc):
    text = "def f(x):\n    return x ** 2  # naïve — ünïcode ✓"
    ids = pydoc.encode(text)
    assert ids.dtype == torch.long
    assert len(ids) == len(text.encode("utf-8")) > len(text)
    assert pydoc.decode(ids) == text
    assert pydoc.decode(ids.tolist()) == text
    # A multi-byte character cut in half decodes with a replacement char instead of raising.
    assert pydoc.decode(pydoc.encode("é")[:1]) == "\ufffd"
    assert "Python" in pydoc.decode(pydoc.train[:20000])


def test_unigram_entropy(pydoc):
    h = pydoc.unigram_entropy_bits()
    assert 3.0 < h < 6.0
    uniform = Corpus("u", torch.arange(256, dtype=torch.uint8).repeat(4), torch.zeros(1, dtype=torch.uint8))
    assert uniform.unigram_entropy_bits() == pytest.approx(8.0)
    constant = Corpus("c", torch.full((100,), 65, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8))
    assert constant.unigram_entropy_bits() == 0.0


def test_held_out_fraction(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_bytes(bytes(range(200)) * 5)
    corpus = load_corpus(f"file:{path}", held_out_fraction=0.2)
    assert corpus.name == f"file:{path}"
    assert (len(corpus.train), len(corpus.val)) == (800, 200)
    assert corpus.val.tolist() == list(range(200))
    for bad in (0, 0.0, -0.1, 0.51, 1.0):
        with pytest.raises(ConfigError, match="held_out_fraction"):
            load_corpus(f"file:{path}", held_out_fraction=bad)


def test_bad_names_raise_config_error(tmp_path):
    with pytest.raises(ConfigError, match="pydoc"):
        load_corpus("shakespeare")
    with pytest.raises(ConfigError, match="cannot read"):
        load_corpus(f"file:{tmp_path / 'missing.txt'}")
    (tmp_path / "one.txt").write_bytes(b"a")
    with pytest.raises(ConfigError, match="too small"):
        load_corpus(f"file:{tmp_path / 'one.txt'}")

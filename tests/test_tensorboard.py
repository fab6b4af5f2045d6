"""`[log] tensorboard = true` (plait.train.tensorboard): event files read back with tensorboard's
own reader hold every number of metrics.jsonl; and one BPE run end to end (data.tokenizer = bpe)."""

import json
import math

import pytest
import tensorboard  # noqa: F401  (installed by the test command, make test: a missing one fails, never skips)
import torch
from conftest import TINY, plait_train
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from plait.train.metrics import read_metrics
from plait.train.tensorboard import TensorBoardWriter, scalars


def _read(log_dir) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _expected(records) -> dict[str, list[tuple[int, float]]]:
    out = {}
    for r in records:
        for tag, value in scalars(r).items():
            out.setdefault(tag, []).append((r["step"], value))
    return out


def _assert_events_match(events, records):
    expected = _expected(records)
    assert set(events) == set(expected)
    for tag, want in expected.items():
        got = events[tag]
        assert [s for s, _ in got] == [s for s, _ in want], tag  # each step once, in order
        for (_, g), (_, w) in zip(got, want):
            assert g == pytest.approx(w, rel=1e-6, abs=1e-30), tag  # stored as float32


def test_every_number_of_a_record_becomes_a_scalar(tmp_path):
    records = [
        {"step": 1, "loss": 2.5, "lr": 1e-3, "moe": {"aux_loss": 0.02, "tokens_per_expert": [[1, 2]]}},
        {"step": 2, "loss": 2.25, "skipped": True, "note": "text", "grad_norm": float("nan")},
        {"step": 3, "loss": 2.0, "val_loss": 2.1, "model_state_bytes": {"total": 123456789}},
    ]
    assert scalars(records[0]) == {"loss": 2.5, "lr": 1e-3, "moe/aux_loss": 0.02}
    assert scalars(records[1]) == {"loss": 2.25, "skipped": 1.0}  # lists, strings, NaN: jsonl only
    writer = TensorBoardWriter(tmp_path / "tb")
    for r in records:
        writer.write(r)
    writer.write({"loss": 9.0})  # no step: not a step record
    writer.close()
    events = _read(tmp_path / "tb")
    _assert_events_match(events, records)
    assert events["moe/aux_loss"] == [(1, pytest.approx(0.02))]


def test_bpe_run_with_tensorboard_at_dp2_then_resumed(tmp_path):
    """A dp2 run on a BPE of 512 ids with TensorBoard and a mixture-of-experts layer, stopped after
    step 6 and resumed from its step-4 checkpoint: the event files hold exactly the numbers of
    metrics.jsonl (the resumed run's steps 5 and 6 replace the first run's), the held-out loss
    in bits per byte is the hand computation from the tokenizer saved in the run directory, and
    the resumed run reuses that tokenizer."""
    run, cache = tmp_path / "run", tmp_path / "cache"
    args = [
        *TINY,
        "--parallel.dp", "2",
        "--data.tokenizer", "bpe",
        "--data.vocab_size", "512",
        "--data.cache_dir", str(cache),
        "--log.tensorboard", "true",
        "--model.experts", "2",
        "--train.eval_every", "4",
        "--train.stop_at", "6",
        "--train.run_dir", str(run),
    ]  # fmt: skip
    first = plait_train(*args)
    assert first.returncode == 0, first.stderr[-3000:]
    first_events = _read(run / "tensorboard")
    assert [s for s, _ in first_events["loss"]] == [1, 2, 3, 4, 5, 6]
    saved = run / "tokenizer.json"
    trained = list((cache / "bpe").iterdir())
    assert len(trained) == 1 and saved.read_text() == trained[0].read_text()
    trained[0].unlink()  # a resumed run must take the run directory's tokenizer, not train again

    second = plait_train("--resume", str(run / "checkpoints" / "step_4"))
    assert second.returncode == 0, second.stderr[-3000:]
    assert not list((cache / "bpe").iterdir())
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 9))
    events = _read(run / "tensorboard")
    _assert_events_match(events, records)
    for tag in ("loss", "lr", "tokens_per_s", "mfu", "peak_mem_bytes", "comm_bytes", "grad_norm"):
        assert tag in events, tag
    for tag in ("val_loss", "val_bits_per_byte", "moe/aux_loss", "moe/dropped_fraction"):
        assert tag in events, tag
    assert [s for s, _ in events["val_bits_per_byte"]] == [4, 8]

    # bits per byte by hand: the held-out batches' targets under the saved tokenizer, their bytes
    from plait.data import eval_batches, load_corpus

    corpus = load_corpus("pydoc", 0.05, str(saved), cache_dir=cache)
    assert corpus.tokenizer.vocab_size <= 512
    batches = eval_batches(corpus.val, 32, 8, 2)  # tiny: seq_len 32; global_batch 8; eval_batches 2
    sizes = corpus.token_bytes()
    tokens = sum(y.numel() for _, y in batches)
    nbytes = sum(int(sizes[t]) for _, y in batches for t in y.reshape(-1).tolist())
    assert nbytes > 2 * tokens  # a BPE token spells several bytes
    for r in records:
        if "val_loss" in r:
            assert r["val_bits_per_byte"] == pytest.approx(
                r["val_loss"] * tokens / nbytes / math.log(2), rel=1e-12
            )
    summary = json.loads((run / "summary.json").read_text())
    assert summary["tokenizer"] == str(saved)
    assert summary["val_bits_per_byte"] == pytest.approx(records[-1]["val_bits_per_byte"], rel=1e-12)
    assert isinstance(summary["sample"], str) and summary["sample"].startswith("The ")

    # plait export: the vocabulary follows the run's tokenizer (model.vocab_size was never set),
    # the tokenizer goes beside the file, and the exported model gives the run's held-out loss
    from plait.train.export import export, load_exported

    (tmp_path / "export").mkdir()
    out = export(run, tmp_path / "export" / "model.safetensors")
    assert (out.parent / "tokenizer.json").read_text() == saved.read_text()
    model, cfg = load_exported(out)
    assert cfg.vocab_size == 512
    with torch.no_grad():
        val = sum(model(x, y, "sum").item() for x, y in batches) / tokens
    assert val == pytest.approx(summary["val_loss"], rel=1e-5)

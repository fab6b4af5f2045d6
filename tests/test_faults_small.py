"""One line, not a traceback, for checkpoint faults, and the small defects of issue 29
(docs/fault-tolerance.md, "Checkpoints, export and the small promises"): a full disk during a
save, an unwritable checkpoint directory, a `latest` pointer that is not UTF-8, `plait export` of
a python: run, a binary corpus, a job refused for memory, a python factory that does not fit the
data, and MFU from a CPU peak measured under load. Each at the level a user meets it: a `plait`
command, run in a process of its own where it trains, in this one where it is refused before
start."""

import functools
import json
import os
import re
import shutil
import stat
import sys
import textwrap

import pytest
import torch
from conftest import TINY, fault_env, metrics, plait_train, side_by_side

import plait.train.peak as peak
import plait.train.preflight as preflight
from plait.cli import main
from plait.train.checkpoint import verify_checkpoint
from plait.train.peak import REMEASURE, _key

FAST = ["--train.peak_tflops", "1"]  # no peak measurement on the way to a refusal


FACTORIES = "plait_issue29_factories"
FACTORY_SOURCE = textwrap.dedent(
    '''
    """Factories of tests/test_faults_small.py: a byte model of the user's own, and two that do
    not fit the data they will train on."""
    import torch
    from torch import nn

    from plait.models import GPT, gpt_config


    class Net(nn.Module):
        def __init__(self, rows, d, vocab):
            super().__init__()
            self.emb = nn.Embedding(rows, d)
            self.mix = nn.Linear(d, d)
            self.head = nn.Linear(d, vocab)

        def forward(self, idx):
            return self.head(self.mix(self.emb(idx)).relu())


    def fits(args):
        return Net(args.vocab_size, args.d_model, args.vocab_size)


    def small_vocab(args):  # 100 rows for the ids of 256 bytes: an index error in the first step
        return Net(100, args.d_model, args.vocab_size)


    def short_context(args):  # a context of 8 tokens for sequences of model.seq_len
        return GPT(gpt_config("tiny", seq_len=8, vocab_size=args.vocab_size))


    class Positions(Net):  # learned positions, as GPT-2's wpe
        def __init__(self, rows, d, vocab, positions):
            super().__init__(rows, d, vocab)
            self.wpe = nn.Embedding(positions, d)

        def forward(self, idx):
            pos = torch.arange(idx.shape[1], device=idx.device)
            return self.head(self.mix(self.emb(idx) + self.wpe(pos)).relu())


    def short_positions(args):  # 8 positions for sequences of model.seq_len: an index error
        return Positions(args.vocab_size, args.d_model, args.vocab_size, 8)
    '''
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The module's `plait train` runs, side by side: {name: (run dir, CompletedProcess)}, and
    the factories' directory, on sys.path while the module's tests run.

    * enospc: dp 2, rank 1's disk fills after step 6 (its save of step 8 fails);
    * python: the `fits` factory, dp 1;
    * mfu: dp 1 with a CPU peak cache of 1 kFLOP/s, as if measured on a very busy machine."""
    base = tmp_path_factory.mktemp("small")
    (base / f"{FACTORIES}.py").write_text(FACTORY_SOURCE)
    cache = base / "cache" / "plait" / "peak.json"
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps(LOW_PEAKS))
    python_env = {"PYTHONPATH": os.pathsep.join([str(base), os.environ.get("PYTHONPATH", "")])}
    source = ["--model.source", f"python:{FACTORIES}:fits", "--model.d_model", "16", "--parallel.dp", "1"]
    jobs = {
        "enospc": ((*TINY,), fault_env("1:6:enospc")),
        "python": ((*TINY, *source, *FAST), python_env),
        "mfu": ((*TINY, "--parallel.dp", "1"), {"XDG_CACHE_HOME": str(base / "cache")}),
    }

    def job(name, args, env):
        return base / name, plait_train(*args, "--train.run_dir", str(base / name), env=env)

    sys.path.insert(0, str(base))  # (a run's process starts with this process's sys.path)
    done = side_by_side({n: functools.partial(job, n, *spec) for n, spec in jobs.items()})
    yield {**done, "factories": base, "cache": cache}
    sys.path.remove(str(base))
    sys.modules.pop(FACTORIES, None)


LOW_PEAKS = {_key(t, torch.float32): 1e3 / t for t in range(1, (os.cpu_count() or 1) + 1)}  # MFU ~1e6 %


@pytest.fixture
def no_ranks(monkeypatch):
    """Starting ranks (in this process or spawned) is recorded instead of done."""
    calls = []
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", str(os.cpu_count() or 1)))
    monkeypatch.setattr("plait.train.loop.run", lambda *a, **k: calls.append("in-process"))
    monkeypatch.setattr(
        "torch.distributed.launcher.api.elastic_launch", lambda *a, **k: lambda *args: calls.append("spawned")
    )
    return calls


def _one_line(capsys, code: int, want: int, prefix: str = "plait: ") -> str:
    out = capsys.readouterr()
    err = out.err.strip()
    assert code == want, (code, out.err)
    assert err.startswith(prefix) and "\n" not in err and "Traceback" not in out.err + out.out, err
    return err


def test_checkpoint_faults_are_one_line_and_the_run_continues(runs, tmp_path, capsys, no_ranks):
    run, r = runs["enospc"]  # the disk fills on rank 1 after step 6: the save of step 8 fails on it
    assert r.returncode == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    line = next(x for x in r.stderr.splitlines() if "No space left on device" in x)
    tmp = run / "checkpoints" / "step_00000008.tmp"
    assert f"writing {tmp}/" in line and re.search(r"\(\d[\d,.]* MiB free there\)", line), line
    assert "step_00000008.tmp was removed and the previous checkpoint is intact (step_00000004)" in line
    assert not tmp.exists() and sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "latest",
        "step_00000004",
    ]
    verify_checkpoint(run / "checkpoints" / "step_00000004")

    # train.steps below the step reached: refused before start
    err = _one_line(capsys, main(["train", "--resume", str(run), "--train.steps", "3"]), 2)
    assert "train.steps = 3" in err and "step 4" in err, err
    # an unwritable checkpoint directory: refused before any rank starts
    ro = tmp_path / "read-only"
    shutil.copytree(run, ro, ignore=shutil.ignore_patterns("checkpoints", "run.lock"))
    os.symlink("/sys", ro / "checkpoints")  # a directory no one may write in, root included
    err = _one_line(capsys, main(["train", "--resume", str(ro)]), 1)
    assert "checkpoint directory" in err and "not writable" in err and str(ro) in err, err
    assert no_ranks == []

    # `latest` not UTF-8: export names it and the checkpoints to choose; --resume falls back
    (run / "checkpoints" / "latest").write_bytes(b"step_\xff\xfe0004")
    err = _one_line(capsys, main(["export", str(run)]), 1)
    assert "latest is damaged (not UTF-8 text)" in err and "--step (4)" in err, err
    r = plait_train("--resume", str(run), "--parallel.dp", "1", *FAST)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "latest is damaged (not UTF-8 text); resuming from step_00000004" in r.stdout, r.stdout
    assert max(metrics(run)) == 8 and (run / "checkpoints" / "latest").read_text() == "step_00000008"


def test_python_runs_export_and_factories_that_do_not_fit_are_refused(runs, tmp_path, capsys, no_ranks):
    for func, words in (
        ("small_vocab", ("embedding emb has 100 rows", "token ids go up to model.vocab_size - 1 = 255")),
        ("short_context", ("longer than",)),
        ("short_positions", ("embedding wpe has 8 rows", "positions go up to model.seq_len - 1 = 127")),
    ):
        argv = ["train", "--model.source", f"python:{FACTORIES}:{func}", "--parallel.dp", "1", *FAST]
        err = _one_line(capsys, main([*argv, "--train.run_dir", str(tmp_path / func)]), 2)
        assert "model.source" in err and all(w in err for w in words), err
    assert no_ranks == []

    run, r = runs["python"]
    assert r.returncode == 0, r.stderr[-3000:]
    code = main(["export", str(run)])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "exported step 8" in out.out and "load_state_dict" in out.out, out.out
    mask = os.umask(0o022)
    os.umask(mask)
    assert stat.S_IMODE((run / "model.safetensors").stat().st_mode) == 0o666 & ~mask


def test_refusals_write_nothing_and_a_binary_corpus_warns(tmp_path, monkeypatch, capsys, no_ranks):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(preflight, "_host_available", lambda: 20 * 10**9)
    err = _one_line(capsys, main(["train", "--model.name", "gpt2-medium", *FAST]), 2)
    assert "does not fit in memory" in err, err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
    assert no_ranks == []

    corpus = tmp_path / "data.bin"
    text = b"plain text, as a corpus should be. " * 400
    corpus.write_bytes(text + bytes(range(256)) * 40)
    argv = ["train", *TINY, "--data.corpus", str(corpus), "--train.run_dir", str(tmp_path / "r"), *FAST]
    code = main(argv)
    out = capsys.readouterr()
    assert code == 0 and no_ranks == ["spawned"], out.err
    warnings = [x for x in out.err.splitlines() if x.startswith("plait: warning:")]
    assert len(warnings) == 1, out.err
    assert str(corpus) in warnings[0] and f"offset {len(text)}" in warnings[0], warnings
    assert "does not look like text" in warnings[0]
    (tmp_path / "t.txt").write_bytes("plain text, accents é and 日本".encode() * 400)
    argv = [
        "train",
        *TINY,
        "--data.corpus",
        str(tmp_path / "t.txt"),
        "--train.run_dir",
        str(tmp_path / "t"),
        *FAST,
    ]
    assert main(argv) == 0
    assert "warning" not in capsys.readouterr().err


def test_mfu_is_never_above_100_percent_and_a_low_cached_peak_is_measured_again(runs):
    """A CPU peak measured on a busy machine (~/.cache/plait/peak.json), far too low, and a peak
    for more threads below the one for fewer."""
    run, r = runs["mfu"]
    assert r.returncode == 0, r.stderr[-3000:]
    shown = [float(m) for m in re.findall(r"MFU +([\d.]+)%", r.stdout)]
    assert shown and max(shown) <= 100.0, r.stdout
    assert all(0 < m["mfu"] <= 1.0 for m in metrics(run).values() if "mfu" in m)
    after = json.loads(runs["cache"].read_text())
    raised = [k for k in LOW_PEAKS if after[k] > LOW_PEAKS[k]]
    assert raised and set(raised) <= set(after[REMEASURE]), after  # measured again at the next start


def test_the_cpu_peak_keeps_its_best_figure_and_more_threads_never_lower(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    one, two = _key(1, torch.float32), _key(2, torch.float32)
    (tmp_path / "plait").mkdir()
    (tmp_path / "plait" / "peak.json").write_text(json.dumps({one: 100e9, two: 60e9}))
    measured = []
    monkeypatch.setattr(peak, "measure_peak_flops", lambda threads, dtype: measured.append(threads) or 70e9)
    assert peak.cpu_peak_flops(2) == 100e9 and measured == []  # 2 threads: never below 1 thread's
    # a run went faster than the peak: raised to what it did, and measured again at the next start
    assert peak.raise_cpu_peak(2, torch.float32, 130e9) == 130e9
    assert peak.cpu_peak_flops(2) == 130e9 and measured == [2]  # the best of all figures is kept
    assert peak.cpu_peak_flops(2) == 130e9 and measured == [2]  # once: the mark is cleared

"""Faults caught before start, and the small ones (docs/fault-tolerance.md).

Every bad input is refused in the launching process with one line, `plait: config error: ...`
(exit code 2, no traceback) that names the key and what is valid, and no rank starts. In-process
through `plait.cli.main`, except the closed pipe, which needs a real pipe.
"""

import json
import os
import subprocess
import sys
import time
import types

import pytest

import plait.train.preflight as preflight
from plait.cli import main
from plait.comm.recorder import STACK_ENV, WATCHDOG_EXIT_CODE, FlightRecorder, Watchdog
from plait.models import gpt_config
from plait.train.config import load_config, parse_overrides
from plait.train.launch import format_child_failure
from plait.zero.estimate import estimate_memory

GB = 10**9
FAST = ["--train.peak_tflops", "1"]  # no peak measurement on the way to the launch


@pytest.fixture
def started(monkeypatch):
    """Records any attempt to start ranks (in process or spawned) instead of starting them."""
    calls = []
    # launch() sets OMP_NUM_THREADS for the ranks it spawns: keep that out of this process.
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", str(os.cpu_count() or 1)))
    monkeypatch.setattr("plait.train.loop.run", lambda *a, **k: calls.append("in-process"))
    monkeypatch.setattr(
        "torch.distributed.launcher.api.elastic_launch",
        lambda *a, **k: lambda *args: calls.append("spawned"),
    )
    return calls


def _one_line(capsys, code, expected_code=2) -> str:
    out = capsys.readouterr()
    err = out.err.strip()
    assert code == expected_code, (code, err)
    assert err.startswith("plait: config error: ") and "\n" not in err, err
    assert "Traceback" not in out.err + out.out
    return err


# --- Before start -------------------------------------------------------------------------------


def test_an_unwritable_run_dir_is_refused_before_any_rank_starts(tmp_path, capsys, started):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    for run_dir, words in (
        (blocker / "run", ("cannot be created", "is a file")),
        (blocker, ("is a file, not a directory",)),
        ("/proc/plait-run", ("is not writable",)),
    ):
        err = _one_line(capsys, main(["train", "--train.run_dir", str(run_dir), *FAST]))
        assert "train.run_dir" in err and str(run_dir) in err and "choose another" in err, err
        assert all(w in err for w in words), err
    assert started == []
    # A writable one passes: the launcher creates it (and its lock) before the ranks start.
    assert main(["train", "--train.run_dir", str(tmp_path / "new" / "run"), *FAST]) == 0
    assert started == ["spawned"] and [p.name for p in (tmp_path / "new" / "run").iterdir()] == ["run.lock"]


def test_sizes_are_bounded(tmp_path, capsys, started):
    big = tmp_path / "big.toml"
    big.write_text("[train]\nsteps = 9999999999999999999999\n")
    for argv, words in (
        (["--train.steps", "9999999999999999999999"], ("train.steps = 9999999999999999999999", "at most")),
        ([str(big)], ("train.steps = 9999999999999999999999", "1,000,000,000")),
        (["--train.steps", "1e30"], ("train.steps", "at most 1,000,000,000")),
        (["--train.seed", str(2**64)], ("train.seed", "64-bit")),
        (["--model.d_model", str(2**22)], ("model.d_model", "at most 1,048,576")),
        (["--parallel.dp", "1024", "--parallel.tp", "2048"], ("ranks", "at most 1,048,576")),
        (["--comm.timeout_s", "1e300"], ("comm.timeout_s", "at most 1,000,000")),
        (["--train.sample_tokens", "1000000"], ("train.sample_tokens", "at most 65,536")),
        (["--parallel.pp", "2", "--parallel.microbatches", "100000"], ("parallel.pp x microbatches",)),
        (["--train.steps", "-3"], ("train.steps must be >= 1",)),
    ):
        t0 = time.time()
        err = _one_line(capsys, main(["train", *argv]))
        assert all(w in err for w in words), (argv, err)
        assert time.time() - t0 < 5, argv  # refused, not worked through
    assert started == []


def test_a_config_that_is_not_a_utf8_file_is_named(tmp_path, capsys):
    bad = tmp_path / "latin1.toml"
    bad.write_bytes(b"[train]\nsteps = 5\n# caf\xe9\n")
    err = _one_line(capsys, main(["train", str(bad)]))
    assert "not UTF-8" in err and "0xe9" in err and "line 3" in err and str(bad) in err, err
    err = _one_line(capsys, main(["train", str(tmp_path)]))
    assert "is a directory" in err and "give a TOML file" in err, err
    err = _one_line(capsys, main(["train", str(tmp_path / "nope.toml")]))
    assert "not found" in err, err


def _host(monkeypatch, free_bytes):
    monkeypatch.setattr(preflight, "_host_available", lambda: free_bytes)


def test_a_job_too_big_for_memory_is_refused_with_the_figure_and_a_fix(
    monkeypatch, capsys, started, tmp_path
):
    _host(monkeypatch, 20 * GB)
    argv = ["train", "--model.name", "gpt2-medium", "--train.run_dir", str(tmp_path / "r"), *FAST]
    err = _one_line(capsys, main(argv))
    # Two ranks of 350M parameters: 1.42 GB of fp32 parameters each, twice that of AdamW state;
    # 8 sequences of 1024 tokens per rank make the activations the largest part.
    assert "does not fit in memory" in err and "each of the 2 ranks needs at least" in err, err
    for part in ("parameters 1.42", "gradients 1.42", "optimizer state 2.84", "activations", "in all"):
        assert part in err, (part, err)
    assert "20.00 GB available host RAM" in err and "it fits with" in err, err
    assert "train.activation_checkpointing = true" in err and "PLAIT_MEMORY_CHECK=0" in err, err
    # Beyond anything: no change of layout fits.
    err = _one_line(capsys, main([*argv, "--model.d_model", "65536", "--model.n_head", "64"]))
    assert "a smaller model" in err, err
    assert started == []
    # What the message says it fits with does start; so does anything with the check turned off.
    assert main([*argv, "--train.activation_checkpointing", "true"]) == 0
    monkeypatch.setenv(preflight.MEMORY_CHECK_ENV, "0")
    assert main(argv) == 0
    assert started == ["spawned", "spawned"]


def test_the_memory_figure_is_the_estimators():
    """The per-rank figure is plait.zero.estimate's accounting of what plait keeps (fp32 AdamW)."""
    for overrides, dp, stage in (([], 2, 0), (["--parallel.zero_stage", "3", "--parallel.dp", "4"], 4, 3)):
        cfg = load_config(None, parse_overrides(["--model.name", "gpt2", *overrides]))
        mem = preflight.rank_memory(cfg, use_cuda=False)
        est = estimate_memory(
            model=gpt_config("gpt2"), dp=dp, zero_stage=stage, optimizer="adamw", precision="fp32"
        )
        states = est["model_state_bytes"]
        # tp = pp = 1: every parameter is on the rank, sharded only by ZeRO
        assert (mem["params"], mem["grads"], mem["optimizer"]) == (
            states["params"],
            states["grads"],
            states["optimizer"],
        )
        assert mem["total"] == states["total"] + mem["activations"] + preflight.RANK_RUNTIME_BYTES


def test_no_config_of_the_readme_or_the_tests_is_refused():
    """Each rank of the layouts the README shows needs well under 1 GB, so no machine that runs the
    test suite refuses them."""
    for args in (
        [],
        ["--parallel.dp", "1", "--train.micro_batches", "2"],
        ["--parallel.zero_stage", "2", "--train.bf16", "true", "--offload.optimizer", "cpu"],
        ["--parallel.tp", "2", "--parallel.dp", "1", "--parallel.sequence_parallel", "true"],
        ["--model.experts", "4", "--parallel.dp", "1", "--parallel.ep", "2"],
        ["--parallel.pp", "2", "--parallel.zero_stage", "1", "--parallel.microbatches", "4"],
        ["--model.name", "tiny", "--parallel.dp", "8", "--train.global_batch", "16"],
    ):
        cfg = load_config(None, parse_overrides(args))
        assert preflight.rank_memory(cfg, use_cuda=False)["total"] < 0.5 * GB, args


def test_on_cuda_each_rank_is_checked_against_its_own_device(monkeypatch):
    cfg = load_config(None, parse_overrides(["--model.name", "gpt2-large", "--parallel.zero_stage", "1"]))
    need = preflight.rank_memory(cfg, use_cuda=True)["total"]
    monkeypatch.setattr(preflight, "_cuda_free", lambda ranks: [need + 1, 2 * need])
    preflight.check_memory(cfg, use_cuda=True, ranks=2)  # per device, not the sum of two ranks
    monkeypatch.setattr(preflight, "_cuda_free", lambda ranks: [need - 1, 2 * need])
    with pytest.raises(Exception, match="free on the GPUs") as info:
        preflight.check_memory(cfg, use_cuda=True, ranks=2)
    assert "parallel.tp = 2 (more GPUs)" in str(info.value) or "offload" in str(info.value)
    monkeypatch.setattr(preflight, "_cuda_free", lambda ranks: None)  # no answer: not refused
    preflight.check_memory(cfg, use_cuda=True, ranks=2)


# --- The small ones: plait estimate and plait schedule ---------------------------------------------


def test_estimate_takes_negative_numbers_as_values_and_refuses_them(capsys):
    for argv, option in (
        (["--params", "-7e9"], "--params"),
        (["--params=-350M"], "--params"),
        (["--params", "1e400"], "--params"),
        (["--params", "7e9", "--dp", "-4"], "--dp"),
        (["--params", "7e9", "--dp", "1e12"], "--dp"),
        (["--model", "gpt2", "--batch", "-1"], "--batch"),
        (["--model", "gpt2", "--batch", "2", "--seq", "-0.5"], "--seq"),
    ):
        err = _one_line(capsys, main(["estimate", *argv]))
        assert f"argument {option}:" in err and "expected" in err and "from 1 to" in err, err
        assert "expected one argument" not in err, err
    err = _one_line(capsys, main(["estimate", "--params", "7e9", "--zero-stage", "-1"]))
    assert "0, 1, 2, 3" in err, err


def test_schedule_bounds_its_inputs_and_refuses_quickly(capsys, tmp_path):
    for argv, words in (
        (["--stages", "100000", "--microbatches", "100000"], ("--stages", "from 1 to 256")),
        (["--stages", "128", "--microbatches", "1000"], ("128 x 1000 x 1", "8,192")),
        (["--stages", "2", "--microbatches", "4", "--width", "-5"], ("--width", "from 10 to 10,000")),
        (["--stages", "-2", "--microbatches", "4"], ("--stages", "'-2'")),
        (["--stages", "2", "--microbatches", "4", "--comm", "-1"], ("comm -1", ">= 0")),
        (["--stages", "64", "--microbatches", "64", "--out", str(tmp_path / "t.png")], ("as a PNG",)),
    ):
        t0 = time.time()
        err = _one_line(capsys, main(["schedule", "--kind", "gpipe", *argv]))
        assert all(w in err for w in words), (argv, err)
        assert time.time() - t0 < 2, argv
    assert not (tmp_path / "t.png").exists()


def test_schedule_out_that_cannot_be_written_is_one_line(capsys, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    base = ["schedule", "--kind", "1f1b", "--stages", "2", "--microbatches", "4", "--out"]
    for out, words in (
        (str(blocker / "t.png"), ("does not exist",)),
        (str(tmp_path), ("is a directory",)),
        ("/proc/t.png", ("cannot write in '/proc'",)),
    ):
        err = _one_line(capsys, main([*base, out]))
        assert "--out" in err and all(w in err for w in words), err
    assert main([*base, str(tmp_path / "ok.png")]) == 0 and (tmp_path / "ok.png").stat().st_size > 0


def test_schedule_survives_a_closed_pipe():
    """`plait schedule ... | head -1`: the reader leaves after the first line of about 80 kB."""
    argv = ["schedule", "--kind", "1f1b", "--stages", "8", "--microbatches", "8", "--width", "10000"]
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    proc = subprocess.Popen(
        [sys.executable, "-m", "plait.cli", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    first = proc.stdout.readline()
    proc.stdout.close()  # head -1 exits
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141, err  # as if ended by SIGPIPE, like any Unix filter
    assert first.startswith(b"schedule 1f1b: p=8 ranks") and err == "", err


# --- The small ones: the watchdog report -------------------------------------------------------------


class _Store:
    """The key-value store as the watchdog uses it: the other rank published its last op."""

    def __init__(self):
        self.data = {"plait/flight/1": b"#1 all_reduce axis=dp bytes=8 completed in 0.001s"}

    def set(self, key, value):
        self.data[key] = value.encode()

    def check(self, keys):
        return all(k in self.data for k in keys)

    def get(self, key):
        return self.data[key]


def _fire(monkeypatch, tmp_path, stack: bool) -> dict:
    """Rank 0's watchdog firing on its second all-reduce; returns what it wrote to the error file."""
    error_file = tmp_path / f"error-{stack}.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    if stack:
        monkeypatch.setenv(STACK_ENV, "1")
    else:
        monkeypatch.delenv(STACK_ENV, raising=False)

    class Exited(Exception):
        pass

    def fake_exit(code):
        assert code == WATCHDOG_EXIT_CODE
        raise Exited

    monkeypatch.setattr("plait.comm.recorder.os._exit", fake_exit)
    recorder = FlightRecorder(rank=0)
    recorder.complete(recorder.start("all_reduce", "dp", 8))
    stuck = recorder.start("all_reduce", "dp", 64)
    dog = Watchdog(recorder, rank=0, world_size=2, timeout_s=0.1, store=_Store())
    with pytest.raises(Exited):
        dog._fire(stuck)
    return json.loads(error_file.read_text())["message"]


def test_the_watchdog_report_is_printed_once_without_the_stack_unless_asked(monkeypatch, tmp_path, capsys):
    message = _fire(monkeypatch, tmp_path, stack=False)
    err = capsys.readouterr().err
    assert err.count("plait watchdog: rank 0") == 1 and "#2 all_reduce on axis 'dp'" in err, err
    assert "rank 1: last op #1 all_reduce" in err and f"{STACK_ENV}=1 adds" in err, err
    assert "File " not in err and "main thread" not in err, err  # no stack dump
    assert message["message"].startswith("plait watchdog: rank 0") and "rank 1: last op" in message["message"]
    assert "File " not in message["extraInfo"]["py_callstack"]

    message = _fire(monkeypatch, tmp_path, stack=True)
    err = capsys.readouterr().err
    assert err.count("plait watchdog: rank 0") == 1 and "main thread:" in err and "File " in err, err
    assert "File " in message["extraInfo"]["py_callstack"]

    # The launcher does not print the report again: it points at it.
    failure = types.SimpleNamespace(message=message, exitcode=WATCHDOG_EXIT_CODE, timestamp=1)
    other = types.SimpleNamespace(message="", exitcode=-15, timestamp=2)
    exc = types.SimpleNamespace(failures={0: failure, 1: other}, get_first_failure=lambda: (0, failure))
    text = format_child_failure(exc, 12.0)
    assert "plait watchdog" not in text and "the watchdog report above" in text and "rank 0 failed" in text


def test_the_root_cause_is_the_earliest_error_any_rank_wrote(tmp_path):
    """The agent reports only the first rank to exit. When rank 1 raises and rank 0 dies in a
    collective with it but exits first, the launcher still names rank 1 and shows its error."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    def error_file(rank, text, mtime_ns):
        path = tmp_path / "attempt_0" / str(rank) / "error.json"
        path.parent.mkdir(parents=True)
        info = {"py_callstack": f"Traceback: {text}", "timestamp": "1700000000"}
        path.write_text(json.dumps({"message": {"message": text, "extraInfo": info}}))
        os.utime(path, ns=(mtime_ns, mtime_ns))
        return str(path)

    error_file(1, "RuntimeError: injected fault on rank 1", 1_700_000_000_100_000_000)
    first_out = error_file(0, "RuntimeError: Connection reset by peer", 1_700_000_000_900_000_000)
    exc = types.SimpleNamespace(failures={0: ProcessFailure(0, 123, 1, first_out)})
    text = format_child_failure(exc, 3.0)
    assert "plait: rank 1 failed after 3.0s; the job was stopped" in text, text
    assert "injected fault on rank 1" in text and "Connection reset" not in text, text
    assert "rank 0: exit code 1" in text, text


def test_a_peers_error_file_still_being_written_is_not_read_as_a_report(tmp_path):
    """A peer's error.json can be empty when the launcher looks (being written, or the disk is
    full: the offload test's case). It is no report: the agent's own failure is shown."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    first = tmp_path / "attempt_0" / "0" / "error.json"
    first.parent.mkdir(parents=True)
    info = {"py_callstack": "Traceback: OffloadError: disk full", "timestamp": "1700000000"}
    first.write_text(json.dumps({"message": {"message": "OffloadError: disk full", "extraInfo": info}}))
    empty = tmp_path / "attempt_0" / "1" / "error.json"
    empty.parent.mkdir(parents=True)
    empty.write_text("")
    exc = types.SimpleNamespace(failures={0: ProcessFailure(0, 123, 1, str(first))})
    text = format_child_failure(exc, 2.0)
    assert "plait: rank 0 failed after 2.0s" in text and "disk full" in text, text

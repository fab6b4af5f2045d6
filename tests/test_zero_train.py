"""`plait train` with ZeRO: every stage and offload runs; checkpoints reshard across dp degrees and
stages; a full disk while offloading fails clearly and the last checkpoint survives."""

import json
from pathlib import Path

import pytest
from conftest import TINY, assert_runs_match, fault_env, losses, plait_train, resume_job, side_by_side

from plait.errors import ConfigError
from plait.train.checkpoint import latest_checkpoint, verify_checkpoint
from plait.train.config import load_config
from plait.train.metrics import read_metrics

RESHARD = {  # a dp=2 ZeRO-3 checkpoint resumed on each
    "zero3-dp4": ("--parallel.dp", "4"),
    "zero1-dp2": ("--parallel.zero_stage", "1"),
    "one-process": ("--parallel.dp", "1", "--parallel.zero_stage", "0"),
}
MODES = {
    "zero1-bf16": ("--parallel.zero_stage", "1", "--train.bf16", "true"),
    "zero2-cpu-delayed": (
        "--parallel.zero_stage",
        "2",
        "--offload.optimizer",
        "cpu",
        "--offload.delayed_update",
        "true",
    ),
    "zero3-hybrid": ("--parallel.zero_stage", "3", "--parallel.dp", "4", "--parallel.hybrid_shard", "2"),
    "zero3-disk": ("--parallel.zero_stage", "3", "--offload.optimizer", "disk"),
}


@pytest.fixture(scope="module")
def runs(shared_runs, tmp_path_factory):
    """{name: (run dir, CompletedProcess)}: "full", ZeRO-3 at dp=2, 8 uninterrupted steps (shared
    with other files); each of MODES; and "full" as stopped after step 4 (`cut_copy`) resumed on
    each of RESHARD; side by side."""
    base = tmp_path_factory.mktemp("zero")
    jobs = {"full": shared_runs.job(*TINY, "--parallel.zero_stage", "3")}
    for name, args in MODES.items():
        jobs[name] = shared_runs.job(*TINY, *args)
    for name, layout in RESHARD.items():  # last: a lane that takes one waits for "full"
        jobs[f"resumed-{name}"] = resume_job(jobs["full"], base / f"resumed-{name}", *layout)
    return side_by_side(jobs)


@pytest.fixture(scope="module")
def zero3_reference(runs):
    """ZeRO-3 at dp=2, 8 uninterrupted steps."""
    _, r = runs["full"]
    assert r.returncode == 0, r.stderr
    return runs["full"][0]


@pytest.mark.parametrize("name", RESHARD)
def test_zero3_checkpoint_reshards_and_training_continues(zero3_reference, runs, name):
    """A dp=2 ZeRO-3 checkpoint loads into dp=4 ZeRO-3, into ZeRO-1 and into one process, and the
    steps after it have the losses of the uninterrupted run."""
    full = zero3_reference
    run, r = runs[f"resumed-{name}"]
    assert r.returncode == 0, r.stderr
    assert "resumed from" in r.stdout and "step_00000004" in r.stdout
    assert sorted(losses(run)) == list(range(1, 9))
    assert_runs_match(run, full, steps=range(5, 9), what=f"resumed on {RESHARD[name]}")


@pytest.mark.parametrize("name", MODES)
def test_plait_train_runs_each_zero_mode(runs, name):
    args = MODES[name]
    run, r = runs[name]
    assert r.returncode == 0, r.stderr
    assert "ZeRO stage" in r.stdout and "precision:" in r.stdout  # the policy is printed at start-up
    summary = json.loads((run / "summary.json").read_text())
    mem = summary["model_state_bytes_per_rank"]
    assert mem["total"] == mem["params"] + mem["grads"] + mem["optimizer"] > 0
    logged = [r for r in read_metrics(run / "metrics.jsonl") if "model_state_bytes" in r]
    assert logged and logged[-1]["model_state_bytes"]["total"] > 0
    first, last = losses(run)[1], losses(run)[8]
    assert last < first, (first, last)
    if "disk" in args:
        assert not any((run / "offload").rglob("*.bin")), "offload files left behind"


def test_full_disk_while_offloading_fails_clearly_and_keeps_the_checkpoint(tmp_path):
    run = tmp_path / "run"
    args = (*TINY, "--parallel.zero_stage", "3", "--offload.optimizer", "disk", "--train.run_dir", str(run))
    r = plait_train(*args, env=fault_env("1:6:enospc"))
    assert r.returncode != 0
    assert "free space or choose another [offload] path" in r.stderr, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]  # OffloadError says what to change: its line alone
    ckpt = latest_checkpoint(run / "checkpoints")
    assert ckpt is not None and ckpt.name == "step_00000004"
    verify_checkpoint(ckpt)
    # the run continues from it (on CPU offload, away from the full disk)
    r = plait_train("--resume", str(run), "--offload.optimizer", "cpu")
    assert r.returncode == 0, r.stderr
    assert sorted(losses(run)) == list(range(1, 9))


@pytest.mark.parametrize(
    "overrides, message",
    [
        ([("parallel.zero_stage", "5")], "valid: 0, 1, 2, 3"),
        ([("parallel.hybrid_shard", "3")], "must divide parallel.dp"),
        ([("parallel.hybrid_shard", "2")], "needs parallel.zero_stage >= 1"),
        ([("offload.optimizer", "nvme"), ("parallel.zero_stage", "2")], "valid: none, cpu, disk"),
        ([("offload.optimizer", "cpu")], "needs parallel.zero_stage >= 1"),
        ([("offload.delayed_update", "true"), ("parallel.zero_stage", "2")], "needs offload.optimizer"),
        (
            [
                ("parallel.zero_stage", "3"),
                ("comm.compression", "onebit"),
                ("parallel.tp", "2"),
                ("model.n_head", "4"),
            ],
            "tp replicas drift apart",
        ),
    ],
)
def test_bad_zero_config_is_rejected_before_start(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, overrides)


def test_unwritable_offload_path_is_rejected_before_start(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    bad = str(Path(blocker) / "offload")
    overrides = [("parallel.zero_stage", "3"), ("offload.optimizer", "disk"), ("offload.path", bad)]
    with pytest.raises(ConfigError, match="offload.path .* is not a writable directory"):
        load_config(None, overrides)
    r = plait_train(
        *TINY, *[x for k, v in overrides for x in (f"--{k}", v)], "--train.run_dir", str(tmp_path / "r")
    )
    assert r.returncode == 2 and "not a writable directory" in r.stderr
    assert not (tmp_path / "r").exists()  # nothing started

"""`plait train` end to end: layout-independent losses, bit-exact resume, checkpoint damage, failures."""

import json
import shutil
import subprocess
import sys
import time
from functools import partial

import pytest
from conftest import (
    SGD,
    TINY,
    assert_runs_match,
    fault_env,
    losses,
    plait_train,
    plait_train_all,
    resume_job,
    side_by_side,
    train_job,
)

from plait.train.metrics import read_metrics

DP_LAYOUTS = {
    "dp2": ("--parallel.dp", "2"),
    "dp1 x 2 micro-batches": ("--parallel.dp", "1", "--train.micro_batches", "2"),
    "dp1": ("--parallel.dp", "1"),
    "dp2 bf16 + recompute x 2 micro-batches": (
        "--parallel.dp",
        "2",
        "--train.bf16",
        "true",
        "--train.activation_checkpointing",
        "true",
        "--train.micro_batches",
        "2",
    ),
}


@pytest.fixture(scope="module")
def dp_runs(tmp_path_factory):
    """TINY on each of DP_LAYOUTS, side by side: {name: (run dir, CompletedProcess)}."""
    base = tmp_path_factory.mktemp("dp")
    dirs = {name: base / f"run{i}" for i, name in enumerate(DP_LAYOUTS)}
    done = plait_train_all(
        {name: (*TINY, *layout, "--train.run_dir", str(dirs[name])) for name, layout in DP_LAYOUTS.items()}
    )
    return {name: (dirs[name], r) for name, r in done.items()}


@pytest.fixture(scope="module")
def reference_run(dp_runs):
    """dp=2, 8 uninterrupted steps, checkpoints at 4 and 8."""
    run, r = dp_runs["dp2"]
    assert r.returncode == 0, r.stderr
    return run, r


def test_run_dir_contents(reference_run):
    run, r = reference_run
    assert {"config.toml", "metrics.jsonl", "metrics-rank1.jsonl", "loss.png", "summary.json"} <= {
        p.name for p in run.iterdir()
    }
    assert (run / "checkpoints" / "latest").read_text() == "step_00000008"
    records = read_metrics(run / "metrics.jsonl")
    assert [x["step"] for x in records] == list(range(1, 9)) and all("loss" in x for x in records)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["val_loss"] > 0 and len(summary["sample"]) > 0
    assert "held-out loss" in r.stdout and "unigram entropy" in r.stdout and "MFU" in r.stdout


def test_layout_independent_losses(reference_run, dp_runs):
    """dp=1 with 2 accumulation micro-batches and dp=2 see the same global batches: the same
    losses and gradient norms within 1e-5 relative (the loss is normalised per token across ranks
    and micro-batches; the norm sees a wrong gradient scale that AdamW and clipping would hide)."""
    run, _ = reference_run
    one, r = dp_runs["dp1 x 2 micro-batches"]
    assert r.returncode == 0, r.stderr
    plain, r = dp_runs["dp1"]
    assert r.returncode == 0, r.stderr
    for other, what in ((one, "dp1 x 2 micro-batches"), (run, "dp2")):
        assert_runs_match(other, plain, what=what)
    # and the runs are not trivially equal: the loss moved
    b = losses(run)
    assert b[8] < b[1] - 0.05


ONE = ("--parallel.dp", "1")
ACCUM = ("--train.micro_batches", "2")
SGD_LAYOUTS = {
    "dp2 x 2 micro-batches": ("--parallel.dp", "2", "--train.micro_batches", "2"),
    "dp2 ZeRO-3": ("--parallel.dp", "2", "--parallel.zero_stage", "3"),
    # accumulation under sharding at `plait train` level: ZeRO-2 accumulates whole gradients in
    # its buckets (no_sync) and reduce-scatters once; ZeRO-3 reduce-scatters every micro-batch's
    # gradient into its shard. (ZeRO-1 accumulates as plain data parallelism, the first row; it
    # has a custom-loop case in test_custom_loop.py.)
    "dp2 ZeRO-2 x 2 micro-batches": ("--parallel.dp", "2", "--parallel.zero_stage", "2", *ACCUM),
    "dp2 ZeRO-3 x 2 micro-batches": ("--parallel.dp", "2", "--parallel.zero_stage", "3", *ACCUM),
    "tp2 + sequence parallel": (*ONE, "--parallel.tp", "2", "--parallel.sequence_parallel", "true"),
    "pp2 1F1B x 4 micro-batches": (*ONE, "--parallel.pp", "2", "--parallel.microbatches", "4"),
}


def test_sgd_without_clipping_every_layout_follows_one_process(tmp_path):
    """The parity matrix's scale-sensitive configuration: SGD with momentum, no clipping, a large
    learning rate. Data parallel with accumulation, ZeRO-3, ZeRO-2 and ZeRO-3 with accumulation,
    tensor + sequence parallel and a pipeline each match one process's losses and gradient norms
    at every step."""
    model = ("--model.n_layer", "4", "--model.n_head", "4")
    dirs = {"one": tmp_path / "one", **{what: tmp_path / f"layout{i}" for i, what in enumerate(SGD_LAYOUTS)}}
    layouts = {"one": ("--parallel.dp", "1"), **SGD_LAYOUTS}
    done = plait_train_all(  # independent runs, side by side
        {
            what: (*TINY, *SGD, *model, *layout, "--train.run_dir", str(dirs[what]))
            for what, layout in layouts.items()
        }
    )
    one, r = dirs["one"], done["one"]
    assert r.returncode == 0, r.stderr
    first, last = losses(one)[1], losses(one)[8]
    assert last < first - 0.3, (first, last)  # SGD really trains at this rate
    for what in SGD_LAYOUTS:
        run, r = dirs[what], done[what]
        assert r.returncode == 0, r.stderr
        assert_runs_match(run, one, what=what)


ERROR_FEEDBACK = [
    ("topk", "gradient", 0),
    ("topk", "momentum", 0),
    ("topk", "momentum", 2),
    ("topk", "gradient", 2),
    ("powersgd", "gradient", 0),
    ("onebit", "sgd-momentum", 0),  # 1-bit SGD: momentum SGD, its momentum exchanged in 1 bit
]


def _error_feedback(compression, target, stage):
    comp = ("--parallel.dp", "2", "--comm.compression", compression, "--comm.topk_ratio", "0.05")
    if target == "sgd-momentum":
        target, comp = "momentum", comp + ("--optim.name", "sgd", "--train.lr", "0.05")
    comp += ("--comm.target", target, "--comm.freeze_step", "2", "--parallel.zero_stage", str(stage))
    return comp + ("--comm.powersgd_rank", "2")


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """For each ERROR_FEEDBACK config, <config>/ref: 8 uninterrupted steps, and <config>/run: a
    copy of ref as a stop after step 4 leaves it (`cut_copy`), resumed; another/run: the same of
    topk-gradient-0, resumed with powersgd. Side by side, each resume as soon as its reference is
    done. Returns the base directory and {"<config>/<ref|resume>": CompletedProcess}."""
    base = tmp_path_factory.mktemp("resume")
    refs, resumes = {}, {}
    for config in ERROR_FEEDBACK:
        name, comp = "-".join(map(str, config)), _error_feedback(*config)
        refs[name] = train_job(base / name / "ref", *TINY, *comp)
        resumes[f"{name}/resume"] = resume_job(refs[name], base / name / "run")
    another = base / "another" / "run"
    resumes["another/resume"] = resume_job(refs["topk-gradient-0"], another, "--comm.compression", "powersgd")
    done = side_by_side({f"{name}/ref": job for name, job in refs.items()} | resumes)
    return base, {name: r for name, (_, r) in done.items()}


@pytest.mark.parametrize("compression,target,stage", ERROR_FEEDBACK)
def test_resume_with_error_feedback_restores_the_residuals(resumed, compression, target, stage):
    # The residual is part of the training state: without it the resumed steps would differ.
    # With target = momentum (1-bit Adam) the stop at step 4 falls in the compression stage (the
    # freeze is at 2); under ZeRO-2 the momentum, whole on every rank after the freeze, is saved
    # as shards and gathered again at the resume. Under ZeRO-2 with target = gradient the
    # compressor replaces the gradient reduce-scatter; PowerSGD's warm-start matrices are state too.
    base, done = resumed
    name = f"{compression}-{target}-{stage}"
    for what in ("ref", "resume"):
        r = done[f"{name}/{what}"]
        assert r.returncode == 0, f"{name} {what}: {r.stderr}"
    assert "resumed from" in r.stdout and "step_00000004" in r.stdout
    ref, run = base / name / "ref", base / name / "run"
    assert max(losses(run)) > 4 and losses(run) == losses(ref)  # bit for bit, every step


def test_onebit_adam_under_zero2_follows_data_parallel(resumed):
    """1-bit Adam's rule with top-k messages under ZeRO-2 (reduce-scatter and sharded AdamW in the
    warm-up; after the freeze no reduce-scatter, the whole momentum exchanged, the shard stepped)
    follows the same run at zero_stage 0 (DataParallel): the losses, and the gradient norms that
    after the freeze are rank 0's own gradient's, clipped by each rank on its own, within 1e-5."""
    base, done = resumed
    for name in ("topk-momentum-2", "topk-momentum-0"):
        assert done[f"{name}/ref"].returncode == 0, done[f"{name}/ref"].stderr
    assert "under ZeRO-2 backward then skips the reduce-scatter" in done["topk-momentum-2/ref"].stdout
    ref = base / "topk-momentum-0" / "ref"
    assert_runs_match(base / "topk-momentum-2" / "ref", ref, what="1-bit Adam, ZeRO-2 vs stage 0")


def test_resume_with_another_compressor_starts_from_zero_residuals(resumed):
    base, done = resumed
    r = done["another/resume"]
    assert r.returncode == 0, r.stderr
    assert "residuals of another layout" in r.stdout and max(losses(base / "another" / "run")) == 8


def test_resume_is_bit_exact_and_damage_is_detected(tmp_path):
    """With dropout on, so the restored RNG states matter too."""
    ref = tmp_path / "ref"
    run = tmp_path / "run"
    # the first half under an outer torchrun (plait train is then one rank), interrupted at step 4
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "plait.cli"]
    job = (*TINY, "--parallel.dp", "2", "--model.dropout", "0.1")
    first = side_by_side(  # independent: the reference and the first half, side by side
        {
            "ref": partial(plait_train, *job, "--train.run_dir", str(ref)),
            "cut": partial(
                subprocess.run,
                [*torchrun, "train", *job, "--train.run_dir", str(run), "--train.stop_at", "4"],
                capture_output=True,
                text=True,
                timeout=180,
            ),
        }
    )
    r = first["ref"]
    assert r.returncode == 0, r.stderr
    r = first["cut"]
    assert r.returncode == 0, r.stderr
    assert max(losses(run)) == 4
    # Three damaged copies of the interrupted run, each with the damage of the one before and
    # one more: a flipped byte in a shard, then the shard truncated, then no manifest.
    damaged = [tmp_path / f"damaged{i}" for i in range(3)]
    for i, copy in enumerate(damaged):
        shutil.copytree(run, copy)
        ckpt = copy / "checkpoints" / "step_00000004"
        shard = sorted(ckpt.glob("*.distcp"))[0]
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
        if i >= 1:
            shard.write_bytes(bytes(data[: len(data) // 3]))
        if i >= 2:
            (ckpt / "MANIFEST.json").unlink()
    r = plait_train("--resume", str(run), "--model.n_layer", "3")
    assert r.returncode == 2 and "model.n_layer cannot change on resume" in r.stderr, r.stderr
    # the resume, and beside it the damaged copies refused before any rank starts
    second = plait_train_all(
        {"resume": ("--resume", str(run)), **{i: ("--resume", str(d)) for i, d in enumerate(damaged)}}
    )
    r = second["resume"]
    assert r.returncode == 0, r.stderr
    assert "resumed from" in r.stdout
    assert losses(run) == losses(ref)  # bit for bit, every step
    r = plait_train(*TINY, "--train.run_dir", str(run))  # a new run never overwrites an old one
    assert r.returncode == 2 and "already holds a run" in r.stderr, r.stderr

    r = second[0]
    assert r.returncode == 1 and "corrupted" in r.stderr and shard.name in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    r = second[1]
    assert r.returncode == 1 and "truncated" in r.stderr, r.stderr
    r = second[2]
    assert r.returncode == 1 and "did not complete" in r.stderr, r.stderr


def test_a_stuck_rank_is_reported_by_the_watchdog_and_the_job_ends(tmp_path):
    t0 = time.time()
    r = plait_train(
        *TINY,
        "--parallel.dp",
        "2",
        "--comm.timeout_s",
        "4",
        "--train.run_dir",
        str(tmp_path / "run"),
        env=fault_env("1:3:hang"),
    )
    elapsed = time.time() - t0
    assert r.returncode == 1, r.stderr
    assert "plait watchdog: rank 0" in r.stderr and "all_reduce on axis 'dp'" in r.stderr, r.stderr
    assert "rank 1: last op" in r.stderr  # what the stuck rank last did
    # Printed once, by the rank (the launcher points at it), and without a stack dump.
    assert r.stderr.count("plait watchdog: rank 0") == 1 and "the watchdog report above" in r.stderr
    assert "main thread" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert elapsed < 40, elapsed  # timeout 4 s + start-up, not a hang


def test_failing_rank_takes_the_job_down_with_its_traceback(tmp_path):
    t0 = time.time()
    r = plait_train(
        *TINY, "--parallel.dp", "2", "--train.run_dir", str(tmp_path / "run"), env=fault_env("1:3")
    )
    elapsed = time.time() - t0
    assert r.returncode == 1
    assert "rank 1 failed" in r.stderr and "injected fault on rank 1 at step 3" in r.stderr, r.stderr
    assert "Traceback" in r.stderr and "loop.py" in r.stderr  # the rank's own traceback
    assert elapsed < 40, elapsed  # not the 60 s collective timeout, let alone a hang


def test_bf16_recompute_and_accumulation_train(reference_run, dp_runs):
    """bf16 autocast + activation checkpointing + accumulation: runs, and tracks the fp32 losses."""
    ref, _ = reference_run
    run, r = dp_runs["dp2 bf16 + recompute x 2 micro-batches"]
    assert r.returncode == 0, r.stderr
    a, b = losses(run), losses(ref)
    assert a.keys() == b.keys()
    for step in a:
        assert abs(a[step] - b[step]) < 0.03 * b[step], (step, a[step], b[step])
    assert a != b  # bf16 really ran

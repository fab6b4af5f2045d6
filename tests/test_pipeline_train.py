"""`plait train` with pipeline parallelism: the same losses as data parallelism, a measured and a
simulated timeline written beside the run, resume from a pipelined checkpoint, and bad pipeline
configs rejected before any process starts."""

import json

import pytest
from conftest import TINY, assert_runs_match, losses, resume_job, side_by_side

from plait.errors import ConfigError
from plait.train.config import load_config

# 4 blocks: pp=2 x 2 virtual stages for interleaved and ZB-V
PP = ("--model.n_layer", "4", "--parallel.dp", "1", "--parallel.pp", "2")


@pytest.fixture(scope="module")
def runs(shared_runs, tmp_path_factory):
    """{name: (run dir, CompletedProcess)}: the job on one process, on dp=2 and on pp=2 under 1F1B
    and ZB-V; the 1F1B run and the one-process run as stopped after step 4 (`cut_copy`) resumed
    under 1F1B at pp=2 (no ZeRO); side by side."""
    base = tmp_path_factory.mktemp("pp")
    layouts = {
        "dp": ("--model.n_layer", "4", "--parallel.dp", "2"),
        "1f1b": (*PP, "--parallel.schedule", "1f1b"),
        "zb-v": (*PP, "--parallel.schedule", "zb-v", "--parallel.microbatches", "4"),
        "one": ("--model.n_layer", "4", "--parallel.dp", "1"),
    }
    jobs = {name: shared_runs.job(*TINY, *extra) for name, extra in layouts.items()}
    jobs["resumed"] = resume_job(jobs["1f1b"], base / "resumed")
    into_pp = (*PP[2:], "--parallel.schedule", "1f1b", "--parallel.zero_stage", "0", "--parallel.tp", "1")
    jobs["one-to-pp2"] = resume_job(jobs["one"], base / "one-to-pp2", *into_pp)
    done = side_by_side(jobs)
    for name in layouts:
        _, r = done[name]
        assert r.returncode == 0, f"{name}: {r.stderr}"
    return done


@pytest.mark.parametrize("kind", ["1f1b", "zb-v"])
def test_pipelined_runs_match_data_parallel(runs, kind):
    run, r = runs[kind]
    assert f"pipeline over 2 ({kind}" in r.stdout
    assert sorted(losses(run)) == sorted(losses(runs["dp"][0]))
    assert_runs_match(run, runs["dp"][0], what=kind)  # losses and gradient norms (4 micro-batches in zb-v)
    summary = json.loads((run / "summary.json").read_text())
    dp_summary = json.loads((runs["dp"][0] / "summary.json").read_text())
    assert abs(summary["val_loss"] - dp_summary["val_loss"]) <= 1e-5 * dp_summary["val_loss"]


def test_timeline_files(runs):
    run, r = runs["zb-v"]
    timeline = json.loads((run / "pipeline_timeline.json").read_text())
    assert timeline["schedule"] == "zb-v" and timeline["p"] == 2 and timeline["v"] == 2
    kinds = {e["kind"] for e in timeline["events"]}
    assert kinds == {"F", "B", "W"}
    assert len(timeline["events"]) == 3 * 2 * 2 * 4  # F, B, W x 2 ranks x 2 stages x 4 micro-batches
    assert timeline["simulated_makespan_s"] > 0 and timeline["measured_step_s"] > 0
    assert (run / "pipeline_timeline.png").stat().st_size > 1000
    assert "simulated" in r.stdout


def test_pipelined_checkpoint_resumes(runs):
    run, r = runs["resumed"]
    assert r.returncode == 0, r.stderr
    assert "resumed from" in r.stdout and "step_00000004" in r.stdout
    assert_runs_match(run, runs["1f1b"][0], steps=range(5, 9), what="resumed 1f1b")


def test_one_process_checkpoint_resumes_under_a_pipeline(runs):
    """A one-process checkpoint resumed at pp=2 without ZeRO (the cell of the resume matrix that
    test_compose.py leaves to this file): steps 5-8 follow the uninterrupted one-process run."""
    run, r = runs["one-to-pp2"]
    assert r.returncode == 0, r.stderr
    assert "resumed from" in r.stdout and "step_00000004" in r.stdout and "pipeline over 2 (1f1b" in r.stdout
    assert_runs_match(run, runs["one"][0], steps=range(5, 9), what="one process resumed at pp=2")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"parallel": {"pp": 2, "schedule": "pipedream"}},
            "valid: gpipe, 1f1b, interleaved, zb-h1, zb-h2, zb-v",
        ),
        (
            {"parallel": {"pp": 2, "schedule": "interleaved", "microbatches": 3}, "model": {"n_layer": 4}},
            "multiple of",
        ),
        ({"parallel": {"pp": 2, "schedule": "interleaved"}, "model": {"n_layer": 2}}, "not divisible into"),
        ({"parallel": {"pp": 3}, "model": {"n_layer": 4}}, "not divisible into"),
        (
            {"parallel": {"pp": 2, "zero_stage": 3}, "offload": {"optimizer": "cpu", "delayed_update": True}},
            "parallel.zero_stage = 3 and offload.delayed_update is not available",
        ),
        ({"parallel": {"pp": 2}, "train": {"micro_batches": 2}}, "parallel.microbatches instead"),
    ],
)
def test_bad_pipeline_configs_rejected(tmp_path, overrides, message):
    import tomllib  # noqa: F401  (the config format)

    lines = []
    for section, values in overrides.items():
        lines.append(f"[{section}]")
        for k, v in values.items():
            lines.append(f"{k} = {json.dumps(v)}")
    path = tmp_path / "c.toml"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=message):
        load_config(path)

"""The parameter servers' checkpoints as a user meets them: `plait train --resume` and
`plait export` of a parameter-server run, with [log] tensorboard on.

One bsp run (2 servers, checkpoints at clocks 2 and 4, stopped at 4) is trained once; the tests
damage copies of it:

* a crafted `step_4/server0.pt` whose pickle would write a marker file when unpickled (its
  manifest rewritten to match, so that only the reading itself can stop it) is never run, by
  `plait export` or by `plait train --resume`: both fall back to step 2 with one line naming the
  file; a truncated `step_4/server1.pt` is caught by the manifest, and the resume falls back too;
  both resumed runs repeat the original's clocks 3 and 4 exactly (bsp is deterministic);
* `plait export` of the undamaged run writes the servers' parameters of step 4 as the file the
  trainer's export writes (load_exported rebuilds the model);
* the TensorBoard events of the run, and of a resumed copy (the resume purges the clocks it
  repeats), hold the numbers of metrics.jsonl;
* a garbage or missing manifest is skipped as a damaged shard is (the choice alone, no process).
"""

import shutil

import pytest
import torch
from conftest import TINY, losses, plait_train, run_cli, side_by_side
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from plait.async_training.ps_checkpoint import choose_checkpoint
from plait.async_training.ps_report import load_final_model
from plait.errors import CheckpointError, ConfigError
from plait.train.checkpoint import write_manifest
from plait.train.config import load_config
from plait.train.export import load_exported
from plait.train.metrics import read_metrics
from plait.train.tensorboard import scalars

PS = [
    *TINY,
    "--parallel.dp", "2",
    "--train.sample_tokens", "0",
    "--ps.servers", "2",
    "--ps.consistency", "bsp",
    "--train.checkpoint_every", "2",
    "--log.tensorboard", "true",
]  # fmt: skip


@pytest.fixture(scope="module")
def ps_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("ps-ckpt") / "run"
    r = plait_train(*PS, "--train.stop_at", "4", "--train.run_dir", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(p.name for p in (run / "ps_checkpoints").iterdir()) == ["step_2", "step_4"]
    return run


class _Payload:
    """Unpickling this runs `code` (pickle calls exec with it)."""

    def __init__(self, code: str):
        self.code = code

    def __reduce__(self):
        return exec, (self.code,)


def _craft(run, marker):
    step = run / "ps_checkpoints" / "step_4"
    state = torch.load(step / "server0.pt", weights_only=True)
    state["optimizer"] = _Payload(f"open({str(marker)!r}, 'w').write('ran')")
    torch.save(state, step / "server0.pt")
    write_manifest(step, ["server0.pt", "server1.pt"], step=4, servers=2)  # checksums that match


def _truncate(run):
    path = run / "ps_checkpoints" / "step_4" / "server1.pt"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _events(log_dir) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _assert_events_are_the_metrics(run):
    records = read_metrics(run / "metrics.jsonl")
    want: dict[str, list] = {}
    for r in records:
        for tag, value in scalars(r).items():
            want.setdefault(tag, []).append((r["step"], value))
    got = _events(run / "tensorboard")
    assert set(got) == set(want) and "loss" in got and "staleness_mean" in got, (sorted(got), sorted(want))
    for tag, points in want.items():
        assert [s for s, _ in got[tag]] == [s for s, _ in points], tag  # each step once, in order
        for (_, g), (_, w) in zip(got[tag], points):
            assert g == pytest.approx(w, rel=1e-6, abs=1e-30), tag  # stored as float32


def test_damaged_server_checkpoints_are_not_unpickled_and_resume_falls_back(ps_run, tmp_path):
    crafted, truncated, marker = tmp_path / "crafted", tmp_path / "truncated", tmp_path / "marker"
    for dst in (crafted, truncated):
        shutil.copytree(ps_run, dst, ignore=shutil.ignore_patterns("run.lock"))
    _craft(crafted, marker)
    _truncate(truncated)

    def export_then_resume():
        exported = run_cli("export", crafted, "--out", tmp_path / "crafted.safetensors")
        return exported, plait_train("--resume", str(crafted))

    done = side_by_side(
        {"crafted": export_then_resume, "truncated": lambda: plait_train("--resume", str(truncated))}
    )
    exported, resumed = done["crafted"]
    assert not marker.exists(), "a crafted server checkpoint ran code"
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert "server0.pt holds more than tensors" in exported.stdout and "exporting step_2" in exported.stdout
    assert "exported step 2" in exported.stdout, exported.stdout
    for r, says in ((resumed, "server0.pt holds more than tensors"), (done["truncated"], "it is truncated")):
        assert r.returncode == 0, r.stderr[-3000:]
        assert "Traceback" not in r.stderr, r.stderr[-3000:]
        note = [x for x in r.stdout.splitlines() if "resuming from step_2" in x]
        assert len(note) == 1 and says in note[0], r.stdout
        assert "resumed at step 2" in r.stdout
    want = losses(ps_run)
    for run in (crafted, truncated):
        got = losses(run)
        assert sorted(got) == list(range(1, 9)), (run.name, sorted(got))
        assert [got[s] for s in (3, 4)] == [want[s] for s in (3, 4)], run.name  # the same clocks again
    assert losses(crafted) == losses(truncated)
    _assert_events_are_the_metrics(truncated)  # the resume purged clocks 3 and 4 of the first run


def test_export_of_a_parameter_server_run(ps_run, tmp_path):
    out = tmp_path / "model.safetensors"
    r = run_cli("export", ps_run, "--out", out)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"exported step 4 of {ps_run}" in r.stdout, r.stdout
    model, _ = load_exported(out)
    want = load_final_model(load_config(ps_run / "config.toml"), ps_run, 4).state_dict()
    got = model.state_dict()
    assert set(got) == set(want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    _assert_events_are_the_metrics(ps_run)


def test_a_bad_or_missing_manifest_is_skipped_like_a_damaged_shard(ps_run, tmp_path):
    """What `--resume` and `plait export` choose from (no process started): a step whose manifest
    is garbage or missing is skipped with its reason; none left that verifies is one error."""
    run = tmp_path / "run"
    shutil.copytree(ps_run / "ps_checkpoints", run / "ps_checkpoints")
    step4, step2 = (run / "ps_checkpoints" / f"step_{c}" for c in (4, 2))
    assert choose_checkpoint(run, 2) == (4, None)
    (step4 / "MANIFEST.json").write_text("{not json")
    clock, note = choose_checkpoint(run, 2)
    assert clock == 2 and "MANIFEST.json is unreadable" in note and "resuming from step_2" in note, note
    (step4 / "MANIFEST.json").unlink()
    clock, note = choose_checkpoint(run, 2)
    assert clock == 2 and "has no MANIFEST.json" in note, note
    (step2 / "server0.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="no parameter-server checkpoint in .* verifies"):
        choose_checkpoint(run, 2)
    with pytest.raises(ConfigError, match="resume with --ps.servers 2"):  # another key-range count
        choose_checkpoint(ps_run, 3)

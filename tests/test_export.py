"""`plait export`: the checkpoint of a ZeRO-3 run and of a tensor-parallel run, written as one
safetensors file, loads strictly into a plain one-process GPT and gives the logits of the same
checkpoint loaded through the trainer's own resume path, and the run's reported held-out loss;
`--step`, `--dtype bf16` and the header; one-line errors with the other subcommands' exit codes."""

import dataclasses
import json
import shutil
import subprocess
import sys

import pytest
import safetensors.torch
import torch
from conftest import TINY

from plait.cli import main
from plait.data import eval_batches, load_corpus
from plait.models import GPT
from plait.testing import run_ranks
from plait.train.export import export, exported_metadata, load_exported, run_model_config

LAYOUTS = {
    "dp2-zero3": ("--parallel.zero_stage", "3"),
    "tp2": ("--model.n_head", "4", "--parallel.tp", "2", "--parallel.dp", "1"),
}
# (layout, step): the latest checkpoint of each run, and an earlier one of the ZeRO-3 run
CHECKS = [("dp2-zero3", None), ("dp2-zero3", 4), ("tp2", None)]


@pytest.fixture(scope="module")
def runs(shared_runs):
    """One 8-step tiny run per layout, checkpoints at steps 4 and 8 (shared with the ZeRO and
    tensor-parallel `plait train` tests: read, and written to only by `export`)."""
    done = shared_runs.get({name: (*TINY, *layout) for name, layout in LAYOUTS.items()})
    for name, (_, r) in done.items():
        assert r.returncode == 0, f"{name}: {r.stderr}"
    return {name: run for name, (run, _) in done.items()}


def _tokens() -> torch.Tensor:
    return torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))


def _trainer_logits(jobs):
    """On one rank: each (run_dir, step) checkpoint loaded as `plait train --resume` loads it,
    resharded to one process (dp 1, tp 1, ZeRO 0), and the raw model's logits on `_tokens()`."""
    from plait.data import DistributedBatchSampler
    from plait.mesh import Mesh
    from plait.train.build import build_engine
    from plait.train.checkpoint import latest_checkpoint, load_checkpoint
    from plait.train.config import load_config, model_config

    mesh = Mesh(dp=1, timeout_s=60)
    one = [("parallel.dp", "1"), ("parallel.tp", "1"), ("parallel.zero_stage", "0")]
    corpus = load_corpus()
    out = []
    for run_dir, step in jobs:
        cfg = load_config(run_dir / "config.toml", one)
        raw = GPT(model_config(cfg))
        engine = build_engine(raw, cfg, mesh, run_dir)
        scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda s: 1.0)
        sampler = DistributedBatchSampler(corpus.train, raw.cfg.seq_len, cfg.train.global_batch, 0, 1, 0)
        root = run_dir / "checkpoints"
        path = latest_checkpoint(root) if step is None else root / f"step_{step:08d}"
        assert load_checkpoint(path, mesh, engine, scheduler, sampler) == (step or 8)
        with torch.no_grad():
            out.append(raw.eval()(_tokens()))
        engine.close()
    mesh.close()
    return out


@pytest.fixture(scope="module")
def trainer_logits(runs):
    (logits,) = run_ranks(_trainer_logits, 1, args=([(runs[name], step) for name, step in CHECKS],))
    return dict(zip(CHECKS, logits))


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: f"{c[0]}-step{c[1] or 'latest'}")
def test_export_loads_strictly_with_the_trainers_logits(runs, trainer_logits, tmp_path, check):
    name, step = check
    run = runs[name]
    out = export(run, tmp_path / "model.safetensors", step=step)
    state = safetensors.torch.load_file(out)
    model = GPT(run_model_config(run))
    assert set(state) == set(model.state_dict())  # both names of the tie, as separate copies
    model.load_state_dict(state, strict=True)
    assert model.lm_head.weight is model.wte.weight  # still tied after the load
    with torch.no_grad():
        logits = model.eval()(_tokens())
    torch.testing.assert_close(logits, trainer_logits[check], atol=1e-6, rtol=0)
    rebuilt, cfg = load_exported(out)
    assert cfg == model.cfg
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(_tokens()), logits, atol=0, rtol=0)
    assert not list(tmp_path.glob(".*tmp*"))  # the temporary file was renamed


@pytest.mark.parametrize("name", LAYOUTS)
def test_exported_model_has_the_runs_held_out_loss(runs, name):
    """The final held-out loss the run reported (summary.json), from the default --out file."""
    run = runs[name]
    assert export(run) == run / "model.safetensors"
    model, cfg = load_exported(run / "model.safetensors")
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in eval_batches(load_corpus().val, cfg.seq_len, 8, 2):  # TINY's global batch, eval batches
            total += float(model(x, y, reduction="sum"))
            count += y.numel()
    want = json.loads((run / "summary.json").read_text())["val_loss"]
    assert abs(total / count - want) <= 1e-6 * want, (total / count, want)


def test_cli_exports_an_earlier_step_in_bf16_with_its_config(runs, tmp_path):
    run = runs["dp2-zero3"]
    out = tmp_path / "new" / "m.safetensors"  # a folder that does not exist yet
    args = ["export", str(run), "--step", "4", "--dtype", "bf16", "--out", str(out)]
    r = subprocess.run(
        [sys.executable, "-m", "plait.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert f"exported step 4 of {run}" in r.stdout and str(out) in r.stdout
    meta = exported_metadata(out)
    assert meta["plait.step"] == "4" and meta["plait.dtype"] == "bf16"
    assert json.loads(meta["plait.model_config"]) == dataclasses.asdict(run_model_config(run))
    assert json.loads(meta["plait.tied"]) == [["wte.weight", "lm_head.weight"]]
    assert meta["plait.run_config"] == (run / "config.toml").read_text()
    fp32 = safetensors.torch.load_file(export(run, tmp_path / "fp32.safetensors", step=4))
    bf16 = safetensors.torch.load_file(out)
    assert set(bf16) == set(fp32)
    for k, v in bf16.items():
        assert v.dtype == torch.bfloat16 and torch.equal(v, fp32[k].to(torch.bfloat16)), k
    model, _ = load_exported(out)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def _plait_export(capsys, *args) -> tuple[int, str]:
    code = main(["export", *map(str, args)])
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    return code, err


def test_export_errors_are_one_line(runs, tmp_path, capsys):
    run = runs["dp2-zero3"]
    (tmp_path / "a_file").write_text("")
    bare = tmp_path / "bare"  # a run directory that saved no checkpoint yet
    bare.mkdir()
    shutil.copy(run / "config.toml", bare / "config.toml")
    corrupt = tmp_path / "corrupt"
    shutil.copytree(run, corrupt, ignore=shutil.ignore_patterns("*.safetensors"))
    shard = corrupt / "checkpoints" / "step_00000008" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    cases = [
        ((tmp_path / "nowhere",), 2, "not found"),
        ((tmp_path,), 2, "no config.toml"),
        ((bare,), 1, "holds no checkpoint"),
        ((run, "--step", "5"), 2, "available: 4, 8"),
        ((run, "--step", "five"), 2, "invalid int value"),
        ((run, "--dtype", "fp16"), 2, "valid: fp32, bf16"),
        ((run, "--out", tmp_path), 2, "is a directory"),
        ((run, "--out", tmp_path / "a_file" / "m.safetensors"), 2, "is not a directory"),
        ((corrupt,), 1, "fails its SHA-256 check"),
    ]
    for args, code, text in cases:
        got, err = _plait_export(capsys, *args)
        assert got == code and text in err, (args, got, err)
        prefix = "plait: config error: " if code == 2 else "plait: error: "
        assert err.startswith(prefix), err
    assert not (bare / "model.safetensors").exists() and not (corrupt / "model.safetensors").exists()


def test_failed_write_keeps_the_old_file_and_leaves_no_partial_one(runs, tmp_path, capsys, monkeypatch):
    out = tmp_path / "model.safetensors"
    out.write_text("an earlier export")

    def full_disk(tensors, filename, metadata=None):
        with open(filename, "wb") as fh:
            fh.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    code, err = _plait_export(capsys, runs["tp2"], "--out", out)
    assert code == 1 and "No space left on device" in err and "nothing was written" in err, err
    assert out.read_text() == "an earlier export"
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]

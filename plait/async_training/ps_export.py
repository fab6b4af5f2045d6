"""`plait export` of a parameter-server run: the servers' parameters of one step of
ps_checkpoints/ (verified as `--resume` verifies them: manifest, then plain tensors only) as the
safetensors file that `plait.train.export.export` writes for a trainer's run, with the same keys,
ties and header, so `load_exported` and `load_state_dict(strict=True)` take it alike.

The servers' keys are the GPT's parameters in registration order with each tie once
(`model.parameters()`), cut into key ranges; concatenating the shards of servers 0..S-1 gives them
back in that order.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from plait.async_training.ps_checkpoint import ROOT, choose_checkpoint, read_params, step_dir, steps
from plait.errors import CheckpointError, ConfigError
from plait.models import GPT
from plait.train.checkpoint import verify_checkpoint
from plait.train.export import (
    DTYPES,
    META_CONFIG,
    META_TIED,
    _check_out,
    _untied,
    _write_file,
    run_model_config,
    tie_groups,
)


def is_ps_run(run_dir: str | Path) -> bool:
    """Whether `run_dir` was trained by parameter servers (it holds ps_checkpoints/, no checkpoints/)."""
    return (Path(run_dir) / ROOT).is_dir() and not (Path(run_dir) / "checkpoints").is_dir()


def export_ps(run_dir: str | Path, out=None, step: int | None = None, dtype: str = "fp32") -> Path:
    """`plait export` of a parameter-server run: the servers' parameters of `step` (default the
    newest step that verifies) as the safetensors file `plait.train.export.export` writes for a
    trainer's run (same keys, ties and header), default RUN_DIR/model.safetensors."""
    run_dir = Path(run_dir)
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is unknown; valid: {', '.join(DTYPES)}")
    if step is None:
        step, note = choose_checkpoint(run_dir, None)
        if note:
            print(note.replace("resuming from", "exporting"), flush=True)
    elif not step_dir(run_dir, step).is_dir():
        have = ", ".join(str(c) for c, _ in reversed(steps(run_dir))) or "none"
        raise ConfigError(f"--step {step}: no parameter-server checkpoint of that step; available: {have}")
    out = Path(out) if out is not None else run_dir / "model.safetensors"
    _check_out(out)
    mcfg = run_model_config(run_dir)
    params = read_params(run_dir, step)
    with torch.device("meta"):
        model = GPT(mcfg)
    keys = list(model.parameters())  # registration order, ties once: the servers' keys
    if [tuple(p.shape) for p in keys] != [tuple(v.shape) for v in params]:
        raise CheckpointError(
            f"{step_dir(run_dir, step)} holds other tensors than the model config.toml describes"
        )
    by_param = {id(p): v for p, v in zip(keys, params)}
    state = {n: by_param[id(p)] for n, p in model.named_parameters(remove_duplicate=False)}
    metadata = {
        META_CONFIG: json.dumps(dataclasses.asdict(mcfg)),
        META_TIED: json.dumps([g for g in tie_groups(model) if len(g) > 1]),
    }
    d = step_dir(run_dir, step)
    return _write_file(_untied(model, state, dtype), out, metadata, run_dir, d, verify_checkpoint(d), dtype)

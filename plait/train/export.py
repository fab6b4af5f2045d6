"""`plait export`: one consolidated model file from a run's checkpoint, for use without plait's trainer.

    plait export runs/20261202-130629 --out model.safetensors [--step N] [--dtype fp32|bf16]

Checkpoints are already layout-free (`plait.zero.state`): every parameter is saved under its
canonical name as (boxes of) the whole tensor, in its `saved_shape`, whatever dp degree, ZeRO
stage or tp degree wrote it. Consolidating is therefore a read, in this one process with no
process group (`dcp.load(..., no_dist=True)`), of the checkpoint's model part into whole tensors,
reshaped to the parameter shapes of the model the run's `config.toml` describes. The checkpoint's
manifest is verified first, as on resume.

The file is a safetensors state dict with exactly the keys of `GPT(cfg).state_dict()`, so a plain
one-process model loads it with `load_state_dict(..., strict=True)`. Tied parameters (GPT's
`wte.weight` and `lm_head.weight`, tied by default) are one tensor in the model and one entry in
the checkpoint; safetensors refuses tensors that share memory, so the file holds each name of a
tie as its own copy of the same values (a tied GPT costs vocab x d_model extra elements on disk),
and loading writes both copies into the one shared parameter. The header's metadata records the
model config (`plait.model_config`, JSON of `GPTConfig`), the ties (`plait.tied`), the step, the
source checkpoint and the run's config.toml, so `load_exported` can rebuild the model alone.
The file is written to a temporary name beside `out` and renamed: a failed export leaves no
partial file and an earlier file of that name intact.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile
import tomllib
import warnings
from pathlib import Path

import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from plait.errors import CheckpointError, ConfigError, ExportError
from plait.models import GPT, GPTConfig
from plait.models.hf import HFCausalLM, hf_model_class
from plait.models.hf_weights import save_hf
from plait.models.python_source import PythonModel, build_python_model, model_args
from plait.state import saved_shape
from plait.train.checkpoint import MANIFEST, latest_checkpoint, read_latest, verify_checkpoint
from plait.train.config import Config, model_config, set_key

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
META_CONFIG = "plait.model_config"
META_TIED = "plait.tied"


def run_model_config(run_dir: str | Path):
    """The GPTConfig (an hf run's HFConfig) of the run in `run_dir`, from the [model] section of its
    config.toml and its tokenizer, which an unset vocabulary size follows.

    Only those keys are read: the rest of the run's config (its corpus file, offload path,
    devices) need not exist where the export runs."""
    return model_config(_run_model_keys(run_dir))


def _run_model_keys(run_dir: str | Path):
    """A default Config with the run's [model] keys and tokenizer keys set."""
    path = Path(run_dir) / "config.toml"
    if not path.is_file():
        raise ConfigError(f"{run_dir} has no config.toml: is it a plait run directory?")
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: unreadable ({exc})") from None
    model = data.get("model", {})
    if not isinstance(model, dict):
        raise ConfigError(f"{path}: [model] must be a section")
    cfg = Config()
    for key, value in model.items():
        set_key(cfg, "model", key, value, from_cli=False)
    _set_tokenizer(cfg, data.get("data", {}), Path(run_dir))
    return cfg


def _set_tokenizer(cfg, data: dict, run_dir: Path) -> None:
    """The run's tokenizer keys, which an unset model.vocab_size follows: a tokenizer file is the
    copy in the run directory (the path the run named need not exist where the export runs)."""
    if not isinstance(data, dict):
        return
    for key in ("tokenizer", "vocab_size"):
        if key in data:
            set_key(cfg, "data", key, data[key], from_cli=False)
    if cfg.data.tokenizer not in ("bytes", "bpe"):
        cfg.data.tokenizer = str(run_dir / "tokenizer.json")


def _copy_tokenizer(run_dir: Path, out_dir: Path) -> None:
    """The run's tokenizer.json (a BPE or a tokenizer file the run used) beside the export."""
    if (run_dir / "tokenizer.json").is_file():
        shutil.copyfile(run_dir / "tokenizer.json", out_dir / "tokenizer.json")


def completed_steps(root: Path) -> list[int]:
    """The steps of the complete checkpoints (with a manifest) under `root`, in order."""
    steps = []
    for p in root.glob("step_*"):
        if p.is_dir() and not p.name.endswith(".tmp") and (p / MANIFEST).exists():
            try:
                steps.append(int(p.name.removeprefix("step_")))
            except ValueError:
                continue
    return sorted(steps)


def find_checkpoint(run_dir: str | Path, step: int | None = None) -> Path:
    """The checkpoint directory of `step` in the run, or the latest one."""
    root = Path(run_dir) / "checkpoints"
    steps = completed_steps(root) if root.is_dir() else []
    if step is None:
        damaged = read_latest(root)[1] if root.is_dir() else None
        path = latest_checkpoint(root) if root.is_dir() and not damaged else None
        if path is None:
            if steps:  # `latest` lost or damaged, complete checkpoints left: do not guess which is wanted
                why = damaged or f"{root} has no 'latest' pointer"
                have = ", ".join(map(str, steps))
                raise CheckpointError(f"{why}; choose a checkpoint with --step ({have})")
            if (Path(run_dir) / "ps_checkpoints").is_dir():  # the servers' (async_training.ps_checkpoint)
                raise CheckpointError(
                    f"{run_dir} is a parameter-server run (ps_checkpoints/): export it with "
                    f"plait export {run_dir}, or plait.async_training.ps_export.export_ps"
                )
            raise CheckpointError(f"{root} holds no checkpoint to export: the run saved none yet")
        return path
    if step < 0:
        raise ConfigError(f"--step must be >= 0, got {step}")
    path = root / f"step_{step:08d}"
    if not path.is_dir():
        have = f"available: {', '.join(map(str, steps))}" if steps else "the run holds no checkpoint"
        raise ConfigError(f"--step {step}: no checkpoint of that step in {root}; {have}")
    return path


def tie_groups(model: torch.nn.Module) -> list[list[str]]:
    """The parameter names of `model` grouped by the Parameter they name (ties), in model order."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return list(groups.values())


def read_model_state(ckpt: str | Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole canonical parameters of `model` (which may be on the meta device) from the
    checkpoint `ckpt`, read in this process without a process group: {state-dict key: tensor in
    the parameter's shape, in the dtype it was saved in}. Every name of a tie gets the same tensor.
    """
    ckpt = Path(ckpt)
    try:
        metadata = dcp.FileSystemReader(str(ckpt)).read_metadata()
    except Exception as exc:
        raise CheckpointError(f"{ckpt}: unreadable DCP metadata ({exc})") from None
    saved = {
        k.removeprefix("model."): md
        for k, md in metadata.state_dict_metadata.items()
        if k.startswith("model.") and isinstance(md, TensorStorageMetadata)
    }
    params = dict(model.named_parameters(remove_duplicate=False))
    unknown = sorted(set(saved) - set(params))
    if unknown:
        raise CheckpointError(
            f"{ckpt} holds parameters the run's model does not have ({', '.join(unknown[:4])}"
            f"{', ...' if len(unknown) > 4 else ''}): config.toml does not describe this checkpoint's model"
        )
    request: dict[str, torch.Tensor] = {}
    for names in tie_groups(model):
        present = [n for n in names if n in saved]
        if not present:
            raise CheckpointError(
                f"{ckpt} lacks the parameter {names[0]}: config.toml does not describe the checkpoint's model"
            )
        for n in present:
            want = saved_shape(params[n].shape)
            if tuple(saved[n].size) != tuple(want):
                raise CheckpointError(
                    f"{ckpt}: {n} was saved as {tuple(saved[n].size)}, the run's model needs {tuple(want)}: "
                    "config.toml does not describe this checkpoint's model"
                )
            request[n] = torch.empty(want, dtype=saved[n].properties.dtype)
    try:
        with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": as intended
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"model": request}, checkpoint_id=str(ckpt), no_dist=True)
    except (Exception, CheckpointException) as exc:  # DCP's exception is a BaseException
        raise CheckpointError(f"reading the model from {ckpt} failed: {exc}") from None
    out: dict[str, torch.Tensor] = {}
    for names in tie_groups(model):
        present = [n for n in names if n in request]
        value = request[present[0]]
        for other in present[1:]:  # copies of one tie held by different ranks (pipelines)
            if not torch.equal(request[other], value):
                raise CheckpointError(
                    f"{ckpt}: the tied parameters {present[0]} and {other} hold different values"
                )
        for n in names:
            out[n] = value.view(params[n].shape)
    return out


def _check_out(out: Path) -> None:
    """`out` can be created: not a directory, its folder exists (made here) and takes files."""
    if out.is_dir():
        raise ConfigError(f"--out {out} is a directory; give a file name such as {out / 'model.safetensors'}")
    if out.parent.exists() and not out.parent.is_dir():
        raise ConfigError(f"--out {out}: {out.parent} is not a directory; choose another path")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out.parent, prefix=".plait-probe-"):
            pass
    except OSError as exc:
        raise ConfigError(f"--out {out}: cannot write in {out.parent} ({exc}); choose another path") from None


def export(
    run_dir: str | Path, out: str | Path | None = None, step: int | None = None, dtype: str = "fp32"
) -> Path:
    """Write the model of the run's checkpoint (`step`, default the latest) as one safetensors
    file at `out` (default RUN_DIR/model.safetensors), in `dtype` ("fp32" or "bf16"); returns
    the path written. See the module docstring for the format."""

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"run directory {str(run_dir)!r} not found")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is unknown; valid: {', '.join(DTYPES)}")
    mcfg = run_model_config(run_dir)
    ckpt = find_checkpoint(run_dir, step)
    source = _run_source(run_dir)
    if source.startswith("python:"):  # the user's module: its own state dict, by its own names
        return export_python(run_dir, source, ckpt, Path(out) if out is not None else None, dtype)
    if not isinstance(mcfg, GPTConfig):  # a Hugging Face model: a save_pretrained directory
        return export_hf(run_dir, mcfg, ckpt, Path(out) if out is not None else run_dir / "hf", dtype)
    out = Path(out) if out is not None else run_dir / "model.safetensors"
    _check_out(out)
    manifest = verify_checkpoint(ckpt)

    with torch.device("meta"):  # names, shapes and ties only: no memory, no initialisation
        model = GPT(mcfg)
    state = read_model_state(ckpt, model)
    tensors = _untied(model, state, dtype)
    for key in model.state_dict():  # persistent buffers (GPT has none) are not in checkpoints
        if key not in tensors:
            raise ExportError(f"the model's state {key} is not a parameter and is not in the checkpoint")
    metadata = {
        META_CONFIG: json.dumps(dataclasses.asdict(mcfg)),
        META_TIED: json.dumps([g for g in tie_groups(model) if len(g) > 1]),
    }
    return _write_file(tensors, out, metadata, run_dir, ckpt, manifest, dtype)


def _untied(model: torch.nn.Module, state: dict, dtype: str, prefix: str = "") -> dict[str, torch.Tensor]:
    """The checkpoint's tensors in `dtype` by the model's names (`prefix` removed); each name of a
    tie gets its own copy, since safetensors takes no tensors that share memory."""
    tensors = {}
    for names in tie_groups(model):
        for i, name in enumerate(names):
            t = state[name].to(DTYPES[dtype]).contiguous()
            tensors[name.removeprefix(prefix)] = t.clone() if i else t
    return tensors


def _write_file(tensors, out: Path, metadata: dict, run_dir: Path, ckpt: Path, manifest, dtype) -> Path:
    """`tensors` as the safetensors file `out`, with `metadata` and the step, checkpoint, dtype and
    run config in its header: written under a temporary name, synced and renamed (a failed export
    leaves nothing); the run's tokenizer.json, if any, beside it."""
    metadata = {
        "format": "pt",
        **metadata,
        "plait.step": str(manifest.get("step", "")),
        "plait.checkpoint": str(ckpt),
        "plait.dtype": dtype,
        "plait.run_config": (run_dir / "config.toml").read_text(),
    }
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        safetensors.torch.save_file(tensors, str(tmp), metadata=metadata)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
            os.fchmod(fh.fileno(), 0o666 & ~_umask())  # a file's usual mode, not save_file's own
        os.replace(tmp, out)
        _copy_tokenizer(run_dir, out.parent)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise ExportError(f"writing {out} failed ({exc}); nothing was written there") from None
    return out


def _umask() -> int:
    mask = os.umask(0o022)  # read by setting it: put back at once
    os.umask(mask)
    return mask


def _run_source(run_dir: Path) -> str:
    model = tomllib.loads((run_dir / "config.toml").read_text()).get("model", {})
    return str(model.get("source", "plait")) if isinstance(model, dict) else "plait"


def export_python(run_dir: Path, source: str, ckpt: Path, out: Path | None, dtype: str) -> Path:
    """A python: run's checkpoint as one safetensors file of the factory's module's own state dict
    (`module.load_state_dict(safetensors.torch.load_file(out))` loads it): the factory is imported
    (from the current directory or PYTHONPATH, as in training) to learn names and shapes on the meta
    device; a tokenizer.json of the run is copied beside the file."""
    out = out if out is not None else run_dir / "model.safetensors"
    _check_out(out)
    manifest = verify_checkpoint(ckpt)
    cfg = _run_model_keys(run_dir)
    with torch.device("meta"):
        model = build_python_model(source, model_args(cfg))
    state = read_model_state(ckpt, model)
    tensors = _untied(model, state, dtype, "net." if isinstance(model, PythonModel) else "")
    return _write_file(tensors, out, {"plait.source": source}, run_dir, ckpt, manifest, dtype)


def export_hf(run_dir: Path, mcfg, ckpt: Path, out: Path, dtype: str) -> Path:
    """An hf run's checkpoint as a ``save_pretrained`` directory `out` (config.json and
    model.safetensors in transformers' names and layouts; `plait.models.hf_weights.save_hf`), which
    ``transformers.AutoModelForCausalLM.from_pretrained(out)`` and ``model.weights = out`` load.
    Written beside `out` under a temporary name and renamed; an existing `out` must be empty or an
    earlier export (it is replaced)."""
    if out.exists() and (not out.is_dir() or any(p.name not in _HF_FILES for p in out.iterdir())):
        raise ConfigError(
            f"--out {out} exists and is not an earlier export (a directory of {', '.join(_HF_FILES)}); "
            "choose another path"
        )
    verify_checkpoint(ckpt)
    with torch.device("meta"):  # names, shapes and ties only
        model = HFCausalLM(hf_model_class(mcfg.arch)(mcfg.to_hf_config()), mcfg)
    state = read_model_state(ckpt, model)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        save_hf(mcfg, {k: v.float() for k, v in state.items()}, tmp, DTYPES[dtype])
        _copy_tokenizer(run_dir, tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ExportError(f"writing {out} failed ({exc}); nothing was written there") from None
    return out


_HF_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json")


def exported_header(path: str | Path) -> tuple[dict[str, str], int]:
    """(the header metadata, the number of tensor elements) of a safetensors file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path} not found")
    try:
        with safe_open(str(path), framework="pt") as fh:
            n = sum(math.prod(fh.get_slice(k).get_shape()) for k in fh.keys())  # noqa: SIM118
            return fh.metadata() or {}, n
    except Exception as exc:  # safetensors raises its own SafetensorError for a bad header
        raise ExportError(f"{path} is not a readable safetensors file ({exc})") from None


def exported_metadata(path: str | Path) -> dict[str, str]:
    """The header metadata of a file written by `export` (model config, ties, step, ...)."""
    metadata = exported_header(path)[0]
    if META_CONFIG not in metadata and "plait.source" in metadata:
        raise ExportError(
            f"{path} holds the state dict of model.source = {metadata['plait.source']!r}: build the module "
            "with your factory and load it with load_state_dict(safetensors.torch.load_file(path))"
        )
    if META_CONFIG not in metadata:
        raise ExportError(f"{path} has no {META_CONFIG} in its header: it was not written by plait export")
    return metadata


def load_exported(path: str | Path, device: str | torch.device = "cpu"):
    """(model, GPTConfig) from a file written by `export`: the GPT rebuilt from the config in the
    header, its parameters loaded with strict=True, in the file's dtype, in eval mode."""
    metadata = exported_metadata(path)
    try:
        state = safetensors.torch.load_file(str(path), device=str(device))
    except Exception as exc:
        raise ExportError(f"{path} is not a readable safetensors file ({exc})") from None
    cfg = GPTConfig(**json.loads(metadata[META_CONFIG]))
    model = GPT(cfg).to(device)
    dtypes = {t.dtype for t in state.values()}
    if len(dtypes) == 1:
        model.to(dtypes.pop())
    model.load_state_dict(state, strict=True)
    return model.eval(), cfg

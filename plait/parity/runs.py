"""`plait verify CONFIG`: the user's config, trained a few steps on one process and under each
layout by `plait train` itself, then compared (`plait.parity.compare`).

Each run is a `plait train` of the user's config with what verification needs set over it
(`VERIFY_KEYS`: SGD without momentum, weight decay, clipping or dropout; a constant learning
rate; the user's precision; a checkpoint after every step, all kept; placements recorded). Its losses and
gradient norms come from metrics.jsonl, its parameters, whole, from its checkpoints through the
checkpoint path (any layout to the model's own names), and the parameters before the first step
from the model built here with the run's seed, as every rank builds it.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from plait.errors import ConfigError
from plait.models.source import build_model
from plait.parity.compare import Trace
from plait.train.checkpoint import step_checkpoints
from plait.train.config import Config, set_key, validate
from plait.train.export import read_model_state
from plait.train.metrics import read_metrics
from plait.train.module_record import read as read_records

# The parallel keys a layout may set (`--layouts dp=2+zero_stage=3`), and train.micro_batches.
LAYOUT_KEYS = (
    "dp",
    "tp",
    "pp",
    "ep",
    "cp",
    "cp_style",
    "zero_stage",
    "hybrid_shard",
    "sequence_parallel",
    "schedule",
    "microbatches",
    "virtual_stages",
    "bucket_mb",
)
TRAIN_KEYS = ("micro_batches",)
MAX_LAYOUTS = 32


def verify_keys(steps: int, lr: float) -> list[tuple[str, object]]:
    """What every run of a verification sets over the user's config."""
    return [
        ("optim.name", "sgd"),
        ("optim.momentum", 0.0),
        ("train.weight_decay", 0.0),
        ("train.grad_clip", 0.0),
        ("model.dropout", 0.0),
        ("train.lr", lr),
        ("train.min_lr", lr),
        ("train.warmup_steps", 0),
        ("train.steps", steps),
        ("train.stop_at", 0),
        ("train.checkpoint_every", 1),
        ("train.keep_checkpoints", steps),
        ("train.log_every", 1),
        ("train.eval_every", 0),
        ("train.eval_batches", 1),
        ("train.sample_tokens", 0),
        ("log.placements", True),
        ("log.modules", True),
        ("log.tensorboard", False),
        ("parallel.plan", "manual"),
        ("parallel.world", 0),
        ("comm.compression", "none"),
        ("offload.optimizer", "none"),
    ]


def _set(cfg: Config, dotted: str, value) -> None:
    section, _, key = dotted.partition(".")
    set_key(cfg, section, key, value, from_cli=False)


def base_config(cfg: Config, steps: int, lr: float) -> Config:
    """The user's config with `verify_keys` set: every run starts from this."""
    out = copy.deepcopy(cfg)
    for dotted, value in verify_keys(steps, lr):
        _set(out, dotted, value)
    return out


def reference_config(base: Config) -> Config:
    """One process: every degree 1, no ZeRO; the whole global batch (accumulated over the
    user's train.micro_batches)."""
    ref = copy.deepcopy(base)
    default = Config().parallel
    for key in LAYOUT_KEYS:
        _set(ref, f"parallel.{key}", getattr(default, key))
    ref.parallel.dp = 1
    validate(ref)
    return ref


def parse_layout(text: str, base: Config) -> tuple[str, Config]:
    """`dp=2+zero_stage=3` -> (its name, the config that runs it): the keys given over the
    one-process layout (unset degrees are 1). Bad keys or values: one ConfigError."""
    ref = copy.deepcopy(base)
    default = Config().parallel
    for key in LAYOUT_KEYS:
        setattr(ref.parallel, key, getattr(default, key))
    ref.parallel.dp = 1
    pairs = [p for p in text.split("+") if p]
    if not pairs:
        raise ConfigError(f"--layouts: empty layout in {text!r}; write one as dp=2+zero_stage=3")
    for pair in pairs:
        key, eq, value = pair.partition("=")
        key = key.strip().removeprefix("parallel.").removeprefix("train.")
        if not eq or key not in (*LAYOUT_KEYS, *TRAIN_KEYS):
            raise ConfigError(
                f"--layouts {text!r}: {pair!r} is not key=value with a layout key; valid keys: "
                f"{', '.join((*LAYOUT_KEYS, *TRAIN_KEYS))}"
            )
        section = "train" if key in TRAIN_KEYS else "parallel"
        try:
            set_key(ref, section, key, value.strip(), from_cli=True)
        except ConfigError as exc:
            raise ConfigError(f"--layouts {text!r}: {exc}") from None
    if ref.world_size < 2:
        raise ConfigError(
            f"--layouts {text!r} runs on one process, which is the reference: give dp, tp, pp, ep or cp > 1"
        )
    try:
        validate(ref)
    except ConfigError as exc:
        raise ConfigError(f"--layouts {text!r}: {exc}") from None
    return "+".join(pairs), ref


def run_one(name: str, cfg: Config, out: Path, timeout: float = 900) -> Path:
    """`plait train` of `cfg` into out/runs/<name>; returns the run directory. Its output goes
    to out/runs/<name>.log; a failed run raises one line with the log's last lines."""
    runs = out / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    run_dir = runs / name
    if run_dir.exists():
        shutil.rmtree(run_dir)  # verify's own run from an earlier call
    cfg = copy.deepcopy(cfg)
    cfg.train.run_dir = str(run_dir)
    config_file = runs / f"{name}.toml"
    config_file.write_text(cfg.to_toml())
    log = runs / f"{name}.log"
    with log.open("w") as fh:
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "plait.cli", "train", str(config_file)],
                stdout=fh,
                stderr=subprocess.STDOUT,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise ConfigError(f"verify: the run {name} took over {timeout:.0f} s; see {log}") from None
    if proc.returncode != 0:
        lines = log.read_text(errors="replace").strip().splitlines()
        raise RunFailed(
            f"verify: the run {name} failed (exit {proc.returncode}): {' | '.join(lines[-3:])}; see {log}",
            "\n".join(lines[-60:]),
            read_records(run_dir / "modules")[1] if (run_dir / "modules").is_dir() else [],
        )
    return run_dir


class RunFailed(ConfigError):
    """A layout's `plait train` exited non-zero: `log` is its output's end, `records` the ranks'
    failure records (the module each failing rank was in, `plait.train.module_record`)."""

    def __init__(self, message: str, log: str, records: list[dict]) -> None:
        super().__init__(message)
        first = min(records, key=lambda f: f.get("time", 0.0)) if records else {}
        self.records = records
        self.failures = {first.get("rank", 0): log}  # what `failed_result` shows as the traceback


def initial_parameters(cfg: Config) -> dict[str, torch.Tensor]:
    """The parameters every rank starts from: the model built here under the run's seed."""
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def read_trace(name: str, run_dir: Path, cfg: Config, initial: dict[str, torch.Tensor]) -> Trace:
    """A finished run as a `Trace`: losses and gradient norms of each step, the parameters after
    each (whole, by the model's names), and the placements its ranks recorded."""
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    by_step = {r["step"]: r for r in records}
    steps = cfg.train.steps
    missing = [k for k in range(1, steps + 1) if k not in by_step]
    if missing:
        raise ConfigError(f"verify: {run_dir} has no metrics for steps {missing}")
    with torch.device("meta"):
        torch.manual_seed(cfg.train.seed)
        shapes = build_model(cfg)
    ckpts = {int(p.name.rsplit("_", 1)[1]): p for p in step_checkpoints(run_dir / "checkpoints")}
    params = [initial]
    for k in range(1, steps + 1):
        if k not in ckpts:
            raise ConfigError(f"verify: {run_dir} has no checkpoint of step {k}")
        state = read_model_state(ckpts[k], shapes)
        params.append({n: state[n].float() for n in initial})
    placements: dict[str, str] = {}
    local: dict[int, int] = {}
    for path in sorted((run_dir / "placements").glob("rank_*.json")):
        record = json.loads(path.read_text())
        for n, where in record.get("placements", {}).items():
            placements.setdefault(n, where)
        local[int(path.stem.split("_")[1])] = record.get("local_params")
    trace = Trace(
        name,
        [by_step[k]["loss"] for k in range(1, steps + 1)],
        [by_step[k]["grad_norm"] for k in range(1, steps + 1)],
        params,
        placements,
    )
    trace.records = [by_step[k] for k in range(1, steps + 1)]  # for the measured figures
    if (run_dir / "modules").is_dir():  # step 1 module by module (log.modules): localisation
        trace.modules = read_records(run_dir / "modules")[0]
    trace.local_params = local
    return trace


class Progress:
    """One line per run on stderr: which run, and how long it took."""

    def __init__(self, total: int, quiet: bool = False) -> None:
        self.total, self.done, self.quiet = total, 0, quiet

    def run(self, name: str, cfg: Config, out: Path) -> Path:
        self.done += 1
        if not self.quiet:
            print(
                f"plait verify: [{self.done}/{self.total}] {name} on {cfg.world_size} process(es) ...",
                file=sys.stderr,
                flush=True,
            )
        t0 = time.perf_counter()
        run_dir = run_one(name, cfg, out)
        if not self.quiet:
            print(
                f"plait verify: [{self.done}/{self.total}] {name}: trained in "
                f"{time.perf_counter() - t0:.0f} s",
                file=sys.stderr,
                flush=True,
            )
        return run_dir

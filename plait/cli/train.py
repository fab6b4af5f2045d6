"""`plait train [CONFIG.toml] [--section.key value ...] [--resume RUN_DIR]`."""

from __future__ import annotations

import sys
from pathlib import Path

from plait.async_training.ps_launch import launch_ps
from plait.controller import launch_controller
from plait.errors import ConfigError
from plait.planner.auto import resolve_auto
from plait.train.config import describe_keys, load_config, parse_overrides, read_config
from plait.train.console import survive_closed_output
from plait.train.diloco_checks import check_trainable
from plait.train.diloco_launch import launch_diloco
from plait.train.launch import launch, under_launcher
from plait.train.resume import check_resume_changes
from plait.train.rundir import resume_target

USAGE = """plait train [CONFIG.toml] [--section.key value ...] [--resume RUN_DIR]

Train a GPT on the configured mesh. CONFIG defaults to plait's built-in defaults; every key can
be overridden on the command line, e.g. `plait train configs/default.toml --train.steps 50`.
--resume RUN_DIR continues the run in RUN_DIR from its latest checkpoint, with its config (from the
newest one that verifies if `latest` is missing or damaged); --resume RUN_DIR/checkpoints/step_N
continues from that one. One plait train at a time owns a run directory. On --resume the layout,
the lr schedule (--train.lr, min_lr, warmup_steps, steps) and the optimizer options may change
(the new schedule takes over from the step reached); what the checkpoint holds (model, data,
batch, seed, optimizer) may not: docs/fault-tolerance.md.
`plait export RUN_DIR` writes a run's model as one safetensors file (plait export --help).
Sizes are bounded (steps at most 1e9, dimensions, degrees and batches at most 2**20), and a job
that does not fit in memory is refused before start (PLAIT_MEMORY_CHECK=0 skips that check):
docs/fault-tolerance.md.
Keys:
"""


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE + describe_keys())
        return 0
    survive_closed_output()  # `plait train | head -1`: the run goes on without its stdout
    resume_dir, rest = _split_resume(argv)
    config_path = None
    if rest and not rest[0].startswith("--"):
        config_path, rest = rest[0], rest[1:]
    overrides = parse_overrides(rest)
    checkpoint = None
    if resume_dir is not None:
        if config_path is not None:
            raise ConfigError(
                "give either a CONFIG file or --resume RUN_DIR (which uses its own config.toml)"
            )
        resume_dir, checkpoint = resume_target(resume_dir)  # a run directory, or one of its checkpoints
        config_path = Path(resume_dir) / "config.toml"
        overrides = _resume_overrides(overrides, resume_dir)
    cfg = load_config(config_path, overrides)
    if cfg.parallel.plan == "auto":
        if under_launcher():
            raise ConfigError(
                "parallel.plan = 'auto' under an outer launcher (torchrun): every rank would plan on "
                "its own; choose the layout first (plait plan --cluster this --devices N) and pass its keys"
            )
        cfg, _ = resolve_auto(cfg, out=sys.stdout)
    if cfg.diloco.inner_steps:  # replica groups, each a world of its own (plait.train.diloco_launch)
        if under_launcher():
            raise ConfigError(
                f"diloco.inner_steps = {cfg.diloco.inner_steps}: DiLoCo starts its own replica groups; "
                "run plait train directly, not under torchrun"
            )
        return launch_diloco(cfg, resume=resume_dir is not None)
    check_trainable(cfg)
    if cfg.ps.servers:  # servers and workers as separate processes (plait.async_training)
        if under_launcher():
            raise ConfigError(
                f"ps.servers = {cfg.ps.servers}: the parameter server starts its own servers and "
                "workers; run plait train directly, not under torchrun"
            )
        return launch_ps(cfg, resume=resume_dir is not None)
    if cfg.runtime.kind == "controller":  # one driver program and Monarch actors (plait.controller)
        return launch_controller(cfg, resume=resume_dir is not None, checkpoint=checkpoint)
    return launch(cfg, resume=resume_dir is not None, checkpoint=checkpoint)


def _split_resume(argv: list[str]) -> tuple[str | None, list[str]]:
    """(--resume's argument or None, the other arguments)."""
    resume_dir = None
    rest = []
    i = 0
    while i < len(argv):
        if argv[i] == "--resume" or argv[i].startswith("--resume="):
            if "=" in argv[i]:
                resume_dir = argv[i].split("=", 1)[1]
                i += 1
            elif i + 1 < len(argv):
                resume_dir = argv[i + 1]
                i += 2
            else:
                raise ConfigError("--resume needs a run directory")
        else:
            rest.append(argv[i])
            i += 1
    return resume_dir, rest


def _resume_overrides(overrides: list[tuple[str, str]], resume_dir) -> list[tuple[str, str]]:
    """A resumed run's overrides, checked against the run's config.toml key by key
    (`plait.train.resume`): a key the checkpoint fixes may not change; the run directory is
    --resume's."""
    config = Path(resume_dir) / "config.toml"
    given = [k for k, _ in overrides]
    check_resume_changes(read_config(config), read_config(config, overrides), given, resume_dir)
    # A resumed run goes to the end unless told otherwise: the interruption is not part of the config.
    return [("train.stop_at", "0"), *overrides, ("train.run_dir", str(resume_dir))]

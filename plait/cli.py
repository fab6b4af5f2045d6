"""The `plait` command: `plait train [CONFIG] [--section.key value ...] [--resume RUN_DIR]`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from plait.errors import ConfigError, PlaitError

USAGE = """plait train [CONFIG.toml] [--section.key value ...] [--resume RUN_DIR]

Train a GPT on the configured mesh. CONFIG defaults to plait's built-in defaults; every key can
be overridden on the command line, e.g. `plait train configs/default.toml --train.steps 50`.
--resume RUN_DIR continues the run in RUN_DIR from its latest checkpoint, with its config.
Keys:
"""


def _train(argv: list[str]) -> int:
    from plait.train.config import describe_keys, load_config, parse_overrides

    if any(a in ("-h", "--help") for a in argv):
        print(USAGE + describe_keys())
        return 0
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
    config_path = None
    if rest and not rest[0].startswith("--"):
        config_path, rest = rest[0], rest[1:]
    overrides = parse_overrides(rest)
    if resume_dir is not None:
        if config_path is not None:
            raise ConfigError(
                "give either a CONFIG file or --resume RUN_DIR (which uses its own config.toml)"
            )
        run_config = Path(resume_dir) / "config.toml"
        if not run_config.is_file():
            raise ConfigError(f"--resume {resume_dir}: no config.toml there; is it a plait run directory?")
        config_path = run_config
        changed = [
            k
            for k, _ in overrides
            if k.split(".")[0] in ("model", "data", "parallel")
            or k in ("train.global_batch", "train.micro_batches", "train.seed")
        ]
        if changed:
            raise ConfigError(
                f"--resume continues the run as configured; {', '.join(changed)} cannot change on resume "
                "(the checkpoint holds that model and data layout): start a new run instead"
            )
        # A resumed run goes to the end unless told otherwise: the interruption is not part of the config.
        overrides = [("train.stop_at", "0"), *overrides, ("train.run_dir", str(resume_dir))]
    cfg = load_config(config_path, overrides)
    from plait.train.launch import launch

    return launch(cfg, resume=resume_dir is not None)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="plait", description="Distributed training, verified and measured.")
    parser.add_argument("command", choices=["train"], help="what to do")
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    if argv[0] not in ("train",):
        parser.error(f"unknown command {argv[0]!r}; valid: train")
    try:
        return _train(argv[1:])
    except ConfigError as exc:
        print(f"plait: config error: {exc}", file=sys.stderr)
        return 2
    except PlaitError as exc:
        print(f"plait: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("plait: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

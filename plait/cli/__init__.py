"""The `plait` command: one module per subcommand, each with `main(argv) -> exit code`.

plait train [CONFIG] [--section.key value ...] [--resume RUN_DIR | RUN_DIR/checkpoints/step_N]
plait export RUN_DIR [--out model.safetensors] [--step N] [--dtype fp32|bf16]
plait estimate (--params N | --model NAME) [--dp N] [--zero-stage S] ... [--json]
plait schedule --kind KIND --stages P --microbatches M [--virtual-stages V] [--costs F,B,W] [--comm C]
               [--out timeline.png] [--json]
plait launch [--nproc N] SCRIPT.py [ARGS ...]
plait plan [CONFIG] [--section.key value ...] --devices N [--cluster NAME|FILE|this] [--top K] [--json]
plait plan --calibrate [--devices N ...]
plait layouts [--json]
plait verify [CONFIG] [--layouts L1,L2,... | --top N] [--steps K] [--lr LR] [--tol T] [--out DIR] [--json]
plait hogwild [--workers N] [--updates U] [--batch B] [--lock] [--optimizer adagrad|sgd] [--lr LR]
              [--features F] [--out DIR] [--json]

Every failure ends in one line and an exit code: 2 for a configuration error, 1 for any other
plait error or a refused file operation, 130 for Ctrl-C, 141 for a closed stdout pipe.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from plait.errors import ConfigError, PlaitError

# Each command's module is imported only when that command runs: this is the one place plait
# imports lazily on purpose, so that `plait --help` or `plait estimate` do not pay for torch's
# launcher and the trainer (seconds), and a command's imports never burden another's.
COMMANDS = {
    "train": "plait.cli.train",
    "export": "plait.cli.export",
    "estimate": "plait.cli.estimate",
    "schedule": "plait.cli.schedule",
    "plan": "plait.cli.plan",
    "hogwild": "plait.cli.hogwild",
    "launch": "plait.cli.launch",
    "layouts": "plait.cli.layouts",
    "verify": "plait.cli.verify",
}

HELP = (
    "train: run training; export: a run's model as one safetensors file (plait export --help); "
    "estimate: per-device memory of ZeRO (plait estimate --help); "
    "schedule: simulate a pipeline schedule (plait schedule --help); "
    "plan: choose the layout for N devices (plait plan --help); "
    "hogwild: lock-free SGD on shared memory (plait hogwild --help); "
    "launch: run your own script on N ranks, like torchrun (plait launch --help); "
    "layouts: which features combine, and why the others are refused; "
    "verify: check that layouts train your model like one process (plait verify --help)"
)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="plait", description="Distributed training, verified and measured.")
    parser.add_argument("command", choices=list(COMMANDS), help=HELP)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        parser.error(f"unknown command {argv[0]!r}; valid: {', '.join(COMMANDS)}")
    try:
        command = importlib.import_module(COMMANDS[argv[0]])
        code = command.main(argv[1:])
        sys.stdout.flush()  # a closed pipe shows here, inside the try
        return code
    except BrokenPipeError:
        _stdout_gone()
        return 141  # what a shell reports for a process ended by SIGPIPE (128 + 13)
    except ConfigError as exc:
        print(f"plait: config error: {exc}", file=sys.stderr)
        return 2
    except PlaitError as exc:
        print(f"plait: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("plait: interrupted", file=sys.stderr)
        return 130
    except OSError as exc:  # the file system said no (a full disk, a permission): one line
        where = f": {exc.filename}" if exc.filename else ""
        print(f"plait: error: {exc.strerror or exc}{where}", file=sys.stderr)
        return 1


def _stdout_gone() -> None:
    """The reader of stdout went away (`plait schedule | head -1`): send what is left nowhere, so
    the interpreter's last flush at exit does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass  # not a real file (a test's capture): nothing will flush it at exit

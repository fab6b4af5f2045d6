"""`plait launch [--nproc N] SCRIPT.py [ARGS ...]`: run a user's script on N local ranks with torch's
elastic launcher (what `torchrun --standalone --nproc-per-node N` does): each rank gets RANK,
WORLD_SIZE, LOCAL_RANK and the rendezvous address in its environment, which `plait.parallelize`
reads."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run

from plait.cli.args import parse_or_help
from plait.errors import ConfigError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="plait launch",
        description="Run SCRIPT on N local processes (ranks), as torchrun --standalone does; a script "
        "written with plait.parallelize trains on all of them (docs/your-model.md).",
    )
    parser.add_argument("--nproc", type=int, default=1, help="processes (ranks) on this machine (default 1)")
    parser.add_argument("script", help="the Python script each rank runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    return parser


def main(argv: list[str]) -> int:
    args = parse_or_help(_parser(), argv)
    if isinstance(args, int):  # --help, or argparse's own usage error (exit code 2)
        return args
    if args.nproc < 1:
        raise ConfigError(f"--nproc must be at least 1, got {args.nproc}")
    if not Path(args.script).is_file():
        raise ConfigError(f"plait launch: no script {args.script!r}")
    torchrun = get_args_parser().parse_args(
        ["--standalone", "--nproc-per-node", str(args.nproc), args.script, *args.args]
    )
    try:
        run(torchrun)
    except ChildFailedError as exc:  # the ranks' tracebacks were printed as they failed
        ranks = ", ".join(str(r) for r in sorted(exc.failures))
        print(f"plait launch: {args.script} failed on rank(s) {ranks}", file=sys.stderr)
        return 1
    return 0

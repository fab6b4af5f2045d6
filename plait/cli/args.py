"""What the commands' argument parsers share: a parser whose errors are ConfigErrors, typed
options with their valid range in the message, and an early check that an output file can be
written."""

from __future__ import annotations

import argparse
import math
import re
import sys
import tempfile
from pathlib import Path

from plait.errors import ConfigError


class Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of printing usage, so errors stay one line, and
    takes a negative number after an option as its value ("--params -7e9"), so that the option's
    own check refuses it with its valid range."""

    def error(self, message: str):
        raise ConfigError(message)

    def parse_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        # argparse reads "-7e9" or "-350M" as an option (only "-5" and "-.5" look numeric to it);
        # an option name never starts with a digit or a dot, so "--opt -7e9" is "--opt=-7e9".
        out = []
        for a in args:
            if out and re.match(r"-[0-9.]", a) and out[-1].startswith("--") and "=" not in out[-1]:
                out[-1] = f"{out[-1]}={a}"
            else:
                out.append(a)
        return super().parse_args(out, namespace)


def parse_or_help(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace | int:
    """The parsed arguments, or the exit code when argparse ended the command (--help printed)."""
    try:
        return parser.parse_args(argv)
    except SystemExit as exc:  # --help: printed, nothing else to do
        return int(exc.code or 0)


def int_in(lo: int, hi: int):
    """An argparse type: an integer in [lo, hi], or an error naming the range."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"expected an integer from {lo} to {hi:,}, got {text!r}")
        return value

    return parse


def float_in(lo: float, hi: float, lo_open: bool = False):
    """An argparse type: a finite number in [lo, hi] ((lo, hi] if `lo_open`), or an error naming it."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (lo < value if lo_open else lo <= value) or not value <= hi:  # NaN too
            where = f"({lo:g}, {hi:g}]" if lo_open else f"[{lo:g}, {hi:g}]"
            raise argparse.ArgumentTypeError(f"expected a number in {where}, got {text!r}")
        return value

    return parse


def check_writable_file(path: str, option: str) -> None:
    """`path` can be written: its directory exists and takes a new file (probed, then removed)."""
    target = Path(path)
    if target.is_dir():
        raise ConfigError(
            f"{option} {path!r} is a directory; give a file name, e.g. {target / 'timeline.png'}"
        )
    parent = target.absolute().parent
    if not parent.is_dir():
        raise ConfigError(f"{option} {path!r}: the directory {str(parent)!r} does not exist")
    try:
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".plait-probe-"):
            pass
    except OSError as exc:
        raise ConfigError(
            f"{option} {path!r}: cannot write in {str(parent)!r} ({exc.strerror or exc})"
        ) from None

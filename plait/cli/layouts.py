"""`plait layouts`: the table of which features combine (plait.combinations), as text or JSON."""

from __future__ import annotations

import dataclasses
import json

from plait.cli.args import Parser, parse_or_help
from plait.combinations import COMBINATIONS, FEATURES, describe_table


def main(argv: list[str]) -> int:
    parser = Parser(
        prog="plait layouts",
        description="Which features combine: each supported row with the test that proves it against one "
        "process, each refused row with its reason and the keys to change. docs/compose.md is generated "
        "from the same table.",
    )
    parser.add_argument("--json", action="store_true", help="print the table as JSON")
    args = parse_or_help(parser, argv)
    if isinstance(args, int):
        return args
    if args.json:
        rows = [
            {k: sorted(v) if isinstance(v, frozenset) else v for k, v in dataclasses.asdict(r).items()}
            for r in COMBINATIONS
        ]
        print(json.dumps({"features": FEATURES, "rows": rows}, indent=2))
    else:
        print(describe_table())
    return 0

"""`plait verify CONFIG [--layouts L1,L2,... | --top N] [--steps K] [--lr LR] [--tol T] [--out DIR]
[--cluster NAME] [--json] [--section.key value ...]`: does each layout train the user's model
exactly like one process? (plait.parity; docs/verify.md)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from plait.cli.args import Parser, float_in, int_in
from plait.parity.config_path import Request, verify_config
from plait.train.config import parse_overrides, read_config

MAX_STEPS = 100
OWN = ("--layouts", "--top", "--steps", "--lr", "--tol", "--out", "--cluster")


def _parser() -> Parser:
    parser = Parser(
        prog="plait verify",
        description="Train CONFIG's model for a few steps with SGD (no momentum, weight decay, clipping or "
        "dropout: Adam with clipping would hide a gradient of the wrong scale) on one process and under "
        "each layout, and compare per step the loss, the gradient norm, every parameter's gradient and "
        "every parameter. Prints `holds` or `differs at <parameter>` per layout, writes report.md, "
        "report.json and errors.png, and exits 1 when a layout differs. docs/verify.md.",
    )
    parser.add_argument(
        "config", nargs="?", metavar="CONFIG", help="a TOML config (default: plait's defaults)"
    )
    parser.add_argument(
        "--layouts",
        help="comma-separated layouts, each key=value pairs joined by +, with the keys of [parallel] "
        "(dp, tp, pp, ep, cp, cp_style, zero_stage, hybrid_shard, sequence_parallel, schedule, "
        "microbatches, virtual_stages, bucket_mb) and micro_batches, e.g. "
        "dp=2+zero_stage=3,tp=2+sequence_parallel=true,cp=2+cp_style=ulysses",
    )
    parser.add_argument(
        "--top", type=int_in(1, 32), default=0, help="verify the planner's N fastest layouts (default 3)"
    )
    parser.add_argument("--steps", type=int_in(1, MAX_STEPS), default=4, help="steps per run (default 4)")
    parser.add_argument(
        "--lr", type=float_in(0.0, 1e3, lo_open=True), default=0.2, help="SGD's learning rate (default 0.2)"
    )
    parser.add_argument(
        "--tol", type=float_in(0.0, 1.0, lo_open=True), default=None,
        help="relative error above which a layout differs (default 1e-5 in fp32, 2e-2 with train.bf16)",
    )  # fmt: skip
    parser.add_argument("--out", default="verify", help="the report's directory (default ./verify)")
    parser.add_argument(
        "--cluster",
        default=None,
        help="the planner's cluster for --top and predicted step times (default this)",
    )
    parser.add_argument("--json", action="store_true", help="print report.json to stdout")
    return parser


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    """(CONFIG and verify's own options, the --section.key overrides)."""
    own, rest, i = [], [], 0
    while i < len(argv):
        a = argv[i]
        if a.split("=", 1)[0] in OWN:
            take = 1 if "=" in a else 2
            own += argv[i : i + take]
            i += take
        elif a == "--json" or (not a.startswith("-") and not own and not rest):
            own.append(a)
            i += 1
        else:
            rest.append(a)
            i += 1
    return own, rest


def main(argv: list[str]) -> int:
    parser = _parser()
    if any(a in ("-h", "--help") for a in argv):
        parser.print_help()
        return 0
    own, rest = _split(argv)
    args = parser.parse_args(own)
    if args.layouts is not None and args.top:
        parser.error("give --layouts or --top, not both")
    config = read_config(args.config, parse_overrides(rest))
    layouts = [t.strip() for t in args.layouts.split(",")] if args.layouts is not None else []
    req = Request(config, layouts, args.top, args.steps, args.lr, args.tol, Path(args.out), args.cluster)
    report = verify_config(req)
    for line in report.lines():
        print(line)
    print(f"report: {Path(args.out) / 'report.md'}", file=sys.stderr)
    if args.json:
        print(json.dumps(json.loads((Path(args.out) / "report.json").read_text())))
    return 0 if report.holds else 1

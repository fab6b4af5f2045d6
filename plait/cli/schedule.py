"""`plait schedule --kind KIND --stages P --microbatches M [--virtual-stages V] [--costs F,B,W]
[--comm C] [--out timeline.png] [--json]`."""

from __future__ import annotations

import json

from plait.cli.args import Parser, check_writable_file, int_in, parse_or_help
from plait.errors import ConfigError
from plait.pipeline.check import check_schedule
from plait.pipeline.render import render_png, render_text
from plait.pipeline.schedules import SCHEDULES, default_virtual_stages, make_schedule
from plait.pipeline.simulate import Costs, formula_bubble, formula_bubble_time, simulate

MAX_STAGES = 256
"""`plait schedule --stages`: a row each in the drawings."""
MAX_SCHEDULE_ACTIONS = 2**13
"""`plait schedule`: stages x micro-batches x virtual stages, each built, checked, simulated and
drawn in Python (a few seconds at this bound)."""
MAX_PNG_ACTIONS, MAX_PNG_STAGES = 2**11, 64
"""`plait schedule --out`: a bar each, drawn by matplotlib (about ten seconds at this bound); a
larger drawing is unreadable anyway."""
MAX_WIDTH = 10_000
"""`plait schedule --width`: columns of the text timeline."""


def _parser() -> Parser:
    parser = Parser(
        prog="plait schedule",
        description="Build a pipeline schedule, check it, and simulate it on a cost model: timeline, "
        "per-rank bubble and peak activations, beside the papers' bubble formulas (GPipe, 1F1B, "
        "interleaved 1F1B, Zero Bubble).",
    )
    parser.add_argument("--kind", required=True, help=f"{', '.join(SCHEDULES)}")
    parser.add_argument("--stages", type=int_in(1, MAX_STAGES), required=True, help="pipeline ranks p")
    parser.add_argument(
        "--microbatches",
        type=int_in(1, MAX_SCHEDULE_ACTIONS),
        required=True,
        help="micro-batches per step m",
    )
    parser.add_argument(
        "--virtual-stages",
        type=int_in(1, MAX_SCHEDULE_ACTIONS),
        help="model chunks per rank v (default 2 for interleaved, zb-v; else 1)",
    )
    parser.add_argument(
        "--costs", default="1,1,1", help="F,B,W times, or F,BW (B and W get half each); default 1,1,1"
    )
    parser.add_argument("--comm", type=float, default=0.0, help="latency of a cross-rank edge (default 0)")
    parser.add_argument("--out", help="write the timeline as a PNG here")
    parser.add_argument(
        "--width", type=int_in(10, MAX_WIDTH), default=100, help="columns of the text timeline (default 100)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    return parser


def main(argv: list[str]) -> int:
    args = parse_or_help(_parser(), argv)
    if isinstance(args, int):
        return args
    if args.kind not in SCHEDULES:
        raise ConfigError(f"unknown schedule kind {args.kind!r}; valid: {', '.join(SCHEDULES)}")
    costs = Costs.parse(args.costs, comm=args.comm)
    v = args.virtual_stages if args.virtual_stages is not None else default_virtual_stages(args.kind)
    _check_size(args, v)
    schedule = make_schedule(args.kind, args.stages, args.microbatches, v)
    check_schedule(schedule)
    result = simulate(schedule, costs)
    p, m = schedule.p, schedule.m
    expected = formula_bubble(args.kind, p, m, schedule.v, costs)
    expected_time = formula_bubble_time(args.kind, p, m, schedule.v, costs)
    png = None
    if args.out:
        try:
            png = render_png([(f"{args.kind} p={p} m={m} v={schedule.v}", result, p)], args.out)
        except OSError as exc:
            raise ConfigError(f"--out {args.out!r}: cannot write it ({exc.strerror or exc})") from None
    if args.json:
        out = result.to_json()
        out.update(
            kind=args.kind, p=p, m=m, v=schedule.v, formula_bubble=expected, formula_bubble_time=expected_time
        )
        out["costs"] = {"F": costs.F, "B": costs.B, "W": costs.W, "comm": costs.comm}
        if png is not None:
            out["png"] = str(png)
        print(json.dumps(out))
        return 0
    _print_tables(args, schedule, costs, result, expected, expected_time)
    if png is not None:
        print(f"timeline written to {png}")
    return 0


def _check_size(args, v: int) -> None:
    """Refuse a schedule too large to simulate (or draw) in seconds, and an unwritable --out,
    before the work rather than after it."""
    size = args.stages * args.microbatches * v
    limit = MAX_PNG_ACTIONS if args.out else MAX_SCHEDULE_ACTIONS
    if size > limit:
        raise ConfigError(
            f"--stages x --microbatches x virtual stages = {args.stages} x {args.microbatches} x {v} = "
            f"{size:,} is more than plait schedule {'draws as a PNG' if args.out else 'simulates'} "
            f"({limit:,}); lower --stages or --microbatches"
        )
    if args.out and args.stages > MAX_PNG_STAGES:
        raise ConfigError(f"--out draws at most {MAX_PNG_STAGES} --stages, got {args.stages}")
    if args.out:
        check_writable_file(args.out, "--out")


def _print_tables(args, schedule, costs, result, expected, expected_time) -> None:
    """The text report: the timeline, per-rank bubble and peak activations, the formula."""
    p, m = schedule.p, schedule.m
    print(
        f"schedule {args.kind}: p={p} ranks, m={m} micro-batches, v={schedule.v} chunks per rank; "
        f"costs F={costs.F:g} B={costs.B:g} W={costs.W:g} (BW={costs.B + costs.W:g}) comm={costs.comm:g}"
    )
    print(render_text(result, p, width=args.width))
    print(f"{'rank':>4}  {'busy':>10}  {'bubble':>7}  {'idle in span':>12}  {'peak activations':>16}")
    for r in range(p):
        print(
            f"{r:>4}  {result.busy[r]:>10.4g}  {result.bubble_fraction[r]:>7.1%}  "
            f"{result.idle_within[r]:>12.4g}  {result.peak_activations[r]:>16.3g}"
        )
    print(f"makespan {result.makespan:.6g}; mean bubble {result.mean_bubble:.2%} of the makespan")
    if expected is not None:
        print(
            f"formula: bubble time {expected_time:.4g}, {expected:.2%} of the step; simulated: "
            f"longest idle within a rank's span {max(result.idle_within):.4g}, rank 0's bubble "
            f"{result.bubble_fraction[0]:.2%}"
        )
    elif args.kind == "zb-v":
        print("formula: none for zb-v in the reference")
    else:
        print("formula: none here (the formulas assume comm = 0 and equal stages)")
    print("bubble: idle share of the makespan; idle in span: idle between the rank's first and last action")
    print("peak activations: in micro-batches of activations through all of a rank's layers")

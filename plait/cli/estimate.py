"""`plait estimate (--params N | --model NAME) [--dp N] [--zero-stage S] ... [--json]`."""

from __future__ import annotations

import argparse
import json
import math

from plait.cli.args import Parser, int_in, parse_or_help
from plait.models import gpt_config
from plait.zero.estimate import MAX_RANKS, OPTIMIZERS, PRECISIONS, estimate_memory, format_estimate

MAX_PARAMS = 10**15
"""`plait estimate --params`: a thousand times the largest models trained."""


def count(text: str) -> int | float:
    """An argparse type: a parameter count as people write it ("7.5e9", "7.5B", "350M", "125k")."""
    scale = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}.get(text[-1:].lower(), 1.0)
    try:
        value = float(text[:-1] if scale != 1.0 else text) * scale
    except ValueError:
        value = math.nan
    if not 1 <= value <= MAX_PARAMS:  # NaN too
        raise argparse.ArgumentTypeError(
            f"expected a parameter count from 1 to {MAX_PARAMS:.0e} like 7.5e9 or 350M, got {text!r}"
        )
    # 1.1 * 1e9 is 1100000000.0000002 in floating point: snap to the count that was meant.
    if abs(value - round(value)) <= 1e-9 * abs(value):
        return round(value)
    return value  # estimate_memory says what is wrong with it


def _parser() -> Parser:
    parser = Parser(
        prog="plait estimate",
        description="Per-device memory of ZeRO training (Rajbhandari et al. 2019): model states for a "
        "parameter count or a named model, activations too with --model and --batch. GB = 1e9 bytes.",
    )
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", type=count, help="parameter count, e.g. 7.5e9 or 350M")
    src.add_argument("--model", help="a plait GPT config name (exact parameter count), e.g. gpt2")
    parser.add_argument(
        "--dp", type=int_in(1, MAX_RANKS), default=1, help="data-parallel degree N (default 1)"
    )
    parser.add_argument("--zero-stage", type=int, default=0, help="0 (baseline), 1, 2 or 3 (default 0)")
    parser.add_argument("--optimizer", default="adam", help=f"{', '.join(OPTIMIZERS)} (default adam)")
    parser.add_argument("--precision", default="bf16", help=f"{', '.join(PRECISIONS)} (default bf16)")
    parser.add_argument(
        "--shard",
        type=int_in(1, MAX_RANKS),
        help="hybrid sharding group size F, a divisor of dp (default dp)",
    )
    parser.add_argument(
        "--batch", type=int_in(1, MAX_RANKS), help="micro-batch size: adds activations (needs --model)"
    )
    parser.add_argument(
        "--seq", type=int_in(1, MAX_RANKS), help="sequence length (default: the model's seq_len)"
    )
    parser.add_argument("--recompute", action="store_true", help="full activation recomputation")
    parser.add_argument(
        "--cp",
        type=int_in(1, MAX_RANKS),
        default=1,
        help="context-parallel degree: each device holds 1/cp of every sequence (default 1)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return parser


def main(argv: list[str]) -> int:
    args = parse_or_help(_parser(), argv)
    if isinstance(args, int):
        return args
    result = estimate_memory(
        params=args.params,
        model=gpt_config(args.model) if args.model else None,  # the estimator knows no model names
        name=args.model,
        dp=args.dp,
        zero_stage=args.zero_stage,
        optimizer=args.optimizer,
        precision=args.precision,
        shard=args.shard,
        batch=args.batch,
        seq=args.seq,
        recompute=args.recompute,
        cp=args.cp,
    )
    print(json.dumps(result) if args.json else format_estimate(result))
    return 0

"""`plait hogwild [--workers N] [--updates U] [--batch B] [--lock] [--optimizer adagrad|sgd] [--lr LR]
[--features F] [--out DIR] [--json]`."""

from __future__ import annotations

import json
import signal
import sys

from plait.async_training.hogwild import MAX_UPDATES, MAX_WORKERS, OPTIMIZERS, HogwildConfig, describe
from plait.async_training.hogwild_run import CURVE_FILE, prepare_out_dir, run_to_dir
from plait.cli.args import Parser, float_in, int_in, parse_or_help


def _parser() -> Parser:
    d = HogwildConfig()
    parser = Parser(
        prog="plait hogwild",
        description="Hogwild (Niu et al. 2011): lock-free SGD from N processes on shared-memory weights, "
        "on a sparse logistic regression built from the embedded corpus (is the next byte whitespace? "
        "hashed byte n-grams). Writes loss.jsonl, summary.json and loss.png to --out. docs/hogwild.md.",
    )
    parser.add_argument(
        "--workers", type=int_in(1, MAX_WORKERS), default=d.workers, help=f"processes (default {d.workers})"
    )
    parser.add_argument(
        "--updates",
        type=int_in(1, MAX_UPDATES),
        default=d.updates,
        help=f"total updates over all workers (default {d.updates:,})",
    )
    parser.add_argument(
        "--batch", type=int_in(1, 4096), default=d.batch, help=f"examples per update (default {d.batch})"
    )
    parser.add_argument("--lock", action="store_true", help="a lock around every update (the baseline)")
    parser.add_argument(
        "--optimizer", default=d.optimizer, help=f"{' or '.join(OPTIMIZERS)} (default {d.optimizer})"
    )
    parser.add_argument(
        "--lr",
        type=float_in(0, 100, lo_open=True),
        default=d.lr,
        help=f"step size (default {d.lr:g}, for adagrad; sgd wants about 0.05)",
    )
    parser.add_argument(
        "--lr-decay",
        type=float_in(0, 1),
        default=d.lr_decay,
        help=f"lr / (1 + (t-1) decay) at global update t (default {d.lr_decay:g})",
    )
    parser.add_argument(
        "--features",
        type=int_in(2**8, 2**26),
        default=d.n_features,
        help=f"hashed features (default {d.n_features:,})",
    )
    parser.add_argument(
        "--context", type=int_in(1, 16), default=d.context, help=f"bytes of context (default {d.context})"
    )
    parser.add_argument(
        "--seed", type=int_in(0, 2**31 - 1), default=d.seed, help="example order seed (default 0)"
    )
    parser.add_argument(
        "--eval-points",
        type=int_in(0, 10_000),
        default=d.eval_points,
        help=f"loss-curve points (default {d.eval_points})",
    )
    parser.add_argument("--out", help="output directory (default runs/hogwild-<timestamp>)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    return parser


class _Terminated(Exception):
    """SIGTERM (a scheduler, `kill`): raised in the main thread, so train_hogwild's cleanup runs."""


def _on_sigterm(signum, frame):
    raise _Terminated


def main(argv: list[str]) -> int:
    args = parse_or_help(_parser(), argv)
    if isinstance(args, int):
        return args
    cfg = HogwildConfig(
        workers=args.workers,
        updates=args.updates,
        batch=args.batch,
        lock=args.lock,
        optimizer=args.optimizer,
        lr=args.lr,
        lr_decay=args.lr_decay,
        n_features=args.features,
        context=args.context,
        seed=args.seed,
        eval_points=args.eval_points,
        progress=not args.no_progress,
    )
    cfg.validate()  # before the directory is made
    out_dir = prepare_out_dir(args.out)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        result, files = run_to_dir(cfg, out_dir)
    except (KeyboardInterrupt, _Terminated) as exc:  # the workers are stopped by train_hogwild
        how, code = ("SIGTERM", 143) if isinstance(exc, _Terminated) else ("Ctrl-C", 130)
        print(
            f"plait: hogwild stopped by {how}; the loss curve so far is in {out_dir / CURVE_FILE} "
            "(no summary.json)",
            file=sys.stderr,
        )
        return code
    finally:
        signal.signal(signal.SIGTERM, previous)
    if args.json:
        summary = result.summary()
        summary.pop("curve")
        summary["files"] = {k: str(v) for k, v in files.items()}
        print(json.dumps(summary))
        return 0
    kind = describe(cfg)
    print(
        f"plait hogwild ({kind}, {cfg.optimizer}): {result.updates:,} updates in {result.seconds:.2f} s = "
        f"{result.updates_per_s:,.0f} updates/s; held-out loss {result.initial_loss:.4f} -> "
        f"{result.final_loss:.4f} nats; per worker {result.per_worker}"
    )
    print(f"curve {files['curve']}, plot {files['plot']}, summary {files['summary']}")
    return 0

"""The `plait` command.

plait train [CONFIG] [--section.key value ...] [--resume RUN_DIR | RUN_DIR/checkpoints/step_N]
plait export RUN_DIR [--out model.safetensors] [--step N] [--dtype fp32|bf16]
plait estimate (--params N | --model NAME) [--dp N] [--zero-stage S] ... [--json]
plait schedule --kind KIND --stages P --microbatches M [--virtual-stages V] [--costs F,B,W] [--comm C]
               [--out timeline.png] [--json]
plait launch [--nproc N] SCRIPT.py [ARGS ...]
plait plan [CONFIG] [--section.key value ...] --devices N [--cluster NAME|FILE|this] [--top K] [--json]
plait plan --calibrate [--devices N ...]
plait hogwild [--workers N] [--updates U] [--batch B] [--lock] [--optimizer adagrad|sgd] [--lr LR]
              [--features F] [--out DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from pathlib import Path

from plait.errors import ConfigError, PlaitError
from plait.zero.estimate import MAX_RANKS

USAGE = """plait train [CONFIG.toml] [--section.key value ...] [--resume RUN_DIR]

Train a GPT on the configured mesh. CONFIG defaults to plait's built-in defaults; every key can
be overridden on the command line, e.g. `plait train configs/default.toml --train.steps 50`.
--resume RUN_DIR continues the run in RUN_DIR from its latest checkpoint, with its config (from the
newest one that verifies if `latest` is missing or damaged); --resume RUN_DIR/checkpoints/step_N
continues from that one. One plait train at a time owns a run directory.
`plait export RUN_DIR` writes a run's model as one safetensors file (plait export --help).
Sizes are bounded (steps at most 1e9, dimensions, degrees and batches at most 2**20), and a job
that does not fit in memory is refused before start (PLAIT_MEMORY_CHECK=0 skips that check):
docs/fault-tolerance.md.
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
    checkpoint = None
    if resume_dir is not None:
        if config_path is not None:
            raise ConfigError(
                "give either a CONFIG file or --resume RUN_DIR (which uses its own config.toml)"
            )
        from plait.train.rundir import resume_target

        resume_dir, checkpoint = resume_target(resume_dir)  # a run directory, or one of its checkpoints
        config_path = Path(resume_dir) / "config.toml"
        changed = [
            k
            for k, _ in overrides
            if (k.split(".")[0] in ("model", "data", "parallel") and k not in RESHARDABLE)
            or k in ("train.global_batch", "train.micro_batches", "train.seed")
        ]
        if changed:
            raise ConfigError(
                f"--resume continues the run as configured; {', '.join(changed)} cannot change on resume "
                "(the checkpoint holds that model and data layout): start a new run instead. "
                f"What may change: {', '.join(RESHARDABLE)} and the [offload] keys"
            )
        # A resumed run goes to the end unless told otherwise: the interruption is not part of the config.
        overrides = [("train.stop_at", "0"), *overrides, ("train.run_dir", str(resume_dir))]
    cfg = load_config(config_path, overrides)
    from plait.train.launch import _under_launcher, launch

    if cfg.parallel.plan == "auto":
        if _under_launcher():
            raise ConfigError(
                "parallel.plan = 'auto' under an outer launcher (torchrun): every rank would plan on "
                "its own; choose the layout first (plait plan --cluster this --devices N) and pass its keys"
            )
        from plait.planner.auto import resolve_auto

        cfg, _ = resolve_auto(cfg, out=sys.stdout)
    return launch(cfg, resume=resume_dir is not None, checkpoint=checkpoint)


# Checkpoints are saved layout-free (plait.zero.state): a run may resume on another dp degree,
# tensor- or expert-parallel degree, pipeline (degree, schedule, micro-batches), ZeRO stage, hybrid group or
# bucket size, and DCP reads the shards the new layout needs.
RESHARDABLE = (
    "parallel.pp",
    "parallel.schedule",
    "parallel.microbatches",
    "parallel.virtual_stages",
    "parallel.dp",
    "parallel.ep",
    "parallel.tp",
    "parallel.sequence_parallel",
    "parallel.zero_stage",
    "parallel.hybrid_shard",
    "parallel.bucket_mb",
)


class _Parser(argparse.ArgumentParser):
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


def _int_in(lo: int, hi: int):
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


MAX_PARAMS = 10**15
"""`plait estimate --params`: a thousand times the largest models trained."""
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


def _count(text: str) -> int | float:
    # "7.5e9", "7.5B", "350M", "125k": parameter counts as people write them.
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


def _estimate(argv: list[str]) -> int:
    from plait.models import gpt_config
    from plait.zero.estimate import OPTIMIZERS, PRECISIONS, estimate_memory, format_estimate

    parser = _Parser(
        prog="plait estimate",
        description="Per-device memory of ZeRO training (Rajbhandari et al. 2019): model states for a "
        "parameter count or a named model, activations too with --model and --batch. GB = 1e9 bytes.",
    )
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", type=_count, help="parameter count, e.g. 7.5e9 or 350M")
    src.add_argument("--model", help="a plait GPT config name (exact parameter count), e.g. gpt2")
    parser.add_argument(
        "--dp", type=_int_in(1, MAX_RANKS), default=1, help="data-parallel degree N (default 1)"
    )
    parser.add_argument("--zero-stage", type=int, default=0, help="0 (baseline), 1, 2 or 3 (default 0)")
    parser.add_argument("--optimizer", default="adam", help=f"{', '.join(OPTIMIZERS)} (default adam)")
    parser.add_argument("--precision", default="bf16", help=f"{', '.join(PRECISIONS)} (default bf16)")
    parser.add_argument(
        "--shard",
        type=_int_in(1, MAX_RANKS),
        help="hybrid sharding group size F, a divisor of dp (default dp)",
    )
    parser.add_argument(
        "--batch", type=_int_in(1, MAX_RANKS), help="micro-batch size: adds activations (needs --model)"
    )
    parser.add_argument(
        "--seq", type=_int_in(1, MAX_RANKS), help="sequence length (default: the model's seq_len)"
    )
    parser.add_argument("--recompute", action="store_true", help="full activation recomputation")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help: printed, nothing else to do
        return int(exc.code or 0)
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
    )
    print(json.dumps(result) if args.json else format_estimate(result))
    return 0


def _export(argv: list[str]) -> int:
    from plait.models import GPTConfig
    from plait.train.export import DTYPES, META_CONFIG, export, exported_metadata

    parser = _Parser(
        prog="plait export",
        description="Write the model of a run's checkpoint as one consolidated safetensors file that a "
        "plain one-process GPT loads with load_state_dict(strict=True), whatever layout trained it; "
        "the header holds the model config (plait.train.export.load_exported rebuilds the model).",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (config.toml, checkpoints/)")
    parser.add_argument(
        "--out",
        help="the file to write (default RUN_DIR/model.safetensors); for an hf:* model the save_pretrained "
        "directory (default RUN_DIR/hf)",
    )
    parser.add_argument("--step", type=int, help="export this step's checkpoint (default: the latest)")
    parser.add_argument(
        "--dtype", default="fp32", help=f"{' or '.join(DTYPES)}: the tensors' dtype (default fp32)"
    )
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help: printed, nothing else to do
        return int(exc.code or 0)
    out = export(args.run_dir, args.out, step=args.step, dtype=args.dtype)
    if out.is_dir():  # a Hugging Face model: a save_pretrained directory
        print(
            f"plait: exported {args.run_dir} ({args.dtype}) to {out} (save_pretrained: config.json, "
            "model.safetensors; transformers.AutoModelForCausalLM.from_pretrained loads it)"
        )
        return 0
    meta = exported_metadata(out)
    n = GPTConfig(**json.loads(meta[META_CONFIG])).n_params()
    step = meta["plait.step"]
    print(f"plait: exported step {step} of {args.run_dir} ({n:,} parameters, {args.dtype}) to {out}")
    return 0


def _schedule(argv: list[str]) -> int:
    from plait.pipeline.check import check_schedule
    from plait.pipeline.render import render_png, render_text
    from plait.pipeline.schedules import SCHEDULES, default_virtual_stages, make_schedule
    from plait.pipeline.simulate import Costs, formula_bubble, formula_bubble_time, simulate

    parser = _Parser(
        prog="plait schedule",
        description="Build a pipeline schedule, check it, and simulate it on a cost model: timeline, "
        "per-rank bubble and peak activations, beside the papers' bubble formulas (GPipe, 1F1B, "
        "interleaved 1F1B, Zero Bubble).",
    )
    parser.add_argument("--kind", required=True, help=f"{', '.join(SCHEDULES)}")
    parser.add_argument("--stages", type=_int_in(1, MAX_STAGES), required=True, help="pipeline ranks p")
    parser.add_argument(
        "--microbatches",
        type=_int_in(1, MAX_SCHEDULE_ACTIONS),
        required=True,
        help="micro-batches per step m",
    )
    parser.add_argument(
        "--virtual-stages",
        type=_int_in(1, MAX_SCHEDULE_ACTIONS),
        help="model chunks per rank v (default 2 for interleaved, zb-v; else 1)",
    )
    parser.add_argument(
        "--costs", default="1,1,1", help="F,B,W times, or F,BW (B and W get half each); default 1,1,1"
    )
    parser.add_argument("--comm", type=float, default=0.0, help="latency of a cross-rank edge (default 0)")
    parser.add_argument("--out", help="write the timeline as a PNG here")
    parser.add_argument(
        "--width", type=_int_in(10, MAX_WIDTH), default=100, help="columns of the text timeline (default 100)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help: printed, nothing else to do
        return int(exc.code or 0)
    if args.kind not in SCHEDULES:
        raise ConfigError(f"unknown schedule kind {args.kind!r}; valid: {', '.join(SCHEDULES)}")
    costs = Costs.parse(args.costs, comm=args.comm)
    v = args.virtual_stages if args.virtual_stages is not None else default_virtual_stages(args.kind)
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
        _check_writable_file(args.out, "--out")  # before the work, not after it
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
    if png is not None:
        print(f"timeline written to {png}")
    return 0


MAX_TOP = 1000
"""`plait plan --top`: rows of the table."""


def _plan(argv: list[str]) -> int:
    from plait.planner.cluster import PRESET_NAMES, load_cluster
    from plait.planner.search import load_plan_config, plan, plan_summary
    from plait.train.config import MAX_SIZE, model_config, parse_overrides

    parser = _Parser(
        prog="plait plan",
        description="Choose the layout (dp, tp, pp, ep, ZeRO stage, micro-batches, schedule, recomputation, "
        "offload) of the configured GPT on N devices of a cluster, Alpa-style: every runnable layout "
        "priced by plait's FLOP count, ledger formulas, pipeline simulator and memory estimator, ranked "
        "by predicted step time. The model is [model] (with model.vocab_size), the batch "
        "train.global_batch; [parallel] keys are what the planner chooses. docs/planner.md.",
    )
    parser.add_argument(
        "config", nargs="?", metavar="CONFIG", help="a TOML config (default: plait's defaults)"
    )
    parser.add_argument("--devices", type=_int_in(1, MAX_SIZE), help="devices to plan for")
    parser.add_argument(
        "--cluster",
        default=None,
        help=f"a preset ({', '.join(PRESET_NAMES)}; this = this machine, calibrated) or a TOML file "
        "(default dgx-a100; this with --calibrate)",
    )
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="measure this machine (matmul rate, efficiency, alpha-beta of each collective; under a "
        "minute), cache it as the cluster `this` and print it; with --devices, then plan on it",
    )
    parser.add_argument(
        "--top", type=_int_in(1, MAX_TOP), default=10, help="feasible plans to show (default 10)"
    )
    parser.add_argument("--json", action="store_true", help='print {"plans": [...]}, best first')
    if any(a in ("-h", "--help") for a in argv):
        parser.print_help()
        return 0
    known, rest, config = [], [], []
    i = 0
    while i < len(argv):  # the planner's own options, then CONFIG and --section.key overrides
        a = argv[i]
        name = a.split("=", 1)[0]
        if name in ("--devices", "--cluster", "--top"):
            take = 1 if "=" in a else 2
            known += argv[i : i + take]
            i += take
        elif a in ("--json", "--calibrate"):
            known.append(a)
            i += 1
        elif not a.startswith("-") and (not rest or not rest[-1].startswith("--")) and not config:
            config = [a]  # CONFIG: a word that is no override's value
            i += 1
        else:
            rest.append(a)
            i += 1
    args = parser.parse_args(config + known)
    if args.calibrate:
        from plait.planner.calibrate import cache_path, load_this

        if args.cluster not in (None, "this"):
            raise ConfigError(
                f"--calibrate measures this machine (the cluster `this`), not --cluster {args.cluster}"
            )
        cluster = load_this(recalibrate=True)
        print(format_cluster(cluster, cache_path()))
        if args.devices is None:
            return 0
    if args.devices is None:
        raise ConfigError("plait plan needs --devices N (the devices to plan for), or --calibrate alone")
    base = load_plan_config(args.config, parse_overrides(rest))
    cluster = load_cluster(args.cluster or ("this" if args.calibrate else "dgx-a100"))
    result = plan(base, model_config(base), base.train.global_batch, args.devices, cluster, top=args.top)
    plans = [plan_summary(r) for r in result["plans"]]
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k != "plans"} | {"plans": plans}))
        return 0
    print(
        f"plait plan: {args.devices} devices of {cluster.name} ({cluster.peak_tflops:g} TFLOP/s peak, "
        f"efficiency {cluster.efficiency:g}); {result['candidates']:,} layouts, {result['simulated']:,} "
        "simulated; best first"
    )
    head = f"{'layout':<48}{'step s':>9}{'TFLOP/s':>9}{'MFU':>6}{'mem GB':>8}{'bubble':>8}{'comm':>6}"
    print(head)
    for r in plans:
        if not r["feasible"]:
            continue
        print(
            f"{r['layout']:<48}{r['step_s']:>9.4g}{r['tflops_per_device']:>9.3g}{r['mfu']:>6.0%}"
            f"{r['memory_gb']:>8.3g}{r['bubble']:>8.1%}{r['comm_share']:>6.0%}"
        )
    bad = [r for r in plans if not r["feasible"]]
    if bad:
        print("rejected (fastest first):")
        for r in bad:
            print(f"  {r['layout']}: {r['reason']}")
    if not any(r["feasible"] for r in plans):
        print("no feasible plan: every layout runs out of memory or is refused (above)")
    return 0


def format_cluster(cluster, path) -> str:
    """A calibrated cluster as `plait plan --calibrate` prints it."""
    lines = [f"cluster `{cluster.name}` ({cluster.note}), cached in {path}"]
    lines.append(
        f"  {cluster.cores} cores, {cluster.memory_gb:.1f} GB; one-thread fp32 matmul "
        f"{cluster.peak_tflops * 1e3:.1f} GFLOP/s; AdamW step {cluster.memory_bw_gbps:.2f} GB/s"
    )
    per = ", ".join(f"{w} ranks: {t * 1e3:.1f}" for w, t in cluster.rank_tflops)
    lines.append(f"  matmul GFLOP/s per rank while all compute (launcher's threads): {per}")
    curve = ", ".join(f"{h:g}/{t:g}: {e:.2f}" for h, t, e in cluster.efficiency_curve)
    lines.append(f"  GPT efficiency (model FLOPs / one-thread matmul) by d_model/tokens: {curve}")
    if cluster.tp_efficiency:
        shares = ", ".join(f"{h:g}/{n:g}/tp{t:g}: {e:.2f}" for h, n, t, e in cluster.tp_efficiency)
        lines.append(f"  as one of tp ranks (its share of the FLOPs), d_model/tokens/tp: {shares}")
    if cluster.pipeline_overhead:
        engine = ", ".join(f"{k} {t * 1e3:.2f}" for k, t in cluster.pipeline_overhead)
        lines.append(f"  pipeline engine per micro-batch beyond compute, ms: {engine}")
    lines.append(f"  {'collective':<16}{'ranks':>6}{'of world':>9}{'alpha us':>10}{'beta GB/s':>11}")
    for op, n, w, link in cluster.collectives:
        lines.append(f"  {op:<16}{n:>6}{w:>9}{link.alpha_s * 1e6:>10.0f}{link.beta_bps / 1e9:>11.3f}")
    return "\n".join(lines)


def _float_in(lo: float, hi: float, lo_open: bool = False):
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


def _hogwild(argv: list[str]) -> int:
    from plait.async_training.hogwild import MAX_UPDATES, MAX_WORKERS, OPTIMIZERS, HogwildConfig, describe
    from plait.async_training.hogwild_run import prepare_out_dir, run_to_dir

    d = HogwildConfig()
    parser = _Parser(
        prog="plait hogwild",
        description="Hogwild (Niu et al. 2011): lock-free SGD from N processes on shared-memory weights, "
        "on a sparse logistic regression built from the embedded corpus (is the next byte whitespace? "
        "hashed byte n-grams). Writes loss.jsonl, summary.json and loss.png to --out. docs/hogwild.md.",
    )
    parser.add_argument(
        "--workers", type=_int_in(1, MAX_WORKERS), default=d.workers, help=f"processes (default {d.workers})"
    )
    parser.add_argument(
        "--updates",
        type=_int_in(1, MAX_UPDATES),
        default=d.updates,
        help=f"total updates over all workers (default {d.updates:,})",
    )
    parser.add_argument(
        "--batch", type=_int_in(1, 4096), default=d.batch, help=f"examples per update (default {d.batch})"
    )
    parser.add_argument("--lock", action="store_true", help="a lock around every update (the baseline)")
    parser.add_argument(
        "--optimizer", default=d.optimizer, help=f"{' or '.join(OPTIMIZERS)} (default {d.optimizer})"
    )
    parser.add_argument(
        "--lr",
        type=_float_in(0, 100, lo_open=True),
        default=d.lr,
        help=f"step size (default {d.lr:g}, for adagrad; sgd wants about 0.05)",
    )
    parser.add_argument(
        "--lr-decay",
        type=_float_in(0, 1),
        default=d.lr_decay,
        help=f"lr / (1 + (t-1) decay) at global update t (default {d.lr_decay:g})",
    )
    parser.add_argument(
        "--features",
        type=_int_in(2**8, 2**26),
        default=d.n_features,
        help=f"hashed features (default {d.n_features:,})",
    )
    parser.add_argument(
        "--context", type=_int_in(1, 16), default=d.context, help=f"bytes of context (default {d.context})"
    )
    parser.add_argument(
        "--seed", type=_int_in(0, 2**31 - 1), default=d.seed, help="example order seed (default 0)"
    )
    parser.add_argument(
        "--eval-points",
        type=_int_in(0, 10_000),
        default=d.eval_points,
        help=f"loss-curve points (default {d.eval_points})",
    )
    parser.add_argument("--out", help="output directory (default runs/hogwild-<timestamp>)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help: printed, nothing else to do
        return int(exc.code or 0)
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
    result, files = run_to_dir(cfg, out_dir)
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


def _launch(argv: list[str]) -> int:
    """Run a user's script on N local ranks with torch's elastic launcher (what `torchrun
    --standalone --nproc-per-node N` does): each rank gets RANK, WORLD_SIZE, LOCAL_RANK and the
    rendezvous address in its environment, which `plait.parallelize` reads."""
    parser = argparse.ArgumentParser(
        prog="plait launch",
        description="Run SCRIPT on N local processes (ranks), as torchrun --standalone does; a script "
        "written with plait.parallelize trains on all of them (docs/your-model.md).",
    )
    parser.add_argument("--nproc", type=int, default=1, help="processes (ranks) on this machine (default 1)")
    parser.add_argument("script", help="the Python script each rank runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    if args.nproc < 1:
        raise ConfigError(f"--nproc must be at least 1, got {args.nproc}")
    if not Path(args.script).is_file():
        raise ConfigError(f"plait launch: no script {args.script!r}")
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

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


def _check_writable_file(path: str, option: str) -> None:
    """`path` can be written: its directory exists and takes a new file (probed, then removed)."""
    import tempfile

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


def _stdout_gone() -> None:
    """The reader of stdout went away (`plait schedule | head -1`): send what is left nowhere, so
    the interpreter's last flush at exit does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass  # not a real file (a test's capture): nothing will flush it at exit


COMMANDS = {
    "train": _train,
    "export": _export,
    "estimate": _estimate,
    "schedule": _schedule,
    "plan": _plan,
    "hogwild": _hogwild,
    "launch": _launch,
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="plait", description="Distributed training, verified and measured.")
    parser.add_argument(
        "command",
        choices=list(COMMANDS),
        help="train: run training; export: a run's model as one safetensors file (plait export --help); "
        "estimate: per-device memory of ZeRO (plait estimate --help); "
        "schedule: simulate a pipeline schedule (plait schedule --help); "
        "plan: choose the layout for N devices (plait plan --help); "
        "hogwild: lock-free SGD on shared memory (plait hogwild --help); "
        "launch: run your own script on N ranks, like torchrun (plait launch --help)",
    )
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        parser.error(f"unknown command {argv[0]!r}; valid: {', '.join(COMMANDS)}")
    try:
        code = COMMANDS[argv[0]](argv[1:])
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


if __name__ == "__main__":
    sys.exit(main())

"""`plait plan [CONFIG] [--section.key value ...] --devices N [--cluster NAME|FILE|this] [--top K]
[--diloco H[,H...]] [--json]` and `plait plan --calibrate [--devices N ...]`."""

from __future__ import annotations

import argparse
import json

from plait.cli.args import Parser, int_in
from plait.errors import ConfigError
from plait.planner.calibrate import cache_path, load_this
from plait.planner.cluster import PRESET_NAMES, load_cluster
from plait.planner.diloco import spec_from_config
from plait.planner.search import load_plan_config, plan, plan_summary
from plait.train.config import MAX_SIZE, model_config, parse_overrides

MAX_TOP = 1000
"""`plait plan --top`: rows of the table."""
MAX_INNER_STEPS = 10**6
"""`plait plan --diloco`: the largest H."""


def _inner_steps(text: str) -> tuple[int, ...]:
    """`--diloco 8,32,128`: DiLoCo's H values, each an integer >= 1."""
    one = int_in(1, MAX_INNER_STEPS)
    try:
        return tuple(one(x) for x in text.split(","))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected inner steps H from 1 to {MAX_INNER_STEPS:,}, comma-separated, got {text!r}"
        ) from None


def _parser() -> Parser:
    parser = Parser(
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
    parser.add_argument("--devices", type=int_in(1, MAX_SIZE), help="devices to plan for")
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
        "--top", type=int_in(1, MAX_TOP), default=10, help="feasible plans to show (default 10)"
    )
    parser.add_argument(
        "--diloco",
        type=_inner_steps,
        default=(),
        metavar="H[,H...]",
        help="also price DiLoCo with these inner steps H (replicas, fragments, overlap_steps and "
        "compression from [diloco]; a config with diloco.inner_steps > 0 prices that H), next to "
        "plain data parallel, and print the best of each",
    )
    parser.add_argument("--json", action="store_true", help='print {"plans": [...]}, best first')
    return parser


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    """(CONFIG and the planner's own options, the --section.key overrides)."""
    known, rest, config = [], [], []
    i = 0
    while i < len(argv):
        a = argv[i]
        name = a.split("=", 1)[0]
        if name in ("--devices", "--cluster", "--top", "--diloco"):
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
    return config + known, rest


def main(argv: list[str]) -> int:
    parser = _parser()
    if any(a in ("-h", "--help") for a in argv):
        parser.print_help()
        return 0
    own, rest = _split(argv)
    args = parser.parse_args(own)
    if args.calibrate:
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
    diloco = spec_from_config(base.diloco, args.diloco)
    result = plan(
        base, model_config(base), base.train.global_batch, args.devices, cluster, top=args.top, diloco=diloco
    )
    plans = [plan_summary(r) for r in result["plans"]]
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k != "plans"} | {"plans": plans}))
        return 0
    islands = cluster.islands(args.devices)
    where = ""
    if islands > 1:
        where = (
            f", {islands} islands of {cluster.island_devices} (between them {cluster.island.alpha_s * 1e3:g} "
            f"ms, {cluster.island.beta_bps / 1e9:g} GB/s per device)"
        )
    print(
        f"plait plan: {args.devices} devices of {cluster.name} ({cluster.peak_tflops:g} TFLOP/s peak, "
        f"efficiency {cluster.efficiency:g}{where}); {result['candidates']:,} layouts, "
        f"{result['simulated']:,} simulated; best first"
    )
    _print_plans(plans)
    if diloco is not None:
        _print_families(result["families"], cluster, args.devices)
    return 0


def _print_families(families: list[dict], cluster, devices: int) -> None:
    """The best plan without DiLoCo and with each H; for each H its speed-up over the first, the
    same layout as DDP (every step's reduction over all of dp), and the outer exchange."""
    plain = families[0]["best"]
    width = max([40] + [len(f["best"]["layout"]) + 2 for f in families if f["best"]])
    ms = [f["best"]["diloco_replicas"] for f in families[1:] if f["best"]]
    where = "across islands" if cluster.islands(devices) > 1 else "on the cluster's links"
    print(f"DiLoCo: M = {'/'.join(map(str, sorted(set(ms)))) or '-'} groups, the replica axis {where}")
    print(
        f"  {'family':<11}{'layout':<{width}}{'step s':>8}{'speed-up':>10}{'as DDP s':>10}"
        f"{'outer MB/step':>15}{'exposed ms':>12}"
    )
    for f in families:
        b, h = f["best"], f["diloco_inner_steps"]
        label = "no DiLoCo" if not h else f"H = {h}"
        if b is None:
            print(f"  {label:<11}no feasible layout (M must split dp into groups of whole ranks)")
            continue
        line = f"  {label:<11}{b['layout']:<{width}}{b['step_s']:>8.4g}"
        if h:
            t = b["terms"]
            up = f"{plain['step_s'] / b['step_s']:.2f}x" if plain is not None else "-"
            line += (
                f"{up:>10}{f['as_ddp']['step_s']:>10.4g}{t['diloco_bus_bytes_per_step'] / 1e6:>15.4g}"
                f"{t['diloco_exposed_s'] * 1e3:>12.3g}"
            )
        print(line)


def _print_plans(plans: list[dict]) -> None:
    """The feasible plans as a table, then the rejected ones with their reasons."""
    width = max([48] + [len(r["layout"]) + 2 for r in plans if r["feasible"]])
    head = f"{'layout':<{width}}{'step s':>9}{'TFLOP/s':>9}{'MFU':>6}{'mem GB':>8}{'bubble':>8}{'comm':>6}"
    print(head)
    for r in plans:
        if not r["feasible"]:
            continue
        print(
            f"{r['layout']:<{width}}{r['step_s']:>9.4g}{r['tflops_per_device']:>9.3g}{r['mfu']:>6.0%}"
            f"{r['memory_gb']:>8.3g}{r['bubble']:>8.1%}{r['comm_share']:>6.0%}"
        )
    bad = [r for r in plans if not r["feasible"]]
    if bad:
        print("rejected (fastest first):")
        for r in bad:
            print(f"  {r['layout']}: {r['reason']}")
    if not any(r["feasible"] for r in plans):
        print("no feasible plan: every layout runs out of memory or is refused (above)")


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

"""The planner's cost model against measured steps on this machine (issue 16's validation).

1. `plait plan --calibrate` (`plait.planner.calibrate.load_this(recalibrate=True)`): the cluster
   `this`, measured now, under the same load as the runs that follow.
2. For the default GPT ("small": 4 layers, d_model 128, seq 128, batch 16) and the 20M GPT
   ("20m": 6 layers, d_model 512, 8 heads; run at seq_len 128 and global batch 4 so that a step
   takes about a second, not ten) at 2 and 4 processes, every layout of `LAYOUTS` (dp, ZeRO 1-3,
   tp with and without SP, pipelines with several schedules, recomputation, combinations) plus
   the planner's own first choice for that world: the predicted step time
   (`plait.planner.cost.evaluate` on `this`, fp32 as the runs) and the measured one: a short
   `plait train` run (`--train.steps` STEPS, fp32, AdamW with clipping), per step the maximum of
   the ranks' `step_time_s` (metrics*.jsonl), the median over the steps after the first WARMUP.
3. Spearman's rank correlation of predicted and measured times per (model, world) and over all
   runs, the median absolute relative error, and whether the plan the planner ranks first among
   the measured layouts is within 10% of the fastest measured.

Four processes on two cores oversubscribe them: the calibration measures the matmul rate a rank
gets when four compute at once, and the collectives in a world of four, so the prediction models
that; nothing is fitted per layout.

    PYTHONPATH=. .venv/bin/python benchmarks/plan_validate.py [--steps 12] [--tag T] [--reprice]
        -> benchmarks/results/plan_validate[_T].md, .png, .json, _cluster.toml (the calibration)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import command_line, machine_info, markdown_table

from plait.planner.calibrate import cache_path, load_this
from plait.planner.cost import Candidate, evaluate
from plait.planner.search import layout_config, plan
from plait.train.config import load_config, model_config

RESULTS = Path(__file__).parent / "results"
MODELS = {  # name: (overrides, global batch)
    "small": ((), 16),
    "20m": ((("model.seq_len", "128"),), 4),
}
WARMUP = 2
STEM = ["plan_validate"]  # results/<STEM>.md, .png, .json, _cluster.toml (--tag adds to it)


def out(ext: str) -> Path:
    return RESULTS / f"{STEM[0]}{ext}"


def _l(dp=1, tp=1, pp=1, z=0, sp=False, m=1, sched="none", v=1, rc=False, rows=16) -> Candidate:
    per = rows // dp
    return Candidate(
        dp=dp, tp=tp, pp=pp, zero_stage=z, sequence_parallel=sp, microbatch_size=per // m, microbatches=m,
        schedule=sched, virtual_stages=v, recompute=rc,
    )  # fmt: skip


def layouts(world: int, rows: int) -> list[Candidate]:
    """The measured layouts (8 per world): dp with ZeRO 0, 1, 3; tp with and without SP;
    pipelines under three schedules; their combinations."""
    if world == 2:
        out = [_l(dp=2, z=z, rows=rows) for z in (0, 1, 3)]
        out += [_l(tp=2, rows=rows), _l(tp=2, sp=True, rows=rows)]
        return out + [_l(pp=2, m=4, sched=s, rows=rows) for s in ("gpipe", "1f1b", "zb-h1")]
    out = [_l(dp=4, z=z, rows=rows) for z in (0, 1, 3)]
    out += [_l(dp=2, tp=2, rows=rows), _l(dp=2, tp=2, sp=True, rows=rows), _l(tp=4, sp=True, rows=rows)]
    return out + [
        _l(dp=2, pp=2, m=2, sched="1f1b", rows=rows),
        _l(tp=2, pp=2, m=4, sched="1f1b", sp=True, rows=rows),
    ]


def base_config(model: str, steps: int):
    extra, batch = MODELS[model]
    overrides = [
        ("model.name", model),
        *extra,
        ("train.global_batch", str(batch)),
        ("train.steps", str(steps)),
        ("train.eval_every", "0"),
        ("train.eval_batches", "1"),
        ("train.checkpoint_every", "0"),
        ("train.sample_tokens", "0"),
        ("train.progress", "false"),
        ("train.log_every", "1000"),
        ("train.replica_check_every", "0"),
        ("train.warmup_steps", "1"),
    ]
    return load_config(None, overrides)


def measure(base, layout: Candidate, workdir: Path) -> float:
    """Median step time (max over ranks) of a short plait train run of `layout`."""
    cfg = layout_config(base, layout, bf16=False)
    workdir.mkdir(parents=True, exist_ok=True)
    run_dir = workdir / layout.name()
    cfg.train.run_dir = str(run_dir)
    path = workdir / f"{layout.name()}.toml"
    path.write_text(cfg.to_toml())
    cmd = [
        sys.executable,
        "-c",
        "import sys; from plait.cli import main; sys.exit(main())",
        "train",
        str(path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise RuntimeError(f"{layout.name()} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    per_step: dict[int, float] = {}
    for f in run_dir.glob("metrics*.jsonl"):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            if "step_time_s" in r:
                per_step[r["step"]] = max(per_step.get(r["step"], 0.0), r["step_time_s"])
    return statistics.median(t for s, t in per_step.items() if s > WARMUP)


def spearman(xs, ys) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2 + 1
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--quick", action="store_true", help="3 layouts per group (a smoke run)")
    ap.add_argument(
        "--repeat",
        type=int,
        default=2,
        help="launches of each layout, in passes over all of them; the median is the measurement "
        "and the spread between launches the run-to-run noise",
    )
    ap.add_argument("--models", default="small,20m")
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument(
        "--reprice",
        action="store_true",
        help="no runs: price the measured layouts of results/plan_validate.json again with the current "
        "cost model on the calibration saved beside it (after a change to the model)",
    )
    ap.add_argument("--tag", default="", help="results/plan_validate_TAG.* instead of plan_validate.*")
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error(f"--repeat {args.repeat}: at least 1 launch per layout")
    if args.tag:
        STEM[0] = f"plan_validate_{args.tag}"
    if args.reprice:
        return reprice()
    info = machine_info()
    t0 = time.time()
    cluster = load_this(recalibrate=True)
    calib_s = time.time() - t0
    RESULTS.mkdir(exist_ok=True)
    shutil.copy(cache_path(), out("_cluster.toml"))  # what the predictions rest on, for --reprice
    todo = []  # (record, base, layout) in measuring order
    for model in args.models.split(","):
        steps = args.steps if model == "small" else max(WARMUP + 3, args.steps - 2)
        base = base_config(model, steps)
        gpt = model_config(base)
        batch = base.train.global_batch
        for world in map(int, args.worlds.split(",")):
            chosen = plan(base, gpt, batch, world, cluster, top=1, optimizer="adamw", bf16=False)
            first = chosen["plans"][0]
            pick = Candidate(**{k: first[k] for k in Candidate.__dataclass_fields__})
            group = layouts(world, batch)
            group = group[:3] if args.quick else group
            if pick not in group:
                group.append(pick)
            for lay in group:
                pred = evaluate(gpt, batch, lay, cluster, optimizer="adamw", precision="fp32")
                rec = {
                    "model": model,
                    "world": world,
                    "layout": lay.name(),
                    "predicted_s": pred["step_s"],
                    "launches_s": [],
                    "planner_pick": lay == pick,
                    "layout_fields": dataclasses.asdict(lay),
                    "command": command_line(),
                    "feasible": pred["feasible"],
                }
                todo.append((rec, base, lay))
    with tempfile.TemporaryDirectory(prefix="plan-validate-") as tmp:
        for rep in range(args.repeat):  # every layout once per pass: a pass's drift hits them all
            for rec, base, lay in todo:
                meas = measure(base, lay, Path(tmp) / f"pass{rep}")
                rec["launches_s"].append(meas)
                rec["measured_s"] = statistics.median(rec["launches_s"])
                rec["error"] = rec["predicted_s"] / rec["measured_s"] - 1
                rec["spread"] = (max(rec["launches_s"]) - min(rec["launches_s"])) / rec["measured_s"]
                print(
                    f"{rec['model']:>6} x{rec['world']} {rec['layout']:<36} predicted "
                    f"{rec['predicted_s'] * 1e3:8.1f} ms  measured {meas * 1e3:8.1f} ms  "
                    f"(pass {rep + 1}; {rec['error']:+.0%} against the median so far)",
                    flush=True,
                )
            rows_out = [rec for rec, _, _ in todo if "measured_s" in rec]
            groups: dict = {}
            for rec in rows_out:
                groups.setdefault((rec["model"], rec["world"]), []).append(rec)
            report(rows_out, groups, cluster, info, calib_s, time.time() - t0)  # so far
    return 0


def reprice() -> int:
    """Predictions of the saved runs again, from the current cost model and the saved calibration."""
    from plait.planner.cluster import load_cluster

    saved = json.loads(out(".json").read_text())
    cluster = load_cluster(str(out("_cluster.toml")))
    groups: dict = {}
    for r in saved["rows"]:
        base = base_config(r["model"], 10)
        gpt = model_config(base)
        lay = Candidate(**r["layout_fields"]) if "layout_fields" in r else _by_name(gpt, base, r, cluster)
        r["layout_fields"] = dataclasses.asdict(lay)
        r["predicted_first_run_s"] = r.get("predicted_first_run_s", r["predicted_s"])
        r["predicted_s"] = evaluate(gpt, base.train.global_batch, lay, cluster, precision="fp32")["step_s"]
        r["error"] = r["predicted_s"] / r["measured_s"] - 1
        groups.setdefault((r["model"], r["world"]), []).append(r)
    info, calib_s, total_s = saved.get("machine", {}), saved.get("calibration_s", 0), saved.get("total_s", 0)
    report(saved["rows"], groups, cluster, info, calib_s, total_s, repriced=True)
    return 0


def _by_name(gpt, base, row, cluster) -> Candidate:
    """The layout of a saved row that has only its name (results written before layout_fields)."""
    from plait.planner.search import enumerate_layouts

    batch = base.train.global_batch
    every = [*layouts(row["world"], batch), *enumerate_layouts(gpt, batch, row["world"], cluster)]
    return next(lay for lay in every if lay.name() == row["layout"])


def report(rows, groups, cluster, info, calib_s, total_s, repriced=False) -> None:
    RESULTS.mkdir(exist_ok=True)
    summary = []
    for (model, world), recs in groups.items():
        p = [r["predicted_s"] for r in recs]
        m = [r["measured_s"] for r in recs]
        top = min(recs, key=lambda r: r["predicted_s"])
        fastest = min(m)
        summary.append(
            {
                "model": model,
                "world": world,
                "layouts": len(recs),
                "spearman": spearman(p, m),
                "median_abs_error": statistics.median(abs(r["error"]) for r in recs),
                "ranked_first": top["layout"],
                "ranked_first_vs_fastest": top["measured_s"] / fastest - 1,
                "fastest": min(recs, key=lambda r: r["measured_s"])["layout"],
                "median_spread": _median_spread(recs),
                "retest_spearman": _retest(recs),
            }
        )
    allp, allm = [r["predicted_s"] for r in rows], [r["measured_s"] for r in rows]
    overall = {
        "spearman": spearman(allp, allm),
        "median_abs_error": statistics.median(abs(r["error"]) for r in rows),
        "runs": len(rows),
        "median_spread": _median_spread(rows),
    }
    out(".json").write_text(
        json.dumps(
            {
                "rows": rows,
                "summary": summary,
                "overall": overall,
                "machine": info,
                "calibration_s": calib_s,
                "total_s": total_s,
                "command": command_line() if not repriced else rows and rows[0].get("command"),
            },
            indent=1,
        )  # fmt: skip
    )
    _plot(rows, out(".png"))
    lines = [
        "# Planner: predicted vs measured step time on this machine",
        "",
        f"Command: `{rows[0].get('command', command_line()) if rows else command_line()}` "
        f"(total {total_s / 60:.1f} min, "
        f"calibration {calib_s:.0f} s)."
        + (
            f" Predictions repriced by `{command_line()}` with the cost model of now on the same calibration "
            f"({STEM[0]}_cluster.toml) and the same measurements; the first run's predictions are in "
            f"{STEM[0]}.json (`predicted_first_run_s`), and the column \"planner's pick\" is that run's."
            if repriced
            else ""
        ),
        "",
        "Machine: " + "; ".join(f"{k}: {v}" for k, v in info.items()),
        "",
        f"Calibrated cluster `this` (saved as {STEM[0]}_cluster.toml): one-thread fp32 matmul "
        f"{cluster.peak_tflops * 1e3:.1f} GFLOP/s; per rank with peers: "
        + ", ".join(f"{w} ranks {t * 1e3:.1f}" for w, t in cluster.rank_tflops)
        + " GFLOP/s; efficiency by d_model/tokens per micro-batch: "
        + ", ".join(f"{h:g}/{t:g} tokens: {e:.2f}" for h, t, e in cluster.efficiency_curve)
        + "; as one of tp ranks, d_model/tokens/tp: "
        + ", ".join(f"{h:g}/{n:g}/{t:g}: {e:.2f}" for h, n, t, e in cluster.tp_efficiency)
        + "; pipeline engine per micro-batch, ms: "
        + ", ".join(f"{k} {t * 1e3:.2f}" for k, t in cluster.pipeline_overhead)
        + "; collectives: "
        + ", ".join(
            f"{op}/{n} of {w}: {ln.alpha_s * 1e6:.0f} us, {ln.beta_bps / 1e9:.2f} GB/s"
            for op, n, w, ln in cluster.collectives
        )
        + ".",
        "",
        "## Summary",
        "",
        markdown_table(
            [
                "model",
                "ranks",
                "layouts",
                "Spearman",
                "median abs error",
                "ranked first",
                "its time vs fastest",
                "fastest measured",
                "launch spread",
                "Spearman launch 1 vs 2",
            ],
            [
                [
                    s["model"],
                    str(s["world"]),
                    str(s["layouts"]),
                    f"{s['spearman']:.2f}",
                    f"{s['median_abs_error']:.0%}",
                    s["ranked_first"],
                    f"{s['ranked_first_vs_fastest']:+.0%}",
                    s["fastest"],
                    _pct(s.get("median_spread")),
                    "" if s.get("retest_spearman") is None else f"{s['retest_spearman']:.2f}",
                ]
                for s in summary
            ],
        ),  # fmt: skip
        "",
        f"All {overall['runs']} runs: Spearman {overall['spearman']:.2f} (target >= 0.8), median absolute "
        f"error {overall['median_abs_error']:.0%} (target <= 20%). Launch spread: (slowest - fastest launch) "
        f"/ median of the same layout's launches, the median over the group: the run-to-run noise "
        f"(all runs: {_pct(overall.get('median_spread'))}). Spearman launch 1 vs 2: the rank correlation "
        f"of the group's first launches with its second, the measurement against itself: a model cannot be "
        f"expected to rank the layouts better than that.",
        "",
        "## Every run",
        "",
        markdown_table(
            ["model", "ranks", "layout", "predicted ms", "measured ms", "launches ms", "error"]
            + ["planner's pick"],
            [
                [
                    r["model"],
                    str(r["world"]),
                    r["layout"],
                    f"{r['predicted_s'] * 1e3:.1f}",
                    f"{r['measured_s'] * 1e3:.1f}",
                    ", ".join(f"{x * 1e3:.0f}" for x in r.get("launches_s", [r["measured_s"]])),
                    f"{r['error']:+.0%}",
                    "yes" if r["planner_pick"] else "",
                ]
                for r in rows
            ],
        ),  # fmt: skip
        "",
        f"![predicted vs measured]({STEM[0]}.png)",
        "",
    ]
    out(".md").write_text("\n".join(lines))
    print("\n".join(lines[lines.index("## Summary") :]))


def _median_spread(recs) -> float | None:
    spreads = [r["spread"] for r in recs if len(r.get("launches_s", [])) > 1]
    return statistics.median(spreads) if spreads else None


def _retest(recs) -> float | None:
    if len(recs) < 3 or any(len(r.get("launches_s", [])) < 2 for r in recs):
        return None
    return spearman([r["launches_s"][0] for r in recs], [r["launches_s"][1] for r in recs])


def _pct(x: float | None) -> str:
    return "one launch" if x is None else f"{x:.0%}"


def _plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 6))
    markers = {("small", 2): "o", ("small", 4): "s", ("20m", 2): "^", ("20m", 4): "D"}
    for key, mk in markers.items():
        pts = [r for r in rows if (r["model"], r["world"]) == key]
        if pts:
            ax.scatter(
                [r["measured_s"] * 1e3 for r in pts],
                [r["predicted_s"] * 1e3 for r in pts],
                marker=mk,
                label=f"{key[0]}, {key[1]} ranks",
            )
    vals = [r["measured_s"] * 1e3 for r in rows] + [r["predicted_s"] * 1e3 for r in rows]
    lo, hi = min(vals) / 1.3, max(vals) * 1.3
    ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="predicted = measured")
    ax.fill_between(
        [lo, hi], [lo * 0.8, hi * 0.8], [lo * 1.2, hi * 1.2], color="grey", alpha=0.15, label="±20%"
    )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured step time (ms, median)")
    ax.set_ylabel("predicted step time (ms, plait plan on `this`)")
    ax.set_title("plait plan: predicted vs measured, this machine")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())

"""The parameter server's consistency models with one worker made 2x slower: bsp, ssp with
τ in {1, 2, 4, 8}, async (Downpour), and plait's synchronous data parallelism for reference.

What is measured (each setup one `plait train` run on this machine's CPU, one thread per process):

* **Job.** The plait GPT (`--model`, default "small": 4 layers, d_model 128, 0.84M parameters)
  on the embedded corpus, global batch `--batch` sequences split over `--workers` workers
  (data-parallel ranks for `dp`), `--steps` clocks (steps), AdamW (`--lr`, default 3e-3, and a
  tenth of it at the end; warm-up 10, cosine),
  global-norm clipping at 1.0. Parameter-server setups: `--servers` servers, server optimizer
  AdamW (the trainer's), so bsp computes what `dp` computes.
* **The slow worker.** Worker (rank) 1 sleeps, every clock, as long as one clock of computation
  takes (measured first from a short bsp run: the median step time of the workers), so it is
  about 2x slower than the others (`plait.testing.slow_hook`, the same hook on a
  dp rank).
* **Figures.** Wall time from the first step to the first held-out evaluation at or below the
  target loss (worker 0 evaluates the parameters it pulled every `--eval-every` clocks; dp its
  model; the target is the worst final held-out loss among the setups, so every setup reaches
  it), the final held-out loss of the final parameters, the run's wall time, the staleness of the
  pushes (mean, max) and the pushes per second. A run's start-up (imports, process start) is not
  counted in the times to target.

Results go to benchmarks/results/ps.md and ps_loss.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import command_line, machine_info, markdown_table  # noqa: E402

from plait.train.metrics import read_metrics  # noqa: E402

OUT = Path(__file__).resolve().parent / "results"


def _run(run_dir: Path, args: list[str], env: dict) -> tuple[list[dict], dict, float]:
    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-m", "plait.cli", "train", *args, "--train.run_dir", str(run_dir)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
    )
    wall = time.perf_counter() - t0
    if r.returncode:
        raise SystemExit(f"{args}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    return read_metrics(run_dir / "metrics.jsonl"), summary, wall


def _evals(records: list[dict], ps: bool) -> list[tuple[float, float]]:
    """(seconds since the first step began, held-out loss) of every evaluation."""
    out, elapsed = [], 0.0
    for r in records:
        elapsed += r.get("step_time_s", 0.0)
        if "val_loss" in r:
            out.append((r["val_wall_s"] if ps else elapsed, r["val_loss"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--servers", type=int, default=1)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--taus", default="1,2,4,8")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--out", default="ps", help="results/OUT.md and results/OUT_loss.png")
    a = ap.parse_args()
    info = machine_info()
    t_start = time.perf_counter()
    base = [
        "--model.name", a.model, "--train.steps", str(a.steps), "--train.global_batch", str(a.batch),
        "--parallel.dp", str(a.workers), "--train.warmup_steps", "10",
        "--train.eval_every", str(a.eval_every),
        "--train.eval_batches", "4", "--train.log_every", "10", "--train.checkpoint_every", "0",
        "--train.sample_tokens", "0", "--train.progress", "false", "--train.replica_check_every", "0",
        "--train.peak_tflops", "1", "--train.lr", str(a.lr), "--train.min_lr", str(a.lr / 10),
    ]  # fmt: skip
    ps = ["--ps.servers", str(a.servers)]
    setups = {"bsp": [*ps, "--ps.consistency", "bsp"]}
    for tau in a.taus.split(","):
        setups[f"ssp τ={tau}"] = [*ps, "--ps.consistency", "ssp", "--ps.staleness", tau]
    setups["async"] = [*ps, "--ps.consistency", "async"]
    setups["dp (synchronous)"] = []
    with tempfile.TemporaryDirectory() as tmp:
        probe, _, _ = _run(
            Path(tmp) / "probe", [*base, *ps, "--train.steps", "12", "--train.eval_every", "0"], {}
        )
        compute = statistics.median(r["step_time_s"] for r in probe[2:])
        slow = {
            "PLAIT_STEP_HOOK": "plait.testing:slow_hook",
            "PLAIT_PS_SLOW": f"1:{compute:.4f}",
        }
        results = {}
        for i, (name, extra) in enumerate(setups.items()):
            records, summary, wall = _run(Path(tmp) / f"run{i}", [*base, *extra], slow)
            results[name] = (records, summary, wall)
            print(f"{name}: final held-out {summary.get('val_loss'):.4f}, {wall:.1f}s", flush=True)
    finals = {n: s["val_loss"] for n, (_, s, _) in results.items()}
    target = max(finals.values())
    rows = []
    curves = {}
    for name, (records, summary, _wall) in results.items():
        is_ps = not name.startswith("dp")
        evals = _evals(records, is_ps) + [
            (records[-1].get("wall_s", sum(r["step_time_s"] for r in records)), finals[name])
        ]
        curves[name] = evals
        reach = next((t for t, v in evals if v <= target + 1e-9), float("nan"))
        train_s = evals[-1][0]
        rates = [r["pushes_per_s"] for r in records if r.get("pushes_per_s") is not None]
        rows.append([
            name, f"{reach:.1f}", f"{finals[name]:.4f}", f"{train_s:.1f}",
            f"{summary['staleness_mean']:.2f}" if is_ps else "-",
            str(summary["staleness_max"]) if is_ps else "-",
            f"{statistics.median(rates):.1f}" if rates else "-",
        ])  # fmt: skip
    _plot(curves, target, OUT / f"{a.out}_loss.png", a)
    headers = [
        "setup", f"s to held-out {target:.3f}", "final held-out loss", "training s", "staleness mean",
        "staleness max", "pushes/s",
    ]  # fmt: skip
    lines = [
        "# Parameter server: bsp, ssp and async with one worker 2x slower, vs synchronous data parallel",
        "",
        "Written by `benchmarks/ps.py`; every figure below comes from one run of it. See the script's "
        "docstring for the method.",
        "",
        f"- Command: `{command_line()}`",
        *[f"- {k}: {v}" for k, v in info.items()],
        f"- load average at end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}",
        f"- Runtime: {time.perf_counter() - t_start:.0f} s",
        f"- Job: GPT `{a.model}`, global batch {a.batch}, {a.workers} workers (dp ranks), "
        f"{a.servers} server(s), {a.steps} clocks, AdamW (lr {a.lr:g}, min_lr {a.lr / 10:g}) "
        "with clipping at 1.0 (on the servers for the parameter-server setups).",
        f"- Worker 1 sleeps {compute * 1e3:.0f} ms per clock (the median clock of a probe run): "
        "about 2x slower.",
        f"- Target: the worst final held-out loss, {target:.4f}; times count from the first step.",
        "",
        markdown_table(headers, rows),
        "",
        f"![held-out loss against time]({a.out}_loss.png)",
        "",
    ]
    (OUT / f"{a.out}.md").write_text("\n".join(lines))
    print("\n".join(lines))


def _plot(curves: dict, target: float, out: Path, a) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, pts in curves.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=name)
    ax.axhline(target, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("seconds since the first step")
    ax.set_ylabel("held-out loss (nats/byte)")
    ax.set_title(f"GPT {a.model}, {a.workers} workers, worker 1 2x slower", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()

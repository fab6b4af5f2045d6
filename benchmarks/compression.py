"""Gradient compression and large-batch optimizers on the default GPT: held-out loss, bytes, step time.

Every figure comes from `plait train configs/default.toml` run as a subprocess (2 gloo ranks on
the CPU, the config's seed), one run after another so that no two runs share the cores, each in
its own run directory under a temporary directory. What is read back from a run directory:
`summary.json` (final held-out loss) and rank 0's `metrics.jsonl` (training loss and
`step_time_s` of every step, `comm_bytes` / `comm_uncompressed_bytes` at every logged step,
`val_loss` at every evaluation).

1. **Compression** (Seide et al. 2014, 1-bit SGD; Aji & Heafield 2017, top-k sparsification):
   the same model, data, steps and seed, with the data-parallel gradient exchange uncompressed,
   in fp16, 1-bit with and without error feedback, top-1% with and without the residual, and
   (an extra) rank-4 PowerSGD (Vogels et al. 2019) with and without error feedback.
   "Gradient bytes per step" is what plait's ledger recorded as sent per rank (bus bytes) for
   the step's collectives; the compression factor is the uncompressed run's bytes divided by
   this run's, both measured. The uncompressed run is repeated with another seed to show how
   much the final held-out loss moves for reasons that have nothing to do with compression.
2. **LAMB vs AdamW at 8x the global batch** (You et al. 2020): 8 x the config's global batch,
   1/8 of its steps (the same number of training tokens). AdamW's peak learning rate is scaled
   by sqrt(8) (the square-root rule for Adam-type optimizers) and, as a check of that rule, also
   left at the config's; LAMB's is tried at each of `--lamb-lrs`. min_lr keeps the config's
   ratio to the peak; warm-up is `--big-warmup` steps.

3. **SGD with momentum** (`--optim sgd`; the optimizer of Seide et al. and of Aji & Heafield):
   `--optim.name sgd`, momentum `--momentum` (0.9), no weight decay (the config's 0.1 is meant for
   AdamW). Part 0 trains uncompressed at each peak learning rate of `--sgd-lrs` (warm-up, cosine
   decay and gradient clipping as the config sets them) and takes the one with the lowest
   held-out loss; part 1 then runs at that learning rate without fp16 and part 2. Results go to
   benchmarks/results/compression_sgd.md with compression_sgd_loss.png.
4. **Compression after an uncompressed warm-up** (`--warm-start N`, either optimizer): also runs
   1-bit and top-1% with error feedback whose first N steps are uncompressed: the run stops with a
   checkpoint at step N (`--train.stop_at N`) and is resumed from it (`plait train --resume`) with
   compression switched on and a fresh residual. Under AdamW this lets Adam's moments be learned
   on exact gradients first, half of the insight of 1-bit Adam (Tang et al. 2021), which the
   trainer implements in full as `comm.target = "momentum"` (item 5).

5. **1-bit Adam** (`--freeze-step N`, AdamW mode, default 100; 0 leaves it out; Tang et al. 2021):
   `--comm.target momentum --comm.freeze_step N` with 1-bit and with top-1%, each with and
   without error feedback: AdamW on uncompressed gradients for N steps, then the variance frozen
   and the momentum exchanged compressed (plait.optim.onebit_adam). Its bytes are those of the
   last logged step, in the compression stage; the first N steps send fp32. In SGD mode the same
   runs are **1-bit SGD** (keys `onebit-sgdm`, `topk-sgdm`, with `-noef`): momentum SGD whose
   momentum is exchanged compressed, error feedback after the momentum (plait.optim.onebit_sgd).

All runs (both parts) hold out 7.5% of the corpus instead of the config's 5%: one evaluation
batch of 256 sequences must fit into the held-out text, and with 7.5% the 8 evaluation batches
of 32 sequences and the single one of 256 are the same 256 windows, so every held-out loss
below is measured on the same text.

Run from the repository root:  .venv/bin/python benchmarks/compression.py [--steps 600]
[--quick] [--only none,onebit,...] [--optim adamw|sgd] [--sgd-lrs 0.05,0.1,0.3,1.0]
[--warm-start N] [--freeze-step N] [--seed S] [--out PATH]. Prints the tables and writes
benchmarks/results/compression.md with compression_loss.png and lamb_loss.png beside it
(`--optim sgd`: compression_sgd.md and compression_sgd_loss.png; another --out:
<stem>_loss.png); --quick writes nothing unless --out is given.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from _common import command_line, machine_info, markdown_table, running_mean, text_table

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "configs/default.toml"
RESULTS = Path(__file__).resolve().parent / "results" / "compression.md"
RESULTS_SGD = RESULTS.with_name("compression_sgd.md")
HELD_OUT = 0.075  # see the module docstring
BIG = 8  # batch multiplier of part 2
SKIP = 5  # first steps left out of the step-time medians (allocator and thread-pool warm-up)
SMOOTH = 20  # running-mean window of the plotted training losses, in batch-32 steps
LOSS_TOLERANCE = 1.05  # with error feedback: held-out loss within 5% of uncompressed
FACTOR_TARGETS = {"onebit": 30.0, "topk": 40.0}
MIN_WORSE = 0.01  # "measurably worse": at least 1% and twice the seed-to-seed difference
POWERSGD_RANK = 4  # PowerSGD's rank (an extra: the issue sets no target for it)


@dataclass
class Run:
    key: str
    label: str
    overrides: list[str]
    part: int  # 0: SGD learning-rate sweep, 1: compression, 2: LAMB vs AdamW
    batch_mult: int = 1
    result: dict = field(default_factory=dict)
    # --warm-start: the first `warm` steps uncompressed (`overrides` minus `compress`), then the run
    # is resumed from its step-`warm` checkpoint with `compress` added (a fresh residual)
    warm: int = 0
    compress: list[str] = field(default_factory=list)


def default_config() -> dict:
    with open(ROOT / CONFIG, "rb") as fh:
        return tomllib.load(fh)["train"]


SEED: int | None = None  # --seed: every run's train.seed (None: the config's)


def _seed(t: dict) -> int:
    return t["seed"] if SEED is None else SEED


def common_args(optim: str, momentum: float) -> list[str]:
    """The overrides every run of a mode shares."""
    common = [
        *("--data.held_out_fraction", str(HELD_OUT)),
        *("--train.progress", "false", "--train.sample_tokens", "0", "--train.checkpoint_every", "0"),
    ]
    if SEED is not None:
        common += ["--train.seed", str(SEED)]
    if optim == "sgd":  # no weight decay: the config's 0.1 is AdamW's decoupled decay, far too strong here
        common += ["--optim.name", "sgd", "--optim.momentum", f"{momentum:g}", "--train.weight_decay", "0"]
    return common


def _small(steps: int) -> list[str]:
    every = max(1, steps // 6)
    return ["--train.steps", str(steps), "--train.eval_every", str(every), "--train.log_every", str(every)]


def lr_args(lr: float) -> list[str]:
    """Peak and final learning rate, min_lr in the config's ratio to the peak."""
    t = default_config()
    return ["--train.lr", f"{lr:.4g}", "--train.min_lr", f"{lr * t['min_lr'] / t['lr']:.4g}"]


def sweep_runs(steps: int, lrs: list[float]) -> list[Run]:
    """SGD mode, part 0: uncompressed runs at each peak learning rate."""
    small = [*_small(steps), "--comm.compression", "none"]
    return [Run(f"sgd-lr{lr:.4g}", f"SGD, lr {lr:.4g}", [*small, *lr_args(lr)], 0) for lr in lrs]


def compression_runs(steps: int, optim: str, lr: float | None, warm: int, freeze: int = 0) -> list[Run]:
    """Part 1. SGD mode: the uncompressed run comes from the sweep and fp16 is left out. AdamW
    mode with `freeze` > 0: also 1-bit Adam (the momentum compressed after `freeze` steps)."""
    t = default_config()
    small = _small(steps) + (lr_args(lr) if lr is not None else [])
    onebit = ["--comm.compression", "onebit"]
    topk = ["--comm.compression", "topk", "--comm.topk_ratio", "0.01"]
    psgd = ["--comm.compression", "powersgd", "--comm.powersgd_rank", str(POWERSGD_RANK)]
    ef, no_ef = ["--comm.error_feedback", "true"], ["--comm.error_feedback", "false"]
    runs = [
        Run("none", "none (fp32)", [*small, "--comm.compression", "none"], 1),
        Run("fp16", "fp16", [*small, "--comm.compression", "fp16"], 1),
        Run("onebit", "1-bit + error feedback", [*small, *onebit, *ef], 1),
        Run("onebit-noef", "1-bit, no error feedback", [*small, *onebit, *no_ef], 1),
        Run("topk", "top-1% + residual", [*small, *topk, *ef], 1),
        Run("topk-noef", "top-1%, no residual", [*small, *topk, *no_ef], 1),
        Run("powersgd", f"PowerSGD rank {POWERSGD_RANK} + error feedback", [*small, *psgd, *ef], 1),
        Run("powersgd-noef", f"PowerSGD rank {POWERSGD_RANK}, no error feedback", [*small, *psgd, *no_ef], 1),
    ]
    if freeze:  # the momentum compressed: 1-bit Adam (AdamW), 1-bit SGD (SGD, feedback after momentum)
        mom = ["--comm.target", "momentum", "--comm.freeze_step", str(freeze)]
        name, sfx = ("Adam", "adam") if optim == "adamw" else ("SGD", "sgdm")
        runs += [
            Run(
                f"onebit-{sfx}",
                f"1-bit {name}: momentum + error feedback, {freeze} steps fp32 first",
                [*small, *onebit, *ef, *mom],
                1,
            ),
            Run(f"onebit-{sfx}-noef", f"1-bit {name}, no error feedback", [*small, *onebit, *no_ef, *mom], 1),
            Run(
                f"topk-{sfx}",
                f"top-1% {name}: momentum + residual, {freeze} steps fp32 first",
                [*small, *topk, *ef, *mom],
                1,
            ),
            Run(f"topk-{sfx}-noef", f"top-1% {name}, no residual", [*small, *topk, *no_ef, *mom], 1),
        ]
    runs.append(Run("none-seed1", "none (fp32), seed + 1", [*small, "--train.seed", str(_seed(t) + 1)], 1))
    if warm:
        for key, comp, name, feedback in (
            ("onebit", onebit, "1-bit + error feedback", ef),
            ("topk", topk, "top-1% + residual", ef),
            ("onebit-noef", onebit, "1-bit, no error feedback,", no_ef),
            ("topk-noef", topk, "top-1%, no residual,", no_ef),
        ):
            label = f"{name} after {warm} uncompressed steps"
            uncompressed = [*small, "--comm.compression", "none"]
            runs.append(Run(f"{key}-warm", label, uncompressed, 1, 1, {}, warm, [*comp, *feedback]))
    if optim == "sgd":
        runs = [r for r in runs if r.key not in ("none", "fp16")]
    return runs


def plan(
    steps: int, lamb_lrs: list[float], big_warmup: int, warm: int = 0, freeze: int = 0
) -> tuple[list[Run], list[str]]:
    """The AdamW runs of parts 1 and 2 and the overrides common to all of them."""
    t = default_config()
    common = common_args("adamw", 0.0)
    every = max(1, steps // 6)
    runs = compression_runs(steps, "adamw", None, warm, freeze)
    big_steps = max(1, steps // BIG)
    big = [
        *("--train.global_batch", str(BIG * t["global_batch"]), "--train.steps", str(big_steps)),
        *("--train.warmup_steps", str(min(big_warmup, max(1, big_steps // 4)))),
        *("--train.eval_every", str(max(1, every // BIG)), "--train.log_every", str(max(1, every // BIG))),
    ]
    min_ratio = t["min_lr"] / t["lr"]
    lrs = [
        ("adamw", t["lr"] * math.sqrt(BIG), f"AdamW, lr x sqrt({BIG})"),
        ("adamw", t["lr"], "AdamW, config lr"),
    ]
    lrs += [("lamb", lr, "LAMB") for lr in lamb_lrs]
    for name, lr, rule in lrs:
        key = f"{name}-{BIG}x-lr{lr:.4g}"
        label = f"{rule}, batch {BIG * t['global_batch']}, lr {lr:.3g}"
        lr_args = ["--train.lr", f"{lr:.4g}", "--train.min_lr", f"{lr * min_ratio:.4g}"]
        runs.append(Run(key, label, [*big, "--optim.name", name, *lr_args], 2, BIG))
    return runs, common


def read_run(run_dir: Path) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    summary = json.loads((run_dir / "summary.json").read_text())
    logged = [r for r in records if "comm_bytes" in r]
    times = [r["step_time_s"] for r in records]
    return {
        "steps": [r["step"] for r in records],
        "loss": [r["loss"] for r in records],
        "val": [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None],
        "val_loss": summary.get("val_loss", float("nan")),
        "bits": summary.get("val_bits_per_byte", float("nan")),
        "step_s": statistics.median(times[SKIP:] if len(times) > 2 * SKIP else times),
        "bytes": [r["comm_bytes"] for r in logged],
        "logical": [r["comm_uncompressed_bytes"] for r in logged],
    }


def execute(run: Run, common: list[str], workdir: Path, timeout: float) -> None:
    run_dir = workdir / run.key
    cmd = [sys.executable, "-m", "plait.cli", "train", CONFIG, *common, *run.overrides]
    cmd += ["--train.run_dir", str(run_dir)]
    cmds = [cmd]
    if run.warm:  # stop (and checkpoint) after the warm-up, then resume with compression switched on
        cmds = [[*cmd, "--train.stop_at", str(run.warm)]]
        cmds.append([sys.executable, "-m", "plait.cli", "train", "--resume", str(run_dir), *run.compress])
    log = workdir / f"{run.key}.log"
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        for c in cmds:
            proc = subprocess.run(c, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout)
            if proc.returncode != 0:
                break
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        run.result = {"failed": f"exit code {proc.returncode}", "wall_s": wall}
        print(f"    FAILED ({proc.returncode}) after {wall:.0f} s; its last lines:\n{tail}", flush=True)
        return
    run.result = read_run(run_dir) | {"wall_s": wall, "load": os.getloadavg()[0]}


# --- tables ------------------------------------------------------------------------------------


def _f(x: float, fmt: str) -> str:
    return "n/a" if x is None or not math.isfinite(x) else format(x, fmt)


def _bytes(values: list[float]) -> str:
    if not values:
        return "n/a"
    lo, hi = min(values), max(values)
    return f"{lo / 1e3:,.1f}" if math.isclose(lo, hi) else f"{lo / 1e3:,.1f}-{hi / 1e3:,.1f}"


def done(runs: list[Run], key: str) -> dict | None:
    r = next((r for r in runs if r.key == key), None)
    return r.result if r is not None and r.result and "failed" not in r.result else None


HEADERS_1 = [
    "gradient exchange",
    "held-out loss",
    "bits/byte",
    "loss / none",
    "sent kB/step",
    "uncompressed kB/step",
    "compression (none / sent)",
    "median step ms",
    "step / none",
]
HEADERS_2 = [
    "optimizer",
    "global batch",
    "steps",
    "lr (peak -> min)",
    "warm-up",
    "held-out loss",
    "bits/byte",
    "loss / ref",
    "median step ms",
    "tokens/s",
    "run wall s",
]


def rows_1(runs: list[Run]) -> list[list[str]]:
    ref = done(runs, "none")
    out = []
    for run in (r for r in runs if r.part == 1):
        res = run.result
        if "failed" in res:
            out.append([run.label, res["failed"], *["-"] * (len(HEADERS_1) - 2)])
            continue
        sent = res["bytes"][-1] if res["bytes"] else float("nan")
        ratio = res["val_loss"] / ref["val_loss"] if ref else float("nan")
        factor = ref["bytes"][-1] / sent if ref and ref["bytes"] else float("nan")
        step = res["step_s"] / ref["step_s"] if ref else float("nan")
        out.append(
            [
                run.label,
                _f(res["val_loss"], ".4f"),
                _f(res["bits"], ".3f"),
                _f(ratio, ".4f"),
                _bytes(res["bytes"]),
                _bytes(res["logical"]),
                _f(factor, ".1f") + "x",
                _f(1e3 * res["step_s"], ".0f"),
                _f(step, ".3f"),
            ]
        )
    return out


def _arg(run: Run, key: str, default: str) -> str:
    args = run.overrides
    return args[args.index(key) + 1] if key in args else default


def rows_2(runs: list[Run], seq_len: int) -> list[list[str]]:
    t = default_config()
    ref = done(runs, "none")
    chosen = [r for r in runs if r.part == 2]
    if ref is not None:
        chosen.insert(0, Run("ref", "AdamW, config lr (= none above), batch 32", [], 0, result=ref))
    out = []
    for run in chosen:
        res = run.result
        if "failed" in res:
            out.append([run.label, res["failed"], *["-"] * (len(HEADERS_2) - 2)])
            continue
        batch = int(_arg(run, "--train.global_batch", str(t["global_batch"])))
        lr = f"{_arg(run, '--train.lr', str(t['lr']))} -> {_arg(run, '--train.min_lr', str(t['min_lr']))}"
        out.append(
            [
                run.label.split(", batch")[0],
                str(batch),
                str(res["steps"][-1]),
                lr,
                _arg(run, "--train.warmup_steps", str(t["warmup_steps"])),
                _f(res["val_loss"], ".4f"),
                _f(res["bits"], ".3f"),
                _f(res["val_loss"] / ref["val_loss"] if ref else float("nan"), ".4f"),
                _f(1e3 * res["step_s"], ".0f"),
                _f(batch * seq_len / res["step_s"], ",.0f"),
                _f(res["wall_s"], ".0f"),
            ]
        )
    return out


HEADERS_0 = [
    "peak lr -> min lr",
    "held-out loss",
    "bits/byte",
    "final training loss (mean of last 20)",
    "run wall s",
]


def rows_0(runs: list[Run], chosen: str | None) -> list[list[str]]:
    out = []
    for run in (r for r in runs if r.part == 0):
        res = run.result
        lr = f"{_arg(run, '--train.lr', '?')} -> {_arg(run, '--train.min_lr', '?')}"
        if run.key == chosen:
            lr = f"**{lr}** (chosen)"
        if "failed" in res:
            out.append([lr, res["failed"], "-", "-", _f(res.get("wall_s"), ".0f")])
            continue
        last = res["loss"][-SMOOTH:]
        out.append(
            [
                lr,
                _f(res["val_loss"], ".4f"),
                _f(res["bits"], ".3f"),
                _f(sum(last) / len(last) if last else float("nan"), ".4f"),
                _f(res["wall_s"], ".0f"),
            ]
        )
    return out


def best_sweep_run(runs: list[Run]) -> Run | None:
    """The sweep run with the lowest finite held-out loss."""
    ok = [r for r in runs if r.part == 0 and done(runs, r.key) and math.isfinite(r.result["val_loss"])]
    return min(ok, key=lambda r: r.result["val_loss"]) if ok else None


def _factor_row(text: str, goal: float, ref: dict | None, res: dict | None) -> list[str]:
    """Bytes of the last logged step (a compressed one) against the uncompressed run's."""
    if ref is None or res is None or not res["bytes"]:
        return [text, "-", "not measured"]
    factor = ref["bytes"][-1] / res["bytes"][-1]
    measured = f"{factor:.1f}x ({ref['bytes'][-1]:,.0f} / {res['bytes'][-1]:,.0f} B)"
    return [text, measured, "met" if factor >= goal else "NOT met"]


def _loss_rows(name: str, ref, res, bad, noise, note: str = "") -> list[list[str]]:
    """'within 5% of uncompressed' for `res`, and 'without error feedback measurably worse' for `bad`."""
    text = f"{name}: held-out loss within {LOSS_TOLERANCE - 1:.0%} of uncompressed{note}"
    if ref is None or res is None:
        return [[text, "-", "not measured"]]
    ratio = res["val_loss"] / ref["val_loss"]
    measured = f"{res['val_loss']:.4f} vs {ref['val_loss']:.4f} (x{ratio:.4f})"
    rows = [[text, measured, "met" if ratio <= LOSS_TOLERANCE else "NOT met"]]
    text = f"{name}, without error feedback: measurably worse than with it{note}"
    if bad is None:
        return rows + [[text, "-", "not measured"]]
    margin = MIN_WORSE * res["val_loss"]
    rule = f"{MIN_WORSE:.0%} of the loss"
    if noise is not None:
        margin = max(margin, 2 * noise)
        rule = f"max({MIN_WORSE:.0%} of the loss, 2 x seed-to-seed difference {noise:.4f})"
    diff = bad["val_loss"] - res["val_loss"]
    measured = f"{bad['val_loss']:.4f} vs {res['val_loss']:.4f}: +{diff:.4f} (needs > {margin:.4f}: {rule})"
    ok = not math.isfinite(bad["val_loss"]) or diff > margin  # a diverged run is worse too
    return rows + [[text, measured.replace("+-", "-"), "met" if ok else "NOT met"]]


def targets(runs: list[Run]) -> list[list[str]]:
    """[target, measured, verdict] rows, all computed from the runs."""
    ref, seed = done(runs, "none"), done(runs, "none-seed1")
    noise = abs(seed["val_loss"] - ref["val_loss"]) if ref and seed else None
    names = {"onebit": "1-bit", "topk": "top-1%"}
    out = []
    for key, goal in FACTOR_TARGETS.items():
        out.append(
            _factor_row(
                f"{names[key]}: >= {goal:.0f}x fewer gradient bytes than fp32", goal, ref, done(runs, key)
            )
        )
    for key in FACTOR_TARGETS:
        out += _loss_rows(
            f"{names[key]} on gradients", ref, done(runs, key), done(runs, f"{key}-noef"), noise
        )
    psgd = done(runs, "powersgd")
    if psgd is not None:
        name = f"PowerSGD rank {POWERSGD_RANK} on gradients"
        out += _loss_rows(name, ref, psgd, done(runs, "powersgd-noef"), noise, " (extra)")
    for sfx, opt in (("adam", "Adam"), ("sgdm", "SGD")):  # --freeze-step: the momentum compressed
        for key, goal in FACTOR_TARGETS.items():
            res = done(runs, f"{key}-{sfx}")
            if res is None:
                continue
            name = f"{names[key]} {opt} (momentum)"
            out.append(
                _factor_row(f"{name}: >= {goal:.0f}x fewer bytes than fp32 after the freeze", goal, ref, res)
            )
            out += _loss_rows(name, ref, res, done(runs, f"{key}-{sfx}-noef"), noise)
    for key in FACTOR_TARGETS:  # --warm-start
        res = done(runs, f"{key}-warm")
        if res is not None:
            run = next(r for r in runs if r.key == f"{key}-warm")
            out += _loss_rows(run.label, ref, res, done(runs, f"{key}-noef-warm"), noise, " (extra)")
    return out


# --- plots -------------------------------------------------------------------------------------


def plot(runs: list[Run], path: Path, part: int, seq_len: int, batch: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in runs if r.part == part and r.result and "failed" not in r.result]
    if part == 2 and done(runs, "none") is not None:
        shown.insert(0, Run("ref", "AdamW, batch 32 (= none)", [], 0, result=done(runs, "none")))
    if not shown:
        return
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    scale = batch * seq_len / 1e6  # million tokens per batch-32 step
    for k, run in enumerate(shown):
        res, mult = run.result, run.batch_mult
        x = [s * mult * scale for s in res["steps"]] if part == 2 else res["steps"]
        y = running_mean(res["loss"], max(1, SMOOTH // mult))
        style = {"color": "0.6", "ls": "--", "lw": 1} if run.key in ("none-seed1", "ref") else {"lw": 1.3}
        # more than 10 curves: tab20 (10 hue pairs) so that no two runs share a colour
        color = style.pop("color", plt.cm.tab20(k % 20) if len(shown) > 10 else f"C{k}")
        vx = [s * mult * scale if part == 2 else s for s, _ in res["val"]]
        vy = [v for _, v in res["val"]]
        for ax in axes:
            ax.plot(x, y, color=color, label=run.label, **style)
            ax.plot(vx, vy, "o", color=color, ms=4)
    xlabel = "training tokens (millions)" if part == 2 else "step"
    for ax in axes:
        ax.set_xlabel(xlabel)
        ax.set_ylabel("loss (nats/byte)")
        ax.grid(alpha=0.3)
    end = max(max(r.result["steps"]) * (r.batch_mult * scale if part == 2 else 1) for r in shown)
    finals = [v for r in shown for _, v in r.result["val"][-1:] if math.isfinite(v)]
    finals += [y for r in shown for y in running_mean(r.result["loss"], SMOOTH)[-1:] if math.isfinite(y)]
    axes[1].set_xlim(end / 2, end * 1.02)
    if finals:
        axes[1].set_ylim(min(finals) * 0.97, max(finals) * 1.08)
    window = f"{SMOOTH * batch} sequences" if part == 2 else f"{SMOOTH} steps"
    axes[0].set_title(f"training loss (running mean over {window}); dots: held-out loss")
    axes[1].set_title("second half, zoomed")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- report ------------------------------------------------------------------------------------


def markdown(runs, common, info, command, args, runtime_s, seq_len, images: dict[str, str]) -> str:
    t = default_config()
    sgd = args.optim == "sgd"
    per_run = [
        [
            r.key,
            "`"
            + " ".join(r.overrides)
            + (f" --train.stop_at {r.warm}`, then `--resume <run> {' '.join(r.compress)}" if r.warm else "")
            + "`",
            _f(r.result.get("wall_s"), ".0f"),
            _f(r.result.get("load"), ".2f"),
        ]
        for r in runs
        if r.result.get("wall_s") is not None
    ]
    tgt = targets(runs)
    missed = [row for row in tgt if row[2] == "NOT met"]
    best = best_sweep_run(runs)
    if sgd:
        title = "# Gradient compression under SGD with momentum"
        optim = f"SGD, momentum {args.momentum:g}, no weight decay, peak lr {_arg(best, '--train.lr', '?')}"
    else:
        title = "# Gradient compression and large-batch optimizers"
        optim = "AdamW"
    out = [
        title,
        "",
        "Written by `benchmarks/compression.py`; every figure below comes from one run of it (see the",
        "script's docstring for the method). Each row is one `plait train` run of the default GPT",
        f"(`{CONFIG}`: 0.84M parameters, 2 data-parallel gloo ranks on the CPU), run one after another.",
        "",
        f"- Command: `{command}`",
        *(f"- {k}: {v}" for k, v in info.items()),
        f"- Runtime: {runtime_s:.0f} s",
        f"- Every run: `.venv/bin/python -m plait.cli train {CONFIG} {' '.join(common)} "
        "--train.run_dir <tmp>/<run>` plus its own overrides (below).",
        f"- Held-out loss: mean over the same 256 held-out windows of 128 bytes in every run "
        f"(`--data.held_out_fraction {HELD_OUT}` instead of the config's 5%: the 256-sequence batch",
        "  of part 2 needs one evaluation batch of 256 windows, which 5% does not hold).",
        "- Step time: median of `step_time_s` (rank 0) over the steps after the first "
        f"{SKIP}; bytes: `comm_bytes` (sent per rank, bus bytes) and `comm_uncompressed_bytes` at the",
        "  logged steps (a range where they differ).",
        "",
    ]
    if any(r.part == 0 for r in runs):
        out += [
            "## 0. Learning rate of SGD with momentum (uncompressed)",
            "",
            f"{args.steps} steps, linear warm-up over the config's {t['warmup_steps']} steps, cosine decay",
            f"to min_lr = peak x {t['min_lr'] / t['lr']:g}, global gradient norm clipped to the config's"
            " grad_clip; the lowest held-out loss is chosen for part 1.",
            "",
            markdown_table(HEADERS_0, rows_0(runs, best.key if best else None)),
            "",
        ]
    if any(r.part == 1 for r in runs):
        out += [
            f"## 1. Gradient compression ({t['global_batch']} sequences x {seq_len} bytes, {optim}, "
            "same seed)",
            "",
            markdown_table(HEADERS_1, rows_1(runs)),
            "",
        ]
        if done(runs, "none-seed1"):
            out += [
                "`none (fp32), seed + 1` repeats the uncompressed run with another seed (model",
                "initialisation and data order): the difference of its held-out loss to `none` is the noise",
                'floor for "measurably worse".',
                "",
            ]
        if any(r.warm for r in runs):
            out += [
                "The `after N uncompressed steps` rows train their first N steps uncompressed, stop with a",
                "checkpoint, and resume from it with compression on (a fresh residual; Adam's moments as",
                "learned on uncompressed gradients, the idea of 1-bit Adam's warm-up stage). Their bytes",
                "range over both stages; the compression factor is that of the compressed steps.",
                "",
            ]
        out += [f"![training and held-out loss per gradient exchange]({images['part1']})", ""]
    if any(r.part == 2 for r in runs):
        out += [
            f"## 2. LAMB vs AdamW at {BIG}x the global batch, the same training tokens",
            "",
            f"AdamW's peak lr is the config's {t['lr']:g} x sqrt({BIG}) (square-root scaling) and, to check",
            f"that rule, the config's {t['lr']:g} itself; LAMB's is each",
            f"of {', '.join(f'{x:g}' for x in args.lamb_lrs)} (all tried are listed). min_lr keeps the",
            f"config's ratio min_lr/lr = {t['min_lr'] / t['lr']:g}. Loss / ref is relative to the batch-32",
            "AdamW run.",
            "",
            markdown_table(HEADERS_2, rows_2(runs, seq_len)),
            "",
            f"![LAMB vs AdamW at 8x batch]({images['part2']})",
            "",
        ]
    out += [
        "## Targets (issue 6)",
        "",
        markdown_table(["target", "measured", "verdict"], tgt),
        "",
    ]
    if missed:
        out += ["**Not met:**", "", *(f"- {row[0]}: {row[1]}." for row in missed), ""]
    out += [
        "## Runs",
        "",
        markdown_table(["run", "overrides", "wall s", "load avg (1 min) at its end"], per_run),
        "",
    ]
    return "\n".join(out)


def run_all(runs: list[Run], common: list[str], workdir: Path, timeout: float, start: float) -> None:
    """Execute, one after another, the runs that have no result yet."""
    todo = [r for r in runs if not r.result]
    for k, run in enumerate(todo, 1):
        extra = f" | then resume with {' '.join(run.compress)} at step {run.warm}" if run.warm else ""
        print(f"[{k}/{len(todo)}] {run.key}: {' '.join(run.overrides)}{extra}", flush=True)
        execute(run, common, workdir, timeout)
        if "failed" not in run.result:
            res = run.result
            print(
                f"    done in {res['wall_s']:.0f} s (total {time.perf_counter() - start:.0f} s): "
                f"held-out {res['val_loss']:.4f}, median step {1e3 * res['step_s']:.0f} ms, "
                f"sent {_bytes(res['bytes'])} kB/step",
                flush=True,
            )


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    t = default_config()
    parser.add_argument("--steps", type=int, default=t["steps"], help="steps of part 1 (part 2: 1/8)")
    parser.add_argument("--quick", action="store_true", help="smoke check: 40 steps, writes nothing")
    parser.add_argument("--seed", type=int, default=None, help="every run's train.seed (default: config's)")
    parser.add_argument("--only", default="", help="comma-separated run keys of parts 1-2 (default: all)")
    parser.add_argument(
        "--optim",
        choices=("adamw", "sgd"),
        default="adamw",
        help="adamw: parts 1 and 2 with the config's AdamW; sgd: part 0 (lr sweep) and part 1 with SGD",
    )
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (--optim sgd)")
    parser.add_argument(
        "--sgd-lrs", default="0.05,0.1,0.3,1.0", help="SGD peak learning rates of the sweep (--optim sgd)"
    )
    parser.add_argument(
        "--warm-start",
        type=int,
        default=0,
        help="also run 1-bit and top-1%% with error feedback after this many uncompressed steps (0: no)",
    )
    parser.add_argument(
        "--freeze-step",
        type=int,
        default=100,
        help="also run 1-bit Adam / 1-bit SGD (comm.target = momentum) with this comm.freeze_step (0: no)",
    )
    parser.add_argument("--lamb-lrs", default="1e-2,2e-2,4e-2", help="LAMB peak learning rates to try")
    parser.add_argument("--big-warmup", type=int, default=10, help="warm-up steps of part 2")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"markdown output (default {RESULTS}; with --optim sgd {RESULTS_SGD})",
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps = 40
        args.freeze_step = min(args.freeze_step, args.steps // 4)
    if args.steps < BIG:
        parser.error(f"--steps must be >= {BIG}")
    if not 0 <= args.warm_start < args.steps:
        parser.error("--warm-start must be in [0, --steps)")
    if not 0 <= args.freeze_step < args.steps:
        parser.error("--freeze-step must be in [0, --steps)")
    global SEED
    SEED = args.seed
    args.lamb_lrs = _floats(args.lamb_lrs)
    args.sgd_lrs = _floats(args.sgd_lrs)
    if args.optim == "sgd":
        common = common_args("sgd", args.momentum)
        # the compression runs are planned once the sweep has chosen the lr; their keys are known now
        runs = [r for r in compression_runs(args.steps, "sgd", 1.0, args.warm_start, args.freeze_step)]
    else:
        runs, common = plan(args.steps, args.lamb_lrs, args.big_warmup, args.warm_start, args.freeze_step)
    if args.only:
        keys = [k.strip() for k in args.only.split(",") if k.strip()]
        unknown = [k for k in keys if k not in {r.key for r in runs}]
        if unknown:
            parser.error(f"unknown run(s) {unknown}; choose from {[r.key for r in runs]}")
        runs = [r for r in runs if r.key in keys]
    keys = {r.key for r in runs}

    from plait.models import gpt_config

    seq_len = gpt_config("small").seq_len
    command, info = command_line(), machine_info()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="plait-compression-") as tmp:
        if args.optim == "sgd":
            sweep = sweep_runs(args.steps, args.sgd_lrs)
            run_all(sweep, common, Path(tmp), args.timeout, start)
            best = best_sweep_run(sweep)
            if best is None:
                print("every SGD learning rate failed or diverged; no compression runs", flush=True)
                runs = sweep
            else:
                lr = float(_arg(best, "--train.lr", "nan"))
                print(f"SGD: lr {lr:g} chosen (held-out {best.result['val_loss']:.4f})", flush=True)
                none = Run("none", "none (fp32)", best.overrides, 1, result=best.result)
                planned = [
                    r
                    for r in compression_runs(args.steps, "sgd", lr, args.warm_start, args.freeze_step)
                    if r.key in keys
                ]
                runs = [*sweep, none, *planned]
        run_all(runs, common, Path(tmp), args.timeout, start)
    runtime = time.perf_counter() - start

    if any(r.part == 0 for r in runs):
        print()
        print(text_table(HEADERS_0, rows_0(runs, None)))
    print()
    print(text_table(HEADERS_1, rows_1(runs)))
    if any(r.part == 2 for r in runs):
        print()
        print(text_table(HEADERS_2, rows_2(runs, seq_len)))
    print()
    for target, measured, verdict in targets(runs):
        print(f"target: {target}: {measured} -> {verdict}")
    print(f"runtime {runtime:.0f} s")
    default_out = RESULTS_SGD if args.optim == "sgd" else RESULTS
    out = args.out if args.out is not None else (None if args.quick else default_out)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        if out == RESULTS:
            images = {"part1": "compression_loss.png", "part2": "lamb_loss.png"}
        else:
            images = {"part1": f"{out.stem}_loss.png", "part2": f"{out.stem}_lamb.png"}
        plot(runs, out.parent / images["part1"], 1, seq_len, t["global_batch"])
        if any(r.part == 2 for r in runs):
            plot(runs, out.parent / images["part2"], 2, seq_len, t["global_batch"])
        out.write_text(markdown(runs, common, info, command, args, runtime, seq_len, images))
        print(f"wrote {out} and its plot(s) beside it")
    return 0


if __name__ == "__main__":
    sys.exit(main())

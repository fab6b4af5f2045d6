"""Mixture of experts: an MoE GPT against the dense GPT at equal active FLOPs, and plait's `MoE`
layer against DeepSpeed-MoE's on the same shapes at ep = 2.

**Part 1, quality** (each row one `plait train configs/default.toml` run as a subprocess, one
process, two compute threads, the runs one after another):

* ``dense``: the GPT `small` (4 blocks, d_model 128, d_ff 512, 128-byte context), 0.84M parameters.
* ``moe``: the same GPT with a Switch (top-1) MoE MLP of 4 experts in every other block (blocks 2
  and 4), capacity factor 1.25 per sequence, load-balancing loss 0.01, router z-loss 0.001.
* ``moe-noaux``: the same with the load-balancing coefficient 0 (z-loss kept), to see what the
  auxiliary loss does to the expert load.
* ``moe-dropless`` (only with ``--dropless``: it doubles part 1's time): ``moe`` with capacity
  factor 0 (dropless: every group's buffer per expert holds the largest load of any expert in
  any group), to see how much of the MoE - dense difference the dropped tokens make.
* ``dense-seed1``: ``dense`` with train.seed 1 (another initialisation and data order): the
  seed-to-seed spread against which the MoE - dense difference is read.

All train the same number of steps on the same batches (global batch 16 x 128 bytes of the
embedded pydoc corpus, AdamW, lr 3e-3 warm-up + cosine, clipping 1.0: the default config's
optimiser) and are evaluated on the same held-out windows.

**Equal active FLOPs: top-1, not top-2.** A top-1 token goes through one expert, an MLP of the
dense model's size, so the MoE GPT's training FLOPs per token are the dense GPT's plus the
router (2·h·E per MoE layer and token, forward): `plait.models.gpt_train_flops_per_token`
prints both. Top-2 doubles the MoE MLPs' FLOPs, and `GPTConfig.d_ff` sizes the dense blocks'
MLPs and the experts alike, so shrinking d_ff to compensate shrinks the MoE model's dense blocks
too: with 2 of 4 blocks MoE, equal FLOPs would need d_ff = 4·512/6 = 341.3 everywhere, which is
not an integer, and would compare a different dense half. Top-1 at the dense d_ff is the
comparison Switch Transformer makes (Fedus et al. 2021, §2.1, §3).

Read from each run: the held-out loss (summary.json, the mean over `--eval-batches` batches of
16 held-out sequences), the training loss per step and the throughput (metrics.jsonl: tokens/s
per log window of 10 steps, median over the windows after the first), and the load per expert:
each log window's `moe.tokens_per_expert` (claims per expert of each MoE layer over the window's
10 steps, before capacity), summarised as the coefficient of variation (population std / mean;
0 = balanced, sqrt(E-1) = 1.73 = everything on one expert) and max / mean (1 = balanced, E = 4 =
collapse), the dropped fraction (claims over capacity) and Switch's auxiliary loss value
(E·Σ f_e·P_e: 1 = balanced; it is computed and logged also when its coefficient is 0).

The runs' tokens/s follow the machine's load (they run one after another on shared cores), so
the throughput is also measured **interleaved**: the dense and the MoE GPT (`plait.models.GPT`,
torch AdamW, no plait engine) built in this process and trained alternately step by step on the
same corpus batches (`--tp-steps` measured steps each, after 3 warm-up steps); the figure is
the median of the per-step ratios MoE / dense.

**Part 2, step time of the layer** (one job of 2 gloo ranks on the CPU, one compute thread per
rank, ep = 2): the MoE layer of the GPT above (d_model 128, d_ff 512, 4 experts, 2 per rank),
fed 8 x 128 tokens per rank as one routing group (DeepSpeed routes all the tokens of a forward
as one group; plait's `MoE(group_size=None)` does the same), capacity factor 1.25 (tokens over
capacity dropped), top-1 and top-2. Setups, built from the same weights:

* ``plait``: `plait.moe.MoE(..., mesh=Mesh(ep=2))`: router, the dispatch buffer, two all-to-alls
  through `plait.comm` and the expert bank (stacked parameters; on the CPU its two
  `torch.baddbmm` run one local expert at a time, see `plait.moe.experts`).
* ``deepspeed``: `deepspeed.moe.layer.MoE(hidden_size, expert, num_experts=4, ep_size=2, k,
  capacity_factor=1.25, min_capacity=0, use_rts=False, top2_2nd_expert_sampling=False)`, the
  expert an ``nn.Sequential(Linear, GELU(tanh), Linear)``, after ``set_deepspeed_parallelism()``
  (DeepSpeed's expert-parallel group over the 2 ranks); DeepSpeed's CPU accelerator, gloo.
  Random token selection and the Gumbel sampling of the second expert are off so that both
  route deterministically and identically; min_capacity 0 gives both C = ceil(k·1.25·S/E).
* ``torch``: plain PyTorch written here (`TorchMoE`): the same router, GShard positions by a
  cumulative sum, an `index_copy` dispatch, `torch.distributed.all_to_all_single` in an autograd
  function, and the experts as a Python loop of `torch.nn.functional.linear` per local expert.
  The peer the issue names if DeepSpeed-MoE cannot run; otherwise a second reference.

DeepSpeed is never a dependency of plait: it lives in its own venv (`deepspeed_env`, as for
zero.py), and this part runs in that venv's python (this file with ``--layer-worker``, which
imports plait from the repository); without DeepSpeed the job runs in the current python with the
plait and torch setups only, and the report says why.

A step is: fresh input (requires grad, as inside a model), forward, loss = mean(y²) + 0.01·aux,
backward (gradients of the input, router and experts); no optimizer (it is the same for all) and
no data-parallel gradient reduction. Steps of the setups are interleaved, the order rotating every
step; each starts from a barrier (`_common.timed_step`); a step's time is the maximum over the
ranks; figures are medians after `--warmup` unmeasured steps. The expert computation alone
(forward + backward of the local experts on a buffer of the shape the all-to-all delivers) is
timed the same way, which separates, approximately (see the report's notes), the bank from the
routing, dispatch, combine and all-to-alls. Before timing, all setups run once with capacity
factor 4 (nothing dropped) on the same input: outputs, input gradients, router and expert
gradients and the auxiliary loss must agree (the same function), and the expert loads must be
equal (the same routing).

Run from the repository root:  .venv/bin/python benchmarks/moe.py [--steps 300] [--layer-steps 40]
[--dropless] [--no-deepspeed] [--skip-train] [--quick]. Prints the tables and writes
benchmarks/results/moe.md, moe.json and the PNG plots beside them (not with --quick, unless --out
is given).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import (
    command_line,
    machine_info,
    markdown_table,
    max_over_ranks,
    median_ms,
    running_mean,
    text_table,
    timed_step,
)
from deepspeed_env import DS_VENV, ensure_deepspeed, last_lines
from torch import nn

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results" / "moe.md"
CONFIG = "configs/default.toml"

MODEL = "small"
EXPERTS, TOP_K, MOE_EVERY, CAPACITY, AUX, Z = 4, 1, 2, 1.25, 0.01, 0.001
BATCH = 16  # global batch (sequences) of the training runs
LOG_EVERY = 10
SMOOTH = 20  # running-mean window of the plotted training loss, in steps
EP = 2
LAYER_ROWS = 8  # sequences per rank in part 2 (what a dp x ep = 2 run of batch 16 gives each rank)
AUX_WEIGHT = 0.01  # of the auxiliary loss in part 2's objective
PARITY_CAPACITY = 4.0  # C = k·4·S/E >= any load: nothing dropped in the parity check
LAYER_SETUPS = ("plait", "deepspeed", "torch")


# --- part 1: training runs ---------------------------------------------------------------------


def _moe_args(aux: float, capacity: float = CAPACITY) -> list[str]:
    return [
        *("--model.experts", str(EXPERTS), "--model.top_k", str(TOP_K)),
        *("--model.moe_every", str(MOE_EVERY), "--model.capacity_factor", f"{capacity:g}"),
        *("--model.aux_loss_coef", f"{aux:g}", "--model.z_loss_coef", str(Z)),
    ]


RUNS = {  # key: (label, overrides)
    "dense": ("dense GPT", ["--model.experts", "0"]),
    "moe": (f"MoE top-{TOP_K}, aux {AUX}", _moe_args(AUX)),
    "moe-noaux": (f"MoE top-{TOP_K}, aux 0", _moe_args(0.0)),
    "moe-dropless": (f"MoE top-{TOP_K}, aux {AUX}, dropless", _moe_args(AUX, 0.0)),
    "dense-seed1": ("dense GPT, seed 1", ["--model.experts", "0", "--train.seed", "1"]),
}


def gpt_cfg(experts: int, top_k: int = TOP_K):
    from plait.models import gpt_config

    if not experts:
        return gpt_config(MODEL)
    return gpt_config(
        MODEL, experts=experts, top_k=top_k, moe_every=MOE_EVERY, capacity_factor=CAPACITY,
        aux_loss_coef=AUX, z_loss_coef=Z,
    )  # fmt: skip


def throughput(steps: int, warmup: int) -> dict:
    """Training steps (forward, backward, AdamW) of the dense and the MoE GPT in this process,
    interleaved (order alternating), on the same corpus batches: a throughput comparison that
    the machine's changing load cannot skew, unlike the training runs' (one after another)."""
    from _common import corpus_batches, train_step

    from plait.models import GPT

    cfg = gpt_cfg(0)
    batches = corpus_batches(BATCH, cfg.seq_len, 4, seed=0)
    setups = {}
    for key, experts in (("dense", 0), ("moe", EXPERTS)):
        torch.manual_seed(0)
        model = GPT(gpt_cfg(experts))
        setups[key] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True))
    times = {key: [] for key in setups}
    for i in range(warmup + steps):
        x, y = batches[i % len(batches)]
        for key in list(setups)[:: 1 if i % 2 == 0 else -1]:
            seconds, _ = timed_step(train_step, *setups[key], x, y)
            if i >= warmup:
                times[key].append(seconds)
    tokens = BATCH * cfg.seq_len
    return {
        "threads": torch.get_num_threads(),
        "median_ms": {key: median_ms(v) for key, v in times.items()},
        "tokens_per_s": {key: tokens / statistics.median(v) for key, v in times.items()},
        "paired_ratio": statistics.median(a / b for a, b in zip(times["moe"], times["dense"])),
        "steps": steps,
    }


def flop_counts() -> dict:
    """Training FLOPs per token (plait.models.gpt_train_flops_per_token) and parameter counts."""
    from plait.models import gpt_train_flops_per_token

    dense, moe, moe2 = gpt_cfg(0), gpt_cfg(EXPERTS, 1), gpt_cfg(EXPERTS, 2)
    n, m = dense.n_layer, moe.n_moe_layers
    return {
        "dense": gpt_train_flops_per_token(dense),
        "moe_top1": gpt_train_flops_per_token(moe),
        "moe_top2": gpt_train_flops_per_token(moe2),
        # the d_ff at which a top-2 MoE GPT (every MLP of that size) has the dense GPT's MLP FLOPs
        "top2_equal_d_ff": n * dense.ff_dim / ((n - m) + 2 * m),
        "params_dense": dense.n_params(),
        "params_moe": moe.n_params(),
        # active: one expert per token and layer (the other E-1 experts' MLPs are not used)
        "active_params_moe": moe.n_params() - m * (EXPERTS - 1) * _mlp_params(dense),
        "n_moe_layers": m,
    }


def _mlp_params(cfg) -> int:
    d, f = cfg.d_model, cfg.ff_dim
    return d * f + f + f * d + d


def train_args(steps: int, eval_batches: int) -> list[str]:
    every = max(1, steps // 6)
    return [
        *("--model.name", MODEL, "--parallel.dp", "1", "--train.global_batch", str(BATCH)),
        *("--train.steps", str(steps), "--train.warmup_steps", str(max(1, steps // 10))),
        *("--train.log_every", str(LOG_EVERY), "--train.eval_every", str(every)),
        *("--train.eval_batches", str(eval_batches), "--train.progress", "false"),
        *("--train.sample_tokens", "0", "--train.checkpoint_every", "0"),
    ]


def balance(load: list[int]) -> tuple[float, float]:
    """(coefficient of variation, max / mean) of one layer's claims per expert."""
    mean = statistics.fmean(load)
    if mean == 0:
        return float("nan"), float("nan")
    return statistics.pstdev(load) / mean, max(load) / mean


def read_run(run_dir: Path) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    summary = json.loads((run_dir / "summary.json").read_text())
    logged = [r for r in records if "tokens_per_s" in r]
    moe = [(r["step"], r["moe"]) for r in records if "moe" in r]
    out = {
        "steps": [r["step"] for r in records],
        "loss": [r["loss"] for r in records],
        "val": [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None],
        "val_loss": summary.get("val_loss", float("nan")),
        "params": summary.get("params"),
        # the first window holds the allocator's and thread pool's warm-up
        "tokens_per_s": statistics.median([r["tokens_per_s"] for r in logged[1:]] or [float("nan")]),
        "step_ms": median_ms([r["step_time_s"] for r in records[5:]] or [float("nan")]),
        "mfu": statistics.median([r["mfu"] for r in logged[1:]] or [float("nan")]),
    }
    if moe:
        layers = len(moe[0][1]["tokens_per_expert"])
        out["moe"] = {
            "steps": [s for s, _ in moe],
            "tokens_per_expert": [m["tokens_per_expert"] for _, m in moe],
            "cv": [[balance(m["tokens_per_expert"][i])[0] for _, m in moe] for i in range(layers)],
            "max_mean": [[balance(m["tokens_per_expert"][i])[1] for _, m in moe] for i in range(layers)],
            "dropped": [m["dropped_fraction"] for _, m in moe],
            "aux": [m["aux_loss"] for _, m in moe],
            "z": [m["z_loss"] for _, m in moe],
        }
    return out


def balance_summary(res: dict) -> dict:
    """Means over the MoE layers and over the log windows of the second half of training, and the
    last window's figures."""
    m = res["moe"]
    half = len(m["steps"]) // 2
    layers = len(m["cv"])

    def late(series):
        return statistics.fmean(series[half:])

    def last_layers(key):
        return statistics.fmean(m[key][i][-1] for i in range(layers))

    return {
        "cv": statistics.fmean(late(m["cv"][i]) for i in range(layers)),
        "max_mean": statistics.fmean(late(m["max_mean"][i]) for i in range(layers)),
        "cv_per_layer": [late(m["cv"][i]) for i in range(layers)],
        "max_mean_per_layer": [late(m["max_mean"][i]) for i in range(layers)],
        "dropped": late(m["dropped"]),
        "aux": late(m["aux"]),
        "cv_last": last_layers("cv"),
        "max_mean_last": last_layers("max_mean"),
        "dropped_last": m["dropped"][-1],
        "load_last": m["tokens_per_expert"][-1],
    }


def execute(key: str, common: list[str], workdir: Path, timeout: float) -> dict:
    run_dir = workdir / key
    cmd = [sys.executable, "-m", "plait.cli", "train", CONFIG, *common, *RUNS[key][1]]
    cmd += ["--train.run_dir", str(run_dir)]
    log = workdir / f"{key}.log"
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        print(f"    FAILED ({proc.returncode}) after {wall:.0f} s; its last lines:\n{tail}", flush=True)
        return {"failed": f"exit code {proc.returncode}: {last_lines(log.read_text())}", "wall_s": wall}
    return read_run(run_dir) | {"wall_s": wall, "load": os.getloadavg()[0], "run_dir": str(run_dir)}


def train_all(args, workdir: Path) -> dict:
    common = train_args(args.steps, args.eval_batches)
    results = {}
    keys = [k for k in RUNS if args.dropless or k != "moe-dropless"]
    for i, key in enumerate(keys, 1):
        print(f"  [{i}/{len(keys)}] {RUNS[key][0]}: plait train {' '.join(RUNS[key][1])}", flush=True)
        results[key] = execute(key, common, workdir, args.timeout)
        r = results[key]
        if "failed" not in r:
            print(
                f"    held-out loss {r['val_loss']:.4f}, {r['tokens_per_s']:,.0f} tok/s, {r['wall_s']:.0f} s",
                flush=True,
            )
    return results


def plot_loss(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [(k, r) for k, r in results.items() if "failed" not in r]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    styles = {"dense-seed1": {"color": "0.55", "ls": "--", "lw": 1}}
    for i, (key, res) in enumerate(shown):
        style = {"color": f"C{i}", "lw": 1.3} | styles.get(key, {})
        y = running_mean(res["loss"], SMOOTH)
        for ax in axes:
            ax.plot(res["steps"], y, label=f"{RUNS[key][0]} (train)", **style)
            ax.plot(*zip(*res["val"]), "o-", color=style["color"], ms=4, lw=0.8, alpha=0.8)
    end = max(max(r["steps"]) for _, r in shown)
    finals = [v for _, r in shown for _, v in r["val"][-1:]]
    finals += [running_mean(r["loss"], SMOOTH)[-1] for _, r in shown]
    axes[1].set_xlim(end / 2, end * 1.02)
    axes[1].set_ylim(min(finals) * 0.97, max(finals) * 1.06)
    for ax in axes:
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/byte)")
        ax.grid(alpha=0.3)
    axes[0].set_title(f"training loss (running mean over {SMOOTH} steps); dots: held-out loss")
    axes[1].set_title("second half, zoomed")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_balance(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 5.2))
    for i, key in enumerate(k for k in RUNS if k.startswith("moe")):
        res = results.get(key, {})
        if "moe" not in res:
            continue
        m = res["moe"]
        for layer, (cv, mm) in enumerate(zip(m["cv"], m["max_mean"])):
            ls = ("-", "--")[layer % 2]
            label = f"{RUNS[key][0]}, MoE layer {layer}"
            axes[0].plot(m["steps"], cv, ls, color=f"C{i + 1}", label=label)
            axes[1].plot(m["steps"], mm, ls, color=f"C{i + 1}", label=label)
        axes[2].plot(m["steps"], m["dropped"], color=f"C{i + 1}", label=RUNS[key][0])
    axes[0].set_title("coefficient of variation of tokens per expert\n(0 balanced, 1.73 all on one)")
    axes[1].set_title(f"max / mean of tokens per expert (1 balanced, {EXPERTS} all on one)")
    axes[2].set_title(f"fraction of claims dropped (capacity factor {CAPACITY})")
    for ax in axes:
        ax.set_xlabel(f"step (each point: a window of {LOG_EVERY} steps)")
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- part 2: the layer, plait vs DeepSpeed-MoE vs plain torch -------------------------------------


class _AllToAll(torch.autograd.Function):
    """all_to_all_single along dim 0 (equal splits); backward: the same exchange of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _AllToAll.apply(grad.contiguous(), ctx.group), None


class TorchMoE(nn.Module):
    """A GShard/Switch MoE layer in plain PyTorch, experts split over the default group: one
    routing group of all tokens, first choices before second choices in the buffers, capacity
    ceil(k·cf·S/E), the local experts as a Python loop of F.linear (weights [out, in])."""

    def __init__(self, d: int, f: int, experts: int, top_k: int, cf: float) -> None:
        super().__init__()
        self.e, self.k, self.cf, self.ep = experts, top_k, cf, dist.get_world_size()
        self.local = experts // self.ep
        self.wg = nn.Parameter(torch.empty(experts, d))
        self.w1 = nn.ParameterList(nn.Parameter(torch.empty(f, d)) for _ in range(self.local))
        self.b1 = nn.ParameterList(nn.Parameter(torch.empty(f)) for _ in range(self.local))
        self.w2 = nn.ParameterList(nn.Parameter(torch.empty(d, f)) for _ in range(self.local))
        self.b2 = nn.ParameterList(nn.Parameter(torch.empty(d)) for _ in range(self.local))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        d, e, k = x.shape[-1], self.e, self.k
        xs = x.reshape(-1, d)
        s = xs.shape[0]
        probs = F.linear(xs.float(), self.wg.float()).softmax(-1)
        gate, idx = probs.topk(k, dim=-1)  # [S, k]
        if k == 2:
            gate = gate / gate.sum(-1, keepdim=True)
        claims = F.one_hot(idx.t().reshape(-1), e)  # [k·S, E]: every first choice, then every second
        pos = ((claims.cumsum(0) - 1) * claims).sum(-1)
        c = max(1, math.ceil(k * self.cf * s / e - 1e-9))
        kept = pos < c
        slot = torch.where(kept, idx.t().reshape(-1) * c + pos, e * c)
        buf = xs.new_zeros(e * c + 1, d).index_copy(0, slot, xs.repeat(k, 1))[:-1]
        recv = _AllToAll.apply(buf, None).view(self.ep, self.local, c, d)
        outs = []
        for j in range(self.local):
            h = F.gelu(F.linear(recv[:, j].reshape(-1, d), self.w1[j], self.b1[j]), approximate="tanh")
            outs.append(F.linear(h, self.w2[j], self.b2[j]).view(self.ep, 1, c, d))
        out = _AllToAll.apply(torch.cat(outs, 1).reshape(e * c, d), None)
        out = torch.cat([out, out.new_zeros(1, d)]).index_select(0, slot).view(k, s, d)
        y = (out.float() * (gate.t() * kept.view(k, s)).unsqueeze(-1)).sum(0).to(x.dtype)
        f_e = F.one_hot(idx[:, 0], e).float().mean(0)
        aux = e * (f_e * probs.mean(0)).sum()
        return y.view_as(x), aux, claims.sum(0)


def _copy_weights(pm, ds, tm) -> None:
    """The plait layer's router and experts into the DeepSpeed and torch layers (global expert
    ids: this rank's local expert j is expert rank·E/ep + j in all three)."""
    with torch.no_grad():
        bank = pm.experts
        if tm is not None:
            tm.wg.copy_(pm.router.weight)
            for j in range(bank.local):
                tm.w1[j].copy_(bank.w1[j].t())
                tm.b1[j].copy_(bank.b1[j])
                tm.w2[j].copy_(bank.w2[j].t())
                tm.b2[j].copy_(bank.b2[j])
        if ds is not None:
            ds.deepspeed_moe.gate.wg.weight.copy_(pm.router.weight)
            for j, ex in enumerate(ds.deepspeed_moe.experts.deepspeed_experts):
                ex[0].weight.copy_(bank.w1[j].t())
                ex[0].bias.copy_(bank.b1[j])
                ex[2].weight.copy_(bank.w2[j].t())
                ex[2].bias.copy_(bank.b2[j])


def _set_capacity(layers: dict, cf: float) -> None:
    for key, m in layers.items():
        if key == "plait":
            m.capacity_factor = cf
        elif key == "deepspeed":
            m.deepspeed_moe.gate.capacity_factor = cf
        else:
            m.cf = cf


def _forward(key: str, m, x):
    """(y, aux, claims per expert) of one setup's layer."""
    if key == "plait":
        y, stats = m(x)
        return y, stats.aux_loss, stats.tokens_per_expert
    return m(x)  # DeepSpeed's MoE and TorchMoE both return (y, aux, claims per expert)


def _grads(key: str, m) -> tuple[torch.Tensor, torch.Tensor]:
    """(router weight gradient [E, d], local experts' first-layer weight gradients [E_l, d, f])."""
    if key == "plait":
        return m.router.weight.grad, m.experts.w1.grad
    if key == "deepspeed":
        ex = m.deepspeed_moe.experts.deepspeed_experts
        return m.deepspeed_moe.gate.wg.weight.grad, torch.stack([e[0].weight.grad.t() for e in ex])
    return m.wg.grad, torch.stack([w.grad.t() for w in m.w1])


def _step(key: str, m, x):
    """One measured step: forward + backward from a fresh input that requires grad."""

    def step():
        for p in m.parameters():
            p.grad = None
        xi = x.detach().requires_grad_()
        y, aux, _ = _forward(key, m, xi)
        (y.square().mean() + AUX_WEIGHT * aux).backward()
        return xi.grad

    return step


def _bank_step(key: str, m, buf):
    """Forward + backward of this rank's experts alone, on the buffer the all-to-all delivers."""
    local, n, d = buf.shape

    if key == "plait":
        fn = m.experts
    elif key == "deepspeed":
        experts = m.deepspeed_moe.experts
        fn = lambda b: experts(b.view(local, EP, n // EP, d).transpose(0, 1))  # its [ep, E_l, C, d]
    else:

        def fn(b):
            outs = []
            for j in range(m.local):
                h = F.gelu(F.linear(b[j], m.w1[j], m.b1[j]), approximate="tanh")
                outs.append(F.linear(h, m.w2[j], m.b2[j]))
            return torch.stack(outs)

    def step():
        for p in m.parameters():
            p.grad = None
        bi = buf.detach().requires_grad_()
        fn(bi).square().mean().backward()

    return step


def layer_job(
    top_ks: list[int], d: int, f: int, rows: int, seq: int, steps: int, warmup: int, with_ds: bool
) -> dict:
    """On each of the 2 ranks: the three layers from the same weights, a parity check, then
    interleaved forward + backward steps of the layer and of its expert bank alone."""
    from plait.mesh import Mesh
    from plait.moe import MoE
    from plait.moe.router import expert_capacity

    rank = dist.get_rank()
    ds_error, ds_version = None, None
    if with_ds:
        try:
            import deepspeed
            from deepspeed.moe.layer import MoE as DeepSpeedMoE

            deepspeed.init_distributed(dist_backend="gloo")
            ds_version = deepspeed.__version__
        except Exception as exc:  # reported, and the job carries on without it
            ds_error = f"{type(exc).__name__}: {exc}"
    torch.set_num_threads(1)
    mesh = Mesh(ep=EP, timeout_s=120)
    g = torch.Generator().manual_seed(100 + rank)
    inputs = [torch.randn(rows, seq, d, generator=g) for _ in range(4)]  # this rank's tokens
    out = {"by_k": {}, "ds_error": ds_error, "ds_version": ds_version}
    for k in top_ks:
        torch.manual_seed(0)
        layers = {"plait": MoE(d, f, EXPERTS, top_k=k, capacity_factor=CAPACITY, mesh=mesh)}
        if with_ds and ds_error is None:
            try:
                expert = nn.Sequential(nn.Linear(d, f), nn.GELU(approximate="tanh"), nn.Linear(f, d))
                ds = DeepSpeedMoE(
                    d, expert, num_experts=EXPERTS, ep_size=EP, k=k, capacity_factor=CAPACITY,
                    min_capacity=0, use_rts=False, top2_2nd_expert_sampling=False,
                )  # fmt: skip
                ds.set_deepspeed_parallelism()
                layers["deepspeed"] = ds
            except Exception as exc:
                ds_error = out["ds_error"] = f"{type(exc).__name__}: {exc}"
        layers["torch"] = TorchMoE(d, f, EXPERTS, k, CAPACITY)
        _copy_weights(layers["plait"], layers.get("deepspeed"), layers["torch"])
        keys = list(layers)

        # Parity: nothing dropped, the same input on every setup.
        mesh.ledger.set_step(-1)  # untimed work; timed step i of this k is ledger step base + i
        base = 1000 * k
        _set_capacity(layers, PARITY_CAPACITY)
        ref = {}
        for key in keys:
            m = layers[key]
            for p in m.parameters():
                p.grad = None
            xi = inputs[0].clone().requires_grad_()
            y, aux, claims = _forward(key, m, xi)
            (y.square().mean() + AUX_WEIGHT * aux).backward()
            ref[key] = (y.detach(), xi.grad, float(aux), *_grads(key, m), claims.detach().long().cpu())
        parity = {}
        for key in keys[1:]:
            a, b = ref["plait"], ref[key]
            parity[key] = {
                "output": float((a[0] - b[0]).abs().max()),
                "input_grad": float((a[1] - b[1]).abs().max()),
                "aux": abs(a[2] - b[2]),
                "router_grad": float((a[3] - b[3]).abs().max()),
                "expert_grad": float((a[4] - b[4]).abs().max()),
                "same_loads": bool(torch.equal(a[5], b[5])),
            }
        _set_capacity(layers, CAPACITY)

        # Timing: the whole layer, then the local experts alone.
        s = rows * seq
        c = expert_capacity(s, EXPERTS, k, CAPACITY)
        local = EXPERTS // EP
        buf = torch.randn(local, EP * c, d, generator=g)
        step = {key: [_step(key, layers[key], x) for x in inputs] for key in keys}
        bank = {key: _bank_step(key, layers[key], buf) for key in keys}
        times = {key: [] for key in keys}
        bank_times = {key: [] for key in keys}
        for i in range(warmup + steps):
            order = keys[i % len(keys) :] + keys[: i % len(keys)]
            for key in order:
                mesh.ledger.set_step(base + i if key == "plait" else -1)
                seconds, _ = timed_step(step[key][i % len(inputs)])
                if i >= warmup:
                    times[key].append(seconds)
            for key in order:
                seconds, _ = timed_step(bank[key])
                if i >= warmup:
                    bank_times[key].append(seconds)
        mesh.ledger.set_step(-1)
        with torch.no_grad():
            _, stats = layers["plait"](inputs[0])
            dropped = float(stats.dropped_fraction)
        rows_ = mesh.ledger.rows(base + warmup + steps - 1)
        a2a = rows_.get(("all_to_all", "ep"))
        out["by_k"][k] = {
            "setups": keys,
            "capacity": c,
            "tokens_per_rank": s,
            "parity": parity,
            "times": {key: max_over_ranks(v) for key, v in times.items()},
            "bank_times": {key: max_over_ranks(v) for key, v in bank_times.items()},
            "dropped_fraction": max_over_ranks([dropped])[0],
            "ledger": {
                "all_to_all_count": a2a.count if a2a else 0,
                "all_to_all_payload": a2a.payload_bytes if a2a else 0,
                "other_ops": sorted(f"{op} {axis}" for op, axis in rows_ if op != "all_to_all"),
            },
        }
    dist.barrier()
    mesh.close()
    return out


def _layer_args(args) -> tuple:
    from plait.models import gpt_config

    cfg = gpt_config(MODEL)
    return (args.top_ks, cfg.d_model, cfg.ff_dim, LAYER_ROWS, cfg.seq_len, args.layer_steps, args.warmup)


def layer_worker(args) -> int:
    """--layer-worker: run part 2's job in this python (the DeepSpeed venv's) and write JSON."""
    from plait.testing import run_ranks

    r = run_ranks(
        layer_job, EP, args=(*_layer_args(args), True), timeout=args.timeout, env={"DS_ACCELERATOR": "cpu"}
    )[0]
    args.worker_out.write_text(json.dumps(r))
    return 0


def run_layer(args) -> tuple[dict, str]:
    """Part 2's results and a line saying how DeepSpeed ran (or why not)."""
    from plait.testing import run_ranks

    why = "not run (--no-deepspeed)"
    if not args.no_deepspeed:
        print(f"DeepSpeed venv: {args.deepspeed_venv}", flush=True)
        python, status = ensure_deepspeed(args.deepspeed_venv)
        if python is None:
            why = f"unavailable: {status}"
        else:
            with tempfile.TemporaryDirectory(prefix="plait-moe-ds-") as tmp:
                result = Path(tmp) / "layer.json"
                cmd = [
                    str(python), __file__, "--layer-worker", "--worker-out", str(result),
                    "--layer-steps", str(args.layer_steps), "--warmup", str(args.warmup),
                    "--timeout", str(args.timeout), "--top-ks", *map(str, args.top_ks),
                ]  # fmt: skip
                env = {
                    **os.environ,
                    "DS_ACCELERATOR": "cpu",
                    "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")]),
                }
                r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout + 120)
                if r.returncode == 0 and result.exists():
                    out = json.loads(result.read_text())
                    if out["ds_error"] is None:
                        return out, f"{status}, in its own venv {args.deepspeed_venv}"
                    why = f"failed on CPU/gloo: {out['ds_error']}"
                    return out, why
                errors = [line for line in r.stderr.splitlines() if "Error" in line or "error" in line]
                why = "the DeepSpeed job failed: " + (errors[-1].strip() if errors else last_lines(r.stderr))
    print(f"DeepSpeed: {why}; measuring plait and torch only", flush=True)
    out = run_ranks(layer_job, EP, args=(*_layer_args(args), False), timeout=args.timeout)[0]
    out["ds_error"] = why
    return out, why


def layer_summary(layer: dict) -> dict:
    out = {}
    for k, r in layer["by_k"].items():
        keys = r["setups"]
        med = {key: median_ms(r["times"][key]) for key in keys}
        bank = {key: median_ms(r["bank_times"][key]) for key in keys}
        paired = {
            key: statistics.median(a / b for a, b in zip(r["times"]["plait"], r["times"][key]))
            for key in keys
        }
        out[k] = {"median_ms": med, "bank_ms": bank, "paired": paired}
    return out


# --- report -------------------------------------------------------------------------------------


def _f(x, fmt: str) -> str:
    return "n/a" if x is None or not math.isfinite(x) else format(x, fmt)


TRAIN_HEADERS = [
    "run", "params", "train FLOPs/token", "held-out loss", "- dense", "last train loss (mean 20)",
    "tokens/s", "vs dense", "step ms",
]  # fmt: skip


def train_rows(results: dict, flops: dict) -> list[list[str]]:
    dense = results.get("dense", {})
    rows = []
    for key, (label, _) in RUNS.items():
        if key not in results:
            continue
        r = results[key]
        if "failed" in r:
            rows.append([label, *(["failed"] + [""] * 7)])
            continue
        moe = key.startswith("moe")
        fl = flops["moe_top1"] if moe else flops["dense"]
        params = (
            f"{flops['params_moe'] / 1e6:.2f}M ({flops['active_params_moe'] / 1e6:.2f}M active)"
            if moe
            else f"{flops['params_dense'] / 1e6:.2f}M"
        )
        base = "failed" not in dense and dense and key != "dense"
        rows.append([
            label, params, f"{fl / 1e6:.4f}M", f"{r['val_loss']:.4f}",
            _f(r["val_loss"] - dense["val_loss"], "+.4f") if base else "",
            f"{running_mean(r['loss'], SMOOTH)[-1]:.4f}", f"{r['tokens_per_s']:,.0f}",
            _f(r["tokens_per_s"] / dense["tokens_per_s"], ".3f") if base else "", f"{r['step_ms']:.0f}",
        ])  # fmt: skip
    return rows


BALANCE_HEADERS = [
    "run", "CV of tokens/expert", "max/mean", "CV per layer", "dropped", "aux loss value",
    "last window: CV, max/mean, dropped", "last window tokens/expert (per layer)",
]  # fmt: skip


def balance_rows(results: dict) -> list[list[str]]:
    rows = []
    for key in (k for k in RUNS if k.startswith("moe")):
        r = results.get(key, {})
        if "moe" not in r:
            continue
        b = balance_summary(r)
        rows.append([
            RUNS[key][0], f"{b['cv']:.3f}", f"{b['max_mean']:.2f}",
            " / ".join(f"{v:.3f}" for v in b["cv_per_layer"]), f"{100 * b['dropped']:.1f}%",
            f"{b['aux']:.3f}",
            f"{b['cv_last']:.3f}, {b['max_mean_last']:.2f}, {100 * b['dropped_last']:.1f}%",
            " / ".join(str(x) for x in b["load_last"]),
        ])  # fmt: skip
    return rows


LAYER_HEADERS = ["top-k", "setup", "median ms", "plait/setup", "paired ratio", "experts alone ms", "rest ms"]
LAYER_LABELS = {
    "plait": "plait MoE (stacked bank)",
    "deepspeed": "DeepSpeed-MoE deepspeed.moe.layer.MoE",
    "torch": "plain torch (F.linear loop per expert)",
}


def layer_rows(layer: dict, summary: dict) -> list[list[str]]:
    rows = []
    for k, s in summary.items():
        for key in layer["by_k"][k]["setups"]:
            med, bank = s["median_ms"][key], s["bank_ms"][key]
            rows.append([
                f"top-{k}", LAYER_LABELS[key], f"{med:.1f}",
                "" if key == "plait" else f"{s['median_ms']['plait'] / med:.3f}",
                "" if key == "plait" else f"{s['paired'][key]:.3f}", f"{bank:.1f}", f"{med - bank:.1f}",
            ])  # fmt: skip
    return rows


def peer_of(layer: dict) -> str:
    k0 = next(iter(layer["by_k"].values()))
    return "deepspeed" if "deepspeed" in k0["setups"] else "torch"


def verdict_rows(layer: dict, summary: dict) -> list[list[str]]:
    peer = peer_of(layer)
    rows = []
    for k, s in summary.items():
        ratio = s["median_ms"]["plait"] / s["median_ms"][peer]
        v = "met" if ratio <= 1.0 else f"NOT met ({100 * (ratio - 1):.1f}% slower)"
        rows.append([f"plait / {LAYER_LABELS[peer]} step time <= 1.0, top-{k}, ep 2", f"{ratio:.3f}", v])
    return rows


def layer_checks(layer: dict) -> list[str]:
    out = []
    for k, r in layer["by_k"].items():
        for key, p in r["parity"].items():
            out.append(
                f"top-{k}, capacity factor {PARITY_CAPACITY:g} (nothing dropped), plait vs {key}: "
                f"max |Δ output| {p['output']:.1e}, |Δ input grad| {p['input_grad']:.1e}, "
                f"|Δ router grad| {p['router_grad']:.1e}, |Δ expert grad| {p['expert_grad']:.1e}, "
                f"|Δ aux| {p['aux']:.1e}; tokens per expert equal: {'yes' if p['same_loads'] else 'NO'}"
            )
        led = r["ledger"]
        formula = 4 * EXPERTS * r["capacity"] * 128 * 4
        out.append(
            f"top-{k}: C = ceil({k}·{CAPACITY}·{r['tokens_per_rank']}/{EXPERTS}) = {r['capacity']} slots per "
            f"expert; {100 * r['dropped_fraction']:.1f}% of claims dropped at capacity factor {CAPACITY} on "
            f"the timed inputs; plait's ledger per step: {led['all_to_all_count']} all-to-alls on ep, "
            f"{led['all_to_all_payload']:,} payload bytes (formula 4·E·C·d·4 = {formula:,})"
            + (f"; other ops: {', '.join(led['other_ops'])}" if led["other_ops"] else "; no other collective")
        )
    return out


def markdown(res: dict, info: dict, args, runtime_s: float, images: dict[str, str]) -> str:
    fl = res["flops"]
    results, layer, summary = res["train"], res["layer"], res["layer_summary"]
    out = [
        "# Mixture of experts: MoE GPT vs dense GPT, and plait's MoE layer vs DeepSpeed-MoE",
        "",
        "Written by `benchmarks/moe.py`; every figure below comes from one run of it. See the",
        "script's docstring for the method.",
        "",
        f"- Command: `{res['command']}`",
        *(f"- {k}: {v}" for k, v in info.items()),
        f"- load average at end: {res['load_end']}",
        f"- Runtime: {runtime_s:.0f} s",
        f"- DeepSpeed: {res['deepspeed']}",
        "",
    ]
    if results:
        dense, seed = results.get("dense", {}), results.get("dense-seed1", {})
        out += [
            "## 1. MoE GPT vs dense GPT at equal active FLOPs",
            "",
            f"GPT `{MODEL}` (4 blocks, d_model 128, d_ff 512, 128-byte context) on the embedded pydoc",
            f"corpus, {args.steps} steps of {BATCH} x 128 bytes, one process (2 threads), AdamW lr 3e-3",
            f"(warm-up {max(1, args.steps // 10)} steps, cosine to 3e-4), clipping 1.0. MoE: {EXPERTS}",
            f"experts, top-{TOP_K} in every {MOE_EVERY}nd block (2 MoE layers), capacity factor {CAPACITY}",
            "per sequence"
            + (" (dropless: capacity factor 0, C = the largest load)" if "moe-dropless" in results else "")
            + f", z-loss {Z}. Held-out loss: {args.eval_batches} batches of {BATCH} held-out sequences",
            "(the same for every run).",
            "",
            "**FLOPs** (`plait.models.gpt_train_flops_per_token`, training, per token): dense "
            f"{fl['dense']:,.0f}; MoE top-1 {fl['moe_top1']:,.0f} (+{fl['moe_top1'] / fl['dense'] - 1:.3%}:"
            f" the router); MoE top-2 at the same d_ff {fl['moe_top2']:,.0f} "
            f"(+{fl['moe_top2'] / fl['dense'] - 1:.1%}). Top-1 is compared: top-2 would need every MLP "
            f"(dense blocks and experts alike: `GPTConfig.d_ff` sizes both) at d_ff = "
            f"{fl['top2_equal_d_ff']:.1f}.",
            "",
            markdown_table(TRAIN_HEADERS, train_rows(results, fl)),
            "",
            f"![loss curves]({images['loss']})",
            "",
        ]
        ok = lambda r: bool(r) and "failed" not in r
        if ok(dense) and ok(seed):
            diffs = "; ".join(
                f"{RUNS[k][0]} {r['val_loss'] - dense['val_loss']:+.4f}"
                for k, r in results.items()
                if k.startswith("moe") and ok(r)
            )
            spread = abs(seed["val_loss"] - dense["val_loss"])
            moe = results.get("moe", {})
            if ok(moe):
                diff = moe["val_loss"] - dense["val_loss"]
                verdict = (
                    "lower than the dense GPT's by more than the seed spread"
                    if diff < -spread
                    else "higher than the dense GPT's by more than the seed spread"
                    if diff > spread
                    else "within the seed spread of the dense GPT's"
                )
                out += [
                    f"**In short:** at {args.steps} steps and equal active FLOPs the MoE GPT's held-out loss "
                    f"({moe['val_loss']:.4f}) is {verdict} ({dense['val_loss']:.4f}; {diff:+.4f} against a "
                    f"spread of {spread:.4f} between two dense seeds).",
                    "",
                ]
            out += [
                f"Held-out loss MoE - dense (nats/byte): {diffs}; the two seeds of the dense GPT differ by "
                f"{spread:.4f}. Wall time per run: "
                + ", ".join(f"{RUNS[k][0]} {r['wall_s']:.0f} s" for k, r in results.items() if ok(r))
                + ". The tokens/s above come from runs one after another on a shared machine (the two",
                "dense runs show how far the load moved them); the interleaved measurement below is the",
                "throughput comparison to read.",
                "",
            ]
        tp = res.get("throughput")
        if tp:
            out += [
                "### Throughput, interleaved",
                "",
                f"Training steps (forward, backward, AdamW) of the dense GPT and the MoE GPT (top-{TOP_K}, "
                f"capacity factor {CAPACITY}, aux {AUX}),",
                f"built in this process ({tp['threads']} threads) and stepped alternately on the same "
                f"{BATCH} x 128 corpus batches, {tp['steps']} measured steps each:",
                "",
                markdown_table(
                    ["model", "median step ms", "tokens/s", "MoE / dense time (median of per-step ratios)"],
                    [
                        [
                            "dense GPT",
                            f"{tp['median_ms']['dense']:.1f}",
                            f"{tp['tokens_per_s']['dense']:,.0f}",
                            "",
                        ],
                        [
                            f"MoE top-{TOP_K}",
                            f"{tp['median_ms']['moe']:.1f}",
                            f"{tp['tokens_per_s']['moe']:,.0f}",
                            f"{tp['paired_ratio']:.3f}",
                        ],
                    ],  # fmt: skip
                ),
                "",
            ]
        out += [
            "### Expert load",
            "",
            "Per log window of 10 steps, the claims per expert of each MoE layer (over the window's",
            f"{LOG_EVERY * BATCH * 128:,} tokens); figures averaged over both MoE layers and over the",
            "windows of the second half of training, then the last window. Coefficient of variation:",
            "0 = balanced, 1.73 = all tokens on one expert; max/mean: 1 = balanced, 4 = collapse. The aux",
            "loss value is Switch's E·Σ f_e·P_e (1 = balanced), logged in every run.",
            "",
            markdown_table(BALANCE_HEADERS, balance_rows(results)),
            "",
            f"![expert load balance]({images['balance']})",
            "",
        ]
        for key, name in (("moe", "aux"), ("moe-noaux", "noaux")):
            if f"load_{name}" in images:
                out += [f"plait's `expert_load.png` of the {RUNS[key][0]} run:", ""]
                out += [f"![expert load, {RUNS[key][0]}]({images[f'load_{name}']})", ""]
    out += [
        "## 2. Step time of the MoE layer at ep = 2: plait vs the peer",
        "",
        f"2 gloo ranks on the CPU, 1 thread each; d_model 128, d_ff 512, {EXPERTS} experts (2 per rank),",
        f"{LAYER_ROWS} x 128 tokens per rank as one routing group, capacity factor {CAPACITY}; a step is",
        f"forward + backward of mean(y²) + {AUX_WEIGHT}·aux from an input that requires grad. Medians over",
        f"{args.layer_steps} interleaved steps (after {args.warmup} warm-up), each the maximum over the",
        "ranks.",
        '"experts alone": forward + backward of a rank\'s local experts on the buffer the all-to-all',
        'delivers; "rest" = the layer minus that: router, dispatch, all-to-alls, combine.',
        "",
        markdown_table(LAYER_HEADERS, layer_rows(layer, summary)),
        "",
        "### Verdict",
        "",
        markdown_table(["target", "measured", "verdict"], verdict_rows(layer, summary)),
        "",
        "### Checks",
        "",
        *(f"- {line}" for line in layer_checks(layer)),
        "",
        "### Notes",
        "",
        "- DeepSpeed-MoE's defaults changed for an equal comparison: `min_capacity` 4 -> 0 (C from the",
        "  formula alone, as plait), `use_rts` (random token selection, top-1) and",
        "  `top2_2nd_expert_sampling` (Gumbel noise on the second choice) off, so both route",
        "  deterministically and identically (the parity rows check it). Its experts are an",
        "  `nn.ModuleList` run as a Python loop over the local experts (2 here); plait's are stacked",
        "  parameters whose `baddbmm` calls run, on the CPU, one local expert at a time.",
        "- The timed inputs are random normal vectors and the routers freshly initialised, so the load",
        "  is near uniform and the capacity rarely binds (see the checks); the buffers, and so the",
        "  work, have the same shapes whether tokens are dropped or not.",
        '- "experts alone" times each bank on a fixed buffer in isolation; inside the layer the same',
        '  operations run among the layer\'s other allocations, so "rest" (layer - bank) is an',
        "  estimate of the routing, dispatch, all-to-all and combine cost, not a measurement.",
        "- Timings are indicative: the 2 ranks share the machine's 2 cores with other work. Read the",
        "  ratios (the setups' steps alternate, so all see the same load), not the milliseconds;",
        '  "paired ratio" is the median of the per-step ratios (steps of a round run moments apart).',
        "",
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps of every part-1 run")
    parser.add_argument("--eval-batches", type=int, default=16, help="held-out batches of 16 sequences")
    parser.add_argument("--tp-steps", type=int, default=20, help="interleaved throughput steps per model")
    parser.add_argument("--layer-steps", type=int, default=40, help="measured steps per setup in part 2")
    parser.add_argument("--warmup", type=int, default=5, help="unmeasured steps first in part 2")
    parser.add_argument("--top-ks", type=int, nargs="+", default=[1, 2], help="part 2's top-k values")
    parser.add_argument("--skip-train", action="store_true", help="part 2 only")
    parser.add_argument("--dropless", action="store_true", help="part 1 also trains a dropless MoE GPT")
    parser.add_argument("--no-deepspeed", action="store_true", help="part 2 without DeepSpeed (no install)")
    parser.add_argument("--deepspeed-venv", type=Path, default=DS_VENV, help=f"default {DS_VENV}")
    parser.add_argument("--quick", action="store_true", help="smoke check: 40 steps, 5 layer steps, no file")
    parser.add_argument("--out", type=Path, default=None, help=f"markdown output (default {RESULTS})")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per training run / job")
    parser.add_argument("--layer-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.layer_worker:
        return layer_worker(args)
    if args.quick:
        args.steps, args.layer_steps, args.warmup, args.eval_batches, args.tp_steps = 40, 5, 2, 2, 4
    if args.steps < LOG_EVERY * 4 or args.layer_steps < 1 or args.warmup < 1:
        parser.error(f"--steps must be >= {4 * LOG_EVERY}; --layer-steps and --warmup >= 1")
    if any(k not in (1, 2) for k in args.top_ks):
        parser.error("--top-ks: 1 and/or 2")

    command, info = command_line(), machine_info()
    start = time.perf_counter()
    flops = flop_counts()
    print(
        f"training FLOPs per token: dense {flops['dense']:,.0f}, MoE top-1 {flops['moe_top1']:,.0f} "
        f"(+{flops['moe_top1'] / flops['dense'] - 1:.3%}), MoE top-2 {flops['moe_top2']:,.0f}",
        flush=True,
    )
    out = args.out if args.out is not None else (None if args.quick else RESULTS)
    with tempfile.TemporaryDirectory(prefix="plait-moe-") as tmp:
        results, tp = {}, None
        if not args.skip_train:
            print(f"part 1: training runs of {args.steps} steps", flush=True)
            results = train_all(args, Path(tmp))
            print(f"part 1b: dense vs MoE GPT training steps, interleaved, {args.tp_steps} steps", flush=True)
            tp = throughput(args.tp_steps, 3)
            print(
                f"    tokens/s dense {tp['tokens_per_s']['dense']:,.0f}, "
                f"MoE {tp['tokens_per_s']['moe']:,.0f}; MoE / dense step time {tp['paired_ratio']:.3f}",
                flush=True,
            )
        print(f"part 2: the MoE layer, ep = {EP}, top-k {args.top_ks}", flush=True)
        layer, ds_status = run_layer(args)
        summary = layer_summary(layer)
        images = {}
        if out is not None and results:
            out.parent.mkdir(parents=True, exist_ok=True)
            stem = out.stem
            images = {"loss": f"{stem}_loss.png", "balance": f"{stem}_balance.png"}
            plot_loss(results, out.parent / images["loss"])
            plot_balance(results, out.parent / images["balance"])
            for key, name in (("moe", "aux"), ("moe-noaux", "noaux")):
                src = Path(results.get(key, {}).get("run_dir", "/nonexistent")) / "expert_load.png"
                if src.exists():
                    images[f"load_{name}"] = f"{stem}_expert_load_{name}.png"
                    shutil.copyfile(src, out.parent / images[f"load_{name}"])
    runtime = time.perf_counter() - start
    load_end = ", ".join(f"{x:.2f}" for x in os.getloadavg())

    if results:
        print()
        print(text_table(TRAIN_HEADERS, train_rows(results, flops)))
        print()
        print(text_table(BALANCE_HEADERS, balance_rows(results)))
    print()
    print(text_table(LAYER_HEADERS, layer_rows(layer, summary)))
    print()
    for target, measured, v in verdict_rows(layer, summary):
        print(f"target: {target}: {measured} -> {v}")
    for line in layer_checks(layer):
        print(line)
    print(f"DeepSpeed: {ds_status}")
    print(f"runtime {runtime:.0f} s; load average at end {load_end}")
    res = {
        "command": command,
        **info,
        "runtime_s": runtime,
        "load_end": load_end,
        "deepspeed": ds_status,
        "flops": flops,
        "train": results,
        "throughput": tp,
        "layer": layer,
        "layer_summary": summary,
    }
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(markdown(res, info, args, runtime, images))
        out.with_suffix(".json").write_text(json.dumps(res, indent=1, default=str) + "\n")
        print(f"wrote {out}, {out.with_suffix('.json')} and {', '.join(images.values()) or 'no plots'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How much of the gradient each compressor sends, and how large its error-feedback residual grows.

A diagnostic for docs/compression.md's finding that error feedback does not pay within a
600-step run. One process trains the default GPT (`configs/default.toml`: model, data, seed,
global batch 32 split over 2 simulated data-parallel ranks, SGD with momentum 0.9 at peak lr 0.1,
the config's warm-up, cosine decay to lr/10 and clipping) on the *uncompressed* mean gradient, and
at every step also feeds each rank's gradient to one compressor per method, with its own residual
kept in units of the step (`set_lr_scale`), exactly as `plait train` would. Their output is
measured but not applied, so every compressor sees the same realistic gradient sequence.

Per method and step, over both ranks:

- sent share  delta_t = 1 - |p_t - C(p_t)|^2 / |p_t|^2, p_t = scale_t·g_t + e_t: the fraction of
  the accumulated vector's energy that one message carries (1 = lossless). Error-feedback theory
  (Karimireddy et al. 2019) needs delta > 0 and slows down as delta gets small.
- residual ratio  |e_t| / |scale_t·g_t|: how many steps' worth of gradient is still waiting.

Run from the repository root:  .venv/bin/python benchmarks/compression_residual.py [--steps 300]
Writes benchmarks/results/compression_residual.md and compression_residual.png.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import tomllib
from pathlib import Path

import torch
from _common import command_line, machine_info, markdown_table, text_table
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from plait.comm.compress import OneBitCompressor, TopKCompressor  # noqa: E402
from plait.data.corpus import load_corpus  # noqa: E402
from plait.data.sampler import DistributedBatchSampler  # noqa: E402
from plait.data_parallel import GradBucket  # noqa: E402
from plait.models import GPT, gpt_config  # noqa: E402
from plait.train.loop import lr_factor  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "compression_residual.md"
RANKS = 2
METHODS = {
    "1-bit, groups >= 2048 (plait's default)": lambda: OneBitCompressor(True, min_group=2048),
    "1-bit, per column (min_group = 1, the paper's rule)": lambda: OneBitCompressor(True, min_group=1),
    "top-1%": lambda: TopKCompressor(0.01, True),
}


def _decoded(c, bucket: GradBucket) -> torch.Tensor:
    """One rank's message decoded, in units of the step (scale·gradient)."""
    out = torch.zeros_like(bucket.buffer)
    if isinstance(c, OneBitCompressor):
        bits, scales = c.encode(bucket)
        c.decode_into(out, bits, scales, bucket)
    else:
        idx, values = c.select(bucket)
        out[idx.long()] = values
    return out


def run(steps: int, lr: float) -> dict:
    cfg = tomllib.loads((ROOT / "configs" / "default.toml").read_text())
    t = cfg["train"]
    torch.manual_seed(t["seed"])
    torch.set_num_threads(1)
    corpus = load_corpus(cfg["data"]["corpus"], cfg["data"]["held_out_fraction"])
    model = GPT(gpt_config(cfg["model"]["name"], dropout=cfg["model"]["dropout"]))
    params = list(model.parameters())
    samplers = [
        iter(DistributedBatchSampler(corpus.train, model.cfg.seq_len, t["global_batch"], r, RANKS, t["seed"]))
        for r in range(RANKS)
    ]
    opt = torch.optim.SGD(params, lr=lr, momentum=0.9)
    comps = {name: [make() for _ in range(RANKS)] for name, make in METHODS.items()}
    # the one bucket DataParallel would build for these parameters, per simulated rank
    buckets = [GradBucket(0, params, [n for n, _ in model.named_parameters()]) for _ in range(RANKS)]
    sent = {name: [] for name in METHODS}
    ratio = {name: [] for name in METHODS}
    losses = []
    for step in tqdm(range(steps), desc="steps", file=sys.stderr):
        scale = lr_factor(step, t["warmup_steps"], steps, 0.1)
        for group in opt.param_groups:
            group["lr"] = lr * scale
        grads, loss = [], 0.0
        for r in range(RANKS):
            (x, y), *_ = next(samplers[r])
            model.zero_grad(set_to_none=True)
            rank_loss = model(x, y)
            rank_loss.backward()
            loss += rank_loss.item() / RANKS
            grads.append(torch.cat([p.grad.reshape(-1) for p in params]) / RANKS)
        losses.append(loss)
        for name in METHODS:
            num = den = res = g2 = 0.0
            for r in range(RANKS):
                c, b = comps[name][r], buckets[r]
                c.set_lr_scale(scale)
                b.buffer.copy_(grads[r])
                e = c.residuals.get(0, torch.zeros_like(b.buffer))
                p = b.buffer * scale + e
                out = _decoded(c, b)
                num += float((p - out).square().sum())
                den += float(p.square().sum())
                res += float(c.residuals[0].square().sum())
                g2 += float((b.buffer * scale).square().sum())
            sent[name].append(1.0 - num / den)
            ratio[name].append(math.sqrt(res / g2))
        mean = grads[0] + grads[1]
        offset = 0
        for p in params:
            p.grad = mean[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        torch.nn.utils.clip_grad_norm_(params, t.get("grad_clip", 1.0))
        opt.step()
    return {"sent": sent, "ratio": ratio, "loss": losses}


def summary_rows(res: dict, steps: int) -> list[list[str]]:
    lo = min(50, steps // 2)  # after the warm-up
    rows = []
    for name in METHODS:
        s, r = res["sent"][name][lo:], res["ratio"][name][lo:]
        rows.append(
            [
                name,
                f"{statistics.median(s):.3f}",
                f"{min(s):.3f}-{max(s):.3f}",
                f"{statistics.median(r):.1f}",
                f"{max(r):.1f}",
                f"{res['ratio'][name][-1]:.1f}",
            ]
        )
    return rows


HEADERS = [
    "compressor (with error feedback)",
    "sent share delta (median)",
    "delta range",
    "residual / step (median)",
    "residual / step (max)",
    "residual / step (last step)",
]


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for name in METHODS:
        axes[0].plot(res["sent"][name], label=name, lw=1)
        axes[1].plot(res["ratio"][name], label=name, lw=1)
    axes[0].set(xlabel="step", ylabel="sent share delta", yscale="log", title="share of |p|^2 sent")
    axes[1].set(xlabel="step", ylabel="|residual| / |scale x gradient|", yscale="log", title="residual size")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    parser.add_argument("--lr", type=float, default=0.1, help="peak SGD learning rate (default 0.1)")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"markdown output (default {RESULTS})")
    args = parser.parse_args(argv)
    if args.steps < 2 or not args.lr > 0:
        parser.error("--steps must be >= 2 and --lr > 0")
    command, info = command_line(), machine_info()
    start = time.perf_counter()
    res = run(args.steps, args.lr)
    runtime = time.perf_counter() - start
    rows = summary_rows(res, args.steps)
    print(text_table(HEADERS, rows))
    png = args.out.with_suffix(".png")
    plot(res, png)
    lines = [
        "# Error-feedback residuals of plait's compressors on the default GPT",
        "",
        "Written by `benchmarks/compression_residual.py` (see its docstring for the method): one",
        "process, 2 simulated data-parallel ranks, SGD with momentum 0.9 on the uncompressed gradient,",
        "each compressor fed the same gradients with its residual in units of the step.",
        "",
        f"- Command: `{command}`",
        *[f"- {k}: {v}" for k, v in info.items()],
        f"- Steps: {args.steps}, peak lr {args.lr:g}; statistics over steps "
        f"{min(50, args.steps // 2)}-{args.steps - 1}",
        f"- Runtime: {runtime:.0f} s; final training loss {statistics.mean(res['loss'][-20:]):.4f} "
        "(mean of last 20)",
        "",
        markdown_table(HEADERS, rows),
        "",
        f"![sent share and residual size per step]({png.name})",
        "",
    ]
    args.out.write_text("\n".join(lines))
    print(f"wrote {args.out} and {png}")


if __name__ == "__main__":
    main()

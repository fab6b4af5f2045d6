"""plait ZeRO-3 against Hugging Face Accelerate's FSDP plugin on the same transformers Llama, from
the user's own training loop, 2 processes on the CPU (gloo).

    .venv/bin/python benchmarks/accelerate_peer.py            # -> benchmarks/results/accelerate.md + .png
    .venv/bin/python benchmarks/accelerate_peer.py --steps 10 --out /tmp/acc.md    # a quick look

The model is a tiny `LlamaForCausalLM` built from `LlamaConfig` (no download): 4 layers, d 256,
4 heads, 2 key-value heads (grouped-query attention), d_ff 688, sequence 128, vocabulary the 256
bytes. This script builds it once with a fixed seed and writes its config, its initial weights and
the global batches (random windows of the embedded pydoc corpus, `_common.corpus_batches`) into a
work directory; both sides load them, so they start from the same weights and see the same rows
in the same order, with the same AdamW (lr 1e-3, fp32, no clipping).

* Accelerate: `Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(FULL_SHARD, wrapped per
  LlamaDecoderLayer))`, launched with torchrun from a venv of its own
  (~/.cache/plait-bench/accelerate-venv, `deepspeed_env.ensure_accelerate`: torch==2.13.0 pinned
  by a constraints file, accelerate, and the transformers version plait's venv has), so
  Accelerate never becomes a plait dependency.
* plait: `plait.parallelize(model, AdamW factory, {"zero_stage": 3}, blocks=decoder layers)`,
  launched with `plait launch --nproc 2`.

The loops themselves are in benchmarks/accelerate_loops.py; the report quotes the lines a user
writes for each. Each step is timed from a barrier on every rank and the slowest rank's time
counts; the table gives the median after `--warmup` steps and plait / Accelerate. Both runs use
the same threads per rank (`--threads`, default: the cores / 2). The figures come from one run
on whatever machine this is: the load average is written beside them.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from _common import command_line, corpus_batches, machine_info, markdown_table, median_ms  # noqa: E402
from deepspeed_env import ACCELERATE_VENV, ensure_accelerate, last_lines  # noqa: E402

RESULTS = HERE / "results" / "accelerate.md"
LOOPS = HERE / "accelerate_loops.py"
LLAMA = dict(
    vocab_size=256,
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)
SIDES = {
    "accelerate": "Accelerate FSDP2 (full shard, per decoder layer)",
    "plait": "plait ZeRO-3 (parallelize)",
}


def prepare(work: Path, args) -> int:
    """Config, initial weights, global batches and settings into `work`; returns the parameters."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(LLAMA, max_position_embeddings=args.seq)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    (work / "config.json").write_text(json.dumps(cfg))
    torch.save(model.state_dict(), work / "init.pt")
    torch.save(corpus_batches(args.rows, args.seq, args.steps, seed=args.seed), work / "batches.pt")
    (work / "settings.json").write_text(json.dumps({"lr": args.lr}))
    return sum(p.numel() for p in model.parameters())


def launch(side: str, python: Path, work: Path, args) -> dict:
    """Run one side's loop on 2 ranks; its rank 0's results, or {"error": why}."""
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(ROOT)}
    if side == "accelerate":
        cmd = [str(python), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        env.pop("PYTHONPATH")  # the Accelerate venv runs without plait
    else:
        cmd = [str(python), "-m", "plait.cli", "launch", "--nproc", "2"]
    cmd += [str(LOOPS), side, str(work)]
    (work / f"{side}.json").unlink(missing_ok=True)
    print(f"  {SIDES[side]}: {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout, cwd=ROOT)
    print(f"    ... exit {r.returncode} in {time.perf_counter() - t0:.0f} s", flush=True)
    out = work / f"{side}.json"
    if r.returncode != 0 or not out.exists():
        (work / f"{side}.log").write_text(r.stdout + r.stderr)
        return {"error": f"exit {r.returncode}: {last_lines(r.stderr or r.stdout, 3)}"}
    return json.loads(out.read_text())


def user_code(side: str) -> str:
    """The lines between the `user code` markers of the side's loop, dedented."""
    text = LOOPS.read_text()
    m = re.search(rf"# --- user code: {side} ---\n(.*?)\n\s*# --- end ---", text, re.S)
    lines = m.group(1).splitlines()
    indent = min(len(x) - len(x.lstrip()) for x in lines if x.strip())
    return "\n".join(x[indent:] for x in lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for side, style in (("accelerate", "-"), ("plait", "--")):
        r = results.get(side, {})
        if "losses" in r:
            ax.plot(range(1, len(r["losses"]) + 1), r["losses"], style, label=SIDES[side])
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats per byte)")
    ax.set_title("tiny Llama, 2 CPU processes: same init, data and AdamW")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(results: dict, info: dict, args, n_params: int, status: str, png: str, load_end: str) -> str:
    ok = {k: r for k, r in results.items() if "times" in r}
    rows = []
    for side in SIDES:
        r = results.get(side, {})
        if "error" in r:
            rows.append([SIDES[side], "failed", "-", "-", "-", r["error"]])
            continue
        t = r["times"][args.warmup :]
        ms = [f"{median_ms(t):.1f}", f"{min(t) * 1e3:.1f}", f"{max(t) * 1e3:.1f}"]
        rows.append([SIDES[side], *ms, f"{len(t)}", r.get("what", "")])
    ratio = "-"
    if len(ok) == 2:
        med = {k: median_ms(r["times"][args.warmup :]) for k, r in ok.items()}
        ratio = f"{med['plait'] / med['accelerate']:.2f}"
    llama = ", ".join(f"{k}={v}" for k, v in LLAMA.items())
    out = [
        "# plait ZeRO-3 vs Hugging Face Accelerate FSDP: the same tiny Llama, your own loop",
        "",
        f"Produced by `{command_line()}` (the loops: benchmarks/accelerate_loops.py).",
        "",
        f"Model: transformers `LlamaForCausalLM` from `LlamaConfig({llama})`, "
        f"{n_params / 1e6:.2f}M parameters, built once (seed {args.seed}) and loaded by both sides. Data: "
        f"{args.steps} global batches of {args.rows} x {args.seq} bytes of the pydoc corpus, each rank its "
        f"half, the same order on both sides. AdamW lr {args.lr}, fp32, no clipping. 2 processes, gloo, "
        f"{args.threads} thread(s) per process. Peer environment: {status}.",
        "",
        f"## Step time (median over steps {args.warmup + 1}..{args.steps}, the slowest rank's; one run)",
        "",
        markdown_table(["", "median ms/step", "min", "max", "steps", "what ran (rank 0)"], rows),
        "",
        f"**plait / Accelerate = {ratio}** (target <= 1.0; below 1 plait is faster).",
        "",
        f"Machine: {', '.join(f'{k} {v}' for k, v in info.items())}; load average at the end {load_end}.",
        "",
        "## Loss curves",
        "",
        f"![loss curves]({png})",
        "",
    ]
    if len(ok) == 2:
        a, p = ok["accelerate"]["losses"], ok["plait"]["losses"]
        diff = [abs(x - y) for x, y in zip(a, p)]
        worst = max(range(len(diff)), key=diff.__getitem__)
        out += [
            f"Largest difference between the two curves: {diff[worst]:.2e} at step {worst + 1} "
            f"(loss {a[worst]:.4f}); first step {a[0]:.6f} vs {p[0]:.6f}, last {a[-1]:.4f} vs {p[-1]:.4f}.",
            "",
        ]
        every = max(1, len(a) // 10)
        steps = sorted(set(list(range(0, len(a), every)) + [len(a) - 1]))
        out += [
            markdown_table(
                ["step", "Accelerate loss", "plait loss", "|difference|"],
                [[str(i + 1), f"{a[i]:.5f}", f"{p[i]:.5f}", f"{diff[i]:.1e}"] for i in steps],
            ),
            "",
        ]
    cells = "".join(f"<td><pre>{html.escape(user_code(side))}</pre></td>" for side in ("accelerate", "plait"))
    out += [
        "## The code a user writes",
        "",
        "Between model/data construction (shared) and the end of training, as run here:",
        "",
        f"<table><tr><th>Accelerate ({len(user_code('accelerate').splitlines())} lines)</th>"
        f"<th>plait ({len(user_code('plait').splitlines())} lines)</th></tr><tr>{cells}</tr></table>",
        "",
        "Launch: `torchrun --nproc-per-node 2 loop.py` (or `accelerate launch`) for Accelerate, "
        "`plait launch --nproc 2 loop.py` (or torchrun) for plait.",
        "",
        "## Notes",
        "",
        "- Accelerate on the CPU: `Accelerator(cpu=True, fsdp_plugin=...)` ignores the plugin and "
        "trains with DDP (its FSDP switch is only in the branch for accelerator devices), so the loop sets "
        "`accelerator.state.distributed_type = DistributedType.FSDP` by hand; the 'what ran' column "
        "checks that the prepared model is sharded by `fully_shard` (Accelerate's units: each decoder "
        "layer, the embeddings, the final norm, the head and the root; plait's: each decoder layer and "
        "the rest as one unit). FSDP version 1 (Accelerate's default) then refuses the CPU inside torch "
        "(`Inconsistent compute device and device_id: cpu vs cpu:0`), so Accelerate runs with "
        "`fsdp_version=2` (torch's `fully_shard`, `reshard_after_forward=True`: full sharding, ZeRO-3).",
        "- The times include the forward, backward and optimizer step of each rank's rows and the "
        "global mean loss (one scalar all-reduce on both sides). Each step is timed from a barrier, and "
        "the slowest rank's time counts.",
        "- One run on a shared machine, the two sides one after the other (Accelerate first): the load "
        "average above is other work on the same cores, which moves both sides' figures; read the "
        "ratio with it. Neither side was profiled.",
        "",
    ]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rows", type=int, default=8, help="global batch (sequences), split over 2 ranks")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--venv", type=Path, default=ACCELERATE_VENV)
    ap.add_argument("--work", type=Path, default=None, help="work directory (default: a temporary one)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    import transformers

    info = machine_info()
    print(f"Accelerate venv: {args.venv}", flush=True)
    python, status = ensure_accelerate(transformers.__version__, args.venv)
    print(f"  {status}", flush=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="plait-accelerate-"))
    work.mkdir(parents=True, exist_ok=True)
    n_params = prepare(work, args)
    results = {}
    if python is None:
        results["accelerate"] = {"error": f"no Accelerate: {status}"}
    else:
        results["accelerate"] = launch("accelerate", python, work, args)
    results["plait"] = launch("plait", Path(sys.executable), work, args)
    (work / "results.json").write_text(json.dumps(results))
    load_end = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    png = args.out.with_name(args.out.stem + "_loss.png")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    plot(results, png)
    text = markdown(results, info, args, n_params, status, png.name, load_end)
    args.out.write_text(text)
    print(text)
    print(f"wrote {args.out} and {png} (work directory {work})")


if __name__ == "__main__":
    main()

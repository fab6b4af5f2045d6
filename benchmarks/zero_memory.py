"""Model-state memory per rank of every ZeRO stage, measured vs the paper's formulas.

    .venv/bin/python benchmarks/zero_memory.py [--model small] [--worlds 2 4]

For each world size, stage (0-3) and precision (fp32; bf16 mixed precision for stages 1-3) it
wraps plait's GPT with `plait.zero.wrap`, runs one AdamW step and reads `engine.memory()`:
bytes of parameters, gradients and optimizer state held by rank 0, counted from tensor storage.
Beside it: ZeRO's accounting (`model_state_bytes_formula`: (p + g + K)Ψ at stage 0, 4Ψ + KΨ/N
at stage 1 in the paper's mixed precision, ...) and `plait estimate`. Writes
benchmarks/results/zero_memory.md.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from plait.testing import run_ranks  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "zero_memory.md"


def _measure(model_name: str, world: int) -> list[dict]:
    from plait.mesh import Mesh
    from plait.models import GPT, gpt_config
    from plait.optim import param_groups
    from plait.zero import wrap

    torch.set_num_threads(1)
    mesh = Mesh(dp=world, timeout_s=300)
    cfg = gpt_config(model_name)
    rows = []
    for stage in (0, 1, 2, 3):
        for precision in ("fp32", "bf16"):
            if stage == 0 and precision == "bf16":
                continue  # stage 0 keeps fp32 parameters (bf16 there is autocast only)
            torch.manual_seed(0)
            model = GPT(cfg)
            psi = sum(p.numel() for p in model.parameters())
            engine = wrap(
                model,
                mesh,
                stage,
                lambda g: torch.optim.AdamW(g, lr=1e-3),
                param_groups=param_groups(model, 0.1),
                mixed_precision=None if precision == "fp32" else precision,
            )
            x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
            engine.module(x, x).backward()
            engine.step()
            engine.zero_grad()
            rows.append({"stage": stage, "precision": precision, "psi": psi, **engine.memory()})
            engine.close()
    mesh.close()
    return rows


def main() -> None:
    from plait.zero import estimate_memory, model_state_bytes_formula

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small")
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    args = ap.parse_args()
    lines = [
        "# ZeRO model-state memory per rank: measured vs formula",
        "",
        f"`{' '.join(['.venv/bin/python', 'benchmarks/zero_memory.py', *sys.argv[1:]])}` on "
        f"{datetime.date.today()}, torch {torch.__version__}, GPT `{args.model}`, AdamW.",
        "",
        "Measured: bytes held by rank 0 after a step, counted from tensor storage (`engine.memory()`).",
        "Formula: ZeRO's accounting with p, g bytes per parameter and K bytes of optimizer state per",
        "parameter: fp32 p=4, g=4, K=8 (Adam's m and v; the parameters are the master copy);",
        "bf16 p=2, g=2, K=12 (fp32 master + m + v). Estimate: `plait estimate`'s total.",
        "",
        "| N | stage | precision | params MB (formula) | grads MB (formula) | optimizer MB (formula) "
        "| total MB | formula MB | estimate MB | measured/formula |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    worst = 0.0
    for world in args.worlds:
        rows = run_ranks(_measure, world, (args.model, world), timeout=900)[0]
        for r in rows:
            pb, gb, k = (4, 4, 8) if r["precision"] == "fp32" else (2, 2, 12)
            f = model_state_bytes_formula(
                r["psi"], world, r["stage"], param_bytes=pb, grad_bytes=gb, optimizer_k=k
            )
            est = estimate_memory(
                params=r["psi"], dp=world, zero_stage=r["stage"], optimizer="adamw", precision=r["precision"]
            )["model_state_bytes"]["total"]
            ratio = r["total"] / f["total"]
            worst = max(worst, abs(ratio - 1))
            mb = 1e6
            cells = " | ".join(f"{r[k] / mb:.3f} ({f[k] / mb:.3f})" for k in ("params", "grads", "optimizer"))
            lines.append(
                f"| {world} | {r['stage']} | {r['precision']} | {cells} | {r['total'] / mb:.3f} "
                f"| {f['total'] / mb:.3f} | {est / mb:.3f} | {ratio:.4f} |"
            )
    lines += ["", f"Largest deviation of a measured total from its formula: {worst:.2%}.", ""]
    text = "\n".join(lines)
    print(text)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(text)


if __name__ == "__main__":
    main()

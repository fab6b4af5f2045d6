"""Per-step bytes of the default GPT's gradient exchange at ZeRO stages 0 and 2, per compressor.

Runs `plait train configs/default.toml` for 3 steps per row (2 gloo ranks on the CPU) and reads
rank 0's `comm_bytes` (bus bytes sent) and `comm_uncompressed_bytes` at the last step. At stage 2
the total includes ZeRO's parameter all-gather, which is the same in every row: the gradient
part is the total minus the uncompressed row's all-gather (half its total, since an fp32
reduce-scatter and the parameter all-gather move the same bytes).

Run from the repository root:  .venv/bin/python benchmarks/compression_zero_bytes.py
Writes benchmarks/results/compression_zero_bytes.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import command_line, machine_info, markdown_table

ROOT = Path(__file__).resolve().parent.parent
OUT = Path(__file__).resolve().parent / "results" / "compression_zero_bytes.md"
COMPRESSIONS = ("none", "fp16", "onebit", "topk", "powersgd")


def last_bytes(run: Path, stage: int, compression: str) -> tuple[float, float]:
    cmd = [
        *(sys.executable, "-m", "plait.cli", "train", "configs/default.toml"),
        *("--train.steps", "3", "--train.log_every", "1", "--train.eval_every", "0"),
        *("--train.progress", "false", "--train.sample_tokens", "0", "--train.checkpoint_every", "0"),
        *(
            "--parallel.zero_stage",
            str(stage),
            "--comm.compression",
            compression,
            "--train.run_dir",
            str(run),
        ),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr}")
    with open(run / "metrics.jsonl") as fh:
        last = [json.loads(line) for line in fh][-1]
    return last["comm_bytes"], last["comm_uncompressed_bytes"]


def main() -> int:
    sent = {}
    with tempfile.TemporaryDirectory(prefix="plait-zero-bytes-") as tmp:
        for stage in (0, 2):
            for c in COMPRESSIONS:
                sent[stage, c] = last_bytes(Path(tmp) / f"s{stage}-{c}", stage, c)[0]
                print(f"stage {stage} {c:9s} sent {sent[stage, c] / 1e3:10,.1f} kB/step", flush=True)
    gather = sent[2, "none"] / 2  # ZeRO-2's parameter all-gather, in every stage-2 row
    rows = []
    for c in COMPRESSIONS:
        grad2 = sent[2, c] - gather
        rows.append(
            [
                c,
                f"{sent[0, c] / 1e3:,.1f}",
                f"{sent[0, 'none'] / sent[0, c]:.1f}x",
                f"{sent[2, c] / 1e3:,.1f}",
                f"{grad2 / 1e3:,.1f}",
                f"{(sent[2, 'none'] - gather) / grad2:.1f}x",
            ]
        )
    headers = [
        "compression",
        "stage 0: sent kB/step",
        "vs fp32 all-reduce",
        "stage 2: sent kB/step (all)",
        "stage 2: gradient kB/step",
        "vs fp32 reduce-scatter",
    ]
    text = "\n".join(
        [
            "# Gradient bytes per step under DataParallel and ZeRO-2",
            "",
            "Written by `benchmarks/compression_zero_bytes.py` (see its docstring).",
            "",
            f"- Command: `{command_line()}`",
            *(f"- {k}: {v}" for k, v in machine_info().items()),
            f"- ZeRO-2's parameter all-gather, subtracted from the stage-2 totals: {gather / 1e3:,.1f} kB",
            "",
            markdown_table(headers, rows),
            "",
        ]
    )
    OUT.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

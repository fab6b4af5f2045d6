"""A venv of its own for DeepSpeed, so that benchmarks can compare with it without plait depending on it.

`ensure_deepspeed()` creates ~/.cache/plait-bench/deepspeed-venv (once; later calls reuse it while
`import deepspeed` still works there), installs torch==2.13.0 first (the machine's local CPU
wheel; any other version would pull a multi-GB CUDA build) and then `DS_BUILD_OPS=0 pip install
deepspeed` under a constraints file that pins torch, so pip cannot swap it. DS_BUILD_OPS=0 builds
none of DeepSpeed's C++/CUDA ops at install time: benchmarks pass torch optimizers as DeepSpeed's
client optimizer, and the few ops DeepSpeed's CPU accelerator compiles at run time (a shared-memory
all-reduce for inference) are built by torch's JIT extension loader on first use, then cached.
Progress goes to the terminal, pip's output to a log file beside the venv.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

TORCH_PIN = "torch==2.13.0"
DS_VENV = Path.home() / ".cache" / "plait-bench" / "deepspeed-venv"


def last_lines(text: str, n: int = 1) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return " / ".join(lines[-n:]) if lines else "no output"


def ensure_deepspeed(venv: Path) -> tuple[Path | None, str]:
    """(python of a venv where `import deepspeed` works with torch 2.13.0, its version) or (None, why)."""
    python = venv / "bin" / "python"
    marker = venv / ".plait-bench-ok"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "DS_BUILD_OPS": "0"}
    check = "import json, torch, deepspeed; print(json.dumps([torch.__version__, deepspeed.__version__]))"

    def probe() -> tuple[bool, str]:
        r = subprocess.run([str(python), "-c", check], capture_output=True, text=True, env=env)
        if r.returncode != 0:
            return False, f"import deepspeed failed: {last_lines(r.stderr)}"
        torch_v, ds_v = json.loads(r.stdout.strip().splitlines()[-1])
        if not torch_v.startswith(TORCH_PIN.split("==")[1]):
            return False, f"the DeepSpeed venv has torch {torch_v}, not {TORCH_PIN}"
        return True, f"deepspeed {ds_v}, torch {torch_v}"

    if marker.exists() and python.exists():
        ok, what = probe()
        if ok:
            return python, what
        print(f"DeepSpeed venv at {venv} no longer works ({what}); reinstalling", flush=True)
    log = venv.parent / "deepspeed-install.log"
    constraints = venv.parent / "deepspeed-constraints.txt"
    try:
        venv.parent.mkdir(parents=True, exist_ok=True)
        constraints.write_text(TORCH_PIN + "\n")
        fh = open(log, "w")
    except OSError as exc:
        return None, f"cannot write under {venv.parent}: {exc.strerror}"
    steps = [
        ("create the venv", [sys.executable, "-m", "venv", "--clear", str(venv)]),
        (f"install {TORCH_PIN}", [str(python), "-m", "pip", "install", "-c", str(constraints), TORCH_PIN]),
        ("DS_BUILD_OPS=0 pip install deepspeed",
         [str(python), "-m", "pip", "install", "-c", str(constraints), "deepspeed"]),
    ]  # fmt: skip
    with fh:
        for i, (what, cmd) in enumerate(steps, 1):
            print(f"  DeepSpeed install [{i}/{len(steps)}] {what} (log: {log})", flush=True)
            t0 = time.perf_counter()
            fh.write(f"$ {' '.join(cmd)}\n")
            fh.flush()
            r = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
            print(f"    ... {'done' if r.returncode == 0 else 'FAILED'} in {time.perf_counter() - t0:.0f} s")
            if r.returncode != 0:
                return None, f"{what} failed (exit {r.returncode}): {last_lines(log.read_text(), 1)}"
    ok, what = probe()
    if not ok:
        return None, what
    marker.write_text(what + "\n")
    return python, what

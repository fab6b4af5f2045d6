"""Venvs of their own for peer libraries (DeepSpeed, Hugging Face Accelerate), so that benchmarks can
compare with them without plait depending on them.

`ensure_venv(venv, packages, check)` creates the venv (once; later calls reuse it while `check`
still imports there), installs torch==2.13.0 first (the machine's local CPU wheel; any other
version would pull a multi-GB CUDA build) and then the packages under a constraints file that pins
torch, so pip cannot swap it. Progress goes to the terminal, pip's output to a log file beside the
venv.

`ensure_deepspeed()` is `DS_BUILD_OPS=0 pip install deepspeed` into
~/.cache/plait-bench/deepspeed-venv. DS_BUILD_OPS=0 builds none of DeepSpeed's C++/CUDA ops at
install time: benchmarks pass torch optimizers as DeepSpeed's client optimizer, and the few ops
DeepSpeed's CPU accelerator compiles at run time (a shared-memory all-reduce for inference) are
built by torch's JIT extension loader on first use, then cached. `ensure_accelerate()` installs
accelerate and transformers into ~/.cache/plait-bench/accelerate-venv.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

TORCH_PIN = "torch==2.13.0"
BENCH_CACHE = Path.home() / ".cache" / "plait-bench"
DS_VENV = BENCH_CACHE / "deepspeed-venv"
ACCELERATE_VENV = BENCH_CACHE / "accelerate-venv"


def last_lines(text: str, n: int = 1) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return " / ".join(lines[-n:]) if lines else "no output"


def ensure_venv(
    venv: Path,
    name: str,
    packages: list[str],
    modules: list[str],
    env: dict | None = None,
    pins: dict[str, str] | None = None,
) -> tuple[Path | None, str]:
    """(python of `venv` where `import` of each of `modules` works with torch 2.13.0, a line of
    their versions) or (None, why). `packages` are pip-installed after the pinned torch; `pins`
    ({module: version}) must match too. A venv whose torch is right but whose packages are not
    only gets the packages (re)installed."""
    python = venv / "bin" / "python"
    marker = venv / ".plait-bench-ok"
    env = {**os.environ, **(env or {})}
    imports = ", ".join(["json", "torch", *modules])
    versions = ", ".join(["torch.__version__", *(f"{m}.__version__" for m in modules)])
    check = f"import {imports}; print(json.dumps([{versions}]))"

    def probe() -> tuple[bool, str]:
        # from the venv's parent: a `python -c` imports from its working directory first
        r = subprocess.run(
            [str(python), "-c", check], capture_output=True, text=True, env=env, cwd=venv.parent
        )
        if r.returncode != 0:
            return False, f"import {', '.join(modules)} failed: {last_lines(r.stderr)}"
        torch_v, *others = json.loads(r.stdout.strip().splitlines()[-1])
        if not torch_v.startswith(TORCH_PIN.split("==")[1]):
            return False, f"the {name} venv has torch {torch_v}, not {TORCH_PIN}"
        for module, version in (pins or {}).items():
            if others[modules.index(module)] != version:
                return False, f"the {name} venv has {module} {others[modules.index(module)]}, not {version}"
        return True, ", ".join(f"{m} {v}" for m, v in zip([*modules, "torch"], [*others, torch_v]))

    if python.exists():
        ok, what = probe()
        if ok and marker.exists():
            return python, what
        print(f"{name} venv at {venv}: {what if not ok else 'unfinished install'}; installing", flush=True)
    log = venv.parent / f"{venv.name.removesuffix('-venv')}-install.log"
    constraints = venv.parent / f"{venv.name.removesuffix('-venv')}-constraints.txt"
    try:
        venv.parent.mkdir(parents=True, exist_ok=True)
        constraints.write_text(TORCH_PIN + "\n")
        fh = open(log, "w")
    except OSError as exc:
        return None, f"cannot write under {venv.parent}: {exc.strerror}"
    pip = [str(python), "-m", "pip", "install", "-c", str(constraints)]
    steps = [
        ("create the venv", [sys.executable, "-m", "venv", "--clear", str(venv)]),
        (f"install {TORCH_PIN}", [*pip, TORCH_PIN]),
        (f"pip install {' '.join(packages)}", [*pip, *packages]),
    ]
    if _has_pinned_torch(python):  # keep the venv and its torch; (re)install the packages only
        steps = steps[2:]
    with fh:
        for i, (what, cmd) in enumerate(steps, 1):
            print(f"  {name} install [{i}/{len(steps)}] {what} (log: {log})", flush=True)
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


def _has_pinned_torch(python: Path) -> bool:
    if not python.exists():
        return False
    r = subprocess.run(
        [str(python), "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True
    )
    return r.returncode == 0 and r.stdout.strip().startswith(TORCH_PIN.split("==")[1])


def ensure_deepspeed(venv: Path = DS_VENV) -> tuple[Path | None, str]:
    """(python of a venv where `import deepspeed` works with torch 2.13.0, its version) or (None, why)."""
    env = {"DS_ACCELERATOR": "cpu", "DS_BUILD_OPS": "0"}
    return ensure_venv(venv, "DeepSpeed", ["deepspeed"], ["deepspeed"], env)


def ensure_accelerate(transformers_version: str, venv: Path = ACCELERATE_VENV) -> tuple[Path | None, str]:
    """(python of a venv with Hugging Face accelerate and transformers `transformers_version` (the
    one plait's side runs, so both build the same model) on torch 2.13.0, versions) or (None, why)."""
    return ensure_venv(
        venv,
        "Accelerate",
        ["accelerate", f"transformers=={transformers_version}"],
        ["accelerate", "transformers"],
        pins={"transformers": transformers_version},
    )

"""Peak FLOP/s per rank, the denominator of MFU (Narayanan et al. 2021, model FLOPs utilisation).

On a GPU the datasheet's dense peak for the compute dtype is used. On a CPU there is no
datasheet figure that means anything for PyTorch, so plait measures one: the best of a few
large fp32 (or bf16) matrix multiplications with the number of threads each rank gets, cached
in ~/.cache/plait/peak.json (keyed by CPU model, thread count, dtype and torch version) so the
measurement runs once per machine.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

# Dense tensor-core peaks in TFLOP/s from the vendors' datasheets (SXM parts; no sparsity).
GPU_PEAK_TFLOPS = {
    "H200": {"bf16": 989.0, "fp32": 67.0},
    "H100": {"bf16": 989.0, "fp32": 67.0},
    "A100": {"bf16": 312.0, "fp32": 19.5},
    "L40S": {"bf16": 362.0, "fp32": 91.6},
    "L4": {"bf16": 121.0, "fp32": 30.3},
    "A10": {"bf16": 125.0, "fp32": 31.2},
    "V100": {"bf16": 125.0, "fp32": 15.7},
}


def _cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "plait" / "peak.json"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure_peak_flops(
    threads: int, dtype: torch.dtype = torch.float32, n: int = 1024, device: torch.device | str = "cpu"
) -> float:
    """Best FLOP/s of an n x n x n matmul with `threads` CPU threads (the loop runs about a second)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    try:
        gen = torch.Generator(device=device).manual_seed(0)  # never touch the training RNG streams
        a = torch.randn(n, n, dtype=dtype, device=device, generator=gen)
        b = torch.randn(n, n, dtype=dtype, device=device, generator=gen)
        torch.mm(a, b)  # warm-up
        sync()
        best = float("inf")
        deadline = time.perf_counter() + 1.0
        reps = 0
        while reps < 3 or (time.perf_counter() < deadline and reps < 50):
            t0 = time.perf_counter()
            torch.mm(a, b)
            sync()
            best = min(best, time.perf_counter() - t0)
            reps += 1
        return 2.0 * n**3 / best
    finally:
        torch.set_num_threads(previous)


def cpu_peak_flops(threads: int, dtype: torch.dtype = torch.float32) -> float:
    """The cached CPU peak for `threads` threads, measured on first use."""
    key = f"{_cpu_model()}|threads={threads}|{dtype}|torch={torch.__version__}"
    path = _cache_path()
    cache = {}
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    if key in cache:
        return float(cache[key])
    value = measure_peak_flops(threads, dtype)
    cache[key] = value
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass  # an unwritable cache only costs a re-measurement
    return value


def gpu_peak_flops(device: torch.device, bf16: bool) -> float | None:
    """Datasheet peak of the named GPU, or None when the model is not in the table."""
    name = torch.cuda.get_device_name(device)
    for key, peaks in GPU_PEAK_TFLOPS.items():
        if key in name:
            return peaks["bf16" if bf16 else "fp32"] * 1e12
    return None


def peak_flops_per_rank(
    device: torch.device, bf16: bool, threads: int, override_tflops: float = 0.0
) -> float:
    if override_tflops > 0:
        return override_tflops * 1e12
    if device.type == "cuda":
        peak = gpu_peak_flops(device, bf16)
        if peak is not None:
            return peak
        return measure_peak_flops(threads, torch.bfloat16 if bf16 else torch.float32, n=8192, device=device)
    return cpu_peak_flops(threads, torch.bfloat16 if bf16 else torch.float32)

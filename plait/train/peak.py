"""Peak FLOP/s per rank, the denominator of MFU (Narayanan et al. 2021, model FLOPs utilisation).

On a GPU the datasheet's dense peak for the compute dtype is used. On a CPU there is no
datasheet figure that means anything for PyTorch, so plait measures one: the best of a few
large fp32 (or bf16) matrix multiplications with the number of threads each rank gets, cached
in ~/.cache/plait/peak.json (keyed by CPU model, thread count, dtype and torch version) so the
measurement runs once per machine. A measurement on a busy machine comes out low, so the cache
never lets it stand: a key keeps the best figure ever measured, the peak for n threads is never
below the one for fewer, and a run that goes faster than the cached peak raises it to what it
achieved (MFU is never above 100%) and has it measured again at the next start.
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


REMEASURE = "remeasure"  # in the cache: the keys a run found too low, measured again at the next start


def _key(threads: int, dtype: torch.dtype) -> str:
    return f"{_cpu_model()}|threads={threads}|{dtype}|torch={torch.__version__}"


def _load() -> dict:
    try:
        cache = json.loads(_cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return cache if isinstance(cache, dict) else {}


def _record(key: str, value: float, remeasure: bool) -> dict:
    """Merge one figure into the cache (re-read first: another process may have written it):
    a key keeps the highest figure ever found for it. `remeasure` marks it to be measured again
    at the next start (a run went faster than it); a measurement clears the mark."""
    cache = _load()
    old = cache.get(key)
    cache[key] = max(value, float(old)) if isinstance(old, int | float) else value
    marks = cache.get(REMEASURE) if isinstance(cache.get(REMEASURE), list) else []
    marks = [k for k in marks if k != key]
    cache[REMEASURE] = [*marks, key] if remeasure else marks
    path = _cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass  # an unwritable cache only costs a re-measurement
    return cache


def _best_up_to(cache: dict, threads: int, dtype: torch.dtype) -> float:
    """The cached peak for `threads` threads: never below the one for fewer threads (more threads
    never make a matmul slower at best; a lower figure was measured on a busy machine)."""
    values = [cache.get(_key(t, dtype)) for t in range(1, threads + 1)]
    return max(float(v) for v in values if isinstance(v, int | float))


def cpu_peak_flops(threads: int, dtype: torch.dtype = torch.float32) -> float:
    """The cached CPU peak for `threads` threads, measured on first use and again after a run
    found it too low (`raise_cpu_peak`); the cache keeps the best figure of all measurements."""
    key = _key(threads, dtype)
    cache = _load()
    marks = cache.get(REMEASURE, [])
    if not isinstance(cache.get(key), int | float) or (isinstance(marks, list) and key in marks):
        cache = _record(key, measure_peak_flops(threads, dtype), remeasure=False)
    return _best_up_to(cache, threads, dtype)


def raise_cpu_peak(threads: int, dtype: torch.dtype, achieved: float, write: bool = True) -> float:
    """A run did `achieved` FLOP/s per rank, more than the cached peak: the peak is at least that
    (so MFU stays <= 100%). `write`: record it in the cache, marked for a new measurement at the
    next start. Returns the new peak."""
    if write:
        _record(_key(threads, dtype), achieved, remeasure=True)
    return achieved


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

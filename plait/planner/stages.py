"""Pipeline stages for the planner: Alpa's inter-operator dynamic programme and the pipeline's time.

`inter_op_dp` is the stage-partitioning DP of Alpa (Zheng et al. 2022, §5.2, Algorithm 1, without
the choice of sub-mesh shapes, which plait's uniform mesh fixes): cut ``L`` layers into ``S``
contiguous stages so that the pipeline latency of ``B`` micro-batches,

    T* = Σ_i t_i + (B - 1) · max_j t_j,

is least, where ``t_i = cost(lo_i, hi_i)`` is the time of one micro-batch through stage i. As in
Alpa, the maximum is enumerated: for each candidate t_max (every stage cost, in increasing order)
a DP finds the least Σ t_i with every t_i <= t_max, and the enumeration stops once (B - 1)·t_max
alone exceeds the best T* found. `brute_force_stages` is the checker the tests hold it to.

`pipeline_time` prices a layout's pipeline with plait's own simulator (`plait.pipeline.simulate`)
on the schedule plait would run (`plait.pipeline.schedules`), per-stage costs included (the
embeddings on the first stage, the logits on the last). Long pipelines are simulated with fewer
micro-batches and extrapolated: once every rank is in its steady state, each further micro-batch
adds exactly the busiest rank's work per micro-batch (Narayanan et al. 2021, §2.2: the bubble
(p - 1)·(t_f + t_b) does not grow with m); `tests/test_planner.py` checks the extrapolation
against a full simulation.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable

from plait.pipeline.schedules import gpipe, interleaved, one_f_one_b, zb_h1, zb_v
from plait.pipeline.simulate import Costs, simulate

PLANNED_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")
"""The schedules the planner prices (ZB-H2 is left out: its list scheduler takes seconds per
pipeline, too slow to search over)."""

SIM_MICROBATCHES = 4
"""Micro-batches simulated per pipeline rank at most (m_sim = 4p); beyond, extrapolated."""


def inter_op_dp(cost: Callable[[int, int], float], n_layers: int, n_stages: int, microbatches: int):
    """Alpa's stage DP: ``(T*, bounds)`` with ``bounds`` the S + 1 cut points 0 = b_0 < ... < b_S = L
    minimising Σ cost(b_i, b_{i+1}) + (B - 1)·max cost(b_i, b_{i+1}). ``cost(lo, hi)`` is the time
    of layers lo..hi-1 as one stage (``math.inf`` for a range that does not fit). Returns
    ``(math.inf, None)`` when no partition is finite."""
    L, S, B = n_layers, n_stages, microbatches
    if not 1 <= S <= L:
        raise ValueError(f"need 1 <= stages <= layers, got {S} stages for {L} layers")
    table = {(i, j): cost(i, j) for i in range(L) for j in range(i + 1, L + 1)}
    candidates = sorted({c for c in table.values() if math.isfinite(c)})
    best, best_bounds = math.inf, None
    for t_max in candidates:
        if (B - 1) * t_max >= best:
            break  # every later candidate is at least as large: Alpa's early stop
        # f[s][j]: least Σ t over the first j layers in s stages, each stage <= t_max.
        f = [[math.inf] * (L + 1) for _ in range(S + 1)]
        arg = [[-1] * (L + 1) for _ in range(S + 1)]
        f[0][0] = 0.0
        for s in range(1, S + 1):
            for j in range(s, L - (S - s) + 1):
                for i in range(s - 1, j):
                    c = table[(i, j)]
                    if c <= t_max and f[s - 1][i] + c < f[s][j]:
                        f[s][j], arg[s][j] = f[s - 1][i] + c, i
        if f[S][L] + (B - 1) * t_max < best:
            best = f[S][L] + (B - 1) * t_max
            bounds, j = [L], L
            for s in range(S, 0, -1):
                j = arg[s][j]
                bounds.append(j)
            best_bounds = bounds[::-1]
    return best, best_bounds


def balanced_stages(block_s: float, head_s: float, n_layers: int, n_stages: int, microbatches: int) -> dict:
    """Alpa's DP over plait's GPT: blocks of equal cost, the logits on the stage holding the last
    block. Returns the DP's cut points and T*, beside T* of the uniform cut that `plait train`
    runs (equal block counts)."""

    def cost(i: int, j: int) -> float:
        return (j - i) * block_s + (head_s if j == n_layers else 0.0)

    t_star, bounds = inter_op_dp(cost, n_layers, n_stages, microbatches)
    step = n_layers // n_stages
    uniform = [cost(i, i + step) for i in range(0, n_layers, step)]
    return {
        "bounds": bounds,
        "t_star_s": t_star,
        "uniform_t_star_s": sum(uniform) + (microbatches - 1) * max(uniform),
    }


def brute_force_stages(cost: Callable[[int, int], float], n_layers: int, n_stages: int, microbatches: int):
    """Every partition of the layers into contiguous stages, the least T*: the DP's checker."""
    best, best_bounds = math.inf, None
    for cuts in itertools.combinations(range(1, n_layers), n_stages - 1):
        bounds = [0, *cuts, n_layers]
        times = [cost(a, b) for a, b in itertools.pairwise(bounds)]
        total = sum(times) + (microbatches - 1) * max(times)
        if total < best:
            best, best_bounds = total, bounds
    return best, best_bounds


_GENERATORS = {
    "gpipe": lambda p, m, v: gpipe(p, m),
    "1f1b": lambda p, m, v: one_f_one_b(p, m),
    "interleaved": lambda p, m, v: interleaved(p, m, v),
    "zb-h1": lambda p, m, v: zb_h1(p, m),
    "zb-v": lambda p, m, v: zb_v(p, m),
}


@functools.lru_cache(maxsize=4096)
def _simulate_normalised(kind, p, m, v, b, w, comm, first_f, last_f, last_b):
    """Simulate with T_F = 1 (every other cost relative to it): cached, since many layouts share
    a pipeline shape and cost ratios. Returns (makespan, per-rank busy, peak activations)."""
    costs = Costs(F=1.0, B=b, W=w, comm=comm)
    split = kind in ("zb-h1", "zb-v")
    n = p * v
    extra = {}
    # First stage: the embedding's forward; last stage: the logits' forward and backward.
    extra[("F", 0)] = 1.0 / v + first_f
    extra[("F", n - 1)] = extra.get(("F", n - 1), 1.0 / v) + last_f
    if split:
        extra[("B", n - 1)] = b / v + last_b / 2
        extra[("W", n - 1)] = w / v + last_b / 2
    else:
        extra[("BW", n - 1)] = (b + w) / v + last_b
    costs.per_stage = extra
    result = simulate(_GENERATORS[kind](p, m, v), costs)
    return result.makespan, tuple(result.busy), max(result.peak_activations)


def _sig(x: float) -> float:
    return float(f"{x:.3g}")  # three significant digits: enough for a plan, and the cache hits


def pipeline_time(
    kind: str,
    p: int,
    m: int,
    v: int,
    f: float,
    b: float,
    w: float,
    comm: float = 0.0,
    first_f: float = 0.0,
    last_f: float = 0.0,
    last_b: float = 0.0,
) -> dict:
    """Makespan, bubble and peak activations of one step of the pipeline ``kind`` (p ranks, m
    micro-batches, v chunks per rank) with per-rank costs f, b, w of one micro-batch through a
    rank's blocks, ``comm`` seconds per cross-rank message and the extra costs of the first
    stage's embedding (``first_f``) and the last stage's logits (``last_f``, ``last_b``).
    Peak activations are in micro-batches through all of a rank's blocks (the simulator's unit)."""
    if f <= 0:
        raise ValueError("pipeline_time needs a positive forward time f")
    if kind == "interleaved":
        m_sim = min(m, SIM_MICROBATCHES * p)  # a multiple of p, as interleaving needs
    else:
        m_sim = min(m, SIM_MICROBATCHES * p)
    key = tuple(_sig(x / f) for x in (b, w, comm, first_f, last_f, last_b))
    makespan, busy, peak = _simulate_normalised(kind, p, m_sim, v, *key)
    per_mb = max(busy) / m_sim  # the busiest rank's work per micro-batch
    makespan = (makespan + (m - m_sim) * per_mb) * f
    busy_total = [x / m_sim * m * f for x in busy]
    if kind == "gpipe":
        peak = peak * m / m_sim  # GPipe keeps every micro-batch's activations
    bubble = 1.0 - sum(busy_total) / (p * makespan) if makespan > 0 else 0.0
    return {"makespan": makespan, "bubble": bubble, "peak_activations": peak, "m_simulated": m_sim}

"""The pipeline schedules with a fixed order: GPipe, 1F1B, interleaved 1F1B and ZB-H1; and the
stage placements every generator uses.

Each generator returns a compute-only :class:`~plait.pipeline.ir.Schedule` (F/B/W/BW actions);
`plait.pipeline.schedules.make_schedule` adds the communication and checks it. Costs quoted below
are in unit time, T_F = T_B = T_W = 1 (so BW = 2), no communication cost.
"""

from __future__ import annotations

from plait.errors import ConfigError
from plait.pipeline.ir import Action, Schedule

# -- placement and small helpers ---------------------------------------------------------------


def check_multiple(p: int, m: int) -> None:
    """Interleaved 1F1B sends groups of p micro-batches through each chunk in turn."""
    if m % p:
        raise ConfigError(
            f"interleaved 1F1B needs microbatches to be a multiple of pp: m={m} is not a "
            f"multiple of p={p} (valid e.g. {p}, {2 * p}, {3 * p})"
        )


def plain(p: int) -> tuple[tuple[int, ...], ...]:
    """One stage per rank: rank r holds stage r."""
    return tuple((r,) for r in range(p))


def looped(p: int, v: int) -> tuple[tuple[int, ...], ...]:
    """Interleaved placement (Narayanan et al. 2021, §2.2): rank r holds r, r+p, ..., r+(v-1)p."""
    return tuple(tuple(r + c * p for c in range(v)) for r in range(p))


def vshape(p: int) -> tuple[tuple[int, ...], ...]:
    """ZB-V placement (Qi et al. 2023, §5): rank r holds r and 2p-1-r, so rank 0 holds the first and
    the last stage, and the turn of the "V" (stages p-1, p) is local to rank p-1."""
    return tuple((r, 2 * p - 1 - r) for r in range(p))


def new_schedule(
    kind: str, p: int, m: int, v: int, stages, actions: list[list[tuple[str, int, int]]]
) -> Schedule:
    """A schedule from (kind, micro-batch, stage) triples per rank."""
    return Schedule(kind, p, m, v, stages, [[Action(k, mb, s) for k, mb, s in acts] for acts in actions])


# -- the classic schedules -----------------------------------------------------------------------


def gpipe(p: int, m: int) -> Schedule:
    """GPipe (Huang et al. 2019): every forward, then every backward (BW), both in micro-batch order
    0..m-1 (the order torch.distributed.pipelining uses), so the last stage starts the backward
    of micro-batch 0 first. Peak activations: m micro-batches on every rank. Bubble (p-1)/(m+p-1)
    of the step; unit-cost makespan 3(m+p-1)."""
    return new_schedule(
        "gpipe",
        p,
        m,
        1,
        plain(p),
        [[("F", i, r) for i in range(m)] + [("BW", i, r) for i in range(m)] for r in range(p)],
    )


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B / PipeDream-flush (Narayanan et al. 2021, §2.2.1; Harlap et al. 2018): rank r runs
    min(p-1-r, m) warm-up forwards, then alternates one forward and one backward (BW), then drains
    the remaining backwards. Rank r holds at most p-r micro-batches of activations (GPipe: m)
    for the same bubble; unit-cost makespan 3(m+p-1)."""
    actions = []
    for r in range(p):
        w = min(p - 1 - r, m)
        acts = [("F", i, r) for i in range(w)]
        for i in range(m - w):
            acts += [("F", w + i, r), ("BW", i, r)]
        acts += [("BW", i, r) for i in range(m - w, m)]
        actions.append(acts)
    return new_schedule("1f1b", p, m, 1, plain(p), actions)


def interleaved(p: int, m: int, v: int) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021, §2.2, Megatron-LM's
    forward_backward_pipelining_with_interleaving): v model chunks per rank (stage c*p + r on rank r).
    The k-th forward of a rank runs chunk (k mod pv) // p on micro-batch (k // pv)*p + k mod p,
    i.e. groups of p micro-batches go through chunk 0, then chunk 1, ...; backwards mirror that with
    the chunks reversed. Warm-up: min((p-r-1)*2 + (v-1)*p, m*v) forwards, then 1F1B, then cool-down.
    Needs m % p == 0. Bubble (1/v)(p-1)/m of the ideal time."""
    check_multiple(p, m)
    total = m * v

    def unit(k: int, backward: bool) -> tuple[int, int]:
        group, i = divmod(k, p * v)
        chunk = i // p
        return group * p + i % p, (v - 1 - chunk if backward else chunk)

    actions = []
    for r in range(p):
        warm = min((p - r - 1) * 2 + (v - 1) * p, total)
        order = [("F", k, False) for k in range(warm)]
        for k in range(total - warm):
            order += [("F", warm + k, False), ("BW", k, True)]
        order += [("BW", k, True) for k in range(total - warm, total)]
        acts = []
        for kind, k, bwd in order:
            mb, chunk = unit(k, bwd)
            acts.append((kind, mb, chunk * p + r))
        actions.append(acts)
    return new_schedule("interleaved", p, m, v, looped(p, v), actions)


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023, §3.1, Figure 3 top): 1F1B with the backward split into B (input
    gradient, on the critical path) and W (weight gradient, deferrable). Rank r keeps 1F1B's
    warm-up (p-r forwards counting the first steady one), then after its i-th B runs W of
    micro-batch i-r and the next F: its W's trail r micro-batches behind, and the last r fill the
    tail that 1F1B leaves idle. At most p micro-batches are in flight (F done, W not) on any rank, like
    1F1B's rank 0. Unit-cost makespan 3m + p - 1 for m >= p: the bubble is (p-1)(T_F+T_B-T_W),
    a third of 1F1B's."""
    actions = []
    for r in range(p):
        acts = [("F", i, r) for i in range(min(p - r, m))]
        for i in range(m):
            acts.append(("B", i, r))
            if i >= r:
                acts.append(("W", i - r, r))
            if p - r + i < m:
                acts.append(("F", p - r + i, r))
        acts += [("W", i, r) for i in range(max(m - r, 0), m)]
        actions.append(acts)
    return new_schedule("zb-h1", p, m, 1, plain(p), actions)

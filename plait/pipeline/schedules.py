"""Pipeline schedule generators: GPipe, 1F1B, interleaved 1F1B and the Zero Bubble family.

Each generator returns a compute-only :class:`~plait.pipeline.ir.Schedule` (F/B/W/BW actions);
:func:`add_communication` inserts the SEND/RECV actions; :func:`make_schedule` validates its
arguments, does both and checks the result with :func:`plait.pipeline.check.check_schedule`.

Costs quoted below are in unit time, T_F = T_B = T_W = 1 (so BW = 2), no communication cost,
unless a planning cost model is named; a "bubble" is idle time inside the makespan of one step.
"""

from __future__ import annotations

from plait.errors import ConfigError, ScheduleError
from plait.pipeline.check import check_schedule, deadlock_free
from plait.pipeline.ir import Action, Schedule
from plait.pipeline.simulate import Costs

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v")


def default_virtual_stages(kind: str) -> int:
    """Stages (model chunks) per rank a schedule uses unless told otherwise."""
    return 2 if kind in ("interleaved", "zb-v") else 1


def make_schedule(kind: str, p: int, m: int, v: int | None = None, costs: Costs | None = None) -> Schedule:
    """Validated schedule `kind` for p ranks and m micro-batches, with communication inserted.

    `costs` are the planning costs of the list-scheduled kinds, "zb-h2" and "zb-v" (see
    :func:`zb_h2`, :func:`zb_v`; None: their defaults); the other kinds have a fixed order and
    ignore it. Raises ConfigError naming the bad setting and the valid values.
    """
    if kind not in SCHEDULES:
        raise ConfigError(f"pipeline schedule {kind!r} is not valid; valid: {', '.join(SCHEDULES)}")
    for name, val in (("pipeline ranks (pp)", p), ("microbatches", m)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ConfigError(f"{name} must be an integer >= 1, got {val!r}")
    if v is None:
        v = default_virtual_stages(kind)
    if kind == "interleaved":
        if isinstance(v, bool) or not isinstance(v, int) or v < 2:
            raise ConfigError(
                f"interleaved 1F1B needs v >= 2 virtual stages per rank, got v={v!r}; "
                "valid: an integer >= 2 (use '1f1b' for v=1)"
            )
        _check_multiple(p, m)
    elif v != default_virtual_stages(kind):
        want = default_virtual_stages(kind)
        raise ConfigError(
            f"pipeline schedule {kind!r} needs v={want} virtual stage(s) per rank, got v={v!r}; valid: {want}"
        )
    compute = {
        "gpipe": lambda: gpipe(p, m),
        "1f1b": lambda: one_f_one_b(p, m),
        "interleaved": lambda: interleaved(p, m, v),
        "zb-h1": lambda: zb_h1(p, m),
        "zb-h2": lambda: zb_h2(p, m, costs),
        "zb-v": lambda: zb_v(p, m, costs),
    }[kind]()
    schedule = add_communication(compute)
    check_schedule(schedule)  # cheap (linear); turns a generator bug into a clear error, not a hang
    return hoist_receives(schedule)


# -- placement and small helpers ---------------------------------------------------------------


def _check_multiple(p: int, m: int) -> None:
    if m % p:
        raise ConfigError(
            f"interleaved 1F1B needs microbatches to be a multiple of pp: m={m} is not a "
            f"multiple of p={p} (valid e.g. {p}, {2 * p}, {3 * p})"
        )


def _plain(p: int) -> tuple[tuple[int, ...], ...]:
    return tuple((r,) for r in range(p))


def _looped(p: int, v: int) -> tuple[tuple[int, ...], ...]:
    """Interleaved placement (Narayanan et al. 2021, §2.2): rank r holds r, r+p, ..., r+(v-1)p."""
    return tuple(tuple(r + c * p for c in range(v)) for r in range(p))


def _vshape(p: int) -> tuple[tuple[int, ...], ...]:
    """ZB-V placement (Qi et al. 2023, §5): rank r holds r and 2p-1-r, so rank 0 holds the first and
    the last stage, and the turn of the "V" (stages p-1, p) is local to rank p-1."""
    return tuple((r, 2 * p - 1 - r) for r in range(p))


def _new(kind: str, p: int, m: int, v: int, stages, actions: list[list[tuple[str, int, int]]]) -> Schedule:
    return Schedule(kind, p, m, v, stages, [[Action(k, mb, s) for k, mb, s in acts] for acts in actions])


# -- the classic schedules -----------------------------------------------------------------------


def gpipe(p: int, m: int) -> Schedule:
    """GPipe (Huang et al. 2019): every forward, then every backward (BW), both in micro-batch order
    0..m-1 (the order torch.distributed.pipelining uses), so the last stage starts the backward
    of micro-batch 0 first. Peak activations: m micro-batches on every rank. Bubble (p-1)/(m+p-1)
    of the step; unit-cost makespan 3(m+p-1)."""
    return _new(
        "gpipe",
        p,
        m,
        1,
        _plain(p),
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
    return _new("1f1b", p, m, 1, _plain(p), actions)


def interleaved(p: int, m: int, v: int) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021, §2.2, Megatron-LM's
    forward_backward_pipelining_with_interleaving): v model chunks per rank (stage c*p + r on rank r).
    The k-th forward of a rank runs chunk (k mod pv) // p on micro-batch (k // pv)*p + k mod p,
    i.e. groups of p micro-batches go through chunk 0, then chunk 1, ...; backwards mirror that with
    the chunks reversed. Warm-up: min((p-r-1)*2 + (v-1)*p, m*v) forwards, then 1F1B, then cool-down.
    Needs m % p == 0. Bubble (1/v)(p-1)/m of the ideal time."""
    _check_multiple(p, m)
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
    return _new("interleaved", p, m, v, _looped(p, v), actions)


# -- Zero Bubble (Qi et al. 2023) ----------------------------------------------------------------


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
    return _new("zb-h1", p, m, 1, _plain(p), actions)


UNIT_COSTS = Costs(F=1.0, B=1.0, W=1.0, comm=0.0)
"""T_F = T_B = T_W = 1, free messages: the papers' unit-cost model."""

ZB_V_PLANNING_COSTS = Costs(F=1.0, B=1.0, W=0.8, comm=0.0)
"""Default planning costs of :func:`zb_v`, chosen empirically (see its docstring): W planned a
little shorter than F and B, so W's are kept as fillers and the F/B rhythm stays tight. With it the
unit-cost makespan is still the lower bound 6m + p - 1 for p <= 4, m >= p."""


def zb_h2(p: int, m: int, costs: Costs | None = None) -> Schedule:
    """ZB-H2 (Qi et al. 2023, §3.1, Figure 3 bottom): up to 2p-1 micro-batches in flight per rank,
    so the extra warm-up forwards fill the bubble before the first B and the W's fill the tail.
    Built by the paper's kind of heuristic, the list scheduler :func:`_greedy` planning in
    continuous time under `costs` (default: unit costs, :data:`UNIT_COSTS`) with backward first:
    a rank that becomes free starts a ready B, else a ready F if fewer than 2p-1 are in flight,
    else its oldest pending W. Planned with unit costs the makespan is 3m + p - 1 for m >= p, the
    lower bound (the last rank cannot start before p-1): once m >= 2p no rank idles between its
    first and last action, a parallelogram; the paper's "zero bubble" counts its slant as
    overlapped with the neighbouring steps (§4)."""
    return _greedy("zb-h2", p, m, 1, _plain(p), 2 * p - 1, costs or UNIT_COSTS, forward_first=False)


def zb_v(p: int, m: int, costs: Costs | None = None) -> Schedule:
    """ZB-V (Qi et al. 2023, §5): two chunks per rank in the V placement (rank r: stages r and
    2p-1-r), backward split into B and W, activation memory capped at 1F1B's peak: at most 2p
    (micro-batch, chunk) pairs in flight per rank, i.e. p whole micro-batches.

    Built by the list scheduler :func:`_greedy`, planning in continuous time under `costs` (F, B,
    W per rank, so one chunk's action costs half; ``comm`` on every cross-rank message), forward
    first: a free rank starts a ready F (latest stage first) under the memory cap, else a ready B,
    else its oldest pending W, except that when an F has its input but no memory, the W that frees
    its chunk goes before any B. Default `costs`: :data:`ZB_V_PLANNING_COSTS` (T_W = 0.8), chosen
    by simulating against torch.distributed.pipelining's ScheduleZBVZeroBubble order over
    F = 1, B in {1, 1.2, 1.5}, W in {0.5, 0.8, 1}, comm in {0, 0.05, 0.1, 0.3} (p in {2, 4},
    m in {4, 8, 16}): 1.4% shorter on average (per (p, m): from 0.2% longer at p = 2 to 9%
    shorter at p = m = 4), at worst 3.7% longer (p = 2 with comm > 0; p = 4,
    m >= 2p with W = 0.5). Planned with unit costs, or with the default, the unit-cost makespan
    (every action on one chunk costs 1, so a rank's work is 6m) is the lower bound 6m + p - 1 for
    every m >= p when p <= 4 (unit planning: p <= 8)."""
    return _greedy("zb-v", p, m, 2, _vshape(p), 2 * p, costs or ZB_V_PLANNING_COSTS, forward_first=True)


_EPS = 1e-9  # planned times are sums of costs: compare them with this slack


def _greedy(
    kind: str, p: int, m: int, v: int, stages, limit: int, costs: Costs, forward_first: bool
) -> Schedule:
    """Event-driven list scheduler planned in continuous time (after Qi et al. 2023, §3.2).

    An action costs ``costs.cost(kind, stage, v)``; a tensor that crosses ranks (an activation to
    the next stage, a gradient to the one before) arrives ``costs.comm`` after its producer ends,
    a local one at once, as in :func:`plait.pipeline.simulate.simulate`, so the planned timeline is
    what the simulator replays under the same costs. Whenever a rank is free it starts, in priority
    order (each ready when its inputs have arrived):

    - with `forward_first` False: the B that became ready first (then lowest micro-batch), else a
      ready F (latest stage first), else the oldest pending W;
    - with `forward_first` True: a ready F (latest stage first), else that B, else the oldest W;
      but if a ready F is held back only by memory, the oldest W of its stage goes first.

    A rank holds at most `limit` (micro-batch, stage) pairs from the start of F to the end of W.
    With v > 1 the forwards of the chunks before the last may hold at most `limit` - 1 of them, so
    the oldest micro-batch can always take its next forward and the plan cannot deadlock. Only
    the per-rank order of the plan is kept; the runtime times it by its dependencies.
    """
    n = p * v
    if any(not costs.cost(k, s, v) > 0 for k in ("F", "B", "W") for s in range(n)) or not costs.comm >= 0:
        raise ConfigError(f"{kind} planning costs must be > 0 (comm >= 0), got {costs}")
    owner = {s: r for r, held in enumerate(stages) for s in held}
    last_chunk = [held[-1] for held in stages]

    def arrival(end: float, src: int, dst: int) -> float:
        return end + (costs.comm if owner[src] != owner[dst] else 0.0)

    f_end: dict[tuple[int, int], float] = {}  # (mb, stage) -> planned end of its F
    next_f = [0] * n  # next micro-batch to go forward through each stage
    ready_b: list[list[tuple[float, int, int]]] = [[] for _ in range(p)]  # (ready time, mb, stage)
    pending_w: list[list[tuple[int, int]]] = [[] for _ in range(p)]  # (mb, stage), in B order
    in_flight = [0] * p  # pairs from F to W
    early = [0] * p  # of those, on a chunk before the rank's last
    free = [0.0] * p
    actions: list[list[tuple[str, int, int]]] = [[] for _ in range(p)]

    def input_at(s: int) -> float | None:
        """When the input of the next F through stage s is at its rank; None: not yet planned."""
        mb = next_f[s]
        if mb >= m:
            return None
        if s == 0:
            return 0.0
        end = f_end.get((mb, s - 1))
        return None if end is None else arrival(end, s - 1, s)

    def has_memory(r: int, s: int) -> bool:
        if in_flight[r] >= limit:
            return False
        return s == last_chunk[r] or early[r] < limit - 1

    left, t = 3 * m * n, 0.0
    while left:
        for r in range(p):
            if free[r] > t + _EPS:
                continue
            inputs = [s for s in stages[r] if (x := input_at(s)) is not None and x <= t + _EPS]
            fs = [s for s in inputs if has_memory(r, s)]
            bs = [x for x in ready_b[r] if x[0] <= t + _EPS]
            act = None
            if forward_first and not fs:  # an F held back only by memory: its chunk's oldest W first
                act = next(
                    (("W", *x) for s in sorted(inputs, reverse=True) for x in pending_w[r] if x[1] == s), None
                )
            if act is None and fs and (forward_first or not bs):
                act = ("F", next_f[max(fs)], max(fs))
            elif act is None and bs:
                b = min(bs, key=lambda x: (x[0], x[1], -x[2]))
                act = ("B", *b[1:])
            elif act is None and pending_w[r]:
                act = ("W", *pending_w[r][0])
            if act is None:
                continue
            k, mb, s = act
            end = t + costs.cost(k, s, v)
            if k == "F":
                f_end[(mb, s)] = end
                next_f[s] += 1
                in_flight[r] += 1
                early[r] += s != last_chunk[r]
                if s == n - 1:
                    ready_b[r].append((end, mb, s))
            elif k == "B":
                ready_b[r].remove(b)
                pending_w[r].append((mb, s))
                if s > 0:  # its gradient makes B of the stage below ready, once that F is done too
                    ready = max(arrival(end, s, s - 1), f_end[(mb, s - 1)])
                    ready_b[owner[s - 1]].append((ready, mb, s - 1))
            else:
                pending_w[r].remove((mb, s))
                in_flight[r] -= 1
                early[r] -= s != last_chunk[r]
            actions[r].append(act)
            free[r] = end
            left -= 1
        # Next event: a rank becomes free, a gradient or an activation arrives.
        later = [x for x in free if x > t + _EPS]
        later += [x[0] for bs in ready_b for x in bs if x[0] > t + _EPS]
        later += [x for s in range(n) if (x := input_at(s)) is not None and x > t + _EPS]
        if left and not later:
            raise ScheduleError(
                f"{kind} list scheduler is stuck at time {t:g} (p={p}, m={m}): every rank "
                f"waits with {in_flight} pairs in flight; please report this"
            )
        t = min(later, default=t)
    return _new(kind, p, m, v, stages, actions)


# -- communication -------------------------------------------------------------------------------


def add_communication(schedule: Schedule) -> Schedule:
    """A copy of `schedule` with SEND_*/RECV_* actions for every tensor that crosses ranks (any
    communication actions already there are dropped and rebuilt).

    Placement: each rank's compute order is kept; its actions get unit-cost as-soon-as-possible
    ticks (every compute action takes one tick). A tensor produced at tick t is sent right after
    its producer, and the receiver posts the matching RECV at the same tick boundary, so both sides
    of every message sit in the batch each rank posts at boundary t, ordered by (forward before
    backward, micro-batch, stage) on both sides, which keeps every rank pair FIFO. Since every
    batch at boundary t is matched by batches at boundary t, no rank ever waits on a later
    boundary, so the schedule cannot deadlock under the semantics of ir.py (make_schedule checks it
    anyway, then moves receives earlier with :func:`hoist_receives`).
    """
    s = schedule
    owner = {st: r for r, held in enumerate(s.stages) for st in held}
    last = s.n_stages - 1
    compute = [s.compute(r) for r in range(s.p)]
    ticks = _unit_ticks(s, compute, owner)
    batches: list[dict[int, list[tuple[tuple, Action]]]] = [{} for _ in range(s.p)]
    for r, acts in enumerate(compute):
        for a, t in zip(acts, ticks[r]):
            if a.kind == "F" and a.stage < last and owner[a.stage + 1] != r:
                q, key = owner[a.stage + 1], (0, a.mb, a.stage)
                batches[r].setdefault(t, []).append((key, Action("SEND_F", a.mb, a.stage, q)))
                batches[q].setdefault(t, []).append((key, Action("RECV_F", a.mb, a.stage + 1, r)))
            elif a.kind in ("B", "BW") and a.stage > 0 and owner[a.stage - 1] != r:
                q, key = owner[a.stage - 1], (1, a.mb, a.stage)
                batches[r].setdefault(t, []).append((key, Action("SEND_B", a.mb, a.stage, q)))
                batches[q].setdefault(t, []).append((key, Action("RECV_B", a.mb, a.stage - 1, r)))
    actions = []
    for r, acts in enumerate(compute):
        at = dict(zip(ticks[r], acts))
        out: list[Action] = []
        for t in range(max([*ticks[r], *batches[r]], default=-1) + 1):
            if t in at:
                out.append(at[t])
            out += [a for _, a in sorted(batches[r].get(t, []), key=lambda x: x[0])]
        actions.append(out)
    return Schedule(s.kind, s.p, s.m, s.v, s.stages, actions)


HOIST_LIMIT = 2000
"""Schedules with more actions than this keep add_communication's receive placement (hoisting
checks the whole schedule once per receive)."""


def hoist_receives(schedule: Schedule, limit: int = HOIST_LIMIT) -> Schedule:
    """Post receives one compute action earlier where that stays deadlock-free.

    add_communication posts a receive in the batch of its send's unit tick, after the receiver's
    compute of that tick. A transport such as gloo starts moving a message only once its receive is
    posted, so that leaves the transfer exposed before the consumer. This pass moves each receive,
    in order, in front of the compute action before it (joining the batch there), like
    torch.distributed.pipelining's runtime, which posts a receive as soon as the sender has
    computed its input. A move is kept only if :func:`check_schedule` still accepts the whole
    schedule (only its deadlock check can change: a receive has no input, stays before its consumer,
    and never passes another receive from the same peer, so the FIFO matching holds). Schedules with
    more than `limit` actions are returned unchanged.
    """
    if sum(len(a) for a in schedule.actions) > limit:
        return schedule
    actions = [list(a) for a in schedule.actions]
    for r in range(schedule.p):
        k = 0
        while k < len(actions[r]):
            a = actions[r][k]
            k += 1
            if a.kind not in ("RECV_F", "RECV_B"):
                continue
            c = k - 2  # the compute action before a's batch
            while c >= 0 and actions[r][c].is_comm:
                c -= 1
            between = actions[r][c + 1 : k - 1]
            if c < 0 or any(b.kind.startswith("RECV") and b.peer == a.peer for b in between):
                continue
            trial = [*actions[r][:c], a, *actions[r][c : k - 1], *actions[r][k:]]
            rows = [*actions[:r], trial, *actions[r + 1 :]]
            if not deadlock_free(
                Schedule(schedule.kind, schedule.p, schedule.m, schedule.v, schedule.stages, rows)
            ):
                continue
            actions[r] = trial
    return Schedule(schedule.kind, schedule.p, schedule.m, schedule.v, schedule.stages, actions)


def _unit_ticks(s: Schedule, compute: list[list[Action]], owner: dict[int, int]) -> list[list[int]]:
    """Start tick of every compute action when each takes one tick and starts as soon as its rank
    is free and its inputs exist (finished at an earlier tick)."""
    last = s.n_stages - 1
    done: dict[tuple[str, int, int], int] = {}  # ("F" | "G", mb, stage) -> finish tick; G: gradient
    ticks: list[list[int]] = [[] for _ in compute]
    pos = [0] * len(compute)
    t = 0

    def deps(a: Action) -> list[tuple[str, int, int]]:
        if a.kind == "F":
            return [("F", a.mb, a.stage - 1)] if a.stage > 0 else []
        if a.kind in ("B", "BW"):
            return [("F", a.mb, a.stage)] + ([("G", a.mb, a.stage + 1)] if a.stage < last else [])
        return []  # W: after its B, which precedes it on the same rank

    while any(pos[r] < len(compute[r]) for r in range(len(compute))):
        started = []
        for r, acts in enumerate(compute):
            if pos[r] < len(acts) and all(done.get(d, t + 1) <= t for d in deps(acts[pos[r]])):
                started.append(acts[pos[r]])
                ticks[r].append(t)
                pos[r] += 1
        if not started:
            stuck = [
                f"rank {r} at {compute[r][pos[r]]}" for r in range(len(compute)) if pos[r] < len(compute[r])
            ]
            raise ScheduleError(f"{s.kind} schedule: the compute order deadlocks: {'; '.join(stuck)}")
        for a in started:
            done[("G" if a.kind in ("B", "BW") else a.kind, a.mb, a.stage)] = t + 1
        t += 1
    return ticks

"""Zero Bubble schedules built by a list scheduler (Qi et al. 2023): ZB-H2 and ZB-V.

Unlike the fixed orders of :mod:`plait.pipeline.orders`, these are planned: an event-driven list
scheduler places each rank's next action in continuous time under planning costs, and only the
per-rank order of that plan is kept. Costs quoted below are in unit time, T_F = T_B = T_W = 1,
unless a planning cost model is named.
"""

from __future__ import annotations

from plait.errors import ConfigError, ScheduleError
from plait.pipeline.ir import Schedule
from plait.pipeline.orders import new_schedule, plain, vshape
from plait.pipeline.simulate import Costs

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
    return _greedy("zb-h2", p, m, 1, plain(p), 2 * p - 1, costs or UNIT_COSTS, forward_first=False)


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
    return _greedy("zb-v", p, m, 2, vshape(p), 2 * p, costs or ZB_V_PLANNING_COSTS, forward_first=True)


_EPS = 1e-9  # planned times are sums of costs: compare them with this slack


def _greedy(
    kind: str, p: int, m: int, v: int, stages, limit: int, costs: Costs, forward_first: bool
) -> Schedule:
    """The schedule :class:`_ListScheduler` plans (see there)."""
    return _ListScheduler(kind, p, m, v, stages, limit, costs, forward_first).run()


Action3 = tuple[str, int, int]  # (kind, micro-batch, stage)


class _ListScheduler:
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

    def __init__(
        self, kind: str, p: int, m: int, v: int, stages, limit: int, costs: Costs, forward_first: bool
    ) -> None:
        n = p * v
        if any(not costs.cost(k, s, v) > 0 for k in ("F", "B", "W") for s in range(n)) or not costs.comm >= 0:
            raise ConfigError(f"{kind} planning costs must be > 0 (comm >= 0), got {costs}")
        self.kind, self.p, self.m, self.v, self.n, self.stages = kind, p, m, v, n, stages
        self.limit, self.costs, self.forward_first = limit, costs, forward_first
        self.owner = {s: r for r, held in enumerate(stages) for s in held}
        self.last_chunk = [held[-1] for held in stages]
        self.f_end: dict[tuple[int, int], float] = {}  # (mb, stage) -> planned end of its F
        self.next_f = [0] * n  # next micro-batch to go forward through each stage
        self.ready_b: list[list[tuple[float, int, int]]] = [[] for _ in range(p)]  # (ready time, mb, stage)
        self.pending_w: list[list[tuple[int, int]]] = [[] for _ in range(p)]  # (mb, stage), in B order
        self.in_flight = [0] * p  # pairs from F to W
        self.early = [0] * p  # of those, on a chunk before the rank's last
        self.free = [0.0] * p
        self.actions: list[list[Action3]] = [[] for _ in range(p)]

    def run(self) -> Schedule:
        left, t = 3 * self.m * self.n, 0.0
        while left:
            for r in range(self.p):
                if self.free[r] > t + _EPS:
                    continue
                pick = self.choose(r, t)
                if pick is None:
                    continue
                self.start(r, t, *pick)
                left -= 1
            # Next event: a rank becomes free, a gradient or an activation arrives.
            later = [x for x in self.free if x > t + _EPS]
            later += [x[0] for bs in self.ready_b for x in bs if x[0] > t + _EPS]
            later += [x for s in range(self.n) if (x := self.input_at(s)) is not None and x > t + _EPS]
            if left and not later:
                raise ScheduleError(
                    f"{self.kind} list scheduler is stuck at time {t:g} (p={self.p}, m={self.m}): every "
                    f"rank waits with {self.in_flight} pairs in flight; please report this"
                )
            t = min(later, default=t)
        return new_schedule(self.kind, self.p, self.m, self.v, self.stages, self.actions)

    def arrival(self, end: float, src: int, dst: int) -> float:
        return end + (self.costs.comm if self.owner[src] != self.owner[dst] else 0.0)

    def input_at(self, s: int) -> float | None:
        """When the input of the next F through stage s is at its rank; None: not yet planned."""
        mb = self.next_f[s]
        if mb >= self.m:
            return None
        if s == 0:
            return 0.0
        end = self.f_end.get((mb, s - 1))
        return None if end is None else self.arrival(end, s - 1, s)

    def has_memory(self, r: int, s: int) -> bool:
        if self.in_flight[r] >= self.limit:
            return False
        return s == self.last_chunk[r] or self.early[r] < self.limit - 1

    def choose(self, r: int, t: float) -> tuple[Action3, tuple[float, int, int] | None] | None:
        """The action free rank r starts at time t (with, for a B, its entry of ready_b), or None."""
        inputs = [s for s in self.stages[r] if (x := self.input_at(s)) is not None and x <= t + _EPS]
        fs = [s for s in inputs if self.has_memory(r, s)]
        bs = [x for x in self.ready_b[r] if x[0] <= t + _EPS]
        pending = self.pending_w[r]
        if self.forward_first and not fs:  # an F held back only by memory: its chunk's oldest W first
            w = next((("W", *x) for s in sorted(inputs, reverse=True) for x in pending if x[1] == s), None)
            if w is not None:
                return w, None
        if fs and (self.forward_first or not bs):
            return ("F", self.next_f[max(fs)], max(fs)), None
        if bs:
            b = min(bs, key=lambda x: (x[0], x[1], -x[2]))
            return ("B", *b[1:]), b
        if pending:
            return ("W", *pending[0]), None
        return None

    def start(self, r: int, t: float, act: Action3, b: tuple[float, int, int] | None) -> None:
        """Plan `act` on rank r from time t: what it frees, and what becomes ready when it ends."""
        k, mb, s = act
        end = t + self.costs.cost(k, s, self.v)
        if k == "F":
            self.f_end[(mb, s)] = end
            self.next_f[s] += 1
            self.in_flight[r] += 1
            self.early[r] += s != self.last_chunk[r]
            if s == self.n - 1:
                self.ready_b[r].append((end, mb, s))
        elif k == "B":
            self.ready_b[r].remove(b)
            self.pending_w[r].append((mb, s))
            if s > 0:  # its gradient makes B of the stage below ready, once that F is done too
                ready = max(self.arrival(end, s, s - 1), self.f_end[(mb, s - 1)])
                self.ready_b[self.owner[s - 1]].append((ready, mb, s - 1))
        else:
            self.pending_w[r].remove((mb, s))
            self.in_flight[r] -= 1
            self.early[r] -= s != self.last_chunk[r]
        self.actions[r].append(act)
        self.free[r] = end

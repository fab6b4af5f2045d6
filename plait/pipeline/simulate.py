"""Replay a pipeline Schedule on a cost model: makespan, per-rank bubble and peak activations.

The simulator is the oracle the schedule generators are held to: with unit costs it reproduces
the bubbles the papers derive, GPipe's and 1F1B's (p-1)/(m+p-1) of the step (Huang et al. 2018;
Narayanan et al. 2021, §2.2), interleaved 1F1B's (1/v)·(p-1)/m of the ideal time (Narayanan et
al. 2021, §2.2.2) and Zero Bubble's (p-1)(T_F+T_B-T_W) for ZB-H1 and (p-1)(T_F+T_B-2T_W) for
ZB-H2 (Qi et al. 2023, §3).

Rules. Each rank runs its compute actions (F, B, W, BW) in list order; its communication
actions are not timed themselves, the cost of communication is the ``comm`` latency added on
every dependency edge between two ranks. An action starts when the rank's previous compute
action has ended and its dependencies are ready:

- ``F(mb, s)`` needs ``F(mb, s-1)``;
- ``B(mb, s)`` or ``BW(mb, s)`` needs ``F(mb, s)`` and, below the last stage, the input
  gradient of ``s+1``: ``B(mb, s+1)`` or ``BW(mb, s+1)``;
- ``W(mb, s)`` needs ``B(mb, s)``.

Costs are per micro-batch through all of a rank's layers, so with v stages (chunks) per rank an
action costs 1/v of its kind's cost; the ideal step is m(T_F+T_B+T_W) for every schedule.

Activations of a (micro-batch, stage) pair are live from the start of its F to the end of its
W (split backward) or BW; each live pair counts 1/v, so the unit is one micro-batch's
activations through all of a rank's layers (the M_B of Qi et al. 2023).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

from plait.errors import ConfigError, ScheduleError
from plait.pipeline.ir import COMPUTE_KINDS, Schedule


@dataclass
class Event:
    """One executed (or simulated) compute action on one rank."""

    rank: int
    kind: str
    mb: int
    stage: int
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Event:
        return cls(
            rank=int(d["rank"]),
            kind=str(d["kind"]),
            mb=int(d["mb"]),
            stage=int(d["stage"]),
            start=float(d["start"]),
            end=float(d["end"]),
        )


_COSTS_EXAMPLE = "expected 'F,B,W' (e.g. 1,1,1) or 'F,BW' (e.g. 1,2: B and W get half of BW each)"


@dataclass
class Costs:
    """Compute times and the latency ``comm`` of a cross-rank edge, in seconds or any unit.

    F, B and W are the times of one micro-batch through all of a rank's layers, as in the papers'
    formulas (T_F, T_B, T_W), so with v stages per rank one action takes F/v (Narayanan et al. 2021:
    interleaving shrinks the bubble because each chunk's actions are v times shorter). `per_stage`
    values are times of one action, as measured."""

    F: float = 1.0
    B: float = 1.0
    W: float = 1.0
    comm: float = 0.0
    per_stage: dict[tuple[str, int], float] = field(default_factory=dict)
    """(kind, stage) -> cost, overriding F/B/W (e.g. an embedding-heavy first stage)."""

    def cost(self, kind: str, stage: int, v: int = 1) -> float:
        """Cost of one action on `stage` when each rank holds `v` stages: an override as given, else
        F, B or W over v; BW is B + W of that stage unless ("BW", stage) is given."""
        if (kind, stage) in self.per_stage:
            return self.per_stage[(kind, stage)]
        if kind == "BW":
            return self.cost("B", stage, v) + self.cost("W", stage, v)
        if kind not in ("F", "B", "W"):
            raise ValueError(f"no cost for action kind {kind!r}; valid: {', '.join(COMPUTE_KINDS)}")
        return getattr(self, kind) / v

    @classmethod
    def parse(cls, text: str, comm: float = 0.0) -> Costs:
        """``"F,B,W"`` or ``"F,BW"``. Two numbers give the unsplit backward's cost, shared equally
        by B and W (so BW, the only backward a non-split schedule runs, costs exactly that)."""
        parts = [t.strip() for t in str(text).split(",")]
        try:
            values = [float(t) for t in parts]
        except ValueError:
            raise ConfigError(f"costs {text!r}: {_COSTS_EXAMPLE}") from None
        if len(values) not in (2, 3):
            raise ConfigError(f"costs {text!r}: {_COSTS_EXAMPLE}")
        if any(not (v >= 0 and v < float("inf")) for v in values) or not (0 <= comm < float("inf")):
            raise ConfigError(f"costs {text!r}, comm {comm}: costs must be finite and >= 0; {_COSTS_EXAMPLE}")
        if len(values) == 2:
            f, bw = values
            return cls(F=f, B=bw / 2, W=bw / 2, comm=comm)
        f, b, w = values
        return cls(F=f, B=b, W=w, comm=comm)

    @classmethod
    def from_events(cls, events: list[Event], comm: float | None = None) -> Costs:
        """Costs measured from a timeline: the median duration per (kind, stage) as overrides (robust
        to one slow step), the mean per kind as F/B/W. Communication is not separated from compute
        in measured events, so ``comm`` is what the caller gives, or 0. F/B/W are per rank: the mean
        action time times the most stages any rank ran."""
        held: dict[int, set[int]] = {}
        for e in events:
            held.setdefault(e.rank, set()).add(e.stage)
        v = max((len(s) for s in held.values()), default=1)
        by_kind: dict[str, list[float]] = {}
        by_stage: dict[tuple[str, int], list[float]] = {}
        for e in events:
            by_kind.setdefault(e.kind, []).append(e.duration)
            by_stage.setdefault((e.kind, e.stage), []).append(e.duration)
        costs = cls(comm=0.0 if comm is None else comm)
        for kind in ("F", "B", "W"):
            if kind in by_kind:
                setattr(costs, kind, v * statistics.fmean(by_kind[kind]))
        if "BW" in by_kind and "B" not in by_kind and "W" not in by_kind:
            costs.B = costs.W = v * statistics.fmean(by_kind["BW"]) / 2
        costs.per_stage = {key: statistics.median(d) for key, d in sorted(by_stage.items())}
        return costs


@dataclass
class SimResult:
    """A timeline and its summary, per pipeline rank."""

    makespan: float
    busy: list[float]
    """Compute time per rank."""
    bubble_fraction: list[float]
    """Per rank: 1 - busy / makespan."""
    peak_activations: list[float]
    """Per rank, in units of one micro-batch's activations through all of the rank's layers."""
    events: list[Event]
    idle_within: list[float] = field(default_factory=list)
    """Per rank: idle time between its first start and its last end. The papers' bubble counts this
    (Qi et al. 2023 fig. 3: ZB-H2 is a parallelogram, each rank busy throughout its own span, and the
    slant vanishes when one step's tail overlaps the next one's head)."""
    kind: str | None = None
    p: int | None = None
    m: int | None = None
    v: int | None = None

    @property
    def mean_bubble(self) -> float:
        return statistics.fmean(self.bubble_fraction) if self.bubble_fraction else 0.0

    def to_json(self, events: bool = False) -> dict:
        out: dict = {k: getattr(self, k) for k in ("kind", "p", "m", "v") if getattr(self, k) is not None}
        out.update(
            makespan=self.makespan,
            busy=self.busy,
            idle_within=self.idle_within,
            bubble_fraction=self.bubble_fraction,
            mean_bubble=self.mean_bubble,
            peak_activations=self.peak_activations,
        )
        if events:
            out["events"] = [e.to_dict() for e in self.events]
        return out


def summarize(events: list[Event], p: int | None = None, v: int | None = None) -> SimResult:
    """Makespan, busy time, bubble and peak activations of a timeline, simulated or measured.

    `p` defaults to the highest rank + 1, `v` to the most stages any rank ran."""
    if p is None:
        p = max((e.rank for e in events), default=-1) + 1
    if v is None:
        held: dict[int, set[int]] = {}
        for e in events:
            held.setdefault(e.rank, set()).add(e.stage)
        v = max((len(s) for s in held.values()), default=1)
    t0 = min((e.start for e in events), default=0.0)
    t1 = max((e.end for e in events), default=0.0)
    makespan = t1 - t0
    busy = [0.0] * p
    for e in events:
        busy[e.rank] += e.duration
    bubble = [1.0 - b / makespan if makespan > 0 else 0.0 for b in busy]
    first = [min((e.start for e in events if e.rank == r), default=0.0) for r in range(p)]
    last = [max((e.end for e in events if e.rank == r), default=0.0) for r in range(p)]
    idle_within = [last[r] - first[r] - busy[r] for r in range(p)]
    # Live interval of each (rank, mb, stage): its F's start to the last of its backward actions' ends
    # (W for a split backward, BW otherwise); a pair never released is live to the end.
    born: dict[tuple[int, int, int], float] = {}
    freed: dict[tuple[int, int, int], float] = {}
    for e in events:
        key = (e.rank, e.mb, e.stage)
        if e.kind == "F":
            born[key] = e.start
        elif e.kind in ("W", "BW"):
            freed[key] = max(freed.get(key, e.end), e.end)
    sweep: list[tuple[float, int, int]] = []
    for key, start in born.items():
        sweep.append((start, 1, key[0]))
        sweep.append((freed.get(key, t1), 0, key[0]))  # at equal times, free (0) before allocating (1)
    live = [0] * p
    peak = [0] * p
    for _, delta, rank in sorted(sweep):
        live[rank] += 1 if delta else -1
        peak[rank] = max(peak[rank], live[rank])
    return SimResult(
        makespan=makespan,
        busy=busy,
        bubble_fraction=bubble,
        peak_activations=[n / v for n in peak],
        events=sorted(events, key=lambda e: (e.rank, e.start, e.end)),
        idle_within=idle_within,
        p=p,
        v=v,
    )


def _deps(kind: str, mb: int, stage: int, last: int) -> list[tuple[str, int, int]]:
    # Keys: ("F", mb, s) the forward output, ("G", mb, s) the input gradient (from B or BW),
    # ("B", mb, s) a split B, which W needs specifically.
    if kind == "F":
        return [("F", mb, stage - 1)] if stage > 0 else []
    if kind in ("B", "BW"):
        deps = [("F", mb, stage)]
        if stage < last:
            deps.append(("G", mb, stage + 1))
        return deps
    return [("B", mb, stage)]  # W


def _provides(kind: str) -> tuple[str, ...]:
    return {"F": ("F",), "B": ("G", "B"), "BW": ("G",), "W": ()}[kind]


def simulate(schedule: Schedule, costs: Costs | None = None) -> SimResult:
    """Time `schedule` under `costs` (unit F = B = W = 1, no latency, by default); see the module
    docstring for the rules. Raises ScheduleError for a dependency that can never be satisfied:
    one no rank runs, or a cycle through the ranks' compute orders (a deadlock)."""
    costs = costs or Costs()
    last = schedule.n_stages - 1
    acts = [schedule.compute(r) for r in range(schedule.p)]
    where: dict[tuple[str, int, int], int] = {}  # provided key -> rank that computes it
    for r, rank_acts in enumerate(acts):
        for a in rank_acts:
            if not 0 <= a.stage <= last:
                raise ScheduleError(f"rank {r}: {a} names stage {a.stage}; the schedule has 0..{last}")
            for key in [(k, a.mb, a.stage) for k in _provides(a.kind)] or [("W", a.mb, a.stage)]:
                if key in where:
                    raise ScheduleError(f"rank {r}: {a} is run twice (also on rank {where[key]})")
                where[key] = r
    for r, rank_acts in enumerate(acts):
        for a in rank_acts:
            for key in _deps(a.kind, a.mb, a.stage, last):
                if key not in where:
                    need = {"F": "F", "G": "B or BW", "B": "B"}[key[0]] + f"{key[1]}@{key[2]}"
                    raise ScheduleError(f"rank {r}: {a} needs {need}, which no rank runs")

    ready: dict[tuple[str, int, int], float] = {}
    events: list[Event] = []
    pos = [0] * schedule.p
    clock = [0.0] * schedule.p
    while True:
        progressed = False
        for r in range(schedule.p):
            # Run rank r as far as its dependencies allow; the order of ranks does not change any
            # time, since each start is a max over ends that are already final.
            while pos[r] < len(acts[r]):
                a = acts[r][pos[r]]
                deps = _deps(a.kind, a.mb, a.stage, last)
                if any(key not in ready for key in deps):
                    break
                start = clock[r]
                for key in deps:
                    start = max(start, ready[key] + (costs.comm if where[key] != r else 0.0))
                end = start + costs.cost(a.kind, a.stage, schedule.v)
                events.append(Event(r, a.kind, a.mb, a.stage, start, end))
                for k in _provides(a.kind):
                    ready[(k, a.mb, a.stage)] = end
                clock[r] = end
                pos[r] += 1
                progressed = True
        if all(pos[r] == len(acts[r]) for r in range(schedule.p)):
            break
        if not progressed:
            stuck = "; ".join(
                f"rank {r} at {acts[r][pos[r]]}" for r in range(schedule.p) if pos[r] < len(acts[r])
            )
            raise ScheduleError(f"deadlock in the compute order: {stuck} (each waits on another)")
    result = summarize(events, schedule.p, schedule.v)
    result.kind, result.m = schedule.kind, schedule.m
    return result


def formula_bubble_time(kind: str, p: int, m: int, v: int, costs: Costs) -> float | None:
    """The bubble time the papers predict for one step, or None where REFERENCE.md has no formula
    (ZB-V) or the formula's assumptions fail (communication latency, per-stage costs).

    GPipe / 1F1B (p-1)(T_F+T_B+T_W) (Huang et al. 2018; Narayanan et al. 2021); interleaved that
    over v (Narayanan et al. 2021); ZB-H1 (p-1)(T_F+T_B-T_W), ZB-H2 (p-1)(T_F+T_B-2T_W), at least 0
    (Qi et al. 2023). For GPipe, 1F1B, interleaved and ZB-H1 it is rank 0's idle time, which spans
    the whole step; for ZB-H2 it is the idle time within each rank's own span (`idle_within`)."""
    if costs.comm or costs.per_stage:
        return None
    f, b, w = costs.F, costs.B, costs.W
    bubble = {
        "gpipe": (p - 1) * (f + b + w),
        "1f1b": (p - 1) * (f + b + w),
        "interleaved": (p - 1) * (f + b + w) / v,
        "zb-h1": (p - 1) * (f + b - w),
        "zb-h2": (p - 1) * (f + b - 2 * w),
    }.get(kind)
    return None if bubble is None else max(bubble, 0.0)


def formula_bubble(kind: str, p: int, m: int, v: int, costs: Costs) -> float | None:
    """`formula_bubble_time` as a fraction of the step m(T_F+T_B+T_W) + bubble; GPipe and 1F1B give
    (p-1)/(m+p-1)."""
    bubble = formula_bubble_time(kind, p, m, v, costs)
    if bubble is None:
        return None
    step = m * (costs.F + costs.B + costs.W) + bubble
    return bubble / step if step > 0 else 0.0

"""The point-to-point messages of a pipeline schedule: :func:`add_communication` inserts the
SEND/RECV actions into a compute-only schedule, :func:`hoist_receives` posts receives earlier
where that stays deadlock-free."""

from __future__ import annotations

from plait.errors import ScheduleError
from plait.pipeline.check import deadlock_free
from plait.pipeline.ir import Action, Schedule


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

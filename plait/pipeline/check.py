"""Static checks of a pipeline :class:`~plait.pipeline.ir.Schedule`, and a text grid to show one.

``check_schedule`` proves, without running anything, that a schedule computes every forward and
backward exactly once, in an order that respects the data dependencies of the model's stages,
that its point-to-point messages pair up (FIFO per ordered pair of ranks, as NCCL and Gloo deliver
them) and that it cannot deadlock under the communication semantics defined in ``ir.py``. Every
violation raises :class:`~plait.errors.ScheduleError` naming the rank, the step (index in that
rank's action list) and the actions involved, followed by the grid with the offending cell marked.
"""

from __future__ import annotations

from typing import NamedTuple

from plait.errors import ScheduleError
from plait.pipeline.ir import Action, Schedule

# The global stage on the other side of each communication kind, relative to the action's own
# stage, and the kind of the matching operation on the peer (see ir.py for the semantics).
_NEIGHBOUR = {"SEND_F": +1, "RECV_F": -1, "SEND_B": -1, "RECV_B": +1}
_MATCH = {"SEND_F": "RECV_F", "SEND_B": "RECV_B", "RECV_F": "SEND_F", "RECV_B": "SEND_B"}
_GRID_WINDOW = 20  # columns of the grid shown in an error message


def format_grid(schedule: Schedule, mark: tuple[int, int] | None = None, max_steps: int | None = None) -> str:
    """One row per rank (``rank 0 | F0@0 F1@0 ...``), one column per step index, columns aligned.

    ``mark=(rank, step)`` wraps that cell in ``[ ]``; a step one past the end of the rank's list
    shows an empty ``[ ]`` (something missing there). With ``max_steps`` only that many columns
    are shown, a window around the marked column (or the start), with ``...`` where cut.
    """
    rows = [[str(a) for a in acts] for acts in schedule.actions]
    if mark is not None and 0 <= mark[0] < len(rows):
        r, i = mark
        if 0 <= i < len(rows[r]):
            rows[r][i] = f"[{rows[r][i]}]"
        elif i == len(rows[r]):
            rows[r].append("[ ]")
    ncols = max((len(row) for row in rows), default=0)
    lo, hi = 0, ncols
    if max_steps is not None and ncols > max_steps:
        centre = mark[1] if mark is not None else 0
        lo = max(0, min(centre - max_steps // 2, ncols - max_steps))
        hi = lo + max_steps
    widths = [max([len(str(c))] + [len(row[c]) for row in rows if c < len(row)]) for c in range(lo, hi)]
    label_w = len(f"rank {max(len(rows) - 1, 0)}")

    def line(label: str, cells: list[str], more: bool) -> str:
        body = " ".join(cell.ljust(w) for cell, w in zip(cells, widths)).rstrip()
        return f"{label.ljust(label_w)} | {'... ' if lo > 0 else ''}{body}{' ...' if more else ''}"

    out = [line("step", [str(c) for c in range(lo, hi)], hi < ncols)]
    for r, row in enumerate(rows):
        out.append(line(f"rank {r}", [row[c] if c < len(row) else "" for c in range(lo, hi)], hi < len(row)))
    return "\n".join(out)


def check_schedule(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` on the first violation found, or return None.

    Checked in order: the shape (ranks, stage placement); every action (stage held by its rank,
    micro-batch in range, peer fields); per rank, the data dependencies in list order (F after its
    input, B/BW after its output gradient, W after B, SEND after the compute that produces it);
    completeness (one F and one BW, or one B and one W, per micro-batch and stage); message
    matching (every send has a receive, FIFO per ordered rank pair); and freedom from deadlock,
    by simulating the ranks under the communication semantics of ir.py.
    """
    _Checker(schedule).run()


def deadlock_free(schedule: Schedule) -> bool:
    """Whether a schedule that passes the other checks also runs to the end (the deadlock check
    of :func:`check_schedule` alone)."""
    checker = _Checker(schedule)
    try:
        checker.check_deadlock(checker.check_matching())
    except ScheduleError:
        return False
    return True


class _Checker:
    def __init__(self, schedule: Schedule) -> None:
        self.s = schedule

    def fail(self, msg: str, mark: tuple[int, int] | None = None) -> None:
        if mark is not None:
            r, i = mark
            acts = self.s.actions[r]
            what = f" ({acts[i]})" if i < len(acts) else " (end of its list)"
            msg = f"rank {r}, step {i}{what}: {msg}"
        grid = format_grid(self.s, mark, max_steps=_GRID_WINDOW)
        note = "\n(offending cell in [brackets])" if mark is not None else ""
        raise ScheduleError(
            f"invalid pipeline schedule {self.s.kind!r} (p={self.s.p}, m={self.s.m}, "
            f"v={self.s.v}): {msg}\n{grid}{note}"
        )

    def run(self) -> None:
        self.check_shape()
        self.check_actions()
        match = self.check_matching()
        self.check_order()
        self.check_complete()
        self.check_deadlock(match)

    # -- structure -------------------------------------------------------------------------------

    def check_shape(self) -> None:
        s = self.s
        if s.p < 1 or s.m < 1 or s.v < 1:
            self.fail(f"p, m and v must be >= 1 (got p={s.p}, m={s.m}, v={s.v})")
        if len(s.stages) != s.p or len(s.actions) != s.p:
            self.fail(
                f"expected {s.p} ranks, got {len(s.stages)} stage tuples and {len(s.actions)} action lists"
            )
        for r, held in enumerate(s.stages):
            if len(held) != s.v:
                self.fail(f"rank {r} holds stages {tuple(held)}; every rank must hold v={s.v}")
        flat = sorted(st for held in s.stages for st in held)
        if flat != list(range(s.n_stages)):
            self.fail(f"stages {tuple(map(tuple, s.stages))} are not a partition of 0..{s.n_stages - 1}")
        self.owner = {st: r for r, held in enumerate(s.stages) for st in held}
        self.last = s.n_stages - 1

    def check_actions(self) -> None:
        s = self.s
        for r, acts in enumerate(s.actions):
            seen: set[tuple[str, int, int]] = set()
            for i, a in enumerate(acts):
                if not isinstance(a, Action):
                    self.fail(f"{a!r} is not an Action", (r, i))
                if self.owner.get(a.stage) != r:
                    self.fail(f"stage {a.stage} is not held by rank {r} (it holds {s.stages[r]})", (r, i))
                if not 0 <= a.mb < s.m:
                    self.fail(f"micro-batch {a.mb} is out of range 0..{s.m - 1}", (r, i))
                key = (a.kind, a.mb, a.stage)
                if key in seen:
                    self.fail(f"{a.kind}{a.mb}@{a.stage} appears twice on rank {r}", (r, i))
                seen.add(key)
                if not a.is_comm:
                    if a.peer is not None:
                        self.fail(f"compute action {a} has a peer", (r, i))
                    continue
                nb = a.stage + _NEIGHBOUR[a.kind]
                if not 0 <= nb <= self.last:
                    self.fail(f"{a.kind} of stage {a.stage} has no neighbouring stage {nb}", (r, i))
                if self.owner[nb] == r:
                    self.fail(
                        f"stage {nb} is on this rank too: neighbouring stages on one rank "
                        "pass tensors locally, without communication",
                        (r, i),
                    )
                if a.peer != self.owner[nb]:
                    self.fail(
                        f"peer should be rank {self.owner[nb]} (holder of stage {nb}), not {a.peer}", (r, i)
                    )

    # -- per-rank order of dependencies ----------------------------------------------------------

    def check_order(self) -> None:
        for r, acts in enumerate(self.s.actions):
            done: set[tuple[str, int, int]] = set()
            for i, a in enumerate(acts):
                mb, st = a.mb, a.stage
                need: list[tuple[str, int, int]] = []
                if a.kind == "F" and st > 0:
                    need = [("F", mb, st - 1) if self.owner[st - 1] == r else ("RECV_F", mb, st)]
                elif a.kind in ("B", "BW"):
                    need = [("F", mb, st)]
                    if st < self.last:
                        need.append(("GRAD", mb, st + 1) if self.owner[st + 1] == r else ("RECV_B", mb, st))
                elif a.kind == "W":
                    need = [("B", mb, st)]
                elif a.kind == "SEND_F":
                    need = [("F", mb, st)]
                elif a.kind == "SEND_B":
                    need = [("GRAD", mb, st)]
                for k, nmb, nst in need:
                    if (k, nmb, nst) not in done:
                        what = "B or BW" if k == "GRAD" else k
                        self.fail(f"{a} runs before {what}{nmb}@{nst}, which it needs, on rank {r}", (r, i))
                done.add((a.kind, mb, st))
                if a.kind in ("B", "BW"):
                    done.add(("GRAD", mb, st))

    def check_complete(self) -> None:
        s = self.s
        for r, acts in enumerate(s.actions):
            where = {(a.kind, a.mb, a.stage): i for i, a in enumerate(acts)}
            for st in s.stages[r]:
                for mb in range(s.m):
                    f = where.get(("F", mb, st))
                    bw, b, w = (where.get((k, mb, st)) for k in ("BW", "B", "W"))
                    if f is None:
                        self.fail(f"F{mb}@{st} is missing", (r, len(acts)))
                    if bw is not None and (b is not None or w is not None):
                        self.fail(
                            f"micro-batch {mb} of stage {st} has both BW and a split B/W",
                            (r, max(x for x in (bw, b, w) if x is not None)),
                        )
                    if bw is None and b is None:
                        self.fail(f"F{mb}@{st} has no backward (BW, or B and W)", (r, f))
                    if b is not None and w is None:
                        self.fail(f"B{mb}@{st} has no W", (r, b))

    # -- messages --------------------------------------------------------------------------------

    def check_matching(self) -> dict[tuple[int, int], tuple[int, int]]:
        """Pair the k-th send from a to b with the k-th receive of b from a; return both ways."""
        s = self.s
        ops: dict[tuple[int, int, str], list[tuple[int, Action]]] = {}
        for r, acts in enumerate(s.actions):
            for i, a in enumerate(acts):
                if a.is_comm:
                    ops.setdefault((r, a.peer, a.kind[:4]), []).append((i, a))
        # Unmatched operations first (clearer than a FIFO mismatch they would also cause).
        for (r, q, d), lst in sorted(ops.items()):
            other = {
                (x.kind, x.mb, x.stage) for _, x in ops.get((q, r, "RECV" if d == "SEND" else "SEND"), [])
            }
            for i, a in lst:
                want = (_MATCH[a.kind], a.mb, a.stage + _NEIGHBOUR[a.kind])
                if want not in other:
                    self.fail(
                        f"unmatched {d.lower()}: rank {q} posts no {want[0]}{want[1]}@{want[2]}", (r, i)
                    )
        match: dict[tuple[int, int], tuple[int, int]] = {}
        for (r, q, d), sends in sorted(ops.items()):
            if d != "SEND":
                continue
            recvs = ops.get((q, r, "RECV"), [])
            for k, ((i, a), (j, b)) in enumerate(zip(sends, recvs)):
                if (b.kind, b.mb, b.stage) != (_MATCH[a.kind], a.mb, a.stage + _NEIGHBOUR[a.kind]):
                    self.fail(
                        f"FIFO order mismatch between rank {r} and rank {q}: send #{k} from rank {r} "
                        f"is {a} (step {i}) but receive #{k} on rank {q} is {b}; both ranks must "
                        "post their messages to each other in the same order",
                        (q, j),
                    )
                match[(r, i)] = (q, j)
                match[(q, j)] = (r, i)
        return match

    def check_deadlock(self, match: dict[tuple[int, int], tuple[int, int]]) -> None:
        """Simulate the ranks under the semantics of ir.py: per rank, compute runs in list order,
        an F/B/BW only after the batch holding its RECV has completed; batches run in list order
        (one communication queue per rank, as NCCL's stream runs them), each once the compute
        before it is done; an operation completes once its batch and its match's batch are both
        running and the operations before it in its batch to the same peer have completed (NCCL
        runs those in order), and a batch once all its operations have."""
        acts = self.s.actions
        n = len(acts)
        index = [_batch_index(lst) for lst in acts]
        batch_of = [x.batch_of for x in index]
        first = [x.first for x in index]
        computes = [x.computes for x in index]
        before = [x.before for x in index]
        needs = [x.needs for x in index]
        comp = [0] * n  # compute actions done, per rank
        done = [0] * n  # batches done, per rank
        complete: set[tuple[int, int]] = set()  # (rank, action index) of completed operations

        def ops(r: int, b: int) -> range:
            end = first[r][b]
            while end < len(acts[r]) and acts[r][end].is_comm:
                end += 1
            return range(first[r][b], end)

        def in_turn(r: int, i: int) -> bool:
            """NCCL runs the operations of a group that go to one peer in order: those before i
            in its batch, with the same peer, must have completed."""
            start = first[r][batch_of[r][i]]
            return all((r, k) in complete for k in range(start, i) if acts[r][k].peer == acts[r][i].peer)

        def running(q: int, c: int) -> bool:
            return c < done[q] or (done[q] == c and comp[q] >= before[q][c])

        progress = True
        while progress:
            progress = False
            for r in range(n):
                while comp[r] < len(computes[r]):
                    i = computes[r][comp[r]]
                    if i in needs[r] and done[r] <= needs[r][i]:
                        break  # its input's batch has not completed
                    comp[r] += 1
                    progress = True
                if done[r] < len(first[r]) and running(r, done[r]):
                    for i in ops(r, done[r]):
                        q, j = match[(r, i)]
                        if (
                            (r, i) not in complete
                            and running(q, batch_of[q][j])
                            and in_turn(r, i)
                            and in_turn(q, j)
                        ):
                            complete.update({(r, i), (q, j)})
                    if all((r, i) in complete for i in ops(r, done[r])):
                        done[r] += 1
                        progress = True
        blocked = [r for r in range(n) if comp[r] < len(computes[r]) or done[r] < len(first[r])]
        if blocked:
            waiting = {r: [i for i in ops(r, done[r]) if (r, i) not in complete] for r in blocked}
            self._fail_deadlock({r: first[r][done[r]] for r in blocked}, waiting, match)

    def _fail_deadlock(
        self, at: dict[int, int], waiting: dict[int, list[int]], match: dict[tuple[int, int], tuple[int, int]]
    ) -> None:
        """Name each blocked rank (`at`: rank -> step of its first unfinished batch) and whom the
        operations of that batch not yet complete (`waiting`) wait for. A blocked rank waits
        there: a compute waits only for a batch before it, and that batch's own compute is then
        done, so the batch is posted."""
        acts = self.s.actions
        parts = []
        for r, step in at.items():
            waits = ", ".join(
                f"{acts[r][i]} (needs rank {q} to reach step {j}, {acts[q][j]})"
                for i in waiting[r]
                for q, j in [match[(r, i)]]
            )
            parts.append(f"rank {r} at step {step} waits for {waits}")
        r0 = next(iter(at))
        self.fail(f"deadlock: ranks {list(at)} cannot progress; " + "; ".join(parts), (r0, at[r0]))


class _BatchIndex(NamedTuple):
    """One rank's actions seen as compute actions and batches of consecutive communication."""

    batch_of: dict[int, int]  # action index -> its batch number
    first: list[int]  # batch number -> index of its first action
    computes: list[int]  # compute action indices, in order
    before: list[int]  # batch number -> number of compute actions before it
    needs: dict[int, int]  # compute action index -> batch holding its input


def _batch_index(lst: list[Action]) -> _BatchIndex:
    index = _BatchIndex({}, [], [], [], {})
    recv_at: dict[tuple[str, int, int], int] = {}
    for i, a in enumerate(lst):
        if a.is_comm:
            if i == 0 or not lst[i - 1].is_comm:
                index.first.append(i)
                index.before.append(len(index.computes))
            index.batch_of[i] = len(index.first) - 1
            if a.kind in ("RECV_F", "RECV_B"):
                recv_at[(a.kind, a.mb, a.stage)] = len(index.first) - 1
        else:
            index.computes.append(i)
            key = ("RECV_F" if a.kind == "F" else "RECV_B", a.mb, a.stage)
            if a.kind != "W" and key in recv_at:
                index.needs[i] = recv_at[key]
    return index

"""Flight recorder and watchdog: no collective may hang silently.

The flight recorder keeps the last operations of this rank (sequence number, op, axis, bytes,
start and end time). The watchdog thread looks at the operations still pending; one that has
not completed after the timeout is a hang (a rank skipped a collective, called a different one,
or died). The watchdog then prints a report naming this rank, the op, the axis and the sequence
number, together with what every other rank last did (each rank publishes its latest entry to
the process group's key-value store), writes the same report to the torchelastic error file so
the launcher shows it as the root cause, and ends the process with exit code 3; the launcher
then takes the other ranks down. The same idea as NCCL's watchdog and PyTorch's flight
recorder, for every backend.

The report is printed once, by the rank (plait's launcher points at it rather than repeating
it). The Python stack of the rank's main thread, where it waits, is added only when asked:
`PLAIT_WATCHDOG_STACK=1` in the environment.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import sys
import threading
import time
import traceback

import torch.distributed as dist

WATCHDOG_EXIT_CODE = 3
WATCHDOG_PREFIX = "plait watchdog:"
"""How every watchdog report begins (the launcher recognises a report by it)."""
STACK_ENV = "PLAIT_WATCHDOG_STACK"
"""Set to 1 to add the main thread's Python stack to a watchdog report."""
_STORE_PREFIX = "plait/flight/"


def write_error_file(message: str, callstack: str = "") -> None:
    """Write `message` where torchelastic (and plait.testing) look for a rank's root cause."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {
        "message": {
            "message": message,
            "extraInfo": {"py_callstack": callstack or message, "timestamp": str(int(time.time()))},
        }
    }
    try:
        with open(path, "w") as fh:
            json.dump(data, fh)
    except OSError:
        pass


@dataclasses.dataclass
class OpEntry:
    """One recorded communication operation of this rank."""

    seq: int
    op: str
    axis: str
    nbytes: int
    peer: int | None
    t_start: float  # wall clock, comparable with other timestamps of the run
    t_end: float | None = None
    work: object = dataclasses.field(default=None, repr=False)
    t_mono: float = dataclasses.field(default_factory=time.monotonic)  # for ages: immune to clock jumps

    @property
    def completed(self) -> bool:
        return self.t_end is not None

    def describe(self) -> str:
        peer = f" peer={self.peer}" if self.peer is not None else ""
        if self.completed:
            state = f"completed in {self.t_end - self.t_start:.3f}s"
        else:
            state = f"pending for {time.monotonic() - self.t_mono:.1f}s"
        return f"#{self.seq} {self.op} axis={self.axis}{peer} bytes={self.nbytes} {state}"


class FlightRecorder:
    """A ring buffer of this rank's last `capacity` operations, plus the set still pending."""

    def __init__(self, rank: int, capacity: int = 64):
        self.rank = rank
        self._lock = threading.Lock()
        self._entries: collections.deque[OpEntry] = collections.deque(maxlen=capacity)
        self._pending: dict[int, OpEntry] = {}
        self._seq = 0

    def start(self, op: str, axis: str, nbytes: int, peer: int | None = None, work=None) -> OpEntry:
        with self._lock:
            self._seq += 1
            entry = OpEntry(self._seq, op, axis, int(nbytes), peer, time.time(), work=work)
            self._entries.append(entry)
            self._pending[entry.seq] = entry
            return entry

    def complete(self, entry: OpEntry) -> None:
        with self._lock:
            if entry.t_end is None:
                entry.t_end = time.time()
            entry.work = None
            self._pending.pop(entry.seq, None)

    def pending(self) -> list[OpEntry]:
        with self._lock:
            return list(self._pending.values())

    def entries(self) -> list[OpEntry]:
        with self._lock:
            return list(self._entries)

    def last(self) -> OpEntry | None:
        with self._lock:
            return self._entries[-1] if self._entries else None

    def dump(self, n: int = 8) -> str:
        return "\n".join("    " + e.describe() for e in self.entries()[-n:])


def _default_store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # no store: the report then only covers this rank
        return None


class Watchdog(threading.Thread):
    """Ends the process when a recorded operation stays pending longer than `timeout_s`."""

    def __init__(self, recorder: FlightRecorder, rank: int, world_size: int, timeout_s: float, store=None):
        super().__init__(name=f"plait-watchdog-{rank}", daemon=True)
        self.recorder = recorder
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.poll_s = min(0.5, max(0.05, timeout_s / 10))
        self.store = store if store is not None else _default_store()
        self._stop_event = threading.Event()
        self._published: tuple | None = None

    def stop(self, reason: str = "exited normally") -> None:
        self._stop_event.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=2 * self.poll_s + 1)
        self._publish(final=reason)

    def run(self) -> None:
        while not self._stop_event.wait(self.poll_s):
            now = time.monotonic()
            for entry in self.recorder.pending():
                work = entry.work
                if work is not None and _is_completed(work):
                    self.recorder.complete(entry)
                elif now - entry.t_mono > self.timeout_s:
                    self._fire(entry)
                    return
            self._publish()

    # --- cross-rank state -----------------------------------------------------------------

    def _publish(self, final: str | None = None) -> None:
        if self.store is None:
            return
        last = self.recorder.last()
        key = (last.seq, last.completed) if last is not None else None
        if final is None and key == self._published:
            return
        self._published = key
        text = last.describe() if last is not None else "no communication yet"
        if final:
            text = f"{text}; {final}"
        try:
            self.store.set(f"{_STORE_PREFIX}{self.rank}", f"{text} (at {time.strftime('%H:%M:%S')})")
        except Exception:
            self.store = None  # the store's host is gone; carry on without cross-rank reports

    def _others(self) -> list[str]:
        if self.store is None:
            return ["    (no key-value store: the other ranks' state is unknown)"]
        lines = []
        for r in range(self.world_size):
            if r == self.rank:
                continue
            key = f"{_STORE_PREFIX}{r}"
            try:
                state = self.store.get(key).decode() if self.store.check([key]) else "nothing published yet"
            except Exception as exc:  # the store may have died with its host rank
                state = f"unknown ({type(exc).__name__})"
            lines.append(f"    rank {r}: last op {state}")
        return lines

    def _fire(self, entry: OpEntry) -> None:
        stack = os.environ.get(STACK_ENV, "") not in ("", "0")
        report = (
            f"{WATCHDOG_PREFIX} rank {self.rank} waited {time.monotonic() - entry.t_mono:.1f}s "
            f"(timeout {self.timeout_s:g}s) for collective #{entry.seq} {entry.op} on axis "
            f"'{entry.axis}' ({entry.nbytes} bytes); it did not complete.\n"
            f"  A rank probably skipped or reordered a collective, is stuck, or died.\n"
            f"  rank {self.rank}, last ops:\n{self.recorder.dump()}"
        )
        # This rank's own report goes out first: the store below may hang with a dead host.
        sys.stderr.write(report + "\n")
        sys.stderr.flush()
        write_error_file(report)
        others: list[str] = []
        reader = threading.Thread(
            target=lambda: (self._publish(), others.extend(self._others())), daemon=True
        )
        reader.start()
        reader.join(timeout=5.0)
        tail = ("  other ranks:\n" + "\n".join(others)) if others else ""
        if stack:
            tail += f"\n  rank {self.rank}, main thread:\n{_main_thread_stack()}"
        else:
            tail += f"\n  ({STACK_ENV}=1 adds this rank's Python stack to the report)"
        tail = tail.lstrip("\n")
        sys.stderr.write(tail + "\n")
        sys.stderr.flush()
        write_error_file(f"{report}\n{tail}")
        os._exit(WATCHDOG_EXIT_CODE)


def _is_completed(work) -> bool:
    try:
        return bool(work.is_completed())
    except Exception:
        return False


def _main_thread_stack() -> str:
    frame = sys._current_frames().get(threading.main_thread().ident)
    return "".join(traceback.format_stack(frame)) if frame is not None else ""

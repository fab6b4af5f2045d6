"""The communication ledger: what each step moved, per operation and mesh axis.

For every collective plait records the count, the payload bytes and the "bus bytes" each rank
moves under the ring algorithm (the figure nccl-tests reports and the papers' formulas use):

    all_reduce                 2 (N-1)/N x payload      (reduce-scatter + all-gather, Li et al. 2020)
    all_gather, reduce_scatter   (N-1)/N x payload      (payload = the full, unsharded tensor)
    all_to_all                   (N-1)/N x payload      (one N-th of the payload stays local)
    broadcast, send, recv                  payload
    push, pull                             payload  (parameter server: one message to one server,
                                                     recorded with `record_message`)

Payload and bus bytes are what the collective actually carried. `logical_bytes` is the payload
the same step would have needed uncompressed (a gradient compressor passes the fp32 size of the
bucket it stands for); without compression it equals the payload, so the ledger shows the bytes
actually sent next to their uncompressed equivalent.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import defaultdict

_RING_FACTOR = {
    "all_reduce": lambda n: 2.0 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "send": lambda n: 1.0,
    "recv": lambda n: 1.0,
    "barrier": lambda n: 0.0,
    "push": lambda n: 1.0,
    "pull": lambda n: 1.0,
}


def bus_bytes(op: str, payload_bytes: int, n: int) -> float:
    """Bytes each rank sends under the ring algorithm for `op` over `n` ranks."""
    if n <= 1:
        return 0.0
    return _RING_FACTOR[op](n) * payload_bytes


@dataclasses.dataclass
class LedgerRow:
    """Totals of one (operation, axis) pair within one step."""

    count: int = 0
    payload_bytes: int = 0
    bus_bytes: float = 0.0
    logical_bytes: int = 0


class Ledger:
    """Per-step totals of every collective, keyed by (op, axis).

    The training loop calls `set_step(n)` before step n; everything recorded until the next call
    belongs to step n. Thread-safe: autograd hooks may record from another thread.
    """

    def __init__(self, keep_steps: int = 1000) -> None:
        self.step = 0
        self.keep_steps = keep_steps
        self._lock = threading.Lock()
        self._steps: dict[int, dict[tuple[str, str], LedgerRow]] = defaultdict(dict)

    def set_step(self, step: int) -> None:
        """Start recording under `step`; steps older than the last `keep_steps` are dropped."""
        self.step = int(step)
        with self._lock:
            while len(self._steps) > self.keep_steps:
                self._steps.pop(min(self._steps))

    def record(
        self, op: str, axis: str, payload_bytes: int, n: int, logical_bytes: int | None = None
    ) -> None:
        with self._lock:
            row = self._steps[self.step].setdefault((op, axis), LedgerRow())
            row.count += 1
            row.payload_bytes += int(payload_bytes)
            row.bus_bytes += bus_bytes(op, payload_bytes, n)
            row.logical_bytes += int(payload_bytes if logical_bytes is None else logical_bytes)

    def record_message(self, op: str, peer: str, payload_bytes: int) -> None:
        """A point-to-point message that is not a collective (a parameter server's push or
        pull over torch.distributed.rpc): recorded under the axis `peer`, bus bytes = payload."""
        self.record(op, peer, payload_bytes, 2)

    def rows(self, step: int | None = None) -> dict[tuple[str, str], LedgerRow]:
        """{(op, axis): LedgerRow} for `step` (default: the current step)."""
        with self._lock:
            found = self._steps.get(self.step if step is None else step, {})
            return {k: dataclasses.replace(v) for k, v in found.items()}

    def steps(self) -> list[int]:
        with self._lock:
            return sorted(self._steps)

    def total(self, step: int | None = None, field: str = "payload_bytes", op: str | None = None) -> float:
        """Sum of `field` over the rows of `step`, optionally only for one op."""
        return sum(getattr(r, field) for (o, _), r in self.rows(step).items() if op is None or o == op)

    def clear(self) -> None:
        with self._lock:
            self._steps.clear()

    def table(self, step: int | None = None) -> str:
        """A plain-text table of one step, for logs and docs."""
        rows = self.rows(step)
        lines = [f"{'op':<16}{'axis':<6}{'count':>7}{'payload MB':>13}{'bus MB':>11}{'uncompr. MB':>13}"]
        for (op, axis), r in sorted(rows.items()):
            lines.append(
                f"{op:<16}{axis:<6}{r.count:>7}{r.payload_bytes / 1e6:>13.3f}"
                f"{r.bus_bytes / 1e6:>11.3f}{r.logical_bytes / 1e6:>13.3f}"
            )
        return "\n".join(lines)

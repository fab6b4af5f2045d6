"""Links between islands: a gloo group spanning two neighbouring islands' ranks, over which a
micro-batch's activations go forward and its input gradients back, actor to actor.

Pathways keeps the controller on the control plane: it decides what runs where and when, and the
data moves between the islands' devices directly. plait's islands do the same. The controller
hosts one TCPStore (on 127.0.0.1) for the pipeline. Each boundary s | s+1 is a gloo group of
dp_s + dp_(s+1) ranks: island s's ranks are its ranks 0 .. dp_s - 1, island s+1's follow. A
producer posts its sends (`isend`) when its action ends and returns only the output's shape to
the controller. The controller dispatches the consumer's action once the producer's has ended,
so each receive meets a send already posted. Sends are awaited at the end of the step.

Islands of different widths cut a micro-batch's rows differently. Rank i of an island of `a`
ranks holds rows [i R / a, (i + 1) R / a) of a micro-batch of R rows; rank j of the other
island needs [j R / b, (j + 1) R / b). Each pair whose ranges overlap exchanges the overlap
(`pieces`), so no rank ever holds the whole micro-batch.

On GPUs a link still runs over gloo, staging through host memory (an NCCL link is not built).
"""

from __future__ import annotations

import dataclasses
import datetime

import torch
import torch.distributed as dist

from plait import comm
from plait.comm.ports import LOOPBACK


@dataclasses.dataclass(frozen=True)
class Incoming:
    """What an island's action receives over a link instead of a tensor from the controller: a
    forward's input (`rows` of the micro-batch, each of shape `tail`, `dtype`), or, with no
    fields, a backward's output gradient (shaped as the output the receiver holds)."""

    rows: int = 0
    tail: tuple = ()
    dtype: torch.dtype | None = None


TIMEOUT_S = 300.0  # a receive waits at most this long for its piece (its send is already posted)


def pieces(rows: int, src: int, dst: int) -> list[tuple[int, int, int, int]]:
    """(i, j, lo, hi) for each rank i of `src` ranks and rank j of `dst` ranks whose shares of a
    micro-batch of `rows` rows overlap: the overlap is rows [lo, hi) of the micro-batch."""
    a, b = rows // src, rows // dst
    out = []
    for i in range(src):
        for j in range(dst):
            lo, hi = max(i * a, j * b), min((i + 1) * a, (j + 1) * b)
            if lo < hi:
                out.append((i, j, lo, hi))
    return out


class Link:
    """One rank's end of the link between island s (`first` True: this rank is on island s) and
    island s + 1, whose widths are `dp` = (dp_s, dp_(s+1)). Its sends and receives go through
    plait.comm, in the island mesh's ledger and flight recorder under the axis `link_next`
    (island s's end) or `link_prev` (island s+1's)."""

    def __init__(self, mesh, port: int, boundary: int, dp: tuple[int, int], first: bool, index: int):
        store = dist.TCPStore(LOOPBACK, port, is_master=False, timeout=datetime.timedelta(seconds=TIMEOUT_S))
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = datetime.timedelta(seconds=TIMEOUT_S)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=LOOPBACK)]
        rank = index if first else dp[0] + index
        self.group = dist.ProcessGroupGloo(dist.PrefixStore(f"link{boundary}/", store), rank, sum(dp), opts)
        self.mesh, self.axis = mesh, "link_next" if first else "link_prev"
        self.mine, self.theirs = (dp[0], dp[1]) if first else (dp[1], dp[0])
        self.index, self.offset = index, dp[0] if first else 0  # the other island's first link rank
        self.pending: list[comm.Handle] = []  # the sends posted this step

    @property
    def sent_bytes(self) -> int:
        """The bytes sent over this link so far (the ledger's)."""
        rows = (self.mesh.ledger.rows(step).get(("send", self.axis)) for step in self.mesh.ledger.steps())
        return sum(r.payload_bytes for r in rows if r is not None)

    def _overlaps(self, local_rows: int) -> list[tuple[int, int, int]]:
        """(j, lo, hi): the other island's rank j shares rows [lo, hi) of this rank's rows."""
        rows, start = local_rows * self.mine, self.index * local_rows
        return [
            (j, lo - start, hi - start)
            for i, j, lo, hi in pieces(rows, self.mine, self.theirs)
            if i == self.index
        ]

    def send(self, t: torch.Tensor, mb: int) -> None:
        """Post the sends of `t` (this rank's rows of micro-batch `mb`) to the ranks that need them."""
        for j, lo, hi in self._overlaps(t.shape[0]):
            piece = t[lo:hi].detach().contiguous().cpu()  # held by its handle until it is received
            self.pending.append(comm.link_isend(piece, self.mesh, self.axis, self.group, self.offset + j, mb))

    def recv(self, mb: int, local_rows: int, tail: tuple, dtype: torch.dtype) -> torch.Tensor:
        """This rank's `local_rows` rows of micro-batch `mb` (each of shape `tail`), gathered from
        the other island's ranks that hold them."""
        parts = []
        for j, lo, hi in self._overlaps(local_rows):
            piece = torch.empty((hi - lo, *tail), dtype=dtype)
            parts.append(comm.link_irecv(piece, self.mesh, self.axis, self.group, self.offset + j, mb).wait())
        return torch.cat(parts)

    def wait(self) -> None:
        """Every send posted this step has been received."""
        for handle in self.pending:
            handle.wait()
        self.pending.clear()

"""Waiting on the ranks' futures (Monarch), and what a failure of one of them is.

The controller, the driver API and the islands all wait on a call made to every rank at once:
`gather` returns the results in rank order, or raises the first failure as soon as it is back,
naming the rank whose process died rather than a peer that lost it in a collective.
"""

from __future__ import annotations

import time

from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError  # a process died
from monarch.actor import ActorError


def island_result(future, timeout: float | None):
    """An island's future's value; its failure is reported as the island's."""
    try:
        return future.get(timeout=timeout)
    except (ActorError, SupervisionError) as exc:
        raise RankFailed("eval island", exc) from None


def gather(futures: list, wait_s: float = 0.5) -> list:
    """The results of one call on every rank, in rank order. The first failure is raised as
    soon as it is back, even while another rank still waits for the failed one in a collective
    (which would hold it until the watchdog's timeout)."""
    out, left = [None] * len(futures), list(range(len(futures)))
    while left:
        for i in list(left):
            try:  # the first rank left is waited for; the others are only looked at
                out[i] = futures[i].get(timeout=wait_s if i == left[0] else 0.001)
                left.remove(i)
            except TimeoutError:
                pass
            except (ActorError, SupervisionError) as exc:
                raise _root_cause(futures, left, i, exc) from None
    return out


def _root_cause(futures: list, left: list, i: int, exc: Exception) -> RankFailed:
    """Rank `i`'s failure or, when it failed in a collective because a peer's process died
    (kill -9, a crash: "connection closed by peer"), the dead peer's, which reaches the
    controller as a supervision event a few seconds later (Monarch's health checks: ~7 s here)."""
    if isinstance(exc, SupervisionError) or not any(s in str(exc) for s in _PEER_GONE):
        return RankFailed(i, exc)
    deadline = time.monotonic() + 15.0
    for j in left:
        if j == i:
            continue
        try:
            futures[j].get(timeout=max(0.001, deadline - time.monotonic()))
        except SupervisionError as died:
            return RankFailed(j, died)
        except (ActorError, TimeoutError):
            pass
    return RankFailed(i, exc)


# what a rank's collective raises when its peer is gone (gloo; NCCL's watchdog aborts instead)
_PEER_GONE = ("by peer", "remote worker", "Connection closed", "Connection reset")


class RankFailed(Exception):
    """A rank's call raised (ActorError: the rank's traceback) or its process died
    (SupervisionError)."""

    def __init__(self, rank: int | str, error: Exception):
        super().__init__(f"rank {rank}: {error}")
        self.rank, self.error = rank, error


def quiet(failure) -> None:
    """Monarch's hook for a failure no caller observed: the controller observes every one
    through its futures (`gather`) and reports it there."""

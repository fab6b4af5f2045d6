"""plait.comm: every collective plait issues, with its ledger, flight recorder and watchdog."""

from plait.comm.ledger import Ledger, LedgerRow, bus_bytes
from plait.comm.ops import (
    Handle,
    all_gather,
    all_reduce,
    all_reduce_scalar,
    all_to_all,
    barrier,
    batch_isend_irecv,
    broadcast,
    irecv,
    isend,
    link_irecv,
    link_isend,
    recv,
    reduce_scatter,
    send,
)
from plait.comm.recorder import WATCHDOG_EXIT_CODE, FlightRecorder, OpEntry, Watchdog

__all__ = [
    "Handle",
    "Ledger",
    "LedgerRow",
    "bus_bytes",
    "all_gather",
    "all_reduce",
    "all_reduce_scalar",
    "all_to_all",
    "barrier",
    "broadcast",
    "batch_isend_irecv",
    "irecv",
    "isend",
    "link_irecv",
    "link_isend",
    "recv",
    "reduce_scatter",
    "send",
    "FlightRecorder",
    "OpEntry",
    "Watchdog",
    "WATCHDOG_EXIT_CODE",
]

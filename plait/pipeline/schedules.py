"""Pipeline schedules: GPipe, 1F1B, interleaved 1F1B and the Zero Bubble family, by name.

The generators live in :mod:`plait.pipeline.orders` (the fixed orders: GPipe, 1F1B, interleaved,
ZB-H1) and :mod:`plait.pipeline.zero_bubble` (the list-scheduled ZB-H2 and ZB-V), the messages in
:mod:`plait.pipeline.messages`; this module names them and builds a checked schedule.

Each generator returns a compute-only :class:`~plait.pipeline.ir.Schedule` (F/B/W/BW actions);
:func:`add_communication` inserts the SEND/RECV actions; :func:`make_schedule` validates its
arguments, does both and checks the result with :func:`plait.pipeline.check.check_schedule`.

Costs quoted in the generators are in unit time, T_F = T_B = T_W = 1 (so BW = 2), no communication
cost, unless a planning cost model is named; a "bubble" is idle time inside the makespan of one step.
"""

from __future__ import annotations

from plait.errors import ConfigError
from plait.pipeline.check import check_schedule
from plait.pipeline.ir import Schedule
from plait.pipeline.messages import HOIST_LIMIT, add_communication, hoist_receives
from plait.pipeline.orders import check_multiple, gpipe, interleaved, one_f_one_b, zb_h1
from plait.pipeline.simulate import Costs
from plait.pipeline.zero_bubble import UNIT_COSTS, ZB_V_PLANNING_COSTS, zb_h2, zb_v

__all__ = [
    "HOIST_LIMIT",
    "SCHEDULES",
    "UNIT_COSTS",
    "ZB_V_PLANNING_COSTS",
    "add_communication",
    "default_virtual_stages",
    "gpipe",
    "hoist_receives",
    "interleaved",
    "make_schedule",
    "one_f_one_b",
    "zb_h1",
    "zb_h2",
    "zb_v",
]

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
        check_multiple(p, m)
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

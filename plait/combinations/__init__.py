"""Which features of a training job combine: the table, as data.

Each row (`Rule`) names a set of features (`FEATURES`: the layout's, such as ``tp`` or ``zero3``,
and the job's, such as ``moe`` or ``lamb/lars``) and says whether they work together. A refused
row carries the reason, what to change, the config keys the message names and the test that
proves the refusal; a supported row carries the test that proves the combination against one
process. `plait.layout.check` raises the first refused row that applies to a job, so config
validation, the planner's enumeration and `plait.parallelize` read this one table; a technique
that is used directly (``plait.zero.wrap``, ``apply_ep``, ...) and meets a refused combination
raises the same row with `refuse`, so no refusal is written twice. docs/compose.md's matrix is
`table_markdown()` (``python -m plait.combinations docs/compose.md``), and `plait layouts`
prints `describe_table()`.

This package sits just above plait.errors: every layer may read the table.
"""

from __future__ import annotations

from plait.combinations.render import BEGIN, END, describe_table, table_markdown, with_table
from plait.combinations.rows import COMBINATIONS, REFUSED, SOURCE_LIMITS, SUPPORTED
from plait.combinations.rule import FEATURES, LAYOUT_TEST, SWITCHES, Rule
from plait.errors import ConfigError, PlaitError

__all__ = [
    "BEGIN", "COMBINATIONS", "END", "FEATURES", "LAYOUT_TEST", "REFUSED", "ROWS", "SOURCE_LIMITS",
    "SUPPORTED", "SWITCHES", "Rule", "describe_table", "refuse", "table_markdown", "with_table",
]  # fmt: skip
ROWS: dict[str, Rule] = {r.id: r for r in COMBINATIONS}


class _Values(dict):
    """A row's message values: what a run-time guard knows; a value it does not know reads as
    its name (``{optimizer!r}`` -> ``optimizer``), never as a KeyError inside an error path."""

    def __missing__(self, key: str) -> _Name:
        return _Name(key)


class _Name(str):
    def __repr__(self) -> str:
        return str(self)


def refuse(row: str, error: type[PlaitError] = ConfigError, **values) -> PlaitError:
    """The error of the refused row `row`, for a run-time guard to raise::

        raise refuse("ep-hybrid", ep=2, hybrid_shard=1)

    `values` fill the row's message (the names of `plait.layout.message_values`); `error` is the
    class to raise (a technique's own subclass of PlaitError, ConfigError by default)."""
    rule = ROWS[row]
    if rule.supported:
        raise ValueError(f"row {row!r} is a supported combination, not a refusal")
    return error(rule.message(_Values(values)))

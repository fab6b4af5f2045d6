"""Parity with one process, as a user feature: `plait verify` (the config path, `plait.parity.runs`)
and `plait.verify(model_factory, loss_fn, batches, layouts)` (a custom loop, `plait.parity.pyapi`).

Both train the user's model for a few steps with SGD (no momentum, weight decay or clipping) on one
process and under each layout, and compare per step the loss, the global gradient norm, every
parameter's gradient (as its SGD update) and every parameter, gathered whole
(`plait.parity.compare`); `plait.parity.report` writes report.md, report.json and a plot.
docs/verify.md.
"""

from plait.parity.compare import Trace, compare, verdict_line
from plait.parity.pyapi import verify
from plait.parity.report import Report

__all__ = ["Report", "Trace", "compare", "verdict_line", "verify"]

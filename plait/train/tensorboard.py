"""TensorBoard event files beside metrics.jsonl (`[log] tensorboard = true`).

Every number of a metrics record becomes a scalar at the record's step, under its key (nested
records, such as the mixture-of-experts statistics, as ``moe/aux_loss``), so a technique that adds
a number to the records appears in TensorBoard with no change here. Lists (the per-expert token
counts) and strings are left to metrics.jsonl. Written by rank 0 only, with torch's
``SummaryWriter``, into ``<run_dir>/tensorboard``.
"""

from __future__ import annotations

import math
from pathlib import Path


def scalars(record: dict, prefix: str = "") -> dict[str, float]:
    """The numeric leaves of a metrics record, by slash-joined key (the step itself left out)."""
    out = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(scalars(value, f"{name}/"))
        elif isinstance(value, bool):
            out[name] = float(value)
        elif isinstance(value, int | float) and name != "step" and math.isfinite(value):
            out[name] = float(value)
    return out


class TensorBoardWriter:
    """Writes metrics records as scalars; `purge_step` (a resumed run's first step) tells
    TensorBoard to drop the events an interrupted run wrote from that step on."""

    def __init__(self, log_dir: Path, purge_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter  # needs the optional tensorboard package

        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)

    def write(self, record: dict) -> None:
        step = record.get("step")
        if step is None:
            return
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, global_step=int(step))

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()

"""Cluster descriptions for the planner: `load_cluster` takes a preset's name, `this` (this
machine, measured by `plait.planner.calibrate`) or a cluster file (`plait.planner.cluster_file`).
The records (`Link`, `Cluster`), the α-β model and the presets are in `plait.planner.hardware`.
"""

from __future__ import annotations

from plait.planner.calibrate import load_this
from plait.planner.cluster_file import read_calibration_key, read_cluster_file
from plait.planner.hardware import PRESET_NAMES, PRESETS, Cluster, Link, axis_links

__all__ = [
    "PRESETS",
    "PRESET_NAMES",
    "Cluster",
    "Link",
    "axis_links",
    "load_cluster",
    "read_calibration_key",
    "read_cluster_file",
]


def load_cluster(spec: str) -> Cluster:
    """A preset by name, `this` (this machine: `plait.planner.calibrate`), or a TOML file with the
    fields of a cluster file."""
    if spec in PRESETS:
        return PRESETS[spec]
    if spec == "this":
        return load_this()
    return read_cluster_file(spec)

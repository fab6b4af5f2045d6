"""Cluster files: a TOML file with the fields of a `plait.planner.hardware.Cluster` describes
any cluster the presets do not (a calibration of this machine is one, `plait.planner.calibrate`)::

    name = "my-cluster"
    gpus_per_node = 8
    peak_tflops = 312.0
    memory_gb = 80.0
    efficiency = 0.6
    [intra]
    alpha_us = 5.0
    beta_gbps = 300.0      # GB/s, one direction, per device
    [inter]
    alpha_us = 10.0
    beta_gbps = 25.0
    [islands]              # optional: islands of whole nodes joined by a slower link
    devices = 64           # devices per island, a multiple of gpus_per_node
    alpha_us = 5000.0
    beta_gbps = 1.25       # GB/s, one direction, per device (an island's uplink over its devices)

Every value is range-checked and an unknown key is refused, naming the valid ones.
"""

from __future__ import annotations

import math
import tomllib
from pathlib import Path

from plait.errors import ConfigError
from plait.pipeline.schedules import SCHEDULES
from plait.planner.hardware import PRESET_NAMES, Cluster, Link, _gbps

_LIMITS = {  # field: (lowest, highest) accepted from a file
    "gpus_per_node": (1, 1024),
    "cores": (1, 2**16),
    "ranks": (2, 1024),
    "world": (1, 1024),
    "peak_tflops": (1e-6, 1e6),
    "memory_gb": (1e-3, 1e5),
    "efficiency": (1e-3, 1.0),
    "usable_memory": (0.01, 1.0),
    "alpha_us": (0.0, 1e6),
    "beta_gbps": (1e-6, 1e6),
    "memory_bw_gbps": (1e-3, 1e6),
    "pcie_gbps": (1e-3, 1e6),
    "host_adam_params_per_s": (1.0, 1e15),
    "devices": (1, 2**20),
}


def _number(where: str, key: str, value, integer: bool = False) -> float:
    lo, hi = _LIMITS[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{where}: {key} must be a number, got {value!r}")
    if integer and value != int(value):
        raise ConfigError(f"{where}: {key} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise ConfigError(f"{where}: {key} = {value!r} is out of range [{lo:g}, {hi:g}]")
    return int(value) if integer else float(value)


def _link(where: str, table) -> Link:
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: must be a table with alpha_us and beta_gbps")
    unknown = set(table) - {"alpha_us", "beta_gbps"}
    if unknown or set(table) != {"alpha_us", "beta_gbps"}:
        raise ConfigError(f"{where}: needs exactly alpha_us and beta_gbps, got {', '.join(sorted(table))}")
    return Link(
        alpha_s=_number(where, "alpha_us", table["alpha_us"]) * 1e-6,
        beta_bps=_gbps(_number(where, "beta_gbps", table["beta_gbps"])),
    )


PRECISIONS = ("bf16", "fp32")
COLLECTIVE_OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "send")


def _islands(where: str, table, gpus_per_node: int) -> dict:
    """``[islands]``: devices per island and the α-β of the link between islands."""
    fields = {"devices", "alpha_us", "beta_gbps"}
    if not isinstance(table, dict) or set(table) != fields:
        got = ", ".join(sorted(table)) if isinstance(table, dict) else repr(table)
        raise ConfigError(f"{where}: [islands] needs exactly {', '.join(sorted(fields))}, got {got}")
    devices = _number(where, "devices", table["devices"], integer=True)
    if devices % gpus_per_node:
        raise ConfigError(
            f"{where}: [islands] devices = {devices} is not a whole number of nodes "
            f"(gpus_per_node = {gpus_per_node})"
        )
    link = _link(f"{where} [islands]", {k: table[k] for k in ("alpha_us", "beta_gbps")})
    return {"island_devices": devices, "island": link}


def _read_toml(spec: str) -> dict:
    path = Path(spec)
    if not path.is_file():
        raise ConfigError(
            f"--cluster {spec!r} is neither a preset ({', '.join(PRESET_NAMES)}) nor a TOML file that exists"
        )
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cluster file {spec!r} is not valid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"cluster file {spec!r} cannot be read ({exc.strerror or exc})") from None


def read_calibration_key(path) -> dict | None:
    """The ``[calibration]`` table of a cluster file (what it was measured on), or None."""
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    table = data.get("calibration")
    if not isinstance(table, dict):
        return None
    return {k: v for k, v in table.items() if k != "date"}


def _tuples(where: str, key: str, value, names: tuple[str, ...]) -> tuple:
    n = len(names)
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(p, list) and len(p) == n for p in value)
    ):
        raise ConfigError(f"{where}: {key} must be a list of [{', '.join(names)}] lists")
    out = []
    for item in value:
        for x in item:
            if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x) or x <= 0:
                raise ConfigError(f"{where}: {key} holds {x!r}; expected positive numbers")
        out.append((int(item[0]) if key == "rank_tflops" else float(item[0]), *map(float, item[1:])))
    return tuple(out)


def _collectives(where: str, items) -> tuple:
    if not isinstance(items, list):
        raise ConfigError(f"{where}: [[collective]] must be an array of tables")
    out = []
    for item in items:
        fields = {"op", "ranks", "world", "alpha_us", "beta_gbps"}
        if not isinstance(item, dict) or set(item) != fields:
            raise ConfigError(f"{where}: each [[collective]] needs exactly {', '.join(sorted(fields))}")
        if item["op"] not in COLLECTIVE_OPS:
            raise ConfigError(
                f"{where}: [[collective]] op = {item['op']!r}; valid: {', '.join(COLLECTIVE_OPS)}"
            )
        n, w = (_number(where, k, item[k], integer=True) for k in ("ranks", "world"))
        link = _link(where, {"alpha_us": item["alpha_us"], "beta_gbps": item["beta_gbps"]})
        out.append((item["op"], n, w, link))
    return tuple(out)


def _pipeline_overhead(where: str, table) -> tuple:
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: [pipeline_overhead_ms] must be a table of schedule = milliseconds")
    out = []
    for kind, ms in table.items():
        if kind not in SCHEDULES:
            raise ConfigError(f"{where}: [pipeline_overhead_ms] {kind!r}; valid: {', '.join(SCHEDULES)}")
        if isinstance(ms, bool) or not isinstance(ms, int | float) or not 0 <= ms < 1e6:
            raise ConfigError(f"{where}: [pipeline_overhead_ms] {kind} = {ms!r}; expected milliseconds >= 0")
        out.append((kind, float(ms) * 1e-3))
    return tuple(out)


def read_cluster_file(spec: str) -> Cluster:
    """The cluster a TOML file at `spec` describes (module docstring)."""
    data = _read_toml(spec)
    path = Path(spec)
    required = {"gpus_per_node", "peak_tflops", "memory_gb", "intra", "inter"}
    optional = {"efficiency", "usable_memory", "memory_bw_gbps", "pcie_gbps", "host_adam_params_per_s"}
    measured = {"precision", "cores", "rank_tflops", "efficiency_curve", "tp_efficiency", "collective"}
    measured |= {"calibration", "pipeline_overhead_ms"}
    known = required | optional | measured | {"name", "note", "islands"}
    if missing := required - set(data):
        raise ConfigError(f"cluster file {spec!r} lacks {', '.join(sorted(missing))}")
    if unknown := set(data) - known:
        raise ConfigError(
            f"cluster file {spec!r}: unknown key(s) {', '.join(sorted(unknown))}; "
            f"valid: {', '.join(sorted(known))}"
        )
    where = f"cluster file {spec!r}"
    precision = data.get("precision", "bf16")
    if precision not in PRECISIONS:
        raise ConfigError(f"{where}: precision = {precision!r}; valid: {', '.join(PRECISIONS)}")
    extra = {"precision": precision}
    if "cores" in data:
        extra["cores"] = _number(where, "cores", data["cores"], integer=True)
    tables = {
        "rank_tflops": ("ranks", "TFLOP/s"),
        "efficiency_curve": ("d_model", "tokens", "efficiency"),
        "tp_efficiency": ("d_model", "tokens", "tp", "efficiency"),
    }
    for key, names in tables.items():
        if key in data:
            extra[key] = _tuples(where, key, data[key], names)
    for key in ("efficiency_curve", "tp_efficiency"):
        if any(e > 1 for *_, e in extra.get(key, ())):
            raise ConfigError(f"{where}: {key} efficiencies must be at most 1")
    if any(t < 2 or t != int(t) for _, _, t, _ in extra.get("tp_efficiency", ())):
        raise ConfigError(f"{where}: tp_efficiency's tp must be an integer >= 2 (tp 1 is efficiency_curve)")
    if extra.get("tp_efficiency") and not extra.get("efficiency_curve"):
        raise ConfigError(f"{where}: tp_efficiency needs efficiency_curve (the unsplit model's)")
    if "collective" in data:
        extra["collectives"] = _collectives(where, data["collective"])
    if "pipeline_overhead_ms" in data:
        extra["pipeline_overhead"] = _pipeline_overhead(where, data["pipeline_overhead_ms"])
    gpus_per_node = _number(where, "gpus_per_node", data["gpus_per_node"], integer=True)
    if "islands" in data:
        extra |= _islands(where, data["islands"], gpus_per_node)
    return Cluster(
        name=str(data.get("name", path.stem)),
        gpus_per_node=gpus_per_node,
        peak_tflops=_number(where, "peak_tflops", data["peak_tflops"]),
        memory_gb=_number(where, "memory_gb", data["memory_gb"]),
        intra=_link(f"{where} [intra]", data["intra"]),
        inter=_link(f"{where} [inter]", data["inter"]),
        **{k: _number(where, k, data[k]) for k in optional if k in data},
        note=str(data.get("note", "")),
        **extra,
    )

"""Training configuration: loaded from TOML, overridden on the command line, validated.

    [train]
    steps = 300

    plait train configs/default.toml --train.steps 50 --parallel.dp 2

Loading is strict. An unknown section or key is an error naming the nearest valid one; a value
of the wrong type is refused as it is parsed. `validate` then runs, in the launching process,
before any rank starts: each value's own range (`plait.train.checks`), the model's source
(`plait.models.source`), the combination of the layout's features with the job's
(`plait.layout.check`, the table of `plait.combinations`), and whether the model and the data fit
the layout. The sections themselves are dataclasses with a doc per key (`plait.train.sections`).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import tomllib
import types
import typing
from pathlib import Path

from plait.errors import ConfigError
from plait.layout import Job, Layout, check
from plait.models.python_source import check_source
from plait.models.resolve import model_config
from plait.models.source import validate_source
from plait.train.checks import MAX_SIZE, check_bounds, check_fits, check_values, check_writable_dir, require
from plait.train.diloco_checks import check_diloco
from plait.train.sections import (
    SECTION_TYPES,
    CommConfig,
    Config,
    DataConfig,
    LogConfig,
    ModelConfig,
    OffloadConfig,
    OptimConfig,
    ParallelConfig,
    PsConfig,
    TrainConfig,
    describe_keys,
)

__all__ = [  # the sections, and what callers read from here since before the split
    "CommConfig",
    "Config",
    "DataConfig",
    "LogConfig",
    "MAX_SIZE",
    "ModelConfig",
    "OffloadConfig",
    "OptimConfig",
    "ParallelConfig",
    "PsConfig",
    "TrainConfig",
    "check_writable_dir",
    "config_from_dict",
    "describe_keys",
    "load_config",
    "model_config",
    "parse_overrides",
    "pipeline_shape",
    "read_config",
    "set_key",
    "validate",
]


def _nearest(name: str, choices) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f"; did you mean '{close[0]}'?" if close else f"; valid: {', '.join(sorted(choices))}"


def _field_types(cls) -> dict[str, tuple[type, bool]]:
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        optional = False
        if isinstance(t, types.UnionType) or typing.get_origin(t) is typing.Union:
            args = [a for a in typing.get_args(t) if a is not type(None)]
            optional, t = True, args[0]
        out[f.name] = (t, optional)
    return out


def _coerce(where: str, value, t: type, optional: bool, from_cli: bool):
    if from_cli and isinstance(value, str):
        if optional and value.lower() in ("none", "null", ""):
            return None
        try:
            if t is bool:
                low = value.lower()
                if low not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError
                return low in ("true", "1", "yes")
            if t is int:
                try:
                    return int(value)  # exact, however long ("9999999999999999999999")
                except ValueError:
                    f = float(value)  # "1e6"
                if not f.is_integer():
                    raise ValueError
                return int(f)
            if t is float:
                f = float(value)
                if not math.isfinite(f):
                    raise ValueError
                return f
            return t(value)
        except ValueError:
            raise ConfigError(f"{where}: expected {t.__name__}, got {value!r}") from None
    if value is None and optional:
        return None
    if t is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if t is float and isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where}: expected a finite number, got {value!r}")
    if not isinstance(value, t) or (t is int and isinstance(value, bool)):
        raise ConfigError(f"{where}: expected {t.__name__}, got {type(value).__name__} {value!r}")
    return value


def set_key(cfg: Config, section: str, key: str, value, from_cli: bool) -> None:
    """Set `section.key` of `cfg` to `value`, checked and coerced to the key's type (a ConfigError
    names an unknown key, with the nearest valid one, or a value of the wrong type)."""
    if section not in SECTION_TYPES:
        raise ConfigError(f"unknown section [{section}]{_nearest(section, SECTION_TYPES)}")
    types_ = _field_types(SECTION_TYPES[section])
    if key not in types_:
        full = [f"{section}.{k}" for k in types_]
        raise ConfigError(f"unknown key '{section}.{key}'{_nearest(f'{section}.{key}', full)}")
    t, optional = types_[key]
    setattr(getattr(cfg, section), key, _coerce(f"{section}.{key}", value, t, optional, from_cli))


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """['--train.steps', '50', '--parallel.dp=2'] -> [('train.steps', '50'), ('parallel.dp', '2')]."""
    out, i = [], 0
    while i < len(args):
        a = args[i]
        if not a.startswith("--") or "." not in a:
            raise ConfigError(f"unexpected argument {a!r}: overrides look like --section.key value")
        if "=" in a:
            k, v = a[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"{a} needs a value")
            k, v = a[2:], args[i + 1]
            i += 2
        out.append((k, v))
    return out


def load_config(path: str | Path | None = None, overrides: list[tuple[str, str]] = ()) -> Config:
    """Defaults <- TOML file <- command-line overrides, then validated."""
    cfg = read_config(path, overrides)
    validate(cfg)
    return cfg


def read_config(path: str | Path | None = None, overrides: list[tuple[str, str]] = ()) -> Config:
    """Defaults <- TOML file <- command-line overrides, each key checked for its type only."""
    cfg = Config()
    if path is not None:
        p = Path(path)
        try:
            data = tomllib.loads(_read_config_text(p))
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{p}: not valid TOML: {exc}") from None
        for section, values in data.items():
            if not isinstance(values, dict):
                raise ConfigError(
                    f"{p}: top-level key {section!r} must be a [section]{_nearest(section, SECTION_TYPES)}"
                )
            for key, value in values.items():
                set_key(cfg, section, key, value, from_cli=False)
    for dotted, value in overrides:
        section, _, key = dotted.partition(".")
        set_key(cfg, section, key, value, from_cli=True)
    return cfg


def _read_config_text(p: Path) -> str:
    """The text of config file `p`, or a ConfigError that says what `p` is instead."""
    if p.is_dir():
        raise ConfigError(
            f"config file {str(p)!r} is a directory; give a TOML file, e.g. configs/default.toml"
        )
    if not p.exists():
        raise ConfigError(f"config file {str(p)!r} not found")
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"config file {str(p)!r} cannot be read ({exc.strerror or exc})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ConfigError(
            f"config file {str(p)!r} is not UTF-8 text (byte 0x{raw[exc.start]:02x} on line {line}); "
            "a TOML config is UTF-8: is it the right file, or saved in another encoding?"
        ) from None


def config_from_dict(data: dict, check_data: bool = True) -> Config:
    """The inverse of `Config.to_dict()` (validated; `check_data=False` skips the check that
    loads the corpus, for processes whose launcher made it already)."""
    cfg = Config()
    for section, values in data.items():
        for key, value in values.items():
            set_key(cfg, section, key, value, from_cli=False)
    validate(cfg, data=check_data)
    return cfg


def validate(cfg: Config, data: bool = True) -> None:
    """Reject inconsistent values with a message that says what to change.

    ``data=False`` leaves out the one check that reads the corpus on this machine (that it holds a
    global batch); the planner validates layouts for clusters whose data is elsewhere. With
    ``parallel.plan = "auto"`` the layout is the planner's: what is checked here is everything
    but the layout, and the caller checks the layouts (`plait.planner.auto.check_auto`, which
    `resolve_auto` runs)."""
    check_bounds(cfg)
    check_values(cfg)
    check_diloco(cfg.diloco, cfg.parallel, cfg.train)
    validate_source(cfg)  # the model's source: an hf model refuses what it does not fit
    job = Job.from_config(cfg)
    p = cfg.parallel
    if p.plan == "auto":
        check(Layout(), job)  # what the job refuses whatever its layout (the planner plans plait's GPT)
        return
    require(
        p.world in (0, cfg.world_size),
        f"parallel.world = {p.world} but parallel.pp x dp x ep x cp x tp = {cfg.world_size}: with "
        "parallel.plan = 'manual' the degrees give the world; set parallel.world = 0 (or "
        f"{cfg.world_size}), or parallel.plan = 'auto' to have the layout chosen",
    )
    layout = Layout.from_config(cfg)
    check(layout, job)
    check_fits(cfg, layout, data)
    if cfg.model.source.startswith("python:"):  # last: the factory is imported and called once
        check_source(cfg, layout.n_stages)


def pipeline_shape(cfg: Config) -> tuple[int, int]:
    """(micro-batches, virtual stages per rank) of the configured pipeline, defaults resolved
    (`Layout.pipeline_microbatches`, `Layout.stages_per_rank`)."""
    layout = Layout.from_config(cfg)
    return layout.pipeline_microbatches, layout.stages_per_rank

"""`plait train --parallel.plan auto`: the planner chooses the layout of the processes at hand.

The processes: ``parallel.world`` (0: the product pp x dp x ep x cp x tp as configured, 2 by default).
The layout keys (`LAYOUT_KEYS`) set to anything but their default are constraints: the planner
only considers layouts with those values (``--parallel.tp 2`` keeps tp = 2, ``--parallel.zero_stage
3`` keeps ZeRO-3); a key left at its default is the planner's to choose. (A key given on the command
line with its default value is indistinguishable from one not given: it is the planner's.)

`plait.train.config.validate` checks such a config's keys but not its layout, which is the
planner's: `check_auto`, run by `resolve_auto` before any process starts, checks the non-layout
keys on a one-process copy, and that at least one layout of the model over the world, with the
constraints, passes plait's own validation, else a `ConfigError` says which worlds would do.
`resolve_auto` then prices the layouts on the cluster `this` (this machine, calibrated and cached:
`plait.planner.calibrate`), takes the fastest feasible one that validation accepts, and returns
the config that trains it (``parallel.plan = "manual"``: the run directory's config.toml records
the layout chosen, and ``--resume`` continues with it).
"""

from __future__ import annotations

import dataclasses

from plait.errors import ConfigError
from plait.models.resolve import model_config
from plait.planner.calibrate import load_this
from plait.planner.cluster import Cluster, Link
from plait.planner.cost import Candidate
from plait.planner.search import check_runnable, enumerate_layouts, layout_config, plan
from plait.train.config import Config, validate

LAYOUT_KEYS = {  # config key: the Candidate field it sets
    "parallel.dp": "dp",
    "parallel.tp": "tp",
    "parallel.pp": "pp",
    "parallel.ep": "ep",
    "parallel.cp": "cp",
    "parallel.zero_stage": "zero_stage",
    "parallel.hybrid_shard": "hybrid_shard",
    "parallel.sequence_parallel": "sequence_parallel",
    "parallel.schedule": "schedule",
    "parallel.microbatches": "microbatches",
    "parallel.virtual_stages": "virtual_stages",
    "train.micro_batches": "microbatches",
    "train.activation_checkpointing": "recompute",
    "offload.optimizer": "offload",
}
MAX_WORLD_HINT = 64
"""The worlds listed as valid when a world has no layout: 1 to this."""
_ENUMERATION = Cluster(  # only gpus_per_node and cores shape the enumeration: one CPU node
    name="enumeration",
    gpus_per_node=1024,
    peak_tflops=1.0,
    memory_gb=1.0,
    intra=Link(1e-6, 1e9),
    inter=Link(1e-6, 1e9),
    cores=1,
)


def _get(cfg, dotted: str):
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


def constraints(cfg) -> dict[str, object]:
    """The layout keys set to something other than their default: {config key: value}."""
    default = Config()
    return {k: _get(cfg, k) for k in LAYOUT_KEYS if _get(cfg, k) != _get(default, k)}


def auto_world(cfg) -> int:
    """The processes `--parallel.plan auto` plans for."""
    return cfg.parallel.world or cfg.world_size


def matches(layout: Candidate, cons: dict[str, object]) -> bool:
    """Does `layout` keep every constraint? (Pipeline micro-batches constrain pipelines, and
    gradient-accumulation micro-batches layouts without one.)"""
    for key, value in cons.items():
        if key == "parallel.microbatches" and layout.pp == 1:
            return False
        if key == "train.micro_batches" and layout.pp > 1:
            return False
        if key == "parallel.schedule" and layout.pp == 1:
            return False
        if key == "parallel.virtual_stages" and layout.pp == 1:
            return False
        if getattr(layout, LAYOUT_KEYS[key]) != value:
            return False
    return True


def _one_process(cfg):
    return layout_config(cfg, Candidate(), bf16=cfg.train.bf16)


def _candidates(cfg, world: int) -> list[Candidate]:
    cons = constraints(cfg)
    model = model_config(cfg)
    every = enumerate_layouts(model, cfg.train.global_batch, world, _ENUMERATION, cfg.model.dropout)
    return [lay for lay in every if matches(lay, cons)]


def check_auto(cfg, data: bool = True) -> None:
    """The layout check of a ``parallel.plan = "auto"`` config (module docstring): raises ConfigError."""
    validate(_one_process(cfg), data=data)  # every key but the layout's
    world = auto_world(cfg)
    cons = constraints(cfg)
    where = f"parallel.plan = 'auto' with parallel.world = {world}" + (
        f" and {', '.join(f'{k} = {v!r}' for k, v in cons.items())}" if cons else ""
    )
    layouts = _candidates(cfg, world)
    if not layouts:
        valid = [w for w in range(1, MAX_WORLD_HINT + 1) if _candidates(cfg, w)]
        raise ConfigError(
            f"{where}: no layout of this model (model.n_head, model.n_layer, train.global_batch = "
            f"{cfg.train.global_batch}) splits over {world} processes; parallel.world with a layout: "
            f"{', '.join(map(str, valid)) or 'none up to ' + str(MAX_WORLD_HINT)}"
            + (" (fewer constraints allow more)" if cons else "")
        )
    first = ""
    for lay in layouts:
        reason = check_runnable(cfg, lay, cfg.train.bf16)
        if not reason:
            return
        first = first or reason
    raise ConfigError(f"{where}: plait refuses every layout, e.g. {layouts[0].name()}: {first}")


def resolve_auto(cfg, cluster: Cluster | None = None, top: int = 20, out=None):
    """(the config that trains the best feasible layout, that plan's record) on `cluster`
    (default: `this`). Prints the chosen layout in one line to `out` (a file; None: silent)."""
    check_auto(cfg)
    if cluster is None:
        cluster = load_this()
    world = auto_world(cfg)
    cons = constraints(cfg)
    base = _one_process(cfg)
    result = plan(
        base,
        model_config(cfg),
        cfg.train.global_batch,
        world,
        cluster,
        top=top,
        optimizer=cfg.optim.name,
        bf16=cfg.train.bf16,
        allowed=lambda lay: matches(lay, cons),
    )
    feasible = [r for r in result["plans"] if r["feasible"]]
    if not feasible:
        reasons = "; ".join(f"{r['layout']}: {r['reason']}" for r in result["plans"][:3])
        raise ConfigError(f"parallel.plan = 'auto': no feasible layout for {world} processes ({reasons})")
    best = feasible[0]
    lay = Candidate(**{f.name: best[f.name] for f in dataclasses.fields(Candidate)})
    chosen = layout_config(base, lay, bf16=cfg.train.bf16)
    validate(chosen)  # with the data check this time: the run is here
    if out is not None:
        out.write(
            f"plait: parallel.plan auto: {lay.name()} for {world} processes on `{cluster.name}`, predicted "
            f"{best['step_s'] * 1e3:.0f} ms/step (best of {result['candidates']} layouts; plait plan "
            f"--cluster {cluster.name} --devices {world} lists them)\n"
        )
    return chosen, best

"""`plait verify CONFIG`: choose the layouts, run them and the reference, compare, report."""

from __future__ import annotations

import copy
import dataclasses
import sys
from pathlib import Path

from plait.combinations import refuse
from plait.errors import ConfigError
from plait.layout import Job, Layout, check
from plait.parity.compare import compare, failed_result, verdict_line
from plait.parity.measured import measured
from plait.parity.report import Report
from plait.parity.runs import (
    MAX_LAYOUTS,
    Progress,
    base_config,
    initial_parameters,
    parse_layout,
    read_trace,
    reference_config,
)
from plait.planner.calibrate import cache_path
from plait.planner.candidate import Candidate
from plait.planner.cluster import load_cluster
from plait.planner.search import layout_config, plan
from plait.train.config import Config, model_config, validate

TOL_FP32, TOL_BF16 = 1e-5, 2e-2  # docs/verify.md: bf16 rounds every matmul differently per layout


@dataclasses.dataclass
class Request:
    config: Config
    layouts: list[str]
    top: int
    steps: int
    lr: float
    tol: float | None
    out: Path
    cluster: str | None
    quiet: bool = False


def planned_layouts(base: Config, top: int, world: int, cluster) -> list[tuple[str, Config]]:
    """The planner's `top` fastest runnable layouts of `base` on `world` processes of `cluster`."""
    result = plan(
        base, model_config(base), base.train.global_batch, world, cluster, top=top,
        optimizer="sgd", bf16=base.train.bf16,
    )  # fmt: skip
    out = []
    for r in result["plans"]:
        if not r["feasible"]:
            continue
        lay = Candidate(**{f.name: r[f.name] for f in dataclasses.fields(Candidate)})
        cfg = layout_config(base, lay, bf16=base.train.bf16)
        validate(cfg)
        out.append((lay.name(), cfg))
    if not out:
        raise ConfigError(f"verify: the planner found no runnable layout of this config on {world} processes")
    return out[:top]


def choose_layouts(req: Request, base: Config) -> tuple[list[tuple[str, Config]], object]:
    """(the layouts to verify, the cluster whose predictions are shown), every one checked."""
    if not req.layouts and base.model.source != "plait":  # before calibrating for the planner
        raise refuse("auto-source", source=base.model.source)
    cluster = None
    if req.cluster is not None or req.top or cache_path().is_file():
        cluster = load_cluster(req.cluster or "this")
    if req.layouts:
        layouts = [parse_layout(text, base) for text in req.layouts]
    else:
        world = req.config.world_size if req.config.world_size > 1 else 2
        layouts = planned_layouts(base, req.top or 3, world, cluster)
    names = [n for n, _ in layouts]
    if len(set(names)) != len(names):
        raise ConfigError(f"verify: a layout is given twice ({', '.join(names)})")
    if len(layouts) > MAX_LAYOUTS:
        raise ConfigError(f"verify: {len(layouts)} layouts; at most {MAX_LAYOUTS} per call")
    for _, cfg in layouts:
        check(*_layout_job(cfg))
    return layouts, cluster


def _layout_job(cfg: Config):
    return Layout.from_config(cfg), Job.from_config(cfg)


def verify_config(req: Request) -> Report:
    """Run the verification `req` asks for (every input checked before any process starts)."""
    base = base_config(req.config, req.steps, req.lr)
    ref_cfg = reference_config(base)
    layouts, cluster = choose_layouts(req, base)
    tol = req.tol if req.tol is not None else (TOL_BF16 if base.train.bf16 else TOL_FP32)
    initial = initial_parameters(ref_cfg)
    progress = Progress(1 + len(layouts), quiet=req.quiet)
    ref = read_trace("one process", progress.run("reference", ref_cfg, req.out), ref_cfg, initial)
    report = Report(tol=tol, lr=req.lr, steps=req.steps, reference="one process (the whole global batch)")
    if base.train.bf16:
        report.notes.append(f"bf16: tolerance {tol:g} (each layout rounds its bf16 matmuls differently)")
    if cluster is None:
        report.notes.append("no predicted step times: `plait plan --calibrate` measures this machine once")
    for name, cfg in layouts:
        try:
            trace = read_trace(name, progress.run(name, cfg, req.out), cfg, initial)
        except ConfigError as exc:  # the run failed: a verdict, not the end of the others
            result = failed_result(exc, getattr(exc, "records", []))
            report.add(name, _keys(cfg), result)
            if not req.quiet:
                print(f"plait verify: {verdict_line(name, result)}", file=sys.stderr, flush=True)
            continue
        result = compare(ref, trace, tol)
        report.add(name, _keys(cfg), result, measured(cfg, trace, cluster))
        if not req.quiet:
            print(f"plait verify: {verdict_line(name, result)}", file=sys.stderr, flush=True)
    report.write(req.out)
    return report


def _keys(cfg: Config) -> dict:
    p = cfg.parallel
    keys = {
        k: getattr(p, k)
        for k in ("pp", "dp", "ep", "cp", "tp", "zero_stage", "hybrid_shard", "sequence_parallel")
    }
    if p.cp > 1:
        keys["cp_style"] = p.cp_style
    if p.pp > 1:
        keys.update(schedule=p.schedule, microbatches=p.microbatches, virtual_stages=p.virtual_stages)
    keys["micro_batches"] = cfg.train.micro_batches
    return copy.deepcopy(keys)

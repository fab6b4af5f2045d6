"""`plait.verify(model_factory, loss_fn, batches, layouts)`: the parity check for a custom loop.

The reference is one process training `model_factory()` on each whole batch with SGD; each
layout runs the same model, batches and seed under `plait.parallelize` on as many local
processes as it has ranks. Both record the loss, the global gradient norm and every parameter
whole after each step, and `plait.parity.compare` says where they part.
"""

from __future__ import annotations

import math
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from plait.api import KEYS, parallelize
from plait.comm.spawn import RankFailure, check_main_guard, run_ranks
from plait.errors import ConfigError
from plait.parity.compare import Trace, compare, failed_result, verdict_line
from plait.parity.report import Report
from plait.train.module_record import ModuleRecorder, where_on, write_failure
from plait.train.module_record import read as read_records

DEGREES = ("dp", "tp", "pp", "ep")
MAX_RANKS = 64  # local processes one layout may spawn
_SEEDED = threading.Lock()


def layout_name(layout: Mapping) -> str:
    """`dp=2+zero_stage=3`: a layout as `plait verify --layouts` writes it."""
    return "+".join(f"{k}={v}" for k, v in layout.items())


def layout_world(layout: Mapping) -> int:
    """The processes a layout runs on: dp x tp x pp x ep (an absent degree is 1)."""
    unknown = sorted(set(layout) - set(KEYS) - {"micro_batches"})
    if unknown:
        raise ConfigError(
            f"verify: unknown layout key {unknown[0]!r}; valid: {', '.join([*KEYS, 'micro_batches'])}"
        )
    world = math.prod(int(layout.get(k) or 1) for k in DEGREES)
    if world < 2 or world > MAX_RANKS:
        raise ConfigError(
            f"verify: layout {layout_name(layout) or '{}'} runs on {world} process(es); give degrees "
            f"(dp, tp, pp, ep) whose product is 2 to {MAX_RANKS} (one process is the reference)"
        )
    return world


def _loss(model, batch, loss_fn):
    if loss_fn is not None:
        return loss_fn(model, batch)
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}


def reference_trace(model_factory, loss_fn, batches, lr: float, seed: int) -> Trace:
    """One process, each whole batch, SGD(lr) without momentum, weight decay or clipping."""
    torch.manual_seed(seed)
    model = model_factory()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, norms, params = [], [], [_params(model)]
    recorder = ModuleRecorder(model, {"data": [0, 1], "tp": [0, 1], "pp": 0, "ep": 1})
    for batch in batches:
        loss = _loss(model, batch, loss_fn)
        loss.backward()
        recorder.stop()  # step 1's modules: what localisation compares
        grads = [p.grad.double().square().sum() for p in model.parameters() if p.grad is not None]
        norms.append(float(torch.stack(grads).sum().sqrt()) if grads else 0.0)
        losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad()
        params.append(_params(model))
    trace = Trace("one process", losses, norms, params)
    trace.modules = [recorder.state()]
    return trace


def _rank(
    model_factory, loss_fn, batches, layout, lr, seed, tp_plan, layout_rules, stages=None, failures=None
):
    """One rank of a layout (run by plait.comm.spawn.run_ranks). A step that raises writes the
    module it was in to `failures` (a directory) before the exception ends the rank."""
    options = {k: v for k, v in layout.items() if k != "micro_batches"}
    torch.manual_seed(seed)
    model = model_factory()
    engine = parallelize(
        model,
        lambda p: torch.optim.SGD(p, lr=lr),
        options,
        loss_fn=loss_fn,
        tp_plan=tp_plan,
        layout_rules=layout_rules,
        seed=seed,
        stages=stages,
    )
    micro = int(layout.get("micro_batches", 1))
    losses, norms, params = [], [], [engine.full_parameters()]
    recorder = ModuleRecorder(model, where_on(engine.mesh))
    for batch in batches:
        try:
            losses.append(engine.forward_backward(engine.shard(batch), micro_batches=micro))
        except Exception as exc:
            if failures is not None:
                write_failure(Path(failures), engine.rank, recorder.failure(exc))
            raise
        recorder.stop()  # step 1's modules: what localisation compares
        norms.append(engine.grad_norm())
        engine.step()
        params.append(engine.full_parameters())
    placements = getattr(engine.engine, "placements", {})
    engine.close()
    return losses, norms, params, placements, recorder.state()


def layout_trace(
    model_factory, loss_fn, batches, layout, lr, seed, tp_plan, layout_rules, stages=None
) -> Trace:
    """The layout's run as a `Trace` (with its ranks' module records), or, when a rank failed,
    the failure as a verdict: {"holds": False, "failed": {...}} (`failed_result`)."""
    world = layout_world(layout)
    with tempfile.TemporaryDirectory(prefix="plait-verify-") as failures:
        args = (
            model_factory,
            loss_fn,
            batches,
            dict(layout),
            lr,
            seed,
            tp_plan,
            layout_rules,
            stages,
            failures,
        )
        try:
            results = run_ranks(_rank, world, args, timeout=600)
        except RankFailure as exc:
            return failed_result(exc, read_records(Path(failures))[1])
    return trace_of(layout_name(layout), results)


def trace_of(name: str, results: list) -> Trace:
    """The `Trace` of a layout from its ranks' `_rank` results."""
    losses, norms = results[0][0], results[0][1]
    params = [{} for _ in results[0][2]]
    placements: dict[str, str] = {}
    for _, _, rank_params, rank_placements, _ in results:  # a pipeline's stages hold different names
        for k, step in enumerate(rank_params):
            for pname, value in step.items():
                params[k].setdefault(pname, value)
        for pname, where in rank_placements.items():
            placements.setdefault(pname, where)
    trace = Trace(name, losses, norms, params, placements)
    trace.modules = [r[4] for r in results]
    return trace


def verify(
    model_factory: Callable,
    loss_fn: Callable | None,
    batches: Sequence,
    layouts: Sequence[Mapping],
    *,
    lr: float = 0.2,
    tol: float = 1e-5,
    seed: int = 0,
    tp_plan: dict | None = None,
    layout_rules: dict | None = None,
    stages: Callable | None = None,
    out=None,
    quiet: bool = False,
) -> Report:
    """Check that each layout trains `model_factory()` like one process (docs/verify.md).

    Args:
        model_factory: ``model_factory() -> nn.Module``, the whole model in fp32, called after
            ``torch.manual_seed(seed)`` in the reference and on every rank; a module-level
            function (it is sent to the ranks).
        loss_fn: ``loss_fn(model, batch) -> the mean loss over the batch's rows``, or None for
            the model's own (as `plait.parallelize` takes it).
        batches: the global batches, one per step (tensors, or tuples, lists or dicts of
            tensors sharing their first dimension, a multiple of each layout's dp x ep).
        layouts: `plait.parallelize` layouts (``{"dp": 2, "zero_stage": 3}``, ``{"tp": 2,
            "sequence_parallel": True}``), each on dp x tp x pp x ep local processes, plus
            ``micro_batches`` (gradient accumulation in `forward_backward`).
        lr: SGD's learning rate (no momentum, weight decay or clipping: a gradient 2x too large
            moves the parameters 2x too far instead of being hidden by Adam's normalisation).
        tol: the relative error above which a layout differs.
        stages: ``stages(model) -> the pipeline's stage modules`` (a list, one per stage, or an
            nn.Sequential to cut), for layouts with pp > 1 (`plait.parallelize`'s `stages`); a
            module-level function. Default: the model's own cut.
        out: a directory for report.md, report.json and the plot (None: nothing written).

    Returns the `Report`; ``report.holds`` is True when every layout holds.
    """
    check_main_guard("plait.verify")  # before the reference trains: every rank re-imports the script
    batches = list(batches)
    if not batches:
        raise ConfigError("verify: batches is empty; give one global batch per step")
    for layout in layouts:
        layout_world(layout)  # every layout's keys and size, before any process starts
    with _SEEDED:  # torch's generator is global: one reference at a time in this process
        ref = reference_trace(model_factory, loss_fn, batches, lr, seed)
    report = Report(tol=tol, lr=lr, steps=len(batches), reference=ref.name)
    for layout in layouts:
        trace = layout_trace(model_factory, loss_fn, batches, layout, lr, seed, tp_plan, layout_rules, stages)
        name = layout_name(layout)
        result = trace if isinstance(trace, dict) else compare(ref, trace, tol)
        report.add(name, dict(layout), result)
        if not quiet:
            print(f"plait verify: {verdict_line(name, result)}", flush=True)
    if out is not None:
        report.write(out)
    return report

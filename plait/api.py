"""`plait.parallelize`: plait's parallel training in a training loop the user writes (the audience
of Hugging Face Accelerate).

    engine = plait.parallelize(model, lambda params: torch.optim.AdamW(params, lr=1e-3), {"zero_stage": 3})
    for batch in batches:                              # this rank's rows (engine.shard splits a global batch)
        loss = engine.forward_backward(batch)          # the mean loss over the global batch
        engine.step()
    engine.save("ckpt")                                # DCP; loads at any number of ranks

It calls the one parallelize path, `plait.apply.parallelize`, as `plait train` does
(docs/compose.md): expert parallel -> tensor parallel from the user's layout rules -> the
pipeline cut -> activation checkpointing of the user's blocks -> data parallel or ZeRO 1-3 ->
the optimizer, built by the user's factory after wrapping. Checkpoints go through
`plait.train.checkpoint` (layout-free, so a checkpoint saved at 2 ranks loads at 1). Under a
pipeline (pp > 1) the model cuts itself (plait's GPT, a Hugging Face model plait supports), is an
nn.Sequential, or is cut by `stages=`; a batch is `(inputs, targets)`, and the last stage computes
the loss: the model's own, or `loss_fn(model, batch)` with `model(inputs)` that stage's output.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait import zero
from plait.apply import parallelize as parallelize_part
from plait.context_parallel import STYLES
from plait.errors import ConfigError
from plait.layout import Job, Layout
from plait.mesh import Mesh, backend_for, default_device, init_distributed
from plait.moe.layer import MoE
from plait.parallel_model import ParallelModel, stage_loss
from plait.pipeline.stage import ModuleStage, split_sequential

# The keys `mesh_or_config` may hold, with their defaults (dp = None: every rank not used by tp).
KEYS: dict[str, Any] = {
    "dp": None,
    "tp": 1,
    "zero_stage": 0,
    "hybrid_shard": 0,
    "sequence_parallel": False,
    "bucket_mb": 25.0,
    "mixed_precision": None,
    "activation_checkpointing": False,
    "pp": 1,
    "ep": 1,
    "cp": 1,
    "cp_style": "ring",
    "schedule": "1f1b",
    "microbatches": 0,
    "virtual_stages": 0,
    "offload": "none",
    "offload_path": "",
    "device": None,
    "timeout_s": 300.0,
}
# What a Mesh already fixes; the other keys are `options` beside a Mesh.
SHAPE_KEYS = ("dp", "tp", "pp", "ep", "cp", "hybrid_shard", "device", "timeout_s")


def _settings(spec) -> dict:
    """The keys of a dict or of a ParallelConfig-like object, checked: unknown keys are errors
    naming the nearest valid one."""
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        # a plait ParallelConfig: take the keys this API knows, refuse what it cannot do
        raw = {k: v for k, v in dataclasses.asdict(spec).items() if k in KEYS}
    elif isinstance(spec, Mapping):
        raw = dict(spec)
        unknown = [k for k in raw if k not in KEYS]
        if unknown:
            near = difflib.get_close_matches(unknown[0], list(KEYS), n=1, cutoff=0.5)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(
                f"parallelize: unknown key {unknown[0]!r} in mesh_or_config{hint}; "
                f"valid keys: {', '.join(KEYS)}"
            )
    else:
        raise ConfigError(
            "parallelize: mesh_or_config must be a plait Mesh, a dict (e.g. {'dp': 2, 'zero_stage': 3}) "
            f"or a ParallelConfig, not {type(spec).__name__}"
        )
    out = {**KEYS, **raw}
    if out["zero_stage"] not in zero.STAGES:
        raise ConfigError(f"parallelize: zero_stage = {out['zero_stage']!r}; valid: 0, 1, 2, 3")
    if out["cp_style"] not in STYLES:
        raise ConfigError(f"parallelize: cp_style = {out['cp_style']!r}; valid: {', '.join(STYLES)}")
    for key in ("dp", "tp", "pp", "ep", "cp", "hybrid_shard", "microbatches", "virtual_stages"):
        v = out[key]
        low = 1 if key in ("dp", "tp", "pp", "ep", "cp") else 0
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < low):
            raise ConfigError(f"parallelize: {key} must be an integer >= {low}, got {v!r}")
    return out


def _init_group(device) -> tuple[torch.device, bool]:
    """The default process group: the launcher's (torchrun, `plait launch`) when its environment
    is set, else a group of one process (a plain `python script.py`). Returns the device and
    whether this call created the group."""
    if dist.is_initialized():
        return (torch.device(device) if device is not None else default_device()), False
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if device is None and torch.cuda.is_available():  # one GPU per local rank
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        return init_distributed(device), True
    dev = torch.device(device) if device is not None else default_device()
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group(backend_for(dev), store=dist.HashStore(), rank=0, world_size=1)
    return dev, True


def parallelize(
    model: nn.Module,
    optimizer_factory: Callable,
    mesh_or_config: Mesh | Mapping | Any = None,
    *,
    options: Mapping | None = None,
    loss_fn: Callable | None = None,
    tp_plan: dict | None = None,
    layout_rules: dict | None = None,
    blocks: list[nn.Module] | None = None,
    param_groups: list[dict] | None = None,
    grad_clip: float = 0.0,
    scheduler: Callable | None = None,
    seed: int = 0,
    stages: Sequence[nn.Module] | Callable | None = None,
) -> ParallelModel:
    """Wrap a plain PyTorch model for the layout `mesh_or_config` asks for, and build its optimizer.

    Run on every rank (under `torchrun` or `plait launch`, or as one plain process), with the
    model built identically on every rank (the same seed): tensor parallelism cuts each rank's
    slice from the whole, and data parallelism broadcasts dp rank 0's values.

    Args:
        model: the user's nn.Module, in fp32, on the CPU or the rank's device (moved to it).
        optimizer_factory: `factory(params_or_groups) -> torch.optim.Optimizer`, e.g.
            `lambda p: torch.optim.AdamW(p, lr=1e-3)`. Called once, after wrapping, with the
            tensors this rank steps (its shards from ZeRO stage 1). An optimizer already built
            is refused: it would hold the parameters wrapping replaces.
        mesh_or_config: a plait `Mesh` (its process group already initialised), or a dict or
            plait ParallelConfig with the keys: dp (default: every rank that tp leaves), tp
            (tensor-parallel degree, needs layout rules), zero_stage (0 data parallel, 1-3
            ZeRO), hybrid_shard (ZeRO within groups of this many dp ranks, replicated across),
            sequence_parallel (with tp), bucket_mb (gradient bucket size), mixed_precision
            ("bf16" from stage 1), activation_checkpointing (recompute each of `blocks`),
            device ("cpu", "cuda:0"; default the local GPU, else the CPU), timeout_s (a
            collective pending longer is reported as a hang), pp (pipeline stages; the model
            must cut itself or be an nn.Sequential, and batches are `(inputs, targets)`),
            schedule, microbatches and virtual_stages (the pipeline's: 1f1b, gpipe,
            interleaved, zb-h1, zb-h2, zb-v), ep (expert parallelism over the model's plait MoE
            layers: the batch is split over dp x ep), offload ("cpu" or "disk": ZeRO-Offload's
            optimizer state and step off the device, from stage 1; disk under offload_path), cp
            (context parallelism: each sequence split over cp ranks; the model attends through
            `plait.context_parallel.attention`, batches hold whole sequences on dim 1) and
            cp_style ("ring" or "ulysses").
            None means {} (data parallel over every rank). The process group is initialised
            from the launcher's environment (RANK, WORLD_SIZE, ...) when none is, or as a group
            of one.
        options: the keys above that a Mesh does not fix (zero_stage, sequence_parallel,
            bucket_mb, mixed_precision, activation_checkpointing, schedule, microbatches,
            virtual_stages, offload, offload_path, cp_style), given beside a Mesh; beside a dict they are
            merged into it.
        loss_fn: `loss_fn(model, batch) -> scalar`, the mean loss over the batch's rows;
            default: the model's own output, called as model(*batch), model(**batch) or
            model(batch), which must then be that scalar. Under a pipeline (pp > 1, the model
            an nn.Sequential or cut by `stages`) a batch is `(inputs, targets)` and loss_fn runs
            on the last stage once per micro-batch, where `model(inputs)` returns the last
            stage's output (so one loss_fn serves every layout); without a loss_fn the last
            stage returns the summed loss (a model that cuts itself, like plait's GPT).
        tp_plan: the tensor-parallel plan, {module name pattern: style} with the styles of
            `plait.tensor_parallel` (Colwise, Rowwise, ...); default the model's `tp_plan()`.
            Required (here or on the model) when tp > 1.
        layout_rules: Mesh-TensorFlow layout rules over the plan's named dims, {dim: "tp" or
            None}; default: every named dim split.
        blocks: the model's repeated blocks: ZeRO-3's units (gathered one at a time) and what
            activation checkpointing recomputes; default the model's `plait_blocks()` and any
            torch Transformer layers (otherwise ZeRO-3 gathers the whole model as one unit).
        param_groups: torch-style groups of `model`'s parameters with per-group options (e.g.
            weight decay on matrices only); default one group.
        grad_clip: clip the global gradient norm to this in `step()` (0: no clipping).
        scheduler: `scheduler(optimizer) -> LR scheduler`, stepped after each optimizer step and
            saved in checkpoints.
        seed: seeds the per-tp-rank random stream of dropouts inside split layers.
        stages: the pipeline's stages (pp > 1): a list of modules of `model`, one per stage
            (pp x virtual stages), each called on the previous one's output (the first on the
            inputs); or an nn.Sequential of `model`'s layers, cut into equal runs; or
            `stages(model)` returning either (ignored without a pipeline, so one `stages`
            serves every layout). Default: the model's own cut (`pipeline_split`), or the
            model itself when it is an nn.Sequential.
    """
    _check_inputs(model, optimizer_factory, mesh_or_config, tp_plan)  # before any process group
    owns_mesh = not isinstance(mesh_or_config, Mesh)
    mesh, s, owns_group = _mesh_and_settings(mesh_or_config, dict(options or {}))
    return _wrap(model, optimizer_factory, mesh, s, loss_fn, tp_plan, layout_rules, blocks,
                 param_groups, grad_clip, scheduler, seed, (owns_group, owns_mesh), stages)  # fmt: skip


def _check_inputs(model, optimizer_factory, mesh_or_config, tp_plan) -> None:
    """A factory, not an optimizer; layout rules when tp > 1."""
    if isinstance(optimizer_factory, torch.optim.Optimizer) or not callable(optimizer_factory):
        raise ConfigError(
            "parallelize: optimizer_factory must be a callable building the optimizer from the parameters "
            "it is given, e.g. lambda params: torch.optim.AdamW(params, lr=1e-3); an optimizer built "
            "before wrapping would hold parameters that wrapping replaces"
        )
    tp = mesh_or_config.size("tp") if isinstance(mesh_or_config, Mesh) else None
    if tp is None and isinstance(mesh_or_config, Mapping):
        tp = mesh_or_config.get("tp", 1)
    elif tp is None and mesh_or_config is not None:
        tp = getattr(mesh_or_config, "tp", 1)
    if tp not in (None, 1) and tp_plan is None and not callable(getattr(model, "tp_plan", None)):
        raise ConfigError(
            f"parallelize: tp = {tp} needs layout rules for {type(model).__name__}: pass "
            "tp_plan={module name pattern: Colwise() / Rowwise() ...} (plait.tensor_parallel) and "
            "optionally layout_rules, or give the model a tp_plan() method; or set tp = 1"
        )


def _mesh_and_settings(mesh_or_config, options: dict) -> tuple[Mesh, dict, bool]:
    """The Mesh (given, or built over the launcher's processes), the checked settings, and
    whether this call created the process group."""
    owns_group = False
    if isinstance(mesh_or_config, Mesh):
        mesh = mesh_or_config
        fixed = [k for k in options if k in SHAPE_KEYS]
        if fixed:
            allowed = ", ".join(k for k in KEYS if k not in SHAPE_KEYS)
            raise ConfigError(
                f"parallelize: options key {fixed[0]!r} is fixed by the Mesh given; pass a dict instead "
                f"of a Mesh to choose it, or only these options: {allowed}"
            )
        sizes = {a: mesh.size(a) for a in ("dp", "tp", "pp", "ep", "cp")}
        s = _settings({**sizes, **options})
        if mesh.has_axis("dp_shard"):
            s["hybrid_shard"] = mesh.size("dp_shard")
    else:
        spec = mesh_or_config if mesh_or_config is not None else {}
        if options:  # beside a dict or ParallelConfig: merged into it
            spec = {**(_settings(spec) if dataclasses.is_dataclass(spec) else spec), **options}
        s = _settings(spec)
        device, owns_group = _init_group(s["device"])
        world = dist.get_world_size()
        others = s["tp"] * s["pp"] * s["ep"] * s["cp"]
        dp = s["dp"] if s["dp"] is not None else world // others
        if dp * others != world:
            raise ConfigError(
                f"parallelize: pp = {s['pp']} x dp = {dp} x ep = {s['ep']} x cp = {s['cp']} x "
                f"tp = {s['tp']} is {dp * others} ranks but the world size is {world}: set the degrees "
                "so that their product is the number of processes"
            )
        if s["hybrid_shard"] and dp % s["hybrid_shard"]:
            raise ConfigError(f"parallelize: hybrid_shard = {s['hybrid_shard']} must divide dp = {dp}")
        s["dp"] = dp
        mesh = Mesh(
            pp=s["pp"],
            dp=dp,
            ep=s["ep"],
            cp=s["cp"],
            tp=s["tp"],
            device=device,
            timeout_s=s["timeout_s"],
            dp_shard=s["hybrid_shard"] or None,
        )
    return mesh, s, owns_group


def _layout(mesh: Mesh, s: dict) -> Layout:
    """The Layout of the mesh's degrees and the settings `s`."""
    return Layout(
        **mesh.sizes,
        dp_shard=s["hybrid_shard"] or 0,
        zero_stage=s["zero_stage"],
        sequence_parallel=s["sequence_parallel"],
        cp_style=s["cp_style"],
        schedule=s["schedule"],
        microbatches=s["microbatches"],
        virtual_stages=s["virtual_stages"],
        activation_checkpointing=s["activation_checkpointing"],
        mixed_precision=s["mixed_precision"] or "fp32",
        offload=s["offload"],
        offload_path=s["offload_path"],
        bucket_mb=s["bucket_mb"],
    )


def pipeline_stages(model: nn.Module, stages, loss_fn, n_stages: int) -> list[nn.Module] | None:
    """The stage modules `plait.apply.parallelize` cuts `model` into under a pipeline, or None
    for the model's own cut (no loss_fn, no stages: plait's GPT, a Hugging Face model, an
    nn.Sequential with a summed `loss_fn` attribute). With a loss_fn the last stage applies it
    (`stage_loss`)."""
    if stages is not None and callable(stages) and not isinstance(stages, nn.Module):
        stages = stages(model)
    if stages is None and loss_fn is None:
        return None
    if stages is None:
        if not isinstance(model, nn.Sequential) or callable(getattr(model, "pipeline_split", None)):
            raise ConfigError(
                f"parallelize: a loss_fn under a pipeline (pp > 1) needs the stages' modules: make the "
                f"model an nn.Sequential or pass stages=[...] (one module per stage); a "
                f"{type(model).__name__} that cuts itself computes its loss on its last stage: "
                "pass no loss_fn"
            )
        stages = model
    loss = stage_loss(loss_fn) if loss_fn is not None else None
    ours = {id(q) for q in model.parameters()}
    parts = list(stages)
    if not all(isinstance(m, nn.Module) for m in parts) or any(
        id(q) not in ours for m in parts for q in m.parameters()
    ):
        raise ConfigError(
            "parallelize: stages must be modules of the model (a list, one per stage, or an "
            "nn.Sequential of its layers) sharing its parameters"
        )
    if isinstance(stages, nn.Sequential):
        return split_sequential(stages, n_stages, loss, "uniform")
    if len(parts) != n_stages:
        raise ConfigError(
            f"parallelize: {len(parts)} stage modules for {n_stages} pipeline stages (pp x virtual "
            f"stages): give one per stage, or an nn.Sequential to cut"
        )
    return [ModuleStage(m, i, n_stages, loss) for i, m in enumerate(parts)]


def _wrap(model, factory, mesh, s, loss_fn, tp_plan, layout_rules, blocks, groups, clip, sched, seed, owns,
          stages=None):  # fmt: skip
    """`plait.apply.parallelize` on the user's model, and the ParallelModel over its engine."""

    def part_groups(part):  # the user's groups, restricted to the part a pipeline rank holds
        held = {id(q) for q in part.parameters()}
        return [{**g, "params": [q for q in g["params"] if id(q) in held]} for g in groups]

    layout = _layout(mesh, s)
    cut = pipeline_stages(model, stages, loss_fn, layout.n_stages) if layout.pp > 1 else None
    engine = parallelize_part(
        model,
        layout,
        mesh,
        factory,
        param_groups=None if groups is None else part_groups,
        plan=tp_plan,
        rules=layout_rules,
        seed=seed,
        blocks=blocks,
        stages=cut,
        job=Job(
            api=True,
            experts=max((m.experts.experts for m in model.modules() if isinstance(m, MoE)), default=0),
        ),
    )
    return ParallelModel(engine, mesh, model, loss_fn=loss_fn, grad_clip=clip, scheduler=sched, owns=owns)

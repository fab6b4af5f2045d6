"""`plait.apply.parallelize(model, layout, mesh, optimizer)`: the one path from a layout to an engine
(the module is not named after the function: `plait.parallelize` is the custom-loop API).

`plait train` (plait.train.build), the custom-loop API (`plait.parallelize` in plait.api) and the
planner's probes all call this function; nothing else builds an engine. The order is fixed:

1. expert parallelism: each MoE layer keeps this rank's experts (`apply_ep`);
2. tensor parallelism, with sequence parallelism (`apply_tp`, from the model's plan and the
   layout rules); each dp replica gets its own dropout stream;
3. pipeline parallelism: the model is cut into pp x virtual_stages stages and this rank keeps
   its own (`cut_pipeline`); from here on only that part is touched;
4. activation checkpointing of the part's blocks (a pipeline recomputes per stage instead);
5. data parallelism or ZeRO 1-3 with offload over the part, and the optimizer (`zero.wrap`):
   the gradient exchange is started by backward hooks, or by the pipeline schedule (the
   "manual" trigger) when a pipeline runs the part;
6. a pipeline's schedule runtime over that engine (`PipelineEngine`);
7. context parallelism around the whole (`ContextParallelEngine`): each rank keeps its cp part of
   every sequence, the model's `attention` and `positions` see the split, and the gradients are
   averaged over dp x cp by step 5 (the weights are replicated over cp).

Steps 1 and 2 replace modules of the model (an embedding by its vocab-parallel shard, experts by
this rank's): they run on the model before the cut, because pipeline stages share the model's
submodules (a tied embedding and head on two stages must be split once, as one tensor). Every
step that allocates state per rank (buckets, shards, the optimizer) runs on the rank's part only.
Which features combine is not decided here but in `plait.layout` (the table of combinations).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from plait import zero
from plait.context_parallel import ContextParallelEngine
from plait.engine import Engine
from plait.errors import ConfigError
from plait.layout import Job, Layout, check
from plait.mesh import Mesh
from plait.moe.parallel import apply_ep
from plait.pipeline.engine import PipelineEngine, cut_pipeline
from plait.placement import placement
from plait.recompute import apply_activation_checkpointing
from plait.tensor_parallel import apply_tp

ParamGroups = Callable[[nn.Module], list] | None


def parallelize(
    model: nn.Module,
    layout: Layout,
    mesh: Mesh,
    optimizer: Callable,
    *,
    param_groups: ParamGroups = None,
    plan: dict | None = None,
    rules: dict | None = None,
    seed: int = 0,
    blocks: list[nn.Module] | None = None,
    comm_hook=None,
    split: str = "uniform",
    stages: list[nn.Module] | None = None,
    allow_unused: bool = False,
    job: Job | None = None,
) -> Engine:
    """Parallelize `model` (built whole and identically on every rank) for `layout` on `mesh`,
    and build its optimizer; returns the engine (plait.engine's contract).

    Args:
        optimizer: ``optimizer(param_groups) -> torch.optim.Optimizer``, called once, after
            wrapping, with the tensors this rank steps (its shards from ZeRO stage 1).
        param_groups: ``param_groups(part) -> torch param groups`` of the part this rank holds
            (e.g. weight decay on matrices only); default one group.
        plan, rules: the tensor-parallel plan (default the model's `tp_plan()`) and the layout
            rules over its named dims (plait.tensor_parallel.apply_tp).
        seed: the dropout streams of split layers: seed + 1000 x (1 + data rank), the data rank
            dp rank x cp + cp rank (each chunk of a sequence has its own).
        blocks: the blocks activation checkpointing recomputes and ZeRO-3 gathers one at a time
            (default the model's `plait_blocks()` and torch's Transformer layers).
        comm_hook: a compressor (plait.comm.compress) or 1-bit Adam's momentum hook: replaces the
            gradient exchange's collective.
        split, stages: how the pipeline cuts the model ("uniform", "params", a cost function),
            or the stage modules themselves (plait.pipeline.engine.cut_pipeline).
        allow_unused: parameters that get no gradient are reduced as zeros.
        job: what the job adds that the table of combinations reads (plait.layout.Job); given,
            the layout is checked against the table first (the custom-loop API's way in;
            `plait train` checked its config before any process started).
    """
    if job is not None:
        check(layout, job)
    if layout.sizes != mesh.sizes:
        raise ConfigError(
            f"parallelize: the layout is {layout.describe()} but the mesh is {mesh.shape_str()}"
        )
    model.to(mesh.device)
    if layout.ep > 1:  # each MoE layer keeps this rank's experts; tokens reach them by all-to-all
        apply_ep(model, mesh)
    if layout.tp > 1:
        # one dropout stream per dp replica and per chunk of a sequence
        dropout_seed = seed + 1000 * (1 + mesh.rank("dp") * layout.cp + mesh.rank("cp"))
        apply_tp(
            model, mesh, plan, sequence_parallel=layout.sequence_parallel, seed=dropout_seed, rules=rules
        )
    cut = None
    part = model
    if layout.pp > 1:
        cut = cut_pipeline(
            model, mesh, layout.schedule, layout.pipeline_microbatches, layout.stages_per_rank, split, stages
        )
        part = cut.raw
    elif layout.activation_checkpointing and apply_activation_checkpointing(model, blocks) == 0:
        raise ConfigError(
            "parallelize: activation_checkpointing found no blocks to recompute: pass blocks=[...] or "
            "give the model a plait_blocks() method"
        )
    # before ZeRO-3 flattens the parameters; a pipeline stage's by the whole model's names
    placements = describe_placements(part, layout, cut.names if cut is not None else None)
    local_params = sum(p.numel() for p in part.parameters())
    engine = shard(part, layout, mesh, optimizer, param_groups, blocks, comm_hook, allow_unused, cut)
    if cut is not None:
        engine = PipelineEngine(cut, engine, mesh, recompute=layout.activation_checkpointing)
    engine.placements = placements
    engine.local_params = local_params  # elements of this rank's part, before ZeRO shards them
    if layout.cp > 1:
        engine = ContextParallelEngine(engine, mesh, layout.cp_style)
    return engine


def describe_placements(part: nn.Module, layout: Layout, names: dict | None = None) -> dict[str, str]:
    """{parameter name: where the layout puts it, in words}: split along which dim over which
    axis, whose gradient is partial over which axis, what the data axes and ZeRO do with it
    (what `plait verify` prints beside a parameter that differs)."""
    out = {}
    for name, p in part.named_parameters():
        name = (names or {}).get(id(p), name)
        pl = placement(p)
        words = [f"dim {s.dim} split over {axis}" for axis, s in pl.sharded]
        words += [f"gradient partial over {axis}" for axis in pl.grad_partial]
        data = [a for a in layout.data_axes if layout.sizes.get(a, 1) > 1 and pl.shard(a) is None]
        if layout.zero_stage and data:
            what = "optimizer state" if layout.zero_stage == 1 else "gradient and optimizer state"
            what = "parameter, gradient and optimizer state" if layout.zero_stage == 3 else what
            words.append(f"ZeRO-{layout.zero_stage}: {what} sharded over {' x '.join(data)}")
        elif data:
            words.append(f"replicated over {' x '.join(data)}, gradient averaged")
        out[name] = "; ".join(words) or "replicated"
    return out


def shard(part, layout: Layout, mesh: Mesh, optimizer, param_groups, blocks, comm_hook, allow_unused, cut):
    """Step 5: data parallelism or ZeRO 1-3 (with hybrid sharding, mixed precision and offload)
    over `part` and its optimizer. Under a pipeline (`cut`), the schedule starts the exchange,
    parameters keep the whole model's names and the norm also sums over pp."""
    ids = {id(b) for b in blocks} if blocks is not None else None
    options = {}
    if layout.zero_stage > 0:
        options = dict(
            hybrid_shard=layout.dp_shard or None,
            offload=layout.offload,
            offload_path=layout.offload_path or None,
            delayed_update=layout.delayed_update,
        )
        if cut is None:  # a pipeline's stages compute under autocast with fp32 ZeRO shards
            options["mixed_precision"] = layout.mixed_precision
        if ids is not None and layout.zero_stage == 3:
            options["wrap_policy"] = lambda name, module: id(module) in ids
    if cut is not None:
        options.update(trigger="manual", names=cut.names, norm_axes=("pp",))
    return zero.wrap(
        part,
        mesh,
        layout.zero_stage,
        optimizer,
        param_groups=param_groups(part) if param_groups is not None else None,
        bucket_mb=layout.bucket_mb,
        comm_hook=comm_hook,
        data_axes=layout.data_axes,
        allow_unused=allow_unused or cut is not None,
        **options,
    )

"""Build the engine the configuration asks for: the model's parallel wrapping (data parallel,
ZeRO 1-3, a pipeline) and its optimizer, behind the engine contract of plait.engine."""

from __future__ import annotations

from pathlib import Path

import torch

from plait import zero
from plait.comm.compress import make_compressor
from plait.engine import Engine
from plait.mesh import Mesh
from plait.optim import allreduce_norms, param_groups
from plait.optim import build_optimizer as make_optimizer
from plait.optim.onebit_adam import MomentumHook, OneBitAdam
from plait.tensor_parallel import apply_tp
from plait.train.config import Config, pipeline_shape
from plait.train.recompute import apply_activation_checkpointing


def micro_batches_per_step(cfg: Config) -> int:
    """Micro-batches per dp rank per step: a pipeline's schedule's, else train.micro_batches."""
    return pipeline_shape(cfg)[0] if cfg.parallel.pp > 1 else cfg.train.micro_batches


def build_engine(raw: torch.nn.Module, cfg: Config, mesh: Mesh, run_dir: Path) -> Engine:
    """Parallelize `raw` in torchtitan's order: tensor parallel (Megatron-LM's split, its own
    dropout stream per dp replica) -> activation checkpointing -> a pipeline, data parallel or
    ZeRO (plait.zero.wrap) with the configured optimizer. Weight decay (and LAMB/LARS's trust
    ratio) on matrices only; sharded LAMB/LARS reduce their per-layer norms over the shard axis,
    so each shard sees its whole layer's norms."""
    t, p, o = cfg.train, cfg.parallel, cfg.offload
    if p.ep > 1:  # each MoE layer keeps this rank's experts; tokens reach them by all-to-all
        from plait.moe.parallel import apply_ep

        apply_ep(raw, mesh)
    if p.tp > 1:
        apply_tp(
            raw,
            mesh,
            sequence_parallel=p.sequence_parallel,
            seed=t.seed + 1000 * (1 + mesh.rank("dp")),
            rules=getattr(raw, "layout_rules", None),  # a python: source's; plait's GPT: every dim split
        )
    if t.activation_checkpointing and p.pp == 1:  # a pipeline recomputes per stage
        apply_activation_checkpointing(raw)
    shard_axis = "dp_shard" if p.hybrid_shard else "dp"
    reducer = allreduce_norms(mesh, shard_axis) if p.zero_stage >= 1 else None

    c = cfg.comm
    compressor = make_compressor(  # None without compression
        c.compression,
        topk_ratio=c.topk_ratio,
        error_feedback=c.error_feedback,
        powersgd_rank=c.powersgd_rank,
    )
    momentum_hook = None
    if c.target == "momentum":  # 1-bit Adam: the optimizer exchanges the momentum, compressed
        momentum_hook = MomentumHook(compressor, c.freeze_step)
    # what replaces the gradient reduction's collective: the bucket all-reduce (data parallel)
    # or reduce-scatter (ZeRO-1/2), in every layout
    comm_hook = momentum_hook or compressor

    def factory(groups):
        if momentum_hook is not None:
            return OneBitAdam(groups, momentum_hook, mesh, "dp", lr=t.lr, betas=(t.beta1, t.beta2))
        return make_optimizer(
            cfg.optim.name,
            groups,
            lr=t.lr,
            betas=(t.beta1, t.beta2),
            momentum=cfg.optim.momentum,
            norm_reducer=reducer,
        )

    data_axes = ("dp", "ep") if p.ep > 1 else ("dp",)  # the batch is split over dp x ep
    if p.pp > 1:
        from plait.pipeline.engine import PipelineEngine

        m, v = pipeline_shape(cfg)
        return PipelineEngine(
            raw,
            mesh,
            factory,
            schedule=p.schedule,
            microbatches=m,
            virtual_stages=v,
            recompute=t.activation_checkpointing,
            param_groups=lambda part: param_groups(part, t.weight_decay),
            zero_stage=p.zero_stage,
            bucket_mb=p.bucket_mb,
            comm_hook=comm_hook,
            data_axes=data_axes,
            zero_options=dict(
                shard_axis=shard_axis,
                replicate_axis="dp_replicate" if p.hybrid_shard else None,
            ),
        )

    # stage 0: the bucket all-reduce; stages 1-3: the bucket (unit) reduce-scatter
    # under ep, ZeRO shards the experts over dp and the rest over dp x ep
    extra = {"comm_hook": comm_hook, "data_axes": data_axes}
    if p.zero_stage > 0:
        extra.update(
            mixed_precision="bf16" if t.bf16 else None,
            hybrid_shard=p.hybrid_shard or None,
            offload=o.optimizer,
            offload_path=(o.path or str(run_dir / "offload")) if o.optimizer == "disk" else None,
            delayed_update=o.delayed_update,
        )
    return zero.wrap(
        raw,
        mesh,
        p.zero_stage,
        factory,
        param_groups=param_groups(raw, t.weight_decay),
        bucket_mb=p.bucket_mb,
        **extra,
    )


def describe_engine(cfg: Config, engine) -> str:
    """One line: the sharding and the mixed-precision policy (printed at start-up)."""
    p, o = cfg.parallel, cfg.offload
    tp = ""
    if p.tp > 1:
        tp = f"tensor parallel over {p.tp}" + (" + sequence parallel" if p.sequence_parallel else "") + ", "
    m = cfg.model
    if m.experts:
        tp += f"{m.experts} experts top-{m.top_k} every {m.moe_every} block(s)"
        if p.ep > 1:
            tp += f", expert parallel over {p.ep} ({m.experts // p.ep} per rank, batch over dp x ep)"
        tp += ", "
    if p.pp > 1:
        s = engine.schedule
        what = (
            f"{tp}pipeline over {p.pp} ({s.kind}, {s.m} micro-batches, {s.n_stages} stages: this rank "
            f"holds {list(s.stages[engine.rank])}), "
            + (f"ZeRO stage {p.zero_stage} over {p.dp}" if p.zero_stage else f"data parallel over {p.dp}")
        )
        return f"{what} | precision: {'bf16 autocast, fp32 parameters' if cfg.train.bf16 else 'fp32'}"
    if p.zero_stage == 0:
        what = f"{tp}data parallel over {p.dp}, {len(engine.module.buckets)} gradient bucket(s)"
        precision = "bf16 autocast, fp32 parameters" if cfg.train.bf16 else "fp32"
    else:
        what = f"{tp}ZeRO stage {p.zero_stage} over {p.dp}"
        if p.hybrid_shard:
            what += f", hybrid: shard over {p.hybrid_shard}, replicate x{p.dp // p.hybrid_shard}"
        if o.optimizer != "none":
            what += f", offload {o.optimizer}" + (" + delayed update" if o.delayed_update else "")
        precision = (
            "parameters and gradients bf16, master weights and optimizer state fp32"
            if cfg.train.bf16
            else "fp32 throughout"
        )
    return f"{what} | precision: {precision}"

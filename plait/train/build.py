"""Build the engine the configuration asks for (through the one path, `plait.parallelize`) and
describe it at start-up."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from plait.apply import parallelize
from plait.comm.compress import make_compressor
from plait.engine import Engine
from plait.layout import Layout
from plait.mesh import Mesh
from plait.optim import allreduce_norms, param_groups
from plait.optim import build_optimizer as make_optimizer
from plait.optim.onebit_adam import MomentumHook, OneBitAdam
from plait.optim.onebit_sgd import OneBitSGD
from plait.train.config import Config


def micro_batches_per_step(cfg: Config) -> int:
    """Micro-batches per dp rank per step: a pipeline's schedule's, else train.micro_batches."""
    return Layout.from_config(cfg).pipeline_microbatches if cfg.parallel.pp > 1 else cfg.train.micro_batches


def build_engine(raw: torch.nn.Module, cfg: Config, mesh: Mesh, run_dir: Path) -> Engine:
    """The engine of `plait train`: `plait.apply.parallelize` on the configured layout, with
    the configured optimizer and gradient compression. Weight decay (and LAMB/LARS's trust ratio)
    on matrices only; sharded LAMB/LARS reduce their per-layer norms over the shard axis, so each
    shard sees its whole layer's norms."""
    t, c = cfg.train, cfg.comm
    layout = Layout.from_config(cfg)
    if layout.offload == "disk" and not layout.offload_path:
        layout = dataclasses.replace(layout, offload_path=str(run_dir / "offload"))
    reducer = allreduce_norms(mesh, layout.shard_axis) if layout.zero_stage >= 1 else None
    compressor = make_compressor(  # None without compression
        c.compression,
        topk_ratio=c.topk_ratio,
        error_feedback=c.error_feedback,
        powersgd_rank=c.powersgd_rank,
    )
    momentum_hook = None
    if c.target == "momentum":  # 1-bit Adam: the optimizer exchanges the momentum, compressed
        momentum_hook = MomentumHook(compressor, c.freeze_step)

    def factory(groups):
        if momentum_hook is not None and cfg.optim.name == "sgd":  # 1-bit SGD, feedback after momentum
            return OneBitSGD(groups, momentum_hook, mesh, "dp", lr=t.lr, momentum=cfg.optim.momentum)
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

    return parallelize(
        raw,
        layout,
        mesh,
        factory,
        param_groups=lambda part: param_groups(part, t.weight_decay),
        rules=getattr(raw, "layout_rules", None),  # a python: source's; plait's GPT: every dim split
        seed=t.seed,
        # what replaces the gradient reduction's collective: the bucket all-reduce (data
        # parallel) or reduce-scatter (ZeRO), in every layout
        comm_hook=momentum_hook or compressor,
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

"""The training loop each rank runs: GPT on the corpus, data parallel, AdamW, warm-up + cosine.

Loss normalisation (correct by construction): every rank backpropagates
`sum of its token losses / tokens per rank per step`, over all its accumulation micro-batches,
and DataParallel averages over dp, so the gradient is that of the mean loss over every token of
the global batch, whatever the layout (dp, micro-batches). The logged loss is the same global
mean, reduced in float64.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from plait import comm, zero
from plait.comm.compress import make_compressor
from plait.data import DistributedBatchSampler, eval_batches, load_corpus
from plait.errors import CheckpointError, ConfigError
from plait.mesh import Mesh, init_distributed
from plait.models import GPT, gpt_train_flops_per_token
from plait.optim import allreduce_norms, param_groups
from plait.optim import build_optimizer as make_optimizer
from plait.optim.onebit_adam import MomentumHook, OneBitAdam
from plait.tensor_parallel import apply_tp, without_sequence_parallel
from plait.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from plait.train.config import Config, model_config, pipeline_shape
from plait.train.metrics import MetricsWriter, peak_memory_bytes, plot_loss_curve, read_metrics
from plait.train.peak import peak_flops_per_rank
from plait.train.recompute import apply_activation_checkpointing


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to `min_ratio` at `total` (0-based step)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_engine(raw: torch.nn.Module, cfg: Config, mesh: Mesh, run_dir: Path):
    """Data parallel or ZeRO (plait.zero.wrap) with the configured optimizer; weight decay (and
    LAMB/LARS's trust ratio) on matrices only. Sharded LAMB/LARS reduce their per-layer norms
    over the shard axis, so each shard sees its whole layer's norms."""
    t, p, o = cfg.train, cfg.parallel, cfg.offload
    shard_axis = "dp_shard" if p.hybrid_shard else "dp"
    reducer = allreduce_norms(mesh, shard_axis) if p.zero_stage >= 1 else None

    c = cfg.comm
    momentum_hook = None
    if c.target == "momentum":  # 1-bit Adam: the optimizer exchanges the momentum, compressed
        compressor = make_compressor(
            c.compression,
            topk_ratio=c.topk_ratio,
            error_feedback=c.error_feedback,
            powersgd_rank=c.powersgd_rank,
        )
        momentum_hook = MomentumHook(compressor, c.freeze_step)

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
        )

    extra = {}
    if p.zero_stage <= 2:  # stage 0: the bucket all-reduce; stages 1-2: the bucket reduce-scatter
        extra["comm_hook"] = momentum_hook or make_compressor(
            c.compression,
            topk_ratio=c.topk_ratio,
            error_feedback=c.error_feedback,
            powersgd_rank=c.powersgd_rank,
        )
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
    if p.pp > 1:
        s = engine.schedule
        what = (
            f"{tp}pipeline over {p.pp} ({s.kind}, {s.m} micro-batches, {s.n_stages} stages: this rank "
            f"holds {list(s.stages[engine.rank])}), data parallel over {p.dp}"
        )
        return f"{what} | precision: {'bf16 autocast, fp32 parameters' if cfg.train.bf16 else 'fp32'}"
    if p.zero_stage == 0:
        what = f"{tp}data parallel over {p.dp}, {len(engine.module.buckets)} gradient bucket(s)"
        precision = "bf16 autocast, fp32 parameters" if cfg.train.bf16 else "fp32"
    else:
        what = f"ZeRO stage {p.zero_stage}"
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


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, batches, mesh: Mesh, device: torch.device, bf16: bool, pipeline=None
) -> float:
    """Mean held-out loss per token; each dp rank evaluates its rows of every batch (through
    the pipeline's stages, forward only, when `pipeline` is a PipelineEngine)."""
    was_training = model.training
    model.eval()
    n, r = mesh.size("dp"), mesh.rank("dp")
    total, count = 0.0, 0
    for x, y in batches:
        rows = x.shape[0] // n
        xs, ys = x[r * rows : (r + 1) * rows].to(device), y[r * rows : (r + 1) * rows].to(device)
        with _autocast(device, bf16):
            if pipeline is not None:
                m = pipeline.schedule.m if rows % pipeline.schedule.m == 0 else 1
                total += float(pipeline.eval_loss_sum(list(xs.chunk(m)), list(ys.chunk(m))))
            else:
                total += float(model(xs, ys, reduction="sum"))
        count += ys.numel()
    model.train(was_training)
    total = comm.all_reduce_scalar(total, mesh, ("dp", "pp"))
    count = comm.all_reduce_scalar(count, mesh, ("dp",))
    return total / count


def _autocast(device: torch.device, bf16: bool):
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def _resolve_device(name: str) -> torch.device | None:
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device = 'cuda' but no CUDA device is available; use 'auto' or 'cpu'")
    return None  # auto / cuda: plait.mesh picks CUDA with the local rank


def _say(mesh: Mesh, text: str) -> None:
    if mesh.is_rank0:
        tqdm.write(text, file=sys.stdout)
        sys.stdout.flush()


def run(cfg: Config, resume: bool = False, peak_flops: float | None = None) -> dict:
    """Train on this rank (inside a launcher's environment); returns rank 0's summary."""
    device = init_distributed(
        _resolve_device(cfg.train.device), timeout_s=max(1800.0, 2 * cfg.comm.timeout_s)
    )
    p = cfg.parallel
    mesh = Mesh(
        pp=p.pp,
        dp=p.dp,
        ep=p.ep,
        tp=p.tp,
        device=device,
        timeout_s=cfg.comm.timeout_s,
        dp_shard=p.hybrid_shard or None,
    )
    try:
        return _train(cfg, mesh, resume, peak_flops)
    except BaseException as exc:
        mesh.close(reason=f"failed with {type(exc).__name__}")  # what the other ranks' reports say
        raise
    finally:
        mesh.close()
        dist.destroy_process_group()


def check_fresh_run_dir(run_dir: Path) -> None:
    """A new run never writes into another run's directory (its checkpoints and metrics)."""
    if (run_dir / "metrics.jsonl").exists() or (run_dir / "checkpoints").exists():
        raise ConfigError(
            f"train.run_dir {str(run_dir)!r} already holds a run: continue it with --resume {run_dir}, "
            "or choose another train.run_dir"
        )


def _agreed_run_dir(cfg: Config, mesh: Mesh) -> Path:
    """The configured run directory, or runs/<rank 0's start time> agreed by every rank."""
    if cfg.train.run_dir:
        return Path(cfg.train.run_dir)
    stamp = torch.tensor([int(time.time())], dtype=torch.int64, device=mesh.device)
    comm.broadcast(stamp, mesh, "world")
    return Path("runs") / time.strftime("%Y%m%d-%H%M%S", time.localtime(int(stamp)))


def _train(cfg: Config, mesh: Mesh, resume: bool, peak_flops: float | None) -> dict:
    t, device = cfg.train, mesh.device
    run_dir = _agreed_run_dir(cfg, mesh)
    ckpt_root = run_dir / "checkpoints"
    if mesh.is_rank0:
        if not resume:
            check_fresh_run_dir(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.toml").write_text(cfg.to_toml())
    comm.barrier(mesh)

    mcfg = model_config(cfg)
    corpus = load_corpus(cfg.data.corpus, cfg.data.held_out_fraction)
    dp, dp_rank = mesh.size("dp"), mesh.rank("dp")
    pipelined = cfg.parallel.pp > 1
    sampler = DistributedBatchSampler(
        corpus.train,
        mcfg.seq_len,
        t.global_batch,
        dp_rank,
        dp,
        t.seed,
        micro_batches=pipeline_shape(cfg)[0] if pipelined else t.micro_batches,
    )
    val = eval_batches(corpus.val, mcfg.seq_len, t.global_batch, t.eval_batches)

    # measured (if not cached) before seeding; it uses its own generator anyway
    peak = peak_flops or peak_flops_per_rank(device, t.bf16, torch.get_num_threads(), t.peak_tflops)
    torch.manual_seed(t.seed)  # identical initialisation on every rank (DataParallel broadcasts anyway)
    raw = GPT(mcfg).to(device)
    n_params = sum(q.numel() for q in raw.parameters())
    if cfg.parallel.tp > 1:  # Megatron-LM's split; the per-tp-rank stream differs per dp replica too
        apply_tp(
            raw,
            mesh,
            sequence_parallel=cfg.parallel.sequence_parallel,
            seed=t.seed + 1000 * (1 + mesh.rank("dp")),
        )
    if t.activation_checkpointing and cfg.parallel.pp == 1:  # a pipeline recomputes per stage
        apply_activation_checkpointing(raw)
    engine = build_engine(raw, cfg, mesh, run_dir)
    model, optimizer = engine.module, engine.optimizer
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, t.warmup_steps, t.steps, t.min_lr / t.lr)
    )
    # dropout streams differ per data-parallel replica; tensor-parallel peers share theirs, as
    # they must for dropout on replicated activations (split ones use apply_tp's own stream)
    torch.manual_seed(t.seed + 1 + mesh.rank("dp"))

    start = 0
    if resume:
        path = latest_checkpoint(ckpt_root)
        if path is None:
            raise CheckpointError(f"--resume: {ckpt_root} holds no checkpoint to resume from")
        start = load_checkpoint(path, mesh, engine, scheduler, sampler)
        _say(mesh, f"resumed from {path} at step {start}")
        if mesh.is_rank0:
            _truncate_metrics(run_dir, start)
    comm.barrier(mesh)
    metrics = MetricsWriter(run_dir, mesh.global_rank)

    tokens_per_step = t.global_batch * mcfg.seq_len
    local_tokens = tokens_per_step // dp
    # model FLOPs: recomputation is overhead, not useful work, so MFU never counts it
    flops_per_token = gpt_train_flops_per_token(mcfg, recompute=False)
    last = min(t.steps, t.stop_at) if t.stop_at else t.steps
    _say(
        mesh,
        f"plait: GPT {mcfg.n_layer}L {mcfg.n_head}H d={mcfg.d_model} seq={mcfg.seq_len} "
        f"({n_params / 1e6:.2f}M params) | mesh {mesh.shape_str()} on {device} | "
        f"global batch {t.global_batch} x {mcfg.seq_len} tokens | steps {start + 1}..{last} | "
        f"run dir {run_dir}",
    )
    _say(mesh, f"plait: {describe_engine(cfg, engine)}")
    c = cfg.comm
    if c.target == "momentum":
        _say(
            mesh,
            f"plait: 1-bit Adam: AdamW on uncompressed gradients for {c.freeze_step} steps, then the "
            f"variance is frozen and the momentum is exchanged with {c.compression} compression "
            f"({'with' if c.error_feedback else 'without'} error feedback); from then on gradient "
            "clipping and grad_norm see each rank's own gradient",
        )
    elif (
        c.compression in ("onebit", "topk", "powersgd")
        and c.error_feedback
        and cfg.optim.name in ("adamw", "lamb")
    ):
        _say(
            mesh,
            f"plait: note: error feedback ({c.compression}) on gradients under {cfg.optim.name} trained "
            "worse than without it in plait's experiments (Adam's per-coordinate scaling); "
            "comm.target = 'momentum' (1-bit Adam) compresses AdamW's momentum instead; "
            "see docs/compression.md",
        )

    bar = tqdm(
        total=t.steps,
        initial=start,
        disable=not (mesh.is_rank0 and t.progress),
        desc="train",
        unit="step",
        dynamic_ncols=True,
        mininterval=1.0,
        file=sys.stderr,
    )
    model.train()
    # the step whose action timings are recorded and drawn (pipelines): the third, after warm-up
    timeline_step = min(start + 3, last) if pipelined else -1
    window_t0, window_steps, loss, val_loss = time.perf_counter(), 0, float("nan"), None
    fault = _injected_fault()
    hook = getattr(engine, "comm_hook", None)
    lr_scaled = hook if hasattr(hook, "set_lr_scale") else None
    for step in range(start + 1, last + 1):
        mesh.ledger.set_step(step)
        if fault is not None and fault[:2] == (mesh.global_rank, step):
            if fault[2] == "hang":  # a stuck rank: the others wait for it in the gradient all-reduce
                time.sleep(10 * cfg.comm.timeout_s)
            if fault[2] == "enospc":  # the disk fills up: every offload write from now on fails
                _fill_disk()
                fault = None
            else:
                raise RuntimeError(
                    f"injected fault on rank {mesh.global_rank} at step {step} (PLAIT_FAIL_AT)"
                )
        if lr_scaled is not None:  # error feedback in units of the step (plait.comm.compress)
            lr_scaled.set_lr_scale(optimizer.param_groups[0]["lr"] / t.lr)
        step_t0 = time.perf_counter()
        micro = sampler.next_batch()
        local_sum = torch.zeros((), dtype=torch.float64, device=device)
        if pipelined:
            record = step == timeline_step
            if record:
                comm.barrier(mesh, "pp")  # one start line for the measured timeline
                step_t0 = time.perf_counter()
            with _autocast(device, t.bf16):
                local_sum += engine.train_step(
                    [x.to(device) for x, _ in micro],
                    [y.to(device) for _, y in micro],
                    1.0 / local_tokens,
                    record,
                )
            if record:
                _write_timeline(engine, mesh, run_dir, time.perf_counter() - step_t0)
            micro = []
        for i, (x, y) in enumerate(micro):
            sync = contextlib.nullcontext() if i == len(micro) - 1 else engine.no_sync()
            with sync:
                with _autocast(device, t.bf16):
                    loss_sum = model(x.to(device), y.to(device), reduction="sum")
                (loss_sum / local_tokens).backward()
            local_sum += loss_sum.detach().double()
        grad_norm = engine.clip_grad_norm_(t.grad_clip) if t.grad_clip > 0 else engine.grad_norm()
        lr = optimizer.param_groups[0]["lr"]
        engine.step()
        scheduler.step()
        engine.zero_grad(set_to_none=True)
        mesh.ledger.set_step(-1)  # the loss report is not part of the step's traffic
        loss = comm.all_reduce_scalar(float(local_sum), mesh, ("dp", "pp")) / tokens_per_step
        step_time = time.perf_counter() - step_t0
        window_steps += 1
        record = {
            "step": step,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "step_time_s": step_time,
            "local_loss": float(local_sum) / local_tokens,
        }
        if step % t.log_every == 0 or step == last:
            elapsed = time.perf_counter() - window_t0
            tok_s = window_steps * tokens_per_step / elapsed
            mfu = tok_s * flops_per_token / (peak * mesh.world_size)
            mem = peak_memory_bytes(device)
            record.update(model_state_bytes=engine.memory())
            record.update(
                tokens_per_s=tok_s,
                mfu=mfu,
                peak_mem_bytes=mem,
                comm_bytes=mesh.ledger.total(step, "bus_bytes"),
                comm_uncompressed_bytes=mesh.ledger.total(step, "logical_bytes"),
            )
            _say(
                mesh,
                f"step {step:>5}/{t.steps} | loss {loss:.4f} | lr {lr:.2e} | {tok_s:>8,.0f} tok/s | "
                f"MFU {mfu:6.2%} | peak mem {mem / 2**20:,.0f} MiB",
            )
            window_t0, window_steps = time.perf_counter(), 0
        if (t.eval_every and step % t.eval_every == 0) or step == t.steps:
            if step == t.steps:
                engine.finish()  # the final held-out loss is of the final parameters
            val_loss = evaluate(raw, val, mesh, device, t.bf16, engine if pipelined else None)
            record["val_loss"] = val_loss
            _say(
                mesh,
                f"step {step:>5}/{t.steps} | held-out loss {val_loss:.4f} ({val_loss / math.log(2):.3f} "
                f"bits/byte)",
            )
        metrics.write(**record)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
        if (t.checkpoint_every and step % t.checkpoint_every == 0) or step == last:
            save_checkpoint(ckpt_root, step, mesh, engine, scheduler, sampler, keep=t.keep_checkpoints)
    bar.close()
    metrics.close()
    engine.finish()
    summary = _finish(cfg, mesh, raw, corpus, run_dir, last, loss, val_loss, n_params, engine.memory())
    engine.close()
    return summary


def _write_timeline(engine, mesh: Mesh, run_dir: Path, step_time: float) -> None:
    """The measured action timeline of one pipelined step beside the simulator's prediction
    from the same action costs: pipeline_timeline.{json,png} in the run directory."""
    from plait.pipeline.render import render_png
    from plait.pipeline.simulate import Costs, simulate

    events = engine.gather_events()
    if not mesh.is_rank0:
        return
    sim = simulate(engine.schedule, Costs.from_events(events))
    s = engine.schedule
    (run_dir / "pipeline_timeline.json").write_text(
        json.dumps(
            {
                "schedule": s.kind,
                "p": s.p,
                "m": s.m,
                "v": s.v,
                "measured_step_s": step_time,
                "simulated_makespan_s": sim.makespan,
                "simulated": sim.to_json(),
                "events": [e.to_dict() for e in events],
            },
            indent=1,
        )
    )
    render_png(
        [
            (f"measured ({s.kind})", events, s.p),
            (f"simulated from the measured action costs ({s.kind})", sim, s.p),
        ],
        run_dir / "pipeline_timeline.png",
    )
    _say(
        mesh,
        f"plait: pipeline step measured {step_time * 1e3:.1f} ms, simulated {sim.makespan * 1e3:.1f} ms "
        f"from the measured action costs; timelines in {run_dir / 'pipeline_timeline.png'}",
    )


def _fill_disk() -> None:
    """Make every later disk-offload write fail as on a full disk (ENOSPC)."""
    import errno

    from plait.zero import offload_disk

    def full(path, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    offload_disk._write_file = full


def _injected_fault() -> tuple[int, int, str] | None:
    """PLAIT_FAIL_AT=RANK:STEP[:hang|:enospc] makes that rank raise, hang, or find its disk full
    (disk offload writes fail) at that step: a hook for the failure tests."""
    spec = os.environ.get("PLAIT_FAIL_AT")
    if not spec:
        return None
    rank, step, *mode = spec.split(":")
    return int(rank), int(step), (mode[0] if mode else "raise")


def _truncate_metrics(run_dir: Path, step: int) -> None:
    """On resume, drop metric lines written after the checkpoint (they will be written again)."""
    for path in run_dir.glob("metrics*.jsonl"):
        kept = [r for r in read_metrics(path) if r.get("step", 0) <= step]
        path.write_text("".join(json.dumps(r) + "\n" for r in kept))


def _finish(
    cfg: Config,
    mesh: Mesh,
    raw: GPT,
    corpus,
    run_dir: Path,
    step: int,
    loss: float,
    val_loss: float | None,
    n_params: int,
    memory: dict,
) -> dict:
    summary = {
        "step": step,
        "loss": loss,
        "val_loss": val_loss,
        "params": n_params,
        "unigram_entropy_bits": corpus.unigram_entropy_bits(),
        "model_state_bytes_per_rank": memory,
    }
    sample = None
    if cfg.train.sample_tokens and step == cfg.train.steps and cfg.parallel.pp > 1:
        _say(mesh, "plait: no text sample under pipeline parallelism (each rank holds part of the model)")
    elif cfg.train.sample_tokens and step == cfg.train.steps:
        # every rank generates: under ZeRO-3 each forward gathers parameters from all of them
        prompt = corpus.encode("The ").unsqueeze(0).to(mesh.device)
        gen = torch.Generator(device=mesh.device).manual_seed(cfg.train.seed)
        with without_sequence_parallel(raw):  # growing lengths do not split over tp
            out = raw.generate(prompt, cfg.train.sample_tokens, temperature=0.8, top_k=40, generator=gen)
        sample = corpus.decode(out[0].cpu())
    if not mesh.is_rank0:
        return summary
    records = read_metrics(run_dir / "metrics.jsonl")
    plot_loss_curve(
        records,
        run_dir / "loss.png",
        title=f"plait GPT, mesh {mesh.shape_str()}",
        baseline=summary["unigram_entropy_bits"] * math.log(2),
    )
    if val_loss is not None:
        summary["val_bits_per_byte"] = val_loss / math.log(2)
        _say(
            mesh,
            f"held-out loss {val_loss:.4f} nats/byte = {val_loss / math.log(2):.3f} bits/byte; "
            f"unigram entropy of the corpus {summary['unigram_entropy_bits']:.3f} bits/byte",
        )
    mib = {k: v / 2**20 for k, v in memory.items()}
    _say(
        mesh,
        f"model states per rank: parameters {mib['params']:.2f} MiB, gradients {mib['grads']:.2f} MiB, "
        f"optimizer {mib['optimizer']:.2f} MiB (total {mib['total']:.2f} MiB)",
    )
    if sample is not None:
        summary["sample"] = sample
        _say(mesh, "sample:\n" + sample)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    _say(mesh, f"run dir: {run_dir} (config.toml, metrics.jsonl, loss.png, checkpoints/)")
    return summary

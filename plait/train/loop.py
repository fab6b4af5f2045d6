"""The training loop each rank runs: GPT on the corpus, data parallel, AdamW, warm-up + cosine.

Loss normalisation (correct by construction): every rank backpropagates
`sum of its token losses / tokens per rank per step`, over all its accumulation micro-batches,
and DataParallel averages over dp, so the gradient is that of the mean loss over every token of
the global batch, whatever the layout (dp, micro-batches). The logged loss is the same global
mean, reduced in float64.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from plait import comm
from plait.data import DistributedBatchSampler, eval_batches, load_corpus
from plait.data.tokenizer import target_bytes
from plait.engine import Engine, ErrorFeedback, OuterSteps, RecordsTimeline
from plait.errors import CheckpointError, ConfigError, DivergedError
from plait.mesh import Mesh, init_distributed
from plait.models.source import build_model
from plait.state import group_options
from plait.train import report
from plait.train.build import build_engine, micro_batches_per_step
from plait.train.checkpoint import latest_checkpoint, load_checkpoint
from plait.train.checkpointer import make_checkpointer
from plait.train.config import Config, model_config
from plait.train.diloco import wrap_diloco
from plait.train.diloco_replicas import rejoining_group, replica_group
from plait.train.hooks import named_hook
from plait.train.metrics import MetricsWriter
from plait.train.module_record import first_step, where_on
from plait.train.nonfinite import (
    DIVERGED,
    agree_finite,
    clear_nonfinite_residuals,
    guard_last_step,
    guard_nonfinite,
)
from plait.train.peak import peak_flops_per_rank
from plait.train.preempt import Preempted, StopRequest
from plait.train.replicas import check_replicas
from plait.train.resume import reapply_config
from plait.train.run_state import Run, data_axes, data_axis
from plait.train.rundir import check_fresh_run_dir, create_run_dir


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to `min_ratio` at `total` (0-based step)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


@torch.no_grad()
def evaluate(engine: Engine, batches, mesh: Mesh, device: torch.device, bf16: bool) -> float:
    """Mean held-out loss per token; each data-parallel rank (dp x ep) evaluates its rows of
    every batch through the engine (forward only; a pipeline runs them through its stages)."""
    model = engine.module
    was_training = model.training
    model.eval()
    n, r = mesh.size(data_axis(mesh)), mesh.rank(data_axis(mesh))
    total, count = 0.0, 0
    for x, y in batches:
        rows = x.shape[0] // n
        xs, ys = x[r * rows : (r + 1) * rows].to(device), y[r * rows : (r + 1) * rows].to(device)
        with _autocast(device, bf16):
            total += float(engine.eval_loss_sum(xs, ys))
        count += ys.numel()
    model.train(was_training)
    total = comm.all_reduce_scalar(total, mesh, (*data_axes(mesh), "pp"))  # a pipeline's: last stage
    count = comm.all_reduce_scalar(count, mesh, data_axes(mesh))
    return total / count


def _autocast(device: torch.device, bf16: bool):
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def _resolve_device(name: str) -> torch.device | None:
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device = 'cuda' but no CUDA device is available; use 'auto' or 'cpu'")
    return None  # auto / cuda: plait.mesh picks CUDA with the local rank


def run(cfg: Config, resume: bool = False, peak_flops: float | None = None, restart: int = 0) -> dict:
    """Train on this rank (inside a launcher's environment); returns rank 0's summary. `restart`:
    how many times the launcher restarted the job (it then resumes from the newest checkpoint)."""
    mesh = make_mesh(cfg)
    stop = StopRequest()  # SIGTERM's, for this run only
    previous = stop.install()
    try:
        summary = _train(cfg, mesh, resume, peak_flops, restart, stop)
    except BaseException as exc:
        mesh.close(reason=f"failed with {type(exc).__name__}")  # what the other ranks' reports say
        stop.uninstall(previous)
        # The groups stay up until the process exits: tearing them down here would reset the
        # peers' connections before this rank's own error is written, and a peer's "connection
        # reset" would then be reported as the job's first failure.
        raise
    stop.uninstall(previous)
    mesh.close()
    mesh.release_groups()
    dist.destroy_process_group()
    return summary


def make_mesh(cfg: Config) -> Mesh:
    """The process group (from the launcher's environment) and the configured mesh over it."""
    device = init_distributed(
        _resolve_device(cfg.train.device), timeout_s=max(1800.0, 2 * cfg.comm.timeout_s)
    )
    p = cfg.parallel
    return Mesh(
        pp=p.pp,
        dp=p.dp,
        ep=p.ep,
        tp=p.tp,
        cp=p.cp,
        device=device,
        timeout_s=cfg.comm.timeout_s,
        dp_shard=p.hybrid_shard or None,
    )


def _agreed_run_dir(cfg: Config, mesh: Mesh) -> Path:
    """Rank 0's run directory, which every rank takes: under an outer launcher (torchrun) rank 0's
    process created and locked it (plait.train.rundir) and the others' configs name none."""
    name = torch.zeros(4096, dtype=torch.uint8, device=mesh.device)  # PATH_MAX bytes
    if mesh.is_rank0:
        raw = os.fsencode(cfg.train.run_dir or create_run_dir())  # none: run() called directly
        name[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    comm.broadcast(name, mesh, "world")
    return Path(os.fsdecode(bytes(name.cpu().tolist()).rstrip(b"\0")))


def _train(
    cfg: Config, mesh: Mesh, resume: bool, peak_flops: float | None, restart: int, stop: StopRequest
) -> dict:
    run = _setup(cfg, mesh, resume, peak_flops, restart, stop)
    t, engine = cfg.train, run.engine
    report.announce(run)
    bar = report.progress_bar(run)
    engine.module.train()
    window = report.Window()
    hook = step_hook()
    loss, val_loss = float("nan"), None
    for step in range(run.start + 1, run.last + 1):
        if hook is not None:
            hook(step=step, rank=mesh.global_rank, cfg=cfg, engine=engine)
        if step == 1:  # a failure names its module; log.modules records the step for plait verify
            with first_step(run.raw, where_on(mesh), _modules_dir(run), mesh.global_rank):
                record = _train_step(run, step)
        else:
            record = _train_step(run, step)
        if isinstance(engine, OuterSteps):  # DiLoCo: the outer exchange, on the steps it is due
            mesh.ledger.set_step(step)
            record.update(engine.end_step(step, record["loss"]))
            mesh.ledger.set_step(-1)
        loss = record["loss"]
        guard_nonfinite(run, step, record)
        guard_last_step(run, step, record)
        if t.replica_check_every and step % t.replica_check_every == 0:
            record["replicas_checked"] = check_replicas(engine, mesh, step)
        window.steps += 1
        if step % t.log_every == 0 or step == run.last:
            report.log_step(run, step, record, window)
        if (t.eval_every and step % t.eval_every == 0) or step == t.steps:
            if step == t.steps:
                engine.finish()  # the final held-out loss is of the final parameters
            val_loss = evaluate(engine, run.val, mesh, mesh.device, t.bf16)
            report.log_held_out(run, step, record, val_loss)
        due = (t.checkpoint_every and step % t.checkpoint_every == 0) or step == run.last
        try:  # the step's record holds its checkpoint's figures, and is written if the save fails
            # not while steps are being skipped: the newest checkpoint stays the last good state
            if due and not run.skipped_in_a_row:
                record["checkpoint"] = _save(run, step)
            stop = run.stop.requested(mesh)  # SIGTERM on any rank: every rank stops after this step
            if stop and "checkpoint" not in record:
                record["checkpoint"] = _save(run, step)
        finally:
            run.metrics.write(**record)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
        if stop:
            run.checkpointer.wait()  # the save in flight is committed (within the grace period)
            bar.close()
            run.metrics.close()
            report.log_preempted(run, step)
            engine.close()
            run.checkpointer.close()
            raise Preempted(step)
    bar.close()
    run.metrics.close()
    engine.finish()
    run.checkpointer.wait()  # the last checkpoint committed: `latest` names it
    summary = report.finish(run, loss, val_loss)
    engine.close()
    run.checkpointer.close()
    return summary


def _modules_dir(run: Run) -> Path | None:
    return run.run_dir / "modules" if run.cfg.log.modules else None


def _save(run: Run, step: int) -> dict:
    """The checkpoint of `step` (synchronous, or started in the background under
    train.checkpoint_async); its figures, for the step's metrics record."""
    keep = run.cfg.train.keep_checkpoints
    root = run.run_dir / "checkpoints"
    return run.checkpointer.save(root, step, run.engine, run.scheduler, run.sampler, keep)


def _setup(
    cfg: Config,
    mesh: Mesh,
    resume: bool,
    peak_flops: float | None,
    restart: int,
    stop: StopRequest,
    from_peer: bool = False,
) -> Run:
    """The run directory, data, model, engine, schedule and (on resume) the checkpoint's state.
    `from_peer`: a fresh rank that will load a peer's state instead (plait.controller.peer):
    the run directory is this run's, and no checkpoint is read."""
    t, device = cfg.train, mesh.device
    rejoining = rejoining_group(cfg)  # a DiLoCo group restarted: it heals from a live one
    from_peer = from_peer or rejoining
    run_dir, resume = _prepare_run_dir(cfg, mesh, resume, restart, from_peer)
    mcfg = model_config(cfg)
    corpus = _load_data(cfg, mesh, run_dir, resume)
    dp = mesh.size(data_axis(mesh))  # data-parallel ranks: dp, or dp x ep
    # DiLoCo: this group's ranks are dp of the dp x groups that split the global batch
    group, groups = replica_group() or (0, 1)
    data_rank = group * dp + mesh.rank(data_axis(mesh))
    sampler = DistributedBatchSampler(
        corpus.train,
        mcfg.seq_len,
        t.global_batch,
        data_rank,
        dp * groups,
        t.seed,
        micro_batches=micro_batches_per_step(cfg),
    )
    # the same held-out windows whatever the layout; a DiLoCo group evaluates them in batches of
    # its own rows per step (a pipeline's micro-batches keep their shape)
    n_eval = t.eval_batches * groups if t.eval_batches else t.eval_batches
    val = eval_batches(corpus.val, mcfg.seq_len, t.global_batch // groups, n_eval)
    val_tokens_bytes = target_bytes(val, corpus.token_bytes())  # for bits per byte

    # measured (if not cached) before seeding; it uses its own generator anyway
    peak = peak_flops or peak_flops_per_rank(device, t.bf16, torch.get_num_threads(), t.peak_tflops)
    torch.manual_seed(t.seed)  # identical initialisation on every rank (DataParallel broadcasts anyway)
    raw = build_model(cfg).to(device)  # plait's GPT, a Hugging Face model or a python: factory's
    n_params = sum(q.numel() for q in raw.parameters())
    flops_per_token = report.flops_per_token(raw)  # of the whole model: before wrapping shards it
    engine = build_engine(raw, cfg, mesh, run_dir)
    if cfg.diloco.inner_steps:  # the outer loop around the group's engine (plait.train.diloco)
        engine = wrap_diloco(engine, cfg, mesh)
    if cfg.log.placements:
        report.write_placements(run_dir, mesh, engine)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        engine.optimizer, lambda s: lr_factor(s, t.warmup_steps, t.steps, t.min_lr / t.lr)
    )
    # dropout streams differ per data-parallel replica and per chunk of a sequence (cp); tensor-
    # parallel peers share theirs, as they must for dropout on replicated activations (split
    # ones use apply_tp's own stream)
    torch.manual_seed(t.seed + 1 + data_rank * mesh.size("cp") + mesh.rank("cp"))

    start = _resume_state(run_dir, mesh, engine, scheduler, sampler) if resume and not from_peer else 0
    if isinstance(engine, OuterSteps):
        engine.attach_run(scheduler, sampler)
        if rejoining:
            start = engine.rejoin()  # (it says from which group, at which step)
            if mesh.is_rank0:
                report.truncate_metrics(run_dir, start)
    comm.barrier(mesh)
    last = min(t.steps, t.stop_at) if t.stop_at else t.steps
    tokens_per_step = t.global_batch * mcfg.seq_len // groups  # this group's (DiLoCo), or all
    return Run(
        cfg=cfg,
        mesh=mesh,
        run_dir=run_dir,
        corpus=corpus,
        sampler=sampler,
        val=val,
        raw=raw,
        engine=engine,
        scheduler=scheduler,
        metrics=MetricsWriter(
            run_dir,
            mesh.global_rank,
            tensorboard=cfg.log.tensorboard,
            purge_step=start + 1 if start else None,
        ),
        start=start,
        last=last,
        n_params=n_params,
        tokens_per_step=tokens_per_step,
        local_tokens=tokens_per_step // dp,  # dp: the data-parallel ranks (x ep)
        # model FLOPs: recomputation is overhead, not useful work, so MFU never counts it
        flops_per_token=flops_per_token,
        peak_flops=peak,
        val_tokens_bytes=val_tokens_bytes,
        timeline_step=min(start + 3, last),  # the third step, after warm-up
        stop=stop,
        checkpointer=make_checkpointer(mesh, t.checkpoint_async, max(1800.0, 2 * cfg.comm.timeout_s)),
    )


def _prepare_run_dir(
    cfg: Config, mesh: Mesh, resume: bool, restart: int, from_peer: bool = False
) -> tuple[Path, bool]:
    """Rank 0's run directory with this run's config.toml in it, on every rank, and whether the
    run resumes (a restarted job does when a checkpoint was saved; one restored from a peer's
    memory continues its run directory)."""
    run_dir = _agreed_run_dir(cfg, mesh)
    if from_peer:  # the controller refused a diverged run before (plait.controller.peer)
        resume = True
    elif restart:
        resume = _restarting(run_dir, mesh, restart, cfg.train.max_restarts)
    if mesh.is_rank0:
        if not resume and not restart:
            check_fresh_run_dir(run_dir)
        if resume and not restart:  # resumed on purpose (e.g. with a lower train.lr after diverging)
            (run_dir / DIVERGED).unlink(missing_ok=True)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.toml").write_text(cfg.to_toml())
    comm.barrier(mesh)
    return run_dir, resume


def _resume_state(run_dir: Path, mesh: Mesh, engine: Engine, scheduler, sampler) -> int:
    """Load the newest checkpoint into the engine, schedule and sampler; returns its step. The
    metrics written after it go: the steps will be taken, and written, again."""
    ckpt_root = run_dir / "checkpoints"
    path = latest_checkpoint(ckpt_root)
    if path is None:
        raise CheckpointError(f"--resume: {ckpt_root} holds no checkpoint to resume from")
    fresh_groups, fresh_base_lrs = group_options(engine.optimizer), list(scheduler.base_lrs)
    start = load_checkpoint(path, mesh, engine, scheduler, sampler)
    report.say(mesh, f"resumed from {path} at step {start}")
    # the configured lr schedule and optimizer options take over from the step reached
    for line in reapply_config(engine.optimizer, scheduler, fresh_groups, fresh_base_lrs, start):
        report.say(mesh, f"plait: resume: {line} (as now configured)")
    if mesh.is_rank0:
        report.truncate_metrics(run_dir, start)
    return start


def _load_data(cfg: Config, mesh: Mesh, run_dir: Path, resume: bool):
    """The corpus, tokenized (plait.data): rank 0 first (training a BPE, tokenizing into the cache
    if the launcher's validation has not), then the others, which find it in the cache. A
    tokenizer other than bytes is saved as <run_dir>/tokenizer.json, which a resumed run reuses."""
    d = cfg.data
    saved = run_dir / "tokenizer.json"
    spec = d.tokenizer
    if spec != "bytes" and resume and saved.is_file():
        spec = str(saved)
    load = lambda tokenizer: load_corpus(  # noqa: E731
        d.corpus, d.held_out_fraction, tokenizer, d.vocab_size, d.cache_dir or None, cfg.train.progress
    )
    corpus = load(spec) if mesh.is_rank0 else None
    if corpus is not None and spec != "bytes" and Path(spec) != saved:
        corpus.tokenizer.save(saved)
    comm.barrier(mesh)
    return corpus if corpus is not None else load("bytes" if spec == "bytes" else str(saved))


def _restarting(run_dir: Path, mesh: Mesh, restart: int, limit: int) -> bool:
    """The launcher restarted the job after a rank failed: resume from the newest checkpoint
    (True), or start over when none was saved yet (False). A run that diverged stays stopped."""
    if (run_dir / DIVERGED).exists():
        raise DivergedError(f"{run_dir} stopped because training diverged; a restart does not retrain it")
    found = None
    with contextlib.suppress(CheckpointError):
        found = latest_checkpoint(run_dir / "checkpoints")
    what = f"resuming from {found}" if found is not None else "no checkpoint yet: starting over"
    report.say(mesh, f"plait: restart {restart} of train.max_restarts = {limit} after a rank failed; {what}")
    if found is None and mesh.is_rank0:
        report.truncate_metrics(run_dir, 0)
    return found is not None


def _train_step(run: Run, step: int, batch: list | None = None) -> dict:
    """One optimizer step through the engine contract; returns the step's metric record. `batch`:
    this rank's micro-batches when a controller sends them (plait.controller), else the sampler's."""
    cfg, mesh, engine = run.cfg, run.mesh, run.engine
    t, device = cfg.train, mesh.device
    mesh.ledger.set_step(step)
    lr = engine.optimizer.param_groups[0]["lr"]
    if isinstance(engine, ErrorFeedback):  # residuals in units of the step (plait.comm.compress)
        engine.set_lr_scale(lr / t.lr)
    timeline = isinstance(engine, RecordsTimeline) and step == run.timeline_step
    if timeline:
        engine.record_next_step()
    t0 = time.perf_counter()
    micro = [(x.to(device), y.to(device)) for x, y in (batch or run.sampler.next_batch())]
    local_sum = engine.forward_backward(micro, 1.0 / run.local_tokens, lambda: _autocast(device, t.bf16))
    if timeline:
        report.write_timeline(engine, mesh, run.run_dir, time.perf_counter() - t0)
    grad_norm = engine.clip_grad_norm_(t.grad_clip) if t.grad_clip > 0 else engine.grad_norm()
    mesh.ledger.set_step(-1)  # the loss report is not part of the step's traffic
    loss = comm.all_reduce_scalar(float(local_sum), mesh, (*data_axes(mesh), "pp")) / run.tokens_per_step
    loss, grad_norm = agree_finite(mesh, loss, grad_norm)  # so every rank takes the same decision
    finite = math.isfinite(loss) and math.isfinite(grad_norm)
    if finite:
        mesh.ledger.set_step(step)
        engine.step()
        run.scheduler.step()
        mesh.ledger.set_step(-1)
    else:  # the parameters never see a non-finite gradient (train.nonfinite)
        clear_nonfinite_residuals(engine)
    engine.zero_grad(set_to_none=True)
    record = {
        "step": step,
        "loss": loss,
        "lr": lr,
        "grad_norm": grad_norm,
        "step_time_s": time.perf_counter() - t0,
        "local_loss": float(local_sum) / run.local_tokens,
    }
    if not finite:
        record["skipped"] = True
    return record


def step_hook():
    """The function named by PLAIT_STEP_HOOK ("package.module:function"), called as
    `hook(step=, rank=, cfg=, engine=)` at the start of every step, or None: an extension point for
    instrumentation and for the failure tests (plait.testing.inject_fault)."""
    return named_hook("PLAIT_STEP_HOOK")

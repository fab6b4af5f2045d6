"""The training loop each rank runs: GPT on the corpus, data parallel, AdamW, warm-up + cosine.

Loss normalisation (correct by construction): every rank backpropagates
`sum of its token losses / tokens per rank per step`, over all its accumulation micro-batches,
and DataParallel averages over dp, so the gradient is that of the mean loss over every token of
the global batch, whatever the layout (dp, micro-batches). The logged loss is the same global
mean, reduced in float64.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from plait import comm
from plait.data import DistributedBatchSampler, eval_batches, load_corpus
from plait.data.tokenizer import bits_per_byte, target_bytes
from plait.engine import Engine, ErrorFeedback, RecordsTimeline
from plait.errors import CheckpointError, ConfigError, DivergedError
from plait.mesh import Mesh, init_distributed
from plait.models import GPT, gpt_train_flops_per_token
from plait.models.source import build_model
from plait.tensor_parallel import without_sequence_parallel
from plait.train.build import build_engine, describe_engine, micro_batches_per_step
from plait.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from plait.train.config import Config, model_config
from plait.train.metrics import MetricsWriter, peak_memory_bytes, plot_loss_curve, read_metrics
from plait.train.peak import peak_flops_per_rank
from plait.train.replicas import check_replicas
from plait.train.rundir import create_run_dir


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to `min_ratio` at `total` (0-based step)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def data_axes(mesh: Mesh) -> tuple[str, ...]:
    """The axes the batch is split over: dp, and ep under expert parallelism (each ep rank
    routes its own rows' tokens to the experts of every ep rank)."""
    return ("dp", "ep") if mesh.size("ep") > 1 else ("dp",)


def data_axis(mesh: Mesh) -> str:
    """`data_axes` as one (combined) mesh axis: its size and this rank's index in it split the
    rows of every batch."""
    return mesh.axis_over(data_axes(mesh))


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


def _say(mesh: Mesh, text: str) -> None:
    if mesh.is_rank0:
        tqdm.write(text, file=sys.stdout)
        sys.stdout.flush()


def run(cfg: Config, resume: bool = False, peak_flops: float | None = None, restart: int = 0) -> dict:
    """Train on this rank (inside a launcher's environment); returns rank 0's summary. `restart`:
    how many times the launcher restarted the job (it then resumes from the newest checkpoint)."""
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
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return _train(cfg, mesh, resume, peak_flops, restart)
    except BaseException as exc:
        mesh.close(reason=f"failed with {type(exc).__name__}")  # what the other ranks' reports say
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
        if (timer := _STOP.pop("timer", None)) is not None:  # stopped in time: no forced exit
            timer.cancel()
        _STOP["signal"] = 0
        mesh.close()
        dist.destroy_process_group()


PREEMPTED_EXIT = 143  # 128 + SIGTERM, as a shell reports a process that SIGTERM ended
_STOP = {"signal": 0}  # set by the handler, read at the next step boundary


PREEMPT_GRACE_S = 30.0  # as torch's elastic agent, which kills its workers this long after SIGTERM


def _on_sigterm(signum, frame) -> None:
    """SIGTERM (a scheduler's pre-emption, or the launcher passing it on): finish the step in
    flight, save a checkpoint and exit with PREEMPTED_EXIT (`_train`). A rank that cannot get
    there (blocked on a dead peer) exits anyway after PREEMPT_GRACE_S, or at a second SIGTERM,
    so that nothing waits on it forever; the previous checkpoint is then the newest. When a
    peer rank has already failed, the SIGTERM is the launcher tearing the job down, not a
    pre-emption: no checkpoint can be saved without that peer, so the rank exits at once."""
    if _STOP["signal"] or _peer_failed():
        os._exit(PREEMPTED_EXIT)
    _STOP["signal"] = signum
    _STOP["timer"] = timer = threading.Timer(PREEMPT_GRACE_S, os._exit, args=(PREEMPTED_EXIT,))
    timer.daemon = True
    timer.start()


def _peer_failed() -> bool:
    """Whether another rank of this job on this machine has failed: torch's elastic agent gives
    each rank an error file in one directory per attempt, written by a rank that raises (and
    by the watchdog) before it exits."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    mine = Path(path)
    try:
        return any(f != mine for f in mine.parent.parent.glob("*/error.json"))
    except OSError:
        return False


class Preempted(SystemExit):
    """The run stopped at a step boundary on SIGTERM, after saving a checkpoint."""

    def __init__(self, step: int):
        super().__init__(PREEMPTED_EXIT)
        self.step = step


def check_fresh_run_dir(run_dir: Path) -> None:
    """A new run never writes into another run's directory (its checkpoints and metrics)."""
    if (run_dir / "metrics.jsonl").exists() or (run_dir / "checkpoints").exists():
        raise ConfigError(
            f"train.run_dir {str(run_dir)!r} already holds a run: continue it with --resume {run_dir}, "
            "or choose another train.run_dir"
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


@dataclasses.dataclass
class _Run:
    """What the step loop works with, built once by `_setup`."""

    cfg: Config
    mesh: Mesh
    run_dir: Path
    corpus: object
    sampler: DistributedBatchSampler
    val: list
    raw: torch.nn.Module  # plait's GPT, or a python: source's model
    engine: Engine
    scheduler: torch.optim.lr_scheduler.LRScheduler
    metrics: MetricsWriter
    start: int  # the last step already taken (0, or the checkpoint's)
    last: int  # the last step this invocation takes (train.stop_at or train.steps)
    n_params: int
    tokens_per_step: int
    local_tokens: int  # tokens per dp rank per step: the loss is divided by it
    flops_per_token: float
    peak_flops: float
    timeline_step: int  # the step whose action timeline is recorded (engines that record one)
    val_tokens_bytes: tuple[int, int] = (1, 1)  # tokens the held-out loss averages over, their bytes
    skipped_in_a_row: int = 0  # consecutive steps skipped for a non-finite loss or gradient norm
    skipped: int = 0  # all steps skipped so far in this invocation


def _train(cfg: Config, mesh: Mesh, resume: bool, peak_flops: float | None, restart: int = 0) -> dict:
    run = _setup(cfg, mesh, resume, peak_flops, restart)
    t, engine = cfg.train, run.engine
    _announce(run)
    bar = tqdm(
        total=t.steps,
        initial=run.start,
        disable=not (mesh.is_rank0 and t.progress),
        desc="train",
        unit="step",
        dynamic_ncols=True,
        mininterval=1.0,
        file=sys.stderr,
    )
    engine.module.train()
    window = _Window()
    hook = step_hook()
    loss, val_loss = float("nan"), None
    for step in range(run.start + 1, run.last + 1):
        if hook is not None:
            hook(step=step, rank=mesh.global_rank, cfg=cfg, engine=engine)
        record = _train_step(run, step)
        loss = record["loss"]
        _guard_nonfinite(run, step, record)
        if t.replica_check_every and step % t.replica_check_every == 0:
            record["replicas_checked"] = check_replicas(engine, mesh, step)
        window.steps += 1
        if step % t.log_every == 0 or step == run.last:
            _log(run, step, record, window)
        if (t.eval_every and step % t.eval_every == 0) or step == t.steps:
            if step == t.steps:
                engine.finish()  # the final held-out loss is of the final parameters
            val_loss = record["val_loss"] = evaluate(engine, run.val, mesh, mesh.device, t.bf16)
            bpb = record["val_bits_per_byte"] = bits_per_byte(val_loss, *run.val_tokens_bytes)
            _say(mesh, f"step {step:>5}/{t.steps} | held-out loss {val_loss:.4f} ({bpb:.3f} bits/byte)")
        run.metrics.write(**record)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
        due = (t.checkpoint_every and step % t.checkpoint_every == 0) or step == run.last
        # not while steps are being skipped: the newest checkpoint stays the last good state
        if due and not run.skipped_in_a_row:
            _save(run, step)
        if _stop_requested(mesh):  # SIGTERM on any rank: every rank stops after this step
            if not due:
                _save(run, step)
            bar.close()
            run.metrics.close()
            _say(
                mesh,
                f"plait: stopped by SIGTERM after step {step}; checkpoint saved in "
                f"{run.run_dir / 'checkpoints'}; continue with: plait train --resume {run.run_dir}",
            )
            engine.close()
            raise Preempted(step)
    bar.close()
    run.metrics.close()
    engine.finish()
    summary = _finish(run, loss, val_loss)
    engine.close()
    return summary


def _save(run: _Run, step: int) -> None:
    keep = run.cfg.train.keep_checkpoints
    save_checkpoint(run.run_dir / "checkpoints", step, run.mesh, run.engine, run.scheduler, run.sampler, keep)


def _setup(cfg: Config, mesh: Mesh, resume: bool, peak_flops: float | None, restart: int = 0) -> _Run:
    """The run directory, data, model, engine, schedule and (on resume) the checkpoint's state."""
    t, device = cfg.train, mesh.device
    run_dir = _agreed_run_dir(cfg, mesh)
    if restart:
        resume = _restarting(run_dir, mesh, restart, t.max_restarts)
    if mesh.is_rank0:
        if not resume and not restart:
            check_fresh_run_dir(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.toml").write_text(cfg.to_toml())
    comm.barrier(mesh)

    mcfg = model_config(cfg)
    corpus = _load_data(cfg, mesh, run_dir, resume)
    dp = mesh.size(data_axis(mesh))  # data-parallel ranks: dp, or dp x ep
    sampler = DistributedBatchSampler(
        corpus.train,
        mcfg.seq_len,
        t.global_batch,
        mesh.rank(data_axis(mesh)),
        dp,
        t.seed,
        micro_batches=micro_batches_per_step(cfg),
    )
    val = eval_batches(corpus.val, mcfg.seq_len, t.global_batch, t.eval_batches)
    val_tokens_bytes = target_bytes(val, corpus.token_bytes())  # for bits per byte

    # measured (if not cached) before seeding; it uses its own generator anyway
    peak = peak_flops or peak_flops_per_rank(device, t.bf16, torch.get_num_threads(), t.peak_tflops)
    torch.manual_seed(t.seed)  # identical initialisation on every rank (DataParallel broadcasts anyway)
    raw = build_model(cfg).to(device)  # plait's GPT, a Hugging Face model or a python: factory's
    n_params = sum(q.numel() for q in raw.parameters())
    flops_per_token = _flops_per_token(raw)  # of the whole model: before wrapping shards it
    engine = build_engine(raw, cfg, mesh, run_dir)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        engine.optimizer, lambda s: lr_factor(s, t.warmup_steps, t.steps, t.min_lr / t.lr)
    )
    # dropout streams differ per data-parallel replica; tensor-parallel peers share theirs, as
    # they must for dropout on replicated activations (split ones use apply_tp's own stream)
    torch.manual_seed(t.seed + 1 + mesh.rank(data_axis(mesh)))

    start = 0
    if resume:
        ckpt_root = run_dir / "checkpoints"
        path = latest_checkpoint(ckpt_root)
        if path is None:
            raise CheckpointError(f"--resume: {ckpt_root} holds no checkpoint to resume from")
        start = load_checkpoint(path, mesh, engine, scheduler, sampler)
        _say(mesh, f"resumed from {path} at step {start}")
        if mesh.is_rank0:
            _truncate_metrics(run_dir, start)
    comm.barrier(mesh)
    last = min(t.steps, t.stop_at) if t.stop_at else t.steps
    tokens_per_step = t.global_batch * mcfg.seq_len
    return _Run(
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
    )


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


def _flops_per_token(raw: torch.nn.Module) -> float:
    """Model FLOPs per trained token: a GPT's exact count (of its own config: a python: factory
    may return one), an hf model's from its config, any other model's 6 x parameters."""
    if isinstance(raw, GPT):
        return gpt_train_flops_per_token(raw.cfg, recompute=False)
    cfg = getattr(raw, "cfg", None)
    if hasattr(cfg, "train_flops_per_token"):  # plait.models.hf.HFCausalLM's HFConfig
        return cfg.train_flops_per_token()
    from plait.models.python_source import train_flops_per_token

    return train_flops_per_token(raw)


def _restarting(run_dir: Path, mesh: Mesh, restart: int, limit: int) -> bool:
    """The launcher restarted the job after a rank failed: resume from the newest checkpoint
    (True), or start over when none was saved yet (False). A run that diverged stays stopped."""
    if (run_dir / DIVERGED).exists():
        raise DivergedError(f"{run_dir} stopped because training diverged; a restart does not retrain it")
    found = None
    with contextlib.suppress(CheckpointError):
        found = latest_checkpoint(run_dir / "checkpoints")
    what = f"resuming from {found}" if found is not None else "no checkpoint yet: starting over"
    _say(mesh, f"plait: restart {restart} of train.max_restarts = {limit} after a rank failed; {what}")
    if found is None and mesh.is_rank0:
        _truncate_metrics(run_dir, 0)
    return found is not None


def _model_name(cfg: Config) -> str:
    return "GPT" if cfg.model.source == "plait" else cfg.model.source


def _announce(run: _Run) -> None:
    """The start-up lines: model, mesh, batch, steps, run directory, engine, notes."""
    cfg, mesh = run.cfg, run.mesh
    mcfg = model_config(cfg)
    what = f"{_model_name(cfg)} {mcfg.n_layer}L {mcfg.n_head}H d={mcfg.d_model}"
    if cfg.model.source.startswith("python:"):
        what = f"{cfg.model.source} ({type(getattr(run.raw, 'net', run.raw)).__name__})"
    _say(
        mesh,
        f"plait: {what} seq={mcfg.seq_len} "
        f"({run.n_params / 1e6:.2f}M params) | mesh {mesh.shape_str()} on {mesh.device} | "
        f"global batch {cfg.train.global_batch} x {mcfg.seq_len} tokens | "
        f"steps {run.start + 1}..{run.last} | run dir {run.run_dir}",
    )
    _say(mesh, f"plait: {describe_engine(cfg, run.engine)}")
    c = cfg.comm
    if c.target == "momentum":
        stage = cfg.parallel.zero_stage
        zero = (
            f"; under ZeRO-{stage} backward then skips the reduce-scatter, and the momentum is kept "
            "whole on every rank (4 bytes per parameter) while master weights and variance stay sharded"
            if stage
            else ""
        )
        _say(
            mesh,
            f"plait: 1-bit Adam: AdamW on uncompressed gradients for {c.freeze_step} steps, then the "
            f"variance is frozen and the momentum is exchanged with {c.compression} compression "
            f"({'with' if c.error_feedback else 'without'} error feedback); from then on gradient "
            f"clipping and grad_norm see each rank's own whole gradient{zero}",
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


def _train_step(run: _Run, step: int) -> dict:
    """One optimizer step through the engine contract; returns the step's metric record."""
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
    micro = [(x.to(device), y.to(device)) for x, y in run.sampler.next_batch()]
    local_sum = engine.forward_backward(micro, 1.0 / run.local_tokens, lambda: _autocast(device, t.bf16))
    if timeline:
        _write_timeline(engine, mesh, run.run_dir, time.perf_counter() - t0)
    grad_norm = engine.clip_grad_norm_(t.grad_clip) if t.grad_clip > 0 else engine.grad_norm()
    mesh.ledger.set_step(-1)  # the loss report is not part of the step's traffic
    loss = comm.all_reduce_scalar(float(local_sum), mesh, (*data_axes(mesh), "pp")) / run.tokens_per_step
    # every rank sees the same loss and norm, so every rank takes the same decision
    finite = math.isfinite(loss) and math.isfinite(grad_norm)
    if finite:
        mesh.ledger.set_step(step)
        engine.step()
        run.scheduler.step()
        mesh.ledger.set_step(-1)
    else:  # the parameters never see a non-finite gradient (train.nonfinite)
        _clear_nonfinite_residuals(engine)
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


def _clear_nonfinite_residuals(engine) -> None:
    """A skipped step's non-finite gradient may have reached a compressor's error-feedback
    residual; such a residual would poison every later step, so it starts again from zero."""
    buffers = getattr(engine, "residual_buffers", lambda: None)() or {}
    for t in buffers.values():
        if not bool(torch.isfinite(t).all()):
            t.zero_()


def _guard_nonfinite(run: _Run, step: int, record: dict) -> None:
    """Count a skipped step, say so, and stop the run (every rank alike) when train.nonfinite
    is "stop" or too many steps in a row were skipped."""
    t = run.cfg.train
    if not record.get("skipped"):
        run.skipped_in_a_row = 0
        return
    run.skipped += 1
    run.skipped_in_a_row += 1
    record["skipped_steps"] = run.skipped
    what = f"loss {record['loss']:.4g}, gradient norm {record['grad_norm']:.4g}"
    if t.nonfinite == "skip" and run.skipped_in_a_row < t.max_nonfinite:
        _say(
            run.mesh,
            f"plait: step {step} skipped: non-finite {what} (the parameters were not updated; "
            f"{run.skipped_in_a_row} in a row, the run stops at train.max_nonfinite = {t.max_nonfinite})",
        )
        return
    run.metrics.write(**record)
    run.metrics.close()
    found = None
    with contextlib.suppress(CheckpointError):
        found = latest_checkpoint(run.run_dir / "checkpoints")
    where = (
        f"the last checkpoint, {found}, holds finite parameters: continue from it with a lower "
        f"train.lr (plait train --resume {run.run_dir} --train.lr ...)"
        if found is not None
        else "no checkpoint was saved before it"
    )
    why = (
        f"{run.skipped_in_a_row} steps in a row (train.max_nonfinite = {t.max_nonfinite})"
        if t.nonfinite == "skip"
        else "train.nonfinite = 'stop'"
    )
    _mark_diverged(run.run_dir, run.mesh, step)
    raise DivergedError(f"training diverged at step {step}: non-finite {what}, {why}; {where}")


def _stop_requested(mesh: Mesh) -> bool:
    """Whether any rank got SIGTERM (one small all-reduce over every rank, each step)."""
    return comm.all_reduce_scalar(float(_STOP["signal"] != 0), mesh, ("world",), op="max") > 0


DIVERGED = ".plait-diverged"  # in the run directory: a restarted job does not train again


def _mark_diverged(run_dir: Path, mesh: Mesh, step: int) -> None:
    if mesh.is_rank0:
        (run_dir / DIVERGED).write_text(f"{step}\n")


@dataclasses.dataclass
class _Window:
    """Steps and wall time since the last log line (the throughput is measured over them)."""

    t0: float = dataclasses.field(default_factory=time.perf_counter)
    steps: int = 0


def _log(run: _Run, step: int, record: dict, window: _Window) -> None:
    """Throughput, MFU, memory and traffic over the window into `record`, and the log line."""
    mesh = run.mesh
    elapsed = time.perf_counter() - window.t0
    tok_s = window.steps * run.tokens_per_step / elapsed
    mfu = tok_s * run.flops_per_token / (run.peak_flops * mesh.world_size)
    mem = peak_memory_bytes(mesh.device)
    record.update(
        model_state_bytes=run.engine.memory(),
        tokens_per_s=tok_s,
        mfu=mfu,
        peak_mem_bytes=mem,
        comm_bytes=mesh.ledger.total(step, "bus_bytes"),
        comm_uncompressed_bytes=mesh.ledger.total(step, "logical_bytes"),
    )
    moe = _moe_record(run)
    if moe is not None:
        record["moe"] = moe
    _say(
        mesh,
        f"step {step:>5}/{run.cfg.train.steps} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
        f"{tok_s:>8,.0f} tok/s | MFU {mfu:6.2%} | peak mem {mem / 2**20:,.0f} MiB",
    )
    window.t0, window.steps = time.perf_counter(), 0


def _moe_record(run: _Run) -> dict | None:
    """The mixture-of-experts statistics of the training forwards since the last log, summed over
    the data-parallel ranks (dp x ep; every rank calls it): claims per expert of each MoE layer,
    the fraction of claims dropped over capacity, and the mean load-balancing and z losses."""
    from plait.moe.parallel import moe_stats

    cfg = run.cfg.model
    if not cfg.experts:
        return None
    experts, n_layers = cfg.experts, model_config(run.cfg).n_moe_layers
    # one row per MoE layer of the whole model: this rank fills the rows of the layers it holds
    # (a pipeline rank holds some), the sum over the data axes and pp gives every layer's totals
    flat = torch.zeros(n_layers, experts + 5, dtype=torch.float64)
    for i, s in moe_stats(run.engine.module):
        if s is not None:
            flat[i, :experts] = s["load"].double()
            flat[i, experts:] = torch.tensor([s[k] for k in ("dropped", "claims", "aux", "z", "forwards")])
    flat = flat.to(run.mesh.device)
    comm.all_reduce(flat, run.mesh, data_axis(run.mesh))
    comm.all_reduce(flat, run.mesh, "pp")
    flat = flat.cpu()
    load, (dropped, claims, aux, z, forwards) = flat[:, :experts], flat[:, experts:].sum(0).tolist()
    return {
        "tokens_per_expert": [[int(v) for v in row] for row in load.tolist()],
        "dropped_fraction": dropped / max(claims, 1.0),
        "aux_loss": aux / max(forwards, 1.0),
        "z_loss": z / max(forwards, 1.0),
    }


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


def step_hook():
    """The function named by PLAIT_STEP_HOOK ("package.module:function"), called as
    `hook(step=, rank=, cfg=, engine=)` at the start of every step, or None: an extension point for
    instrumentation and for the failure tests (plait.testing.inject_fault)."""
    spec = os.environ.get("PLAIT_STEP_HOOK")
    if not spec:
        return None
    module, _, name = spec.partition(":")
    if not name:
        raise ConfigError(f"PLAIT_STEP_HOOK = {spec!r}: expected 'package.module:function'")
    return getattr(importlib.import_module(module), name)


def _truncate_metrics(run_dir: Path, step: int) -> None:
    """On resume, drop metric lines written after the checkpoint (they will be written again)."""
    for path in run_dir.glob("metrics*.jsonl"):
        kept = [r for r in read_metrics(path) if r.get("step", 0) <= step]
        path.write_text("".join(json.dumps(r) + "\n" for r in kept))


def _finish(run: _Run, loss: float, val_loss: float | None) -> dict:
    """The summary (rank 0 writes summary.json and loss.png), a text sample and the last lines."""
    cfg, mesh, raw, corpus, run_dir, step = run.cfg, run.mesh, run.raw, run.corpus, run.run_dir, run.last
    memory, n_params = run.engine.memory(), run.n_params
    summary = {
        "step": step,
        "loss": loss,
        "val_loss": val_loss,
        "params": n_params,
        "tokenizer": corpus.tokenizer.name,
        "unigram_entropy_bits": corpus.unigram_entropy_bits(),  # per token
        "model_state_bytes_per_rank": memory,
    }
    sample = None
    if cfg.train.sample_tokens and step == cfg.train.steps and cfg.parallel.pp > 1:
        _say(mesh, "plait: no text sample under pipeline parallelism (each rank holds part of the model)")
    elif cfg.train.sample_tokens and step == cfg.train.steps and not callable(getattr(raw, "generate", None)):
        _say(mesh, f"plait: no text sample: the model ({type(raw).__name__}) has no generate method")
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
    if any("moe" in r for r in records):
        from plait.moe.plot import plot_expert_load

        plot_expert_load(records, run_dir / "expert_load.png", title=f"expert load, mesh {mesh.shape_str()}")
    if val_loss is not None:
        bpb = summary["val_bits_per_byte"] = bits_per_byte(val_loss, *run.val_tokens_bytes)
        _say(
            mesh,
            f"held-out loss {val_loss:.4f} nats/token = {bpb:.3f} bits/byte; unigram entropy of the "
            f"corpus's tokens {summary['unigram_entropy_bits']:.3f} bits/token",
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

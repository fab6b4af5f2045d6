"""What a run reports, apart from the training itself: the start-up lines, the log line of every
log interval (loss, tokens/s, MFU, memory, traffic, mixture-of-experts statistics), a pipeline's
measured timeline, the progress bar, and at the end the summary, the loss plot and a text sample.
Rank 0 prints; every rank writes its metrics (plait.train.metrics)."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from plait import comm
from plait.data.tokenizer import bits_per_byte
from plait.mesh import Mesh
from plait.models import GPT, gpt_train_flops_per_token
from plait.models.python_source import train_flops_per_token as python_train_flops_per_token
from plait.moe.parallel import moe_stats
from plait.moe.plot import plot_expert_load
from plait.pipeline.render import render_png
from plait.pipeline.simulate import Costs, simulate
from plait.tensor_parallel import without_sequence_parallel
from plait.train import console
from plait.train.build import describe_engine
from plait.train.config import Config, model_config
from plait.train.metrics import peak_memory_bytes, plot_loss_curve, read_metrics
from plait.train.peak import raise_cpu_peak
from plait.train.run_state import Run, data_axis


def say(mesh: Mesh, text: str) -> None:
    """A line on rank 0's stdout, above the progress bar."""
    if mesh.is_rank0:
        tqdm.write(text, file=sys.stdout)
        sys.stdout.flush()


def flops_per_token(raw: torch.nn.Module) -> float:
    """Model FLOPs per trained token: a GPT's exact count (of its own config: a python: factory
    may return one), an hf model's from its config, any other model's 6 x parameters."""
    if isinstance(raw, GPT):
        return gpt_train_flops_per_token(raw.cfg, recompute=False)
    cfg = getattr(raw, "cfg", None)
    if hasattr(cfg, "train_flops_per_token"):  # plait.models.hf.HFCausalLM's HFConfig
        return cfg.train_flops_per_token()
    return python_train_flops_per_token(raw)


def _model_name(cfg: Config) -> str:
    return "GPT" if cfg.model.source == "plait" else cfg.model.source


def announce(run: Run) -> None:
    """The start-up lines: model, mesh, batch, steps, run directory, engine, notes."""
    cfg, mesh = run.cfg, run.mesh
    mcfg = model_config(cfg)
    what = f"{_model_name(cfg)} {mcfg.n_layer}L {mcfg.n_head}H d={mcfg.d_model}"
    if cfg.model.source.startswith("python:"):
        what = f"{cfg.model.source} ({type(getattr(run.raw, 'net', run.raw)).__name__})"
    say(
        mesh,
        f"plait: {what} seq={mcfg.seq_len} "
        f"({run.n_params / 1e6:.2f}M params) | mesh {mesh.shape_str()} on {mesh.device} | "
        f"global batch {cfg.train.global_batch} x {mcfg.seq_len} tokens | "
        f"steps {run.start + 1}..{run.last} | run dir {run.run_dir}",
    )
    say(mesh, f"plait: {describe_engine(cfg, run.engine)}")
    c = cfg.comm
    if c.target == "momentum":
        stage = cfg.parallel.zero_stage
        zero = (
            f"; under ZeRO-{stage} backward then skips the reduce-scatter, and the momentum is kept "
            "whole on every rank (4 bytes per parameter) while master weights and variance stay sharded"
            if stage
            else ""
        )
        first = (
            f"1-bit SGD: momentum SGD on uncompressed gradients for {c.freeze_step} steps, then the momentum"
            if cfg.optim.name == "sgd"
            else f"1-bit Adam: AdamW on uncompressed gradients for {c.freeze_step} steps, then the "
            "variance is frozen and the momentum"
        )
        say(
            mesh,
            f"plait: {first} is exchanged with {c.compression} compression "
            f"({'with' if c.error_feedback else 'without'} error feedback); from then on gradient "
            f"clipping and grad_norm see each rank's own whole gradient{zero}",
        )
    elif c.compression == "onebit" and c.error_feedback and cfg.optim.name == "sgd" and cfg.optim.momentum:
        say(
            mesh,
            "plait: note: 1-bit error feedback on gradients under SGD with momentum trained worse than "
            "without it in plait's experiments (the momentum multiplies the carried error); "
            "comm.target = 'momentum' (1-bit SGD, error feedback after the momentum) compresses the "
            "momentum instead; see docs/compression.md",
        )
    elif (
        c.compression in ("onebit", "topk", "powersgd")
        and c.error_feedback
        and cfg.optim.name in ("adamw", "lamb")
    ):
        say(
            mesh,
            f"plait: note: error feedback ({c.compression}) on gradients under {cfg.optim.name} trained "
            "worse than without it in plait's experiments (Adam's per-coordinate scaling); "
            "comm.target = 'momentum' (1-bit Adam) compresses AdamW's momentum instead; "
            "see docs/compression.md",
        )


@dataclasses.dataclass
class Window:
    """Steps and wall time since the last log line (the throughput is measured over them)."""

    t0: float = dataclasses.field(default_factory=time.perf_counter)
    steps: int = 0


def progress_bar(run: Run):
    """Rank 0's progress on stderr (train.progress), from the step the run starts at: a bar on a
    terminal, plain periodic lines in a log file (`plait.train.console`)."""
    return console.progress(run.cfg.train.steps, run.start, run.mesh.is_rank0 and run.cfg.train.progress)


def log_held_out(run: Run, step: int, record: dict, val_loss: float) -> None:
    """The held-out loss, and its bits per byte, into `record` and a line."""
    record["val_loss"] = val_loss
    bpb = record["val_bits_per_byte"] = bits_per_byte(val_loss, *run.val_tokens_bytes)
    steps = run.cfg.train.steps
    say(run.mesh, f"step {step:>5}/{steps} | held-out loss {val_loss:.4f} ({bpb:.3f} bits/byte)")


def log_preempted(run: Run, step: int) -> None:
    say(
        run.mesh,
        f"plait: stopped by SIGTERM after step {step}; checkpoint saved in "
        f"{run.run_dir / 'checkpoints'}; continue with: plait train --resume {run.run_dir}",
    )


def log_step(run: Run, step: int, record: dict, window: Window) -> None:
    """Throughput, MFU, memory and traffic over the window into `record`, and the log line."""
    mesh = run.mesh
    elapsed = time.perf_counter() - window.t0
    tok_s = window.steps * run.tokens_per_step / elapsed
    achieved = tok_s * run.flops_per_token / mesh.world_size  # model FLOP/s per rank
    if achieved > run.peak_flops and mesh.device.type == "cpu" and not run.cfg.train.peak_tflops:
        # the cached CPU peak was measured on a busy machine: it is at least what this run did
        dtype = torch.bfloat16 if run.cfg.train.bf16 else torch.float32
        run.peak_flops = raise_cpu_peak(torch.get_num_threads(), dtype, achieved, write=mesh.is_rank0)
    mfu = achieved / run.peak_flops
    mem = peak_memory_bytes(mesh.device)
    record.update(
        model_state_bytes=run.engine.memory(),
        tokens_per_s=tok_s,
        mfu=mfu,
        peak_mem_bytes=mem,
        comm_bytes=mesh.ledger.total(step, "bus_bytes"),
        comm_uncompressed_bytes=mesh.ledger.total(step, "logical_bytes"),
        comm_by_axis=_bytes_by_axis(mesh.ledger.rows(step)),
    )
    moe = _moe_record(run)
    if moe is not None:
        record["moe"] = moe
    say(
        mesh,
        f"step {step:>5}/{run.cfg.train.steps} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
        f"{tok_s:>8,.0f} tok/s | MFU {mfu:6.2%} | peak mem {mem / 2**20:,.0f} MiB",
    )
    window.t0, window.steps = time.perf_counter(), 0


def _moe_record(run: Run) -> dict | None:
    """The mixture-of-experts statistics of the training forwards since the last log, summed over
    the data-parallel ranks (dp x ep; every rank calls it): claims per expert of each MoE layer,
    the fraction of claims dropped over capacity, and the mean load-balancing and z losses."""
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


def write_timeline(engine, mesh: Mesh, run_dir: Path, step_time: float) -> None:
    """The measured action timeline of one pipelined step beside the simulator's prediction
    from the same action costs: pipeline_timeline.{json,png} in the run directory."""
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
    say(
        mesh,
        f"plait: pipeline step measured {step_time * 1e3:.1f} ms, simulated {sim.makespan * 1e3:.1f} ms "
        f"from the measured action costs; timelines in {run_dir / 'pipeline_timeline.png'}",
    )


def _bytes_by_axis(rows: dict) -> dict[str, float]:
    """This rank's bus bytes of one step, per mesh axis."""
    out: dict[str, float] = {}
    for (_, axis), row in rows.items():
        out[axis] = out.get(axis, 0.0) + row.bus_bytes
    return out


def write_placements(run_dir: Path, mesh, engine) -> None:
    """``log.placements``: where the layout put each of this rank's parameters, with the rank's
    coordinates on the mesh, as ``placements/rank_R.json`` (read by `plait verify`)."""
    out = run_dir / "placements"
    out.mkdir(exist_ok=True)
    record = {
        "coords": mesh.coords,
        "placements": getattr(engine, "placements", {}),
        "local_params": getattr(engine, "local_params", None),  # elements, before ZeRO shards them
    }
    (out / f"rank_{mesh.global_rank}.json").write_text(json.dumps(record, indent=1))


def truncate_metrics(run_dir: Path, step: int) -> None:
    """On resume, drop metric lines written after the checkpoint (they will be written again)."""
    for path in run_dir.glob("metrics*.jsonl"):
        kept = [r for r in read_metrics(path) if r.get("step", 0) <= step]
        path.write_text("".join(json.dumps(r) + "\n" for r in kept))


def checkpoint_line(ckpt: dict) -> str:
    """One line on the run's checkpoints (`Checkpointer.summary`), for the end of the run."""
    how = "asynchronous" if ckpt["async"] else "synchronous"
    line = (
        f"checkpoints: {ckpt['saves']} {how} saves, blocking the step {ckpt['blocking_s_median']:.3f} s "
        f"(median; max {ckpt['blocking_s_max']:.3f} s)"
    )
    if ckpt["async"]:
        write = ckpt["write_s_median"]
        line += (
            f", written in the background in {write:.3f} s (median)" if write is not None else ""
        ) + f", host snapshot {ckpt['host_bytes'] / 2**20:.2f} MiB"
        if ckpt["waited_s_total"] >= 0.05:
            line += f", {ckpt['waited_s_total']:.2f} s waited for a previous save in all"
    return line


def finish(run: Run, loss: float, val_loss: float | None) -> dict:
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
    if run.checkpointer is not None:
        summary["checkpoints"] = run.checkpointer.summary()
    sample = None
    if cfg.train.sample_tokens and step == cfg.train.steps and cfg.parallel.pp > 1:
        say(mesh, "plait: no text sample under pipeline parallelism (each rank holds part of the model)")
    elif cfg.train.sample_tokens and step == cfg.train.steps and not callable(getattr(raw, "generate", None)):
        say(mesh, f"plait: no text sample: the model ({type(raw).__name__}) has no generate method")
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
        plot_expert_load(records, run_dir / "expert_load.png", title=f"expert load, mesh {mesh.shape_str()}")
    if val_loss is not None:
        bpb = summary["val_bits_per_byte"] = bits_per_byte(val_loss, *run.val_tokens_bytes)
        say(
            mesh,
            f"held-out loss {val_loss:.4f} nats/token = {bpb:.3f} bits/byte; unigram entropy of the "
            f"corpus's tokens {summary['unigram_entropy_bits']:.3f} bits/token",
        )
    mib = {k: v / 2**20 for k, v in memory.items()}
    say(
        mesh,
        f"model states per rank: parameters {mib['params']:.2f} MiB, gradients {mib['grads']:.2f} MiB, "
        f"optimizer {mib['optimizer']:.2f} MiB (total {mib['total']:.2f} MiB)",
    )
    if (ckpt := summary.get("checkpoints", {})).get("saves"):
        say(mesh, checkpoint_line(ckpt))
    if sample is not None:
        summary["sample"] = sample
        say(mesh, "sample:\n" + sample)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    say(mesh, f"run dir: {run_dir} (config.toml, metrics.jsonl, loss.png, checkpoints/)")
    return summary

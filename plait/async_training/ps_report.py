"""What a parameter-server run leaves in its directory, assembled by the launcher at the end.

Each worker logs its clocks (ps/workerW.jsonl: loss, times, bytes pushed and pulled, the versions
it read) and each server its applications (ps/serverS.jsonl: worker, clock and staleness of every
push applied, the norm of each bsp/ssp update, discarded parts). From them:

* metrics.jsonl, one record per step (clock): the mean of the workers' losses of that clock, the
  gradient norm, the staleness of that clock's pushes (mean, max), pushes and pulls per second over
  the last train.log_every clocks, bytes pushed and pulled (each worker's plait.comm ledger);
* staleness.png: the histogram of the staleness of every push (server 0's count), and loss.png;
* summary.json: final and held-out loss (of the final server checkpoint), dead workers, staleness.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

import torch

from plait.async_training.ps_checkpoint import read_params, seal


def _read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by SIGKILL
            break
    return out


def truncate_logs(run_dir: Path, clock: int) -> None:
    """On resume, drop what was logged after the checkpoint's clock (it is done again)."""
    for path in list((run_dir / "ps").glob("*.jsonl")) + [run_dir / "metrics.jsonl"]:
        if path.exists():
            kept = [
                r for r in _read(path) if r.get("step", r.get("clock", 0)) <= clock and "discarded" not in r
            ]
            path.write_text("".join(json.dumps(r) + "\n" for r in kept))


def step_records(cfg, run_dir: Path) -> list[dict]:
    """metrics.jsonl's records, from the workers' and server 0's logs."""
    from plait.train.loop import lr_factor

    t = cfg.train
    by_step: dict[int, list[dict]] = defaultdict(list)
    for path in sorted((run_dir / "ps").glob("worker*.jsonl")):
        for r in _read(path):
            if not r.get("skipped"):  # async: a non-finite gradient the worker did not push
                by_step[r["step"]].append(r)
    stale: dict[int, list[int]] = defaultdict(list)
    norms: dict[int, float] = {}
    for r in _read(run_dir / "ps" / "server0.jsonl"):
        if "staleness" in r:
            stale[r["clock"]].append(r["staleness"])
        elif "grad_norm" in r:
            norms[r["clock"]] = r["grad_norm"]
    ends = {c: max(r["t"] for r in rs) for c, rs in by_step.items()}
    t_start = min((r["t"] - r["step_s"] for rs in by_step.values() for r in rs), default=0.0)
    out = []
    for c in sorted(by_step):
        rs = sorted(by_step[c], key=lambda r: r["worker"])
        k = min(t.log_every, c - min(by_step))
        window = sum(len(by_step[s]) for s in range(c - k + 1, c + 1) if s in by_step)
        span = ends[c] - ends[c - k] if k and (c - k) in ends else 0.0
        rate = window / span if span > 0 else None  # the first clock: no window yet
        record = {
            "step": c,
            "loss": math.fsum(r["loss"] for r in rs) / len(rs),
            "lr": t.lr * lr_factor(c - 1, t.warmup_steps, t.steps, t.min_lr / t.lr),
            "grad_norm": norms.get(c, math.fsum(r["local_grad_norm"] for r in rs) / len(rs)),
            "workers": len(rs),
            "staleness_mean": sum(stale[c]) / len(stale[c]) if stale[c] else None,
            "staleness_max": max(stale[c]) if stale[c] else None,
            "pushes_per_s": rate,
            "pulls_per_s": rate,  # one pull (from every server) per push, per clock and worker
            "push_bytes": sum(r["push_bytes"] for r in rs),
            "pull_bytes": sum(r["pull_bytes"] for r in rs),
            "step_time_s": max(r["step_s"] for r in rs),
            "wall_s": ends[c] - t_start,  # since the first clock began (of this invocation)
        }
        for r in rs:
            if "val_loss" in r:  # worker 0's, on the parameters it pulled for this clock
                record["val_loss"], record["val_wall_s"] = r["val_loss"], r["t"] - t_start
        out.append(record)
    return out


def plot_staleness(values: list[int], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    if values:
        top = max(values)
        counts = [values.count(v) for v in range(top + 1)]
        ax.bar(range(top + 1), counts, color="#4c72b0")
        ax.set_xticks(range(top + 1))
    ax.set_xlabel("staleness (updates applied between the pull and the push)")
    ax.set_ylabel("pushes")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def load_final_model(cfg, run_dir: Path, clock: int):
    """The GPT with the parameters the servers saved at `clock`."""
    from plait.models import GPT
    from plait.train.config import model_config

    model = GPT(model_config(cfg))  # not on the meta device: to_empty() would undo the weight tie
    with torch.no_grad():
        for p, v in zip(model.parameters(), read_params(run_dir, clock, cfg.ps.servers), strict=True):
            p.copy_(v)
    return model


def finish_run(cfg, run_dir: Path, start: int, dead: list[int], elapsed: float, ok: bool) -> dict:
    """Write metrics.jsonl, the plots and summary.json; print the last lines."""
    from plait.async_training.ps_worker import evaluate
    from plait.data import eval_batches, load_corpus
    from plait.train.metrics import plot_loss_curve

    records = step_records(cfg, run_dir)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if cfg.log.tensorboard:
        write_tensorboard(records, run_dir, start)
    servers = [_read_json(run_dir / "ps" / f"server{s}.json") for s in range(cfg.ps.servers)]
    stale = [r["staleness"] for r in _read(run_dir / "ps" / "server0.jsonl") if "staleness" in r]
    what = cfg.ps.consistency + (f" tau={cfg.ps.staleness}" if cfg.ps.consistency == "ssp" else "")
    plot_staleness(stale, run_dir / "staleness.png", f"staleness of every push, {what}")
    summary = {
        "ok": ok,
        "consistency": cfg.ps.consistency,
        "step": records[-1]["step"] if records else start,
        "loss": records[-1]["loss"] if records else None,
        "dead_workers": dead,
        "staleness_mean": sum(stale) / len(stale) if stale else None,
        "staleness_max": max(stale) if stale else None,
        "elapsed_s": elapsed,
        "servers": servers,
    }
    if records:
        plot_loss_curve(records, run_dir / "loss.png", title=f"plait GPT, parameter server ({what})")
    last = min(cfg.train.steps, cfg.train.stop_at) if cfg.train.stop_at else cfg.train.steps
    if ok and all(s is not None for s in servers):
        clock = servers[0]["applied_clock"] if cfg.ps.consistency != "async" else last
        seal(run_dir, clock, cfg.ps.servers)  # every server has exited: the shards are final
        corpus = load_corpus(cfg.data.corpus, cfg.data.held_out_fraction)
        model = load_final_model(cfg, run_dir, clock)
        val = eval_batches(corpus.val, model.cfg.seq_len, cfg.train.global_batch, cfg.train.eval_batches)
        summary["val_loss"] = evaluate(model, val, torch.device("cpu"))
        print(
            f"held-out loss {summary['val_loss']:.4f} nats/byte ({summary['val_loss'] / math.log(2):.3f} "
            f"bits/byte) of the servers' parameters at step {clock}",
            flush=True,
        )
    if dead:
        print(f"plait: dead workers: {dead} (the run went on without them)", flush=True)
    if stale:
        print(
            f"plait: staleness of {len(stale)} pushes: mean {summary['staleness_mean']:.2f}, max "
            f"{summary['staleness_max']} (staleness.png)",
            flush=True,
        )
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"run dir: {run_dir} (metrics.jsonl, loss.png, staleness.png, ps_checkpoints/)", flush=True)
    return summary


def write_tensorboard(records: list[dict], run_dir: Path, start: int) -> None:
    """`[log] tensorboard = true`: this invocation's records (the steps after `start`) as scalars in
    run_dir/tensorboard, as the trainer writes them, at the end of the run (the records are
    assembled from every process's log then); a resumed run purges the events after `start`."""
    from plait.train.tensorboard import TensorBoardWriter

    writer = TensorBoardWriter(run_dir / "tensorboard", purge_step=start + 1 if start else None)
    for r in records:
        if r["step"] > start:
            writer.write(r)
    writer.close()


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None

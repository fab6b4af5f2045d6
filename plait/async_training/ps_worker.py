"""A parameter-server worker: pull the parameters, compute the GPT's gradient on its rows of the
global batch, push the gradient whole to every server (Li et al. 2014 §3.1; Dean et al. 2012's
Downpour model replica).

Worker w of W takes rows [w·B/W, (w+1)·B/W) of every global batch of B sequences, as data-parallel
rank w would (`DistributedBatchSampler`), and backpropagates its token-loss sum divided by its
tokens: the mean of the W gradients is the data-parallel gradient of the global batch, which is
what bsp applies. One iteration is one clock:

    pull(c) from every server  ->  forward/backward  ->  push(c) part to every server
        ->  commit record in the store  ->  commit to every server

The pushes of one clock go out together (`rpc_async`) and each carries the version it was computed
from, so each server can measure the push's staleness. Under async each push is its own optimizer
step, so the worker clips its own gradient (the global norm of what it pushes); under bsp/ssp the
servers clip the mean, as data parallelism does.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed.rpc as rpc

from plait.async_training import param_server as ps
from plait.comm.ledger import Ledger
from plait.data import DistributedBatchSampler, eval_batches, load_corpus
from plait.models import GPT
from plait.train.config import model_config
from plait.train.loop import step_hook


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _skip(sampler, steps: int) -> None:
    """Advance the sampler past `steps` global batches (a resumed worker's position)."""
    while steps:
        left = sampler.batches_per_epoch() - sampler.index
        if steps < left:
            sampler.index += steps
            return
        steps -= left
        sampler.epoch, sampler.index = sampler.epoch + 1, 0


def _cut_push_at() -> tuple[int, int] | None:
    """PLAIT_PS_CUT=WORKER:CLOCK: that worker dies (SIGKILL) at that clock after its part has
    reached server 0 and before it commits (the failure tests' half-sent push)."""
    spec = os.environ.get("PLAIT_PS_CUT")
    if not spec:
        return None
    w, c = spec.split(":")
    return int(w), int(c)


def work(cfg, w: int, store, run_dir: Path, start: int, device: torch.device) -> None:
    """Run worker `w`'s clocks start+1 .. last (train.stop_at or train.steps)."""
    t = cfg.train
    worker = _Worker(cfg, w, start, device)
    last = min(t.steps, t.stop_at) if t.stop_at else t.steps
    hook, cut = step_hook(), _cut_push_at()
    with open(run_dir / "ps" / f"worker{w}.jsonl", "a", buffering=1) as out:
        window = time.perf_counter()
        for clock in range(start + 1, last + 1):
            if hook is not None:
                hook(step=clock, rank=w, cfg=cfg, engine=None)
            record = worker.clock(clock, store, cut)
            if record is not None and w == 0:
                window = worker.report(record, window)
            out.write(
                json.dumps(record or {"step": clock, "worker": w, "skipped": True, "t": time.time()}) + "\n"
            )
    store.set(f"ps/done/{w}", "1")


class _Worker:
    """One worker's model replica, its rows of every global batch and its servers."""

    def __init__(self, cfg, w: int, start: int, device: torch.device) -> None:
        t, n_workers = cfg.train, cfg.parallel.dp
        self.cfg, self.w, self.device = cfg, w, device
        mcfg = model_config(cfg)
        corpus = load_corpus(cfg.data.corpus, cfg.data.held_out_fraction)
        self.sampler = DistributedBatchSampler(
            corpus.train, mcfg.seq_len, t.global_batch, w, n_workers, t.seed, micro_batches=t.micro_batches
        )
        _skip(self.sampler, start)
        torch.manual_seed(t.seed)
        self.model = GPT(mcfg).to(device)
        self.model.train()
        self.params = list(self.model.parameters())
        self.ranges = ps.key_ranges([p.numel() for p in self.params], cfg.ps.servers)
        torch.manual_seed(t.seed + 1 + w)  # dropout streams differ per worker, as per dp rank
        self.local_tokens = t.global_batch * mcfg.seq_len // n_workers
        self.val = eval_batches(corpus.val, mcfg.seq_len, t.global_batch, t.eval_batches) if w == 0 else None
        self.ledger = Ledger()
        self.servers = [f"server{s}" for s in range(cfg.ps.servers)]

    def clock(self, clock: int, store, cut: tuple[int, int] | None) -> dict | None:
        """Pull, compute, push and commit one clock; its record, or None when the gradient was
        not pushed (non-finite under async)."""
        self.ledger.set_step(clock)
        t0 = time.perf_counter()
        versions = self.pull(clock)
        t_pull = time.perf_counter() - t0
        loss, grads, norm = self.gradients()
        if self.cfg.ps.consistency == "async" and not math.isfinite(norm):  # train.nonfinite = "skip"
            print(f"plait: worker {self.w} clock {clock}: non-finite gradient, not pushed", flush=True)
            return None
        t1 = time.perf_counter()
        self.push(clock, versions, grads, loss, cut)
        store.set(f"ps/commit/{self.w}/{clock}", "1")  # the push is whole from here on
        for fut in [rpc.rpc_async(name, ps.handle_commit, args=(self.w, clock)) for name in self.servers]:
            fut.wait()
        return {
            "step": clock,
            "worker": self.w,
            "loss": loss,
            "local_grad_norm": norm,
            "t": time.time(),
            "pull_s": t_pull,
            "push_s": time.perf_counter() - t1,
            "step_s": time.perf_counter() - t0,
            "versions": versions,
            "push_bytes": self.ledger.total(clock, op="push"),
            "pull_bytes": self.ledger.total(clock, op="pull"),
        }

    def pull(self, clock: int) -> list[int]:
        """Every server's part of the parameters into the replica; the versions they were at."""
        pulls = [rpc.rpc_async(name, ps.handle_pull, args=(self.w, clock)) for name in self.servers]
        versions = []
        with torch.no_grad():
            for (lo, hi), fut, name in zip(self.ranges, pulls, self.servers):
                values, version = fut.wait()
                versions.append(version)
                for p, v in zip(self.params[lo:hi], values):
                    p.copy_(v)
                self.ledger.record_message("pull", name, _nbytes(values))
        return versions

    def gradients(self) -> tuple[float, list[torch.Tensor], float]:
        """(mean token loss, gradients, their global norm) of this worker's rows of the batch;
        under async each push is a step, so the gradients are clipped here."""
        t, total = self.cfg.train, 0.0
        for x, y in self.sampler.next_batch():
            with _autocast(self.device, t.bf16):
                loss_sum = self.model(x.to(self.device), y.to(self.device), reduction="sum")
            (loss_sum / self.local_tokens).backward()
            total += float(loss_sum.detach().double())
        grads = [p.grad.detach().cpu() for p in self.params]
        norm = float(torch.linalg.vector_norm(torch.stack([g.double().norm() for g in grads])))
        if self.cfg.ps.consistency == "async" and t.grad_clip > 0:  # each push is a step: clip it
            factor = min(1.0, t.grad_clip / (norm + 1e-6))
            grads = [g * factor for g in grads] if factor < 1.0 else grads
        self.model.zero_grad(set_to_none=True)
        return total / self.local_tokens, grads, norm

    def push(self, clock: int, versions: list[int], grads: list[torch.Tensor], loss: float, cut) -> None:
        """Each server's part of the gradient, together (`rpc_async`), with the version it was
        computed from."""
        parts = []
        for s, ((lo, hi), name) in enumerate(zip(self.ranges, self.servers)):
            part = grads[lo:hi]
            parts.append(rpc.rpc_async(name, ps.handle_push, args=(self.w, clock, versions[s], part, loss)))
            self.ledger.record_message("push", name, _nbytes(part))
            if cut == (self.w, clock):  # the failure tests: server 0 has its part, nobody else
                parts[0].wait()
                os.kill(os.getpid(), signal.SIGKILL)
        for fut in parts:
            fut.wait()

    def report(self, record: dict, window: float) -> float:
        """Worker 0's log lines, and its held-out loss on the parameters it pulled (in `record`);
        returns the start of the next log window."""
        t, clock, loss = self.cfg.train, record["step"], record["loss"]
        if clock % t.log_every == 0:
            elapsed, window = time.perf_counter() - window, time.perf_counter()
            print(
                f"step {clock:>5}/{t.steps} | worker 0 loss {loss:.4f} | versions {record['versions']} | "
                f"{t.log_every / elapsed:.2f} clocks/s",
                flush=True,
            )
        if t.eval_every and clock % t.eval_every == 0 and clock != t.steps:
            record["val_loss"] = evaluate(self.model, self.val, self.device)
            print(
                f"step {clock:>5}/{t.steps} | held-out loss {record['val_loss']:.4f} (worker 0)", flush=True
            )
        return window


@torch.no_grad()
def evaluate(model, batches, device) -> float:
    """Mean held-out loss per token of `model` (whole, on this process)."""
    was = model.training
    model.eval()
    total, count = 0.0, 0
    for x, y in batches:
        total += float(model(x.to(device), y.to(device), reduction="sum"))
        count += y.numel()
    model.train(was)
    return total / count


def _autocast(device, bf16: bool):
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()

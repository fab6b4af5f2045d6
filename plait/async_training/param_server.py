"""A parameter-server process: it owns one key range of the model's parameters and its optimizer.

Li et al. 2014 (OSDI, "Scaling distributed machine learning with the parameter server", §3-4):
parameters are (key, value) pairs sharded over server nodes by key range; workers push gradients
and pull parameters; the consistency model is a per-task dependency, from sequential (BSP) through
bounded delay to eventual. Here the keys are the model's parameter tensors in registration order,
and `key_ranges` cuts them into contiguous ranges of about equal size, one per server.

A clock is one worker iteration (pull, compute, push). The consistency models:

* `bsp`: clock c's update is the mean of every live worker's clock-c gradient, applied once all
  of them are in; a pull for clock c waits until clock c-1 is applied. This is synchronous data
  parallelism with the same optimizer (tested against plait's).
* `ssp` with staleness τ (Ho et al. 2013, "More effective distributed ML via a stale synchronous
  parallel parameter server"): updates are applied per clock as under bsp, but a worker at clock c
  may read once every clock <= c-τ-1 is applied, so it runs up to τ clocks ahead of the slowest
  live worker. τ = 0 is bsp exactly. The gradients it pushes ahead wait in the clock's buffer.
* `async` (Dean et al. 2012, Downpour SGD): every push is applied on arrival as its own
  optimizer step; pulls never wait.

Whole or nothing: a push spans every server. A worker sends each server its part (held back,
not applied), then writes one commit record to the control-plane store, then tells the servers.
Only committed parts are applied; when the launcher marks a worker dead, each server looks up the
store for the parts it still holds and applies the committed ones, discards the others. Because
the commit is one store write, every server makes the same decision.

The handlers run on torch.distributed.rpc's thread pool. An RPC names its function by module and
name, and a worker has no handle on a server's objects until a call reaches it, so the handlers find
the shard of this server process through the one binding that `serving(shard)` makes for the
server's life (an RRef would have to be handed to the workers by a call that needs the same lookup).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import threading
import time
from pathlib import Path

import torch

from plait.async_training.ps_checkpoint import load_shard, save_shard
from plait.optim import build_optimizer, param_groups
from plait.train.loop import lr_factor

# the shard this server process serves, bound by `serving` only (a server process serves one)
_SERVED: dict[str, Shard] = {}


def key_ranges(numels: list[int], servers: int) -> list[tuple[int, int]]:
    """Cut tensors 0..P-1 (of `numels` elements) into `servers` contiguous, non-empty ranges
    [lo, hi) whose element counts are as close as the cuts allow to total/servers each."""
    n = len(numels)
    if not 1 <= servers <= n:
        raise ValueError(f"{servers} servers for {n} tensors")
    cum = [0]
    for k in numels:
        cum.append(cum[-1] + k)
    bounds = [0]
    for k in range(1, servers):
        target = cum[-1] * k / servers
        lo, hi = bounds[-1] + 1, n - (servers - k)  # every range keeps at least one tensor
        bounds.append(min(range(lo, hi + 1), key=lambda i: abs(cum[i] - target)))
    bounds.append(n)
    return list(zip(bounds[:-1], bounds[1:]))


def build_server_optimizer(name: str, params: list[torch.nn.Parameter], cfg) -> torch.optim.Optimizer:
    """`ps.server_optimizer` over this server's tensors, with plait's parameter groups (weight
    decay on matrices only) and [train]'s hyperparameters, as the trainer builds it."""
    t = cfg.train
    holder = torch.nn.Module()
    for i, p in enumerate(params):
        holder.register_parameter(f"p{i}", p)
    groups = param_groups(holder, t.weight_decay)
    if name == "adagrad":  # Downpour's choice (Dean et al. 2012 §4.1)
        return torch.optim.Adagrad(groups, lr=t.lr)
    return build_optimizer(name, groups, lr=t.lr, betas=(t.beta1, t.beta2), momentum=cfg.optim.momentum)


class Shard:
    """One server's state: its tensors and optimizer, the pushes it holds, its clocks."""

    def __init__(self, cfg, index: int, params: list[torch.Tensor], store, run_dir: Path, start: int):
        self.cfg, self.index, self.store, self.run_dir = cfg, index, store, Path(run_dir)
        self.servers, self.workers = cfg.ps.servers, cfg.parallel.dp
        self.mode = cfg.ps.consistency
        self.tau = {"bsp": 0, "ssp": cfg.ps.staleness}.get(self.mode)  # None: async
        self.params = [torch.nn.Parameter(p.detach().clone()) for p in params]
        self.optimizer = build_server_optimizer(cfg.ps.server_optimizer, self.params, cfg)
        t = cfg.train
        self._lr = lambda clock: t.lr * lr_factor(clock - 1, t.warmup_steps, t.steps, t.min_lr / t.lr)
        self.cond = threading.Condition()
        self.applied_clock = start  # bsp/ssp: every clock <= this is applied
        self.updates = 0  # optimizer steps taken (the version a pull returns under async)
        self.pending: dict[tuple[int, int], tuple] = {}  # (worker, clock) -> part, not committed
        self.clocks: dict[int, dict[int, tuple]] = {}  # bsp/ssp: clock -> {worker: committed part}
        self.last_clock = dict.fromkeys(range(self.workers), start)  # last committed clock per worker
        self.dead: set[int] = set()
        self.done: set[int] = set()
        self.applied_by_worker = dict.fromkeys(range(self.workers), 0)
        self.discarded: list[tuple[int, int]] = []
        self.saved = start
        self.log = open(self.run_dir / "ps" / f"server{index}.jsonl", "a", buffering=1)  # noqa: SIM115

    # -- what the workers call (through the handlers below) --------------------------------

    def pull(self, worker: int, clock: int) -> tuple[list[torch.Tensor], int]:
        """This range's parameters for `worker`'s clock, once the consistency model allows it,
        with their version (the applied clock under bsp/ssp, the update count under async)."""
        with self.cond:
            if self.tau is not None:
                self.cond.wait_for(lambda: self.applied_clock >= clock - 1 - self.tau)
            version = self.updates if self.tau is None else self.applied_clock
            return [p.detach().clone() for p in self.params], version

    def push(self, worker: int, clock: int, version: int, grads: list[torch.Tensor], loss: float) -> None:
        """Hold `worker`'s part of its clock-`clock` push until it is committed."""
        with self.cond:
            self.pending[(worker, clock)] = (grads, version, loss)

    def commit(self, worker: int, clock: int) -> None:
        """The push is committed (its record is in the store): apply it, or queue its clock."""
        with self.cond:
            self._committed(worker, clock)
            self.cond.notify_all()

    # -- internals ------------------------------------------------------------------------

    def _committed(self, worker: int, clock: int) -> None:
        part = self.pending.pop((worker, clock), None)
        if part is None:
            return  # already resolved from the store
        self.last_clock[worker] = max(self.last_clock[worker], clock)
        if self.tau is None:
            self._apply(clock, {worker: part})
            self._maybe_checkpoint(min(self._floor(), clock))
        else:
            self.clocks.setdefault(clock, {})[worker] = part
            self._advance()

    def _floor(self) -> int:
        live = [self.last_clock[w] for w in range(self.workers) if w not in self.dead]
        return min(live) if live else max(self.last_clock.values())

    def _advance(self) -> None:
        """bsp/ssp: apply the next clocks whose every live worker has committed."""
        while True:
            clock = self.applied_clock + 1
            have = self.clocks.get(clock, {})
            needed = set(range(self.workers)) - self.dead
            if not have or not needed <= set(have):
                return
            self._apply(clock, self.clocks.pop(clock))
            self.applied_clock = clock
            self._maybe_checkpoint(clock)

    def _apply(self, clock: int, parts: dict[int, tuple]) -> None:
        """One optimizer step with the mean of `parts` (one worker's under async)."""
        workers = sorted(parts)
        scale = 1.0 / len(workers)
        grads = []
        for i in range(len(self.params)):
            g = None
            for w in workers:
                term = parts[w][0][i] * scale if scale != 1.0 else parts[w][0][i]
                g = term if g is None else g + term
            grads.append(g)
        clip = self.cfg.train.grad_clip
        norm = None
        if self.tau is not None:  # the global norm of the mean: the trainer's clipping
            norm = self._global_norm(clock, grads)
            if clip > 0:
                factor = min(1.0, clip / (norm + 1e-6))
                grads = [g * factor for g in grads] if factor < 1.0 else grads
        # every server sees the same global norm, so all skip a non-finite update alike (async:
        # the worker does not push a non-finite gradient at all); train.nonfinite = "skip"
        if norm is None or math.isfinite(norm):
            for p, g in zip(self.params, grads):
                p.grad = g
            for group in self.optimizer.param_groups:
                group["lr"] = self._lr(clock)
            self.optimizer.step()
            for p in self.params:
                p.grad = None
        else:
            self.log.write(json.dumps({"clock": clock, "skipped": True}) + "\n")
        now = time.time()
        for w in workers:
            grads_, version, loss = parts[w]
            # updates applied to this server between the pull and this application
            stale = (clock - 1 - version) if self.tau is not None else (self.updates - version)
            self.applied_by_worker[w] += 1
            self.log.write(json.dumps({"worker": w, "clock": clock, "staleness": stale, "t": now}) + "\n")
        if norm is not None and self.index == 0:
            self.log.write(json.dumps({"clock": clock, "grad_norm": norm}) + "\n")
        self.updates += 1
        if os.environ.get("PLAIT_PS_KILL_SERVER") == f"{self.index}:{clock}":  # the failure tests
            os.kill(os.getpid(), signal.SIGKILL)

    def _global_norm(self, clock: int, grads: list[torch.Tensor]) -> float:
        """The norm of the whole mean gradient: each server's sum of squares, exchanged through
        the control-plane store (one key per server and clock)."""
        sq = float(sum(float(g.double().pow(2).sum()) for g in grads))
        if self.servers == 1:
            return sq**0.5
        self.store.set(f"ps/norm/{clock}/{self.index}", repr(sq))
        total = sum(float(self.store.get(f"ps/norm/{clock}/{s}")) for s in range(self.servers))
        return total**0.5

    def worker_gone(self, worker: int, dead: bool) -> None:
        """The launcher marked `worker` dead (or it finished): its committed parts are applied,
        the rest discarded, and it leaves the clock count and the staleness bound."""
        with self.cond:
            if dead:
                self.dead.add(worker)
                for w, clock in sorted(k for k in self.pending if k[0] == worker):
                    if self.store.check([f"ps/commit/{w}/{clock}"]):
                        self._committed(w, clock)
                    else:
                        del self.pending[(w, clock)]
                        self.discarded.append((w, clock))
                        self.log.write(json.dumps({"discarded": [w, clock]}) + "\n")
                if self.tau is not None:
                    self._advance()
                else:
                    self._maybe_checkpoint(self._floor())
            else:
                self.done.add(worker)
            self.cond.notify_all()

    def _maybe_checkpoint(self, clock: int) -> None:
        every = self.cfg.train.checkpoint_every
        if every and clock > self.saved and clock // every > self.saved // every:
            self.save(clock - clock % every)

    def save(self, clock: int) -> None:
        """This shard, its optimizer state and clock, as run_dir/ps_checkpoints/step_N/serverS.pt
        (`ps_checkpoint.save_shard`: renamed into place, the step's manifest written by the last
        server to save it; a crash leaves the previous checkpoint whole)."""
        state = {
            "clock": clock,
            "updates": self.updates,
            "servers": self.servers,
            "params": [p.detach().clone() for p in self.params],
            "optimizer": self.optimizer.state_dict(),
        }
        save_shard(self.run_dir, self.index, self.servers, state, self.store, self.cfg.train.keep_checkpoints)
        self.saved = max(self.saved, clock)

    def load(self, path: Path) -> None:
        """Restore a shard `save` wrote (read as plain tensors: `ps_checkpoint.load_shard`)."""
        state = load_shard(path, [p.numel() for p in self.params])
        with torch.no_grad():
            for p, v in zip(self.params, state["params"], strict=True):
                p.copy_(v)
        self.optimizer.load_state_dict(state["optimizer"])
        self.updates = state["updates"]

    def finished(self) -> bool:
        with self.cond:
            return set(range(self.workers)) <= self.dead | self.done and not self.pending

    def summary(self) -> dict:
        return {
            "server": self.index,
            "updates": self.updates,
            "applied_clock": self.applied_clock if self.tau is not None else None,  # async: no clocks
            "applied_by_worker": self.applied_by_worker,
            "discarded": self.discarded,
            "dead": sorted(self.dead),
        }


# -- RPC handlers (module-level: torch.distributed.rpc pickles a function by its name) ----------


@contextlib.contextmanager
def serving(shard: Shard):
    """Bind `shard` as what this process's RPC handlers serve, for the life of the block: enter it
    before the RPC agent starts, as a worker's first pull may arrive at once."""
    if _SERVED:
        raise RuntimeError(f"this process already serves shard {_SERVED['shard'].index}")
    _SERVED["shard"] = shard
    try:
        yield shard
    finally:
        _SERVED.clear()


def _served() -> Shard:
    try:
        return _SERVED["shard"]
    except KeyError:
        raise RuntimeError("no parameter-server shard is served in this process") from None


def handle_pull(worker: int, clock: int):
    return _served().pull(worker, clock)


def handle_push(worker: int, clock: int, version: int, grads: list[torch.Tensor], loss: float) -> bool:
    _served().push(worker, clock, version, grads, loss)
    return True


def handle_commit(worker: int, clock: int) -> bool:
    _served().commit(worker, clock)
    return True


def serve(shard: Shard, last: int, poll_s: float = 0.02) -> None:
    """The server's main thread (inside `serving(shard)`): watch the store for workers marked dead
    (by the launcher) or done (by themselves) until every worker is one or the other, then save
    the final shard."""
    store, workers = shard.store, shard.workers
    store.set(f"ps/ready/server{shard.index}", "1")
    while not shard.finished():
        for w in range(workers):
            if w not in shard.dead and store.check([f"ps/dead/{w}"]):
                shard.worker_gone(w, dead=True)
            elif w not in shard.done and w not in shard.dead and store.check([f"ps/done/{w}"]):
                shard.worker_gone(w, dead=False)
        time.sleep(poll_s)
    with shard.cond:
        final = shard.applied_clock if shard.tau is not None else last
        shard.save(final)
        (shard.run_dir / "ps" / f"server{shard.index}.json").write_text(json.dumps(shard.summary()))
        shard.log.close()

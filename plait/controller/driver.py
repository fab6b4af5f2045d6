"""The controller's loop: one program drives the mesh of `RankActor`s (plait.controller.actor).

The controller reads the corpus and runs one `DistributedBatchSampler` per data rank (dp, or
dp x ep), so it owns the data: each rank gets its own micro-batches with its step. Steps are
dispatched as futures, up to `runtime.run_ahead` of them before the oldest one's records are
back (Pathways' asynchronous dispatch: the controller's cost hides behind the devices' work);
evaluation and checkpoints are queued right after the step they follow (Monarch delivers one
sender's messages to an actor in order), and the records are consumed in step order: metrics,
log lines and the progress bar are the controller's. SIGTERM or Ctrl-C stop the dispatch, drain
the steps in flight, save a checkpoint of the last one and stop every process of the mesh.
"""

from __future__ import annotations

import itertools
import signal
import sys
import time
from collections import deque
from pathlib import Path

import monarch.actor
import torch
from monarch.actor import this_host
from monarch.config import configure
from tqdm import tqdm

from plait.comm.ports import free_port
from plait.controller import peer
from plait.controller.actor import RankActor
from plait.controller.futures import RankFailed, gather, island_result, quiet
from plait.controller.island import EvalActor
from plait.data import DistributedBatchSampler, load_corpus
from plait.data.tokenizer import bits_per_byte
from plait.errors import ConfigError
from plait.train.build import micro_batches_per_step
from plait.train.config import Config, model_config
from plait.train.launch import INTERRUPTED_EXIT, _threads_per_rank, under_launcher
from plait.train.metrics import MetricsWriter
from plait.train.peak import peak_flops_per_rank
from plait.train.preempt import PREEMPTED_EXIT
from plait.train.preflight import check_before_start, check_run_dir
from plait.train.rundir import claim_run

DIMS = ("pp", "dp_replicate", "dp_shard", "ep", "tp")  # outermost to innermost, as plait's ranks


def mesh_dims(cfg: Config) -> dict[str, int]:
    """The process mesh's named dims: the layout's degrees, dp split into replicate x shard."""
    p = cfg.parallel
    shard = p.hybrid_shard or p.dp
    return dict(zip(DIMS, (p.pp, p.dp // shard, shard, p.ep, p.tp)))


def launch(cfg: Config, resume: bool = False, checkpoint=None) -> int:
    """Check, claim the run directory, spawn the mesh and drive it; returns the exit code."""
    if under_launcher():
        raise ConfigError(
            "runtime.kind = 'controller' starts its own processes (a Monarch mesh); run plait train "
            "directly, not under torchrun"
        )
    use_cuda = cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available())
    world = cfg.world_size
    if use_cuda and world > torch.cuda.device_count():
        found = torch.cuda.device_count()
        raise ConfigError(f"{world} ranks need {world} GPUs on this machine, found {found}")
    if cfg.train.run_dir:
        check_run_dir(cfg.train.run_dir)
    cfg, held = claim_run(cfg, resume, checkpoint)
    with held:
        check_before_start(cfg, use_cuda=use_cuda, ranks=world)
        return Controller(cfg, resume, use_cuda).run()


class _Stop:
    """SIGTERM and SIGINT while the controller runs: a flag read between dispatches."""

    def __init__(self) -> None:
        self.signum = 0

    def __enter__(self):
        handler = lambda signum, frame: setattr(self, "signum", self.signum or signum)  # noqa: E731
        self.previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self.previous.items():
            signal.signal(s, h)


class Controller:
    """One run driven from this process: spawn, set up, the step loop, the end."""

    def __init__(self, cfg: Config, resume: bool, use_cuda: bool):
        self.cfg, self.resume, self.world = cfg, resume, cfg.world_size
        self.threads = _threads_per_rank(self.world)
        t = cfg.train
        cpu = torch.device("cpu")
        self.peak = None if use_cuda else peak_flops_per_rank(cpu, t.bf16, self.threads, t.peak_tflops)
        self.peer: list | None = None  # after a failure: each fresh rank's state, from a peer's memory

    def run(self) -> int:
        # A failed run's mesh is stopped at once: a rank blocked in a collective with a failed
        # peer is not waited for (Monarch's defaults: 10 s each)
        configure(stop_actor_timeout="2s", mesh_terminate_timeout="2s", process_exit_timeout="2s")
        limit = self.cfg.train.max_restarts
        previous, monarch.actor.unhandled_fault_hook = monarch.actor.unhandled_fault_hook, quiet
        try:
            with _Stop() as stop:
                for restart in range(limit + 1):
                    try:
                        return self._attempt(stop, restart)
                    except RankFailed as exc:  # the first failure seen, reported once
                        again = restart < limit and not stop.signum
                        if not again:
                            what = "the job was stopped"
                        elif self.peer is not None:
                            what = (
                                f"a fresh mesh resumes at step {self.peer[0]['taken']} from the "
                                "memory of its data-parallel peers"
                            )
                        else:
                            what = "a fresh mesh resumes from the newest checkpoint"
                        sys.stderr.write(
                            f"\nplait: rank {exc.rank} failed; {what}. Its error:\n{exc.error}\n"
                        )
                        if not again:
                            return 1
        finally:
            monarch.actor.unhandled_fault_hook = previous
        return 1

    def _attempt(self, stop: _Stop, restart: int) -> int:
        """One mesh, from spawn to stop; `restart`: how many meshes failed before it (it then
        resumes from its dp peers' memory, `self.peer`, or else from the newest checkpoint, as a
        restarted SPMD job does: train.max_restarts)."""
        self.writers, self.island, self.evals = [], None, deque()
        self.positions, self.done = {}, -1  # nothing taken yet on this mesh (plait.controller.peer)
        procs = this_host().spawn_procs(per_host=mesh_dims(self.cfg))
        island = this_host().spawn_procs(per_host={"eval": 1}) if self.cfg.runtime.eval_island else None
        try:
            return self._drive(procs, island, stop, restart)
        except RankFailed as exc:
            self.peer = None
            if restart < self.cfg.train.max_restarts and not stop.signum:
                self.peer = self._from_peers(exc)  # before the mesh is stopped
            raise
        finally:
            self._close_writers()  # before a fresh mesh's rank 0 truncates the files on resume
            if island is not None:
                island.stop().get()
            procs.stop().get()

    def _close_writers(self) -> None:
        for w in self.writers:
            w.close()
        self.writers = []

    def _spawn(self, procs) -> None:
        actors = procs.spawn("plait", RankActor)
        dims = mesh_dims(self.cfg)
        self.ranks = [  # one handle per rank, in rank order (row-major: tp fastest)
            actors.slice(**dict(zip(dims, c))) for c in itertools.product(*(range(n) for n in dims.values()))
        ]

    def _each(self, endpoint: str, *args) -> list:
        """`endpoint(*args)` on every rank: the futures, in rank order."""
        return [getattr(r, endpoint).call_one(*args) for r in self.ranks]

    def _each_rank(self, endpoint: str, args) -> list:
        return [getattr(r, endpoint).call_one(*a) for r, a in zip(self.ranks, args)]

    def _setup(self, procs, island, restart: int) -> None:
        self._spawn(procs)
        cfg = self.cfg
        args = (cfg.to_dict(), free_port(), self.threads, self.resume, self.peak, restart)
        states, self.recovered = self.peer or [None] * self.world, self.peer is not None
        setups = gather(self._each_rank("setup", [(*args, s) for s in states]))
        self.peer = None
        first = setups[0]
        self.val_tokens_bytes = first["val_tokens_bytes"]
        _print(first.get("lines", ""))
        _print(
            f"plait: single controller (Monarch): {self.world} actor(s) on a mesh "
            f"{' x '.join(f'{k} {v}' for k, v in mesh_dims(cfg).items())}, "
            f"up to {cfg.runtime.run_ahead} step(s) in flight"
        )
        self.run_dir, self.start, self.last = Path(first["run_dir"]), first["start"], first["last"]
        self.positions = {self.start: first["sampler"]}  # the samplers' position after each step
        self.data_rank = [s["data_rank"] for s in setups]
        d, t = cfg.data, cfg.train
        spec = d.tokenizer if d.tokenizer == "bytes" else str(self.run_dir / "tokenizer.json")
        if island is not None:  # set up while the controller loads the corpus
            self.island = island.spawn("plait_eval", EvalActor)
            ready = self.island.setup.call_one(cfg.to_dict(), free_port(), 1, spec)
        corpus = load_corpus(d.corpus, d.held_out_fraction, spec, d.vocab_size, d.cache_dir or None, False)
        self.samplers = {}
        for r in sorted(set(self.data_rank)):
            s = DistributedBatchSampler(
                corpus.train,
                model_config(cfg).seq_len,
                t.global_batch,
                r,
                first["data_ranks"],
                t.seed,
                micro_batches=micro_batches_per_step(cfg),
            )
            s.load_state_dict(first["sampler"])  # the checkpoint's position on resume
            self.samplers[r] = s
        purge = self.start + 1 if self.start else None
        self.writers = [
            MetricsWriter(self.run_dir, r, tensorboard=cfg.log.tensorboard and r == 0, purge_step=purge)
            for r in range(self.world)
        ]
        if island is not None:
            island_result(ready, None)
            _print("plait: held-out evaluations on an island of their own (1 process), the last in-line")

    def _drive(self, procs, island, stop: _Stop, restart: int) -> int:
        self._setup(procs, island, restart)
        cfg, t = self.cfg, self.cfg.train
        self.bar = tqdm(
            total=t.steps,
            initial=self.start,
            disable=not t.progress,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            mininterval=1.0,
            file=sys.stderr,
        )
        self.loss, self.val_loss, self.done = float("nan"), None, self.start
        self.saved = -1 if self.recovered else self.start  # from a peer: no checkpoint of `start`
        pending: deque = deque()
        for step in range(self.start + 1, self.last + 1):
            if stop.signum:
                break
            while len(pending) >= cfg.runtime.run_ahead:
                self._consume(*pending.popleft())
            if stop.signum:  # arrived while waiting: nothing more is sent
                break
            pending.append(self._dispatch(step))
        while pending:
            self._consume(*pending.popleft())
        self._island_records(wait=True)
        if stop.signum:
            return self._stopped(stop.signum)
        self.bar.close()
        self._close_writers()
        ends = gather(self._each("finish", self.loss, self.val_loss))
        _print(ends[0].get("lines", ""))
        return 0

    def _dispatch(self, step: int) -> tuple:
        """Step `step` on every rank with its micro-batches, and what follows it (evaluation,
        checkpoint), as futures; nothing here waits for a device."""
        t = self.cfg.train
        batches = {r: s.next_batch() for r, s in self.samplers.items()}
        self.positions[step] = self.samplers[self.data_rank[0]].state_dict()
        log = step % t.log_every == 0 or step == self.last
        steps = self._each_rank("step", [(step, batches[r], log) for r in self.data_rank])
        evals = None
        if step != t.steps and self.island is not None and t.eval_every and step % t.eval_every == 0:
            evals = ("island", self._each("weights", step))  # the island evaluates them
        elif (t.eval_every and step % t.eval_every == 0) or step == t.steps:
            evals = self._each("evaluate", step, step == t.steps)
        saves = None
        if (t.checkpoint_every and step % t.checkpoint_every == 0) or step == self.last:
            saves = self._each("save", step, self.samplers[self.data_rank[0]].state_dict(), False)
        return step, steps, evals, saves

    def _consume(self, step: int, steps: list, evals: list | None, saves: list | None) -> None:
        """Step `step`'s records, in order: log lines, metrics of every rank, the progress bar."""
        records = gather(steps)
        for r, rec in enumerate(records):
            lines = rec.pop("_lines", "")
            if r == 0:
                _print(lines)
        if isinstance(evals, tuple):  # the weights of this step: on to the island, not waited for
            parts = [w for w in gather(evals[1]) if w is not None]
            params = {k: v for part in parts for k, v in part.items()}
            self.evals.append((step, self.island.evaluate.call_one(step, params)))
        elif evals is not None:
            for rec, held in zip(records, gather(evals)):
                if rec is records[0]:
                    _print(held.pop("lines", ""))
                held.pop("lines", None)
                rec.update(held)
            self.val_loss = records[0]["val_loss"]
        for w, rec in zip(self.writers, records):
            w.write(**rec)
        self.loss, self.done = records[0]["loss"], step
        for old in [s for s in self.positions if s < step]:  # a survivor is at `step` or later
            del self.positions[old]
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{self.loss:.3f}", refresh=False)
        if saves is not None and all(gather(saves)):
            self.saved = step
        self._island_records(wait=False)

    def _island_records(self, wait: bool) -> None:
        """The island's held-out losses that are back (all of them with `wait`), in step order:
        a metrics record of their own, tagged with the step whose weights were evaluated."""
        while self.evals:
            step, future = self.evals[0]
            try:
                held = island_result(future, None if wait else 0.001)
            except TimeoutError:
                return
            self.evals.popleft()
            bpb = bits_per_byte(held["val_loss"], *self.val_tokens_bytes)
            self.writers[0].write(step=step, val_loss=held["val_loss"], val_bits_per_byte=bpb, eval="island")
            _print(
                f"step {step:>5}/{self.cfg.train.steps} | held-out loss {held['val_loss']:.4f} "
                f"({bpb:.3f} bits/byte; evaluation island)"
            )

    def _from_peers(self, exc: RankFailed) -> list | None:
        """Each fresh rank's state, from the memory of the ranks still alive (plait.controller.peer),
        or None (said why) when the newest checkpoint must do."""
        states, why = peer.recover(
            self.cfg,
            mesh_dims(self.cfg),
            exc.rank,
            self.done,
            self.positions.get(self.done),
            getattr(self, "data_rank", []),
            getattr(self, "run_dir", None),
            self._answers,
        )
        if why:
            _print(f"plait: no recovery from a peer's memory ({why}): the newest checkpoint is used")
        return states

    def _answers(self, ranks: list[int], full: bool, timeout_s: float) -> tuple[dict, dict]:
        """`peer_state(full)`'s answer of each of `ranks` that gives one within `timeout_s`, and
        the error of each that raised (dead, or still waiting for the dead rank: none)."""
        futures = {r: self.ranks[r].peer_state.call_one(full) for r in ranks}
        deadline, out, errors = time.monotonic() + timeout_s, {}, {}
        for r, f in futures.items():
            try:
                out[r] = f.get(timeout=max(0.001, deadline - time.monotonic()))
            except TimeoutError:
                pass
            except Exception as err:
                errors[r] = f"{type(err).__name__}: {str(err).splitlines()[-1] if str(err) else ''}"
        return out, errors

    def _stopped(self, signum: int) -> int:
        """After SIGTERM or Ctrl-C: a checkpoint of the last step taken, then the exit code."""
        if self.done > self.saved:
            state = self.samplers[self.data_rank[0]].state_dict()
            gather(self._each("save", self.done, state, True))
        self.bar.close()
        self._close_writers()
        gather(self._each("close"))
        name = signal.Signals(signum).name
        _print(
            f"plait: stopped by {name} after step {self.done}; checkpoint saved in "
            f"{self.run_dir / 'checkpoints'}; continue with: plait train --resume {self.run_dir}"
        )
        return PREEMPTED_EXIT if signum == signal.SIGTERM else INTERRUPTED_EXIT


def _print(text: str) -> None:
    if text:
        tqdm.write(text.rstrip("\n"), file=sys.stdout)
        sys.stdout.flush()

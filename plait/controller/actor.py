"""The actor each rank of a controller run is: one Monarch actor per process of the mesh.

An actor owns only the compute. `setup` forms the torch.distributed group (gloo on the CPU, NCCL
on CUDA: the same `plait.train.loop.make_mesh` as a `plait train` rank) and builds the run with the
loop's own `_setup` (model, `plait.apply.parallelize`, optimizer, schedule, checkpoint on resume);
`step` takes one optimizer step on the micro-batches the controller sent, with the loop's own
`_train_step`, so that every rank computes exactly what an SPMD rank does. The controller decides
when to log, evaluate, save and stop. What a rank would print (rank 0's lines) is captured and
returned, so that the controller prints it in step order.
"""

from __future__ import annotations

import contextlib
import functools
import io

import torch
import torch.distributed as dist
from monarch.actor import Actor, current_rank, endpoint

from plait.comm.spawn import rank_env
from plait.controller import peer
from plait.train import loop, report
from plait.train.checkpoint import _rng_state
from plait.train.config import config_from_dict
from plait.train.nonfinite import guard_nonfinite
from plait.train.preempt import StopRequest
from plait.train.replicas import check_replicas
from plait.train.run_state import data_axis


@contextlib.contextmanager
def _captured(out: dict):
    """Rank 0's printed lines (plait.train.report.say) into out["lines"], not the terminal."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        yield
    out["lines"] = out.get("lines", "") + buf.getvalue()


def _fails_once(method):
    """After one of this rank's calls raised, every later one is refused at once: the steps the
    controller queued behind it must not start collectives its peers are not in."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        if self.failed:
            raise RuntimeError(
                f"rank {self.rank}: not run, an earlier call failed on this rank ({self.failed})"
            )
        try:
            return method(self, *args, **kwargs)
        except BaseException as exc:
            self.failed = f"{type(exc).__name__}: {exc}"[:200]
            raise

    return call


class RankActor(Actor):
    """One rank of the job: the engine of `plait train` on this process's part of the model."""

    def __init__(self) -> None:
        self.rank = current_rank().rank  # row-major over the mesh's dims: tp fastest, as plait's
        self.run = None
        self.window = None
        self.hook = None
        self.loss = float("nan")
        self.failed = ""
        self.taken = 0  # the last step whose update this rank applied (plait.controller.peer)
        self.rng = None  # this rank's RNG state when that step ended

    @endpoint
    @_fails_once
    def setup(
        self,
        cfg_dict: dict,
        port: int,
        threads: int,
        resume: bool,
        peak: float | None,
        restart: int,
        recovered: dict | None = None,
    ) -> dict:
        """Join the process group and build the run (`restart` > 0: a fresh mesh after a failed
        one, resuming from the newest checkpoint as plait.train.loop does, or, with `recovered`,
        from a data-parallel peer's memory: plait.controller.peer); returns this rank's place in
        the batch (its data rank and their number), the sampler's position and rank 0's
        start-up lines."""
        cfg = config_from_dict(cfg_dict)
        world = cfg.world_size
        # TORCHELASTIC_RESTART_COUNT: what an SPMD rank of a restarted job sees (step hooks read it)
        rank_env(self.rank, world, port, TORCHELASTIC_RESTART_COUNT=str(restart))
        torch.set_num_threads(threads)  # as an SPMD rank's OMP_NUM_THREADS: the same kernels
        mesh = loop.make_mesh(cfg)
        out: dict = {}
        with _captured(out):
            from_peer = recovered is not None
            run = self.run = loop._setup(cfg, mesh, resume, peak, restart, StopRequest(), from_peer)
            if recovered is not None:
                peer.restore(run, recovered)
            report.announce(run)
        self.taken, self.rng = run.start, _rng_state()
        run.metrics.close()  # the controller writes the metrics (an empty append: nothing lost)
        run.engine.module.train()
        self.window = report.Window()
        self.hook = loop.step_hook()
        out.update(
            data_rank=mesh.rank(data_axis(mesh)),
            data_ranks=mesh.size(data_axis(mesh)),
            sampler=run.sampler.state_dict(),
            start=run.start,
            last=run.last,
            run_dir=str(run.run_dir),
            val_tokens_bytes=run.val_tokens_bytes,
        )
        return out

    @endpoint
    @_fails_once
    def step(self, step: int, batch: list, log: bool) -> dict:
        """One optimizer step on `batch` (this rank's micro-batches); `log`: this step's record
        gets the log interval's throughput, memory and traffic (every rank: some are reduced)."""
        run, t = self.run, self.run.cfg.train
        if self.hook is not None:
            self.hook(step=step, rank=self.rank, cfg=run.cfg, engine=run.engine)
        record = loop._train_step(run, step, batch)
        # its update is applied (_train_step's collectives all come before it), its draws made
        self.taken, self.rng = step, _rng_state()
        self.loss = record["loss"]
        guard_nonfinite(run, step, record)
        if t.replica_check_every and step % t.replica_check_every == 0:
            record["replicas_checked"] = check_replicas(run.engine, run.mesh, step)
        self.window.steps += 1
        if log:
            out: dict = {}
            with _captured(out):
                report.log_step(run, step, record, self.window)
            record["_lines"] = out["lines"]
        return record

    @endpoint
    @_fails_once
    def evaluate(self, step: int, final: bool) -> dict:
        """The held-out loss of the parameters after `step` (`final`: the engine finishes first)."""
        run = self.run
        if final:
            run.engine.finish()  # the final held-out loss is of the final parameters
        val = loop.evaluate(run.engine, run.val, run.mesh, run.mesh.device, run.cfg.train.bf16)
        record: dict = {}
        with _captured(record):
            report.log_held_out(run, step, record, val)
        return record

    @endpoint
    @_fails_once
    def weights(self, step: int) -> dict | None:
        """The parameters after `step`, whole, by name, for the evaluation island (a collective
        on every rank); one rank per pipeline stage returns its stage's, the others None."""
        run = self.run
        params = run.engine.full_parameters()
        first = run.mesh.rank(data_axis(run.mesh)) == 0 and run.mesh.rank("tp") == 0
        return params if first else None

    @endpoint
    @_fails_once
    def save(self, step: int, sampler: dict, always: bool) -> bool:
        """A checkpoint of the state after `step` through the loop's DCP path, with the
        controller's sampler position (the data is the controller's); not while steps are being
        skipped (the newest checkpoint stays the last good state) unless `always`."""
        run = self.run
        if run.skipped_in_a_row and not always:
            return False
        run.sampler.load_state_dict(sampler)
        loop._save(run, step)
        return True

    @endpoint
    @_fails_once
    def finish(self, loss: float, val_loss: float | None) -> dict:
        """The end of the run: the summary, loss.png and the sample (rank 0 writes them, after the
        controller closed metrics.jsonl), then the group is closed."""
        run = self.run
        out: dict = {}
        with _captured(out):
            run.engine.finish()
            run.checkpointer.wait()  # the last checkpoint committed (train.checkpoint_async)
            out["summary"] = report.finish(run, loss, val_loss)
        self._close()
        return out

    @endpoint
    def peer_state(self, full: bool) -> dict:
        """For a fresh mesh after a failure: this rank's step and RNG state, and with `full` its
        model and optimizer state (plait.controller.peer). Answered after a failed call too."""
        if self.run is None:
            raise RuntimeError(f"rank {self.rank} holds no run")
        return peer.snapshot(self.run, self.taken, self.rng, full)

    @endpoint
    def close(self) -> None:
        """Close the engine and the process group (idempotent)."""
        self._close()

    def _close(self) -> None:
        if self.run is not None:
            self.run.engine.close()
            self.run.checkpointer.close()
            self.run.mesh.close()
            self.run = None
        if dist.is_initialized():
            dist.destroy_process_group()

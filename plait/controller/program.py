"""The driver API: one Python program drives a mesh of processes (`plait.controller.mesh`).

    with plait.controller.mesh({"dp": 2, "zero_stage": 3}) as m:
        m.parallelize(make_model, lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=loss_fn)
        futures = [m.step(batch) for batch in batches]     # dispatched at once, run in order
        losses = [f.get() for f in futures]
        state = m.state_dict()                              # every parameter, whole, here

The program is the controller: it owns the data and the loop, and runs none of the compute. The
mesh is Monarch processes (children of this one), one `ProgramActor` per rank, with the layout's
named dims. Each actor joins the torch.distributed group of the mesh and calls `plait.parallelize`,
the path of a custom SPMD loop (`plait.api`), on the model `make_model()` builds there: a run
here trains exactly as `plait launch` running the same loop would. `m.step(batch)` splits the
global batch into each data rank's rows here, sends them with the step and returns a future at
once; Monarch delivers one sender's messages to an actor in order, so steps queue on the actors
while the program goes on (run-ahead). A rank's failure (an exception, a process that died) is
raised by the future that sees it as `RankFailedError`, naming the rank, its coordinates on the
mesh and the call; the mesh is then stopped and a fresh one may be opened (load a checkpoint
saved with `m.save`). docs/controller.md ("The driver API").

Functions and classes sent to the actors (the model factory, the optimizer factory, `loss_fn`)
go by cloudpickle: defined in the program's own file they travel by value; defined in a module
they are imported by name in the actors, which must be able to import it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping
from typing import Any

import monarch.actor
import torch
import torch.distributed as dist
from monarch.actor import Actor, current_rank, endpoint, this_host
from monarch.config import configure

from plait.api import _settings
from plait.api import parallelize as parallelize_model
from plait.comm.ports import free_port
from plait.comm.spawn import rank_env
from plait.controller.actor import _fails_once
from plait.controller.futures import RankFailed, gather, quiet
from plait.data.batch import split_batch
from plait.errors import ConfigError, PlaitError
from plait.train.launch import _threads_per_rank


class RankFailedError(PlaitError):
    """A rank of a driver mesh failed: its exception, or its process died. `rank`, `coords` (its
    place on the mesh's named dims) and `call` (the endpoint) say where."""

    def __init__(self, message: str, rank: int, coords: dict[str, int], call: str):
        super().__init__(message)
        self.rank, self.coords, self.call = rank, coords, call


def mesh_shape(layout: Mapping) -> dict[str, int]:
    """The process mesh's named dims for a `plait.parallelize` layout dict: dp (default 1), ep,
    tp and pp degrees; every rank of it is one process."""
    s = _settings(layout)
    return {"pp": s["pp"], "dp": s["dp"] or 1, "ep": s["ep"], "tp": s["tp"]}


_HOOKS: list = []  # Monarch's fault hooks replaced by the meshes open in this program


def _opened() -> None:
    """A driver mesh opens: short stop grace periods (a failed mesh is stopped at once, not after
    Monarch's 10 s defaults), and failures reported by the futures, not Monarch's fault hook."""
    configure(stop_actor_timeout="2s", mesh_terminate_timeout="2s", process_exit_timeout="2s")
    _HOOKS.append(monarch.actor.unhandled_fault_hook)
    monarch.actor.unhandled_fault_hook = quiet


def _closed() -> None:
    monarch.actor.unhandled_fault_hook = _HOOKS.pop()


class ProgramActor(Actor):
    """One rank of a driver mesh: a `plait.parallelize` engine on this process."""

    def __init__(self) -> None:
        self.rank = current_rank().rank  # row-major over (pp, dp, ep, cp, tp): tp fastest
        self.engine = None
        self.failed = ""

    @endpoint
    @_fails_once
    def build(
        self, world: int, port: int, threads: int, layout: dict, factory, optimizer, kwargs: dict, seed: int
    ) -> dict:
        """Join the mesh's process group, build the model with `factory()` (the torch seed set to
        `seed` first, so that every rank builds the same one) and parallelize it."""
        rank_env(self.rank, world, port)
        torch.set_num_threads(threads)
        torch.manual_seed(seed)
        model = factory()
        if callable(kwargs.get("blocks")):  # blocks are the model's own modules: named by a function
            kwargs = {**kwargs, "blocks": kwargs["blocks"](model)}
        self.engine = parallelize_model(model, optimizer, layout, seed=seed, **kwargs)
        e = self.engine
        return {"rank": e.rank, "dp_rank": e.dp_rank, "dp": e.dp, "is_main": e.is_main}

    @endpoint
    @_fails_once
    def step(self, rows, micro_batches: int) -> dict:
        """forward_backward on this rank's rows, then the optimizer step: the loss (the mean over
        the global batch) and the gradient norm before clipping."""
        loss = self.engine.forward_backward(rows, micro_batches=micro_batches)
        norm = self.engine.step()
        return {"loss": loss, "grad_norm": float(norm), "step": self.engine.steps}

    @endpoint
    @_fails_once
    def full_parameters(self) -> dict | None:
        """Every parameter, whole, on the CPU (a collective; rank 0 returns them, the others None)."""
        params = self.engine.full_parameters()
        return params if self.engine.is_main else None

    @endpoint
    @_fails_once
    def save(self, directory: str, keep: int) -> str:
        return str(self.engine.save(directory, keep=keep))

    @endpoint
    @_fails_once
    def load(self, path: str) -> int:
        return self.engine.load(path)

    @endpoint
    @_fails_once
    def run(self, fn, args: tuple, kwargs: dict) -> Any:
        """`fn(engine, *args, **kwargs)` on this rank: the escape hatch for anything else (an
        evaluation, a learning-rate change); every rank runs it, so collectives in it are fine."""
        return fn(self.engine, *args, **kwargs)

    @endpoint
    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        if dist.is_initialized():
            dist.destroy_process_group()


class StepFuture:
    """The result of `DriverMesh.step`, not yet waited for: `get()` -> the loss (the mean over
    the global batch), `result()` -> {"loss", "grad_norm", "step"}."""

    def __init__(self, mesh: DriverMesh, futures: list):
        self._mesh, self._futures, self._value = mesh, futures, None

    def result(self) -> dict:
        if self._value is None:
            self._value = self._mesh._collect(self._futures, "step")[0]
        return self._value

    def get(self) -> float:
        return self.result()["loss"]


class DriverMesh:
    """A mesh of processes driven by this program; made by `plait.controller.mesh(layout)`."""

    def __init__(self, layout: Mapping):
        self.layout = dict(layout)
        self.shape = mesh_shape(self.layout)
        self.world = math.prod(self.shape.values())
        self.procs = None
        self.ranks: list = []
        self.coords = [dict(zip(self.shape, c)) for c in itertools.product(*map(range, self.shape.values()))]
        self.places: list[dict] = []

    # --- open and close ---------------------------------------------------------------------------

    def open(self) -> DriverMesh:
        _opened()
        self.procs = this_host().spawn_procs(per_host=self.shape)
        actors = self.procs.spawn("plait_program", ProgramActor)
        self.ranks = [actors.slice(**c) for c in self.coords]
        return self

    def close(self) -> None:
        """Close every rank's engine and group, and stop the processes (idempotent)."""
        if self.procs is None:
            return
        try:
            if self.places:
                gather([r.close.call_one() for r in self.ranks])
        except RankFailed:
            pass  # a failed mesh is stopped below all the same
        finally:
            self.procs.stop().get()
            self.procs = None
            _closed()

    def __enter__(self) -> DriverMesh:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    # --- the program's calls ----------------------------------------------------------------------

    def parallelize(
        self,
        factory: Callable[[], torch.nn.Module],
        optimizer: Callable,
        *,
        seed: int = 0,
        **kwargs,
    ) -> DriverMesh:
        """Build the model on every rank with `factory()` (after `torch.manual_seed(seed)`) and
        call `plait.parallelize(model, optimizer, layout, **kwargs)` there. `kwargs` are
        parallelize's (loss_fn, tp_plan, layout_rules, grad_clip, scheduler, param_groups);
        `blocks` is a function of the model returning its blocks (the modules live on the ranks)."""
        if self.procs is None:
            raise ConfigError(
                "DriverMesh.parallelize: the mesh is not open (use `with plait.controller.mesh(...)`)"
            )
        if self.places:
            raise ConfigError("DriverMesh.parallelize: the mesh already holds a model; open another mesh")
        args = (self.world, free_port(), _threads_per_rank(self.world), self.layout, factory, optimizer)
        self.places = self._collect([r.build.call_one(*args, kwargs, seed) for r in self.ranks], "build")
        return self

    @property
    def dp(self) -> int:
        """How many data ranks the global batch is split over (dp, or dp x ep)."""
        return self._built().places[0]["dp"]

    def step(self, batch, micro_batches: int = 1) -> StepFuture:
        """One training step on the global `batch` (a tensor, or a tuple, list or dict of tensors
        sharing their first dimension, a multiple of `dp` rows): each data rank gets its rows from
        here. Returns at once; the future's `get()` is the mean loss over the batch."""
        places = self._built().places
        rows = {p["dp_rank"]: split_batch(batch, p["dp"], p["dp_rank"]) for p in places}
        calls = [r.step.call_one(rows[p["dp_rank"]], micro_batches) for r, p in zip(self.ranks, places)]
        return StepFuture(self, calls)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter, whole, on the CPU here, by the model's names (gathered on the ranks)."""
        self._built()
        return self._collect([r.full_parameters.call_one() for r in self.ranks], "full_parameters")[0]

    def save(self, directory: str, keep: int = 2) -> str:
        """A checkpoint of model, optimizer and step under `directory` (DCP; loads at any layout)."""
        self._built()
        return self._collect([r.save.call_one(str(directory), keep) for r in self.ranks], "save")[0]

    def load(self, path: str) -> int:
        """Restore a checkpoint saved with `save` (or by `plait.parallelize`'s engine); its step."""
        self._built()
        return self._collect([r.load.call_one(str(path)) for r in self.ranks], "load")[0]

    def run(self, fn: Callable, *args, **kwargs) -> list:
        """`fn(engine, *args, **kwargs)` on every rank (its `plait.parallelize` engine); the results
        in rank order."""
        self._built()
        return self._collect([r.run.call_one(fn, args, kwargs) for r in self.ranks], fn.__name__)

    # --- helpers ----------------------------------------------------------------------------------

    def _built(self) -> DriverMesh:
        if not self.places:
            raise ConfigError("DriverMesh: call m.parallelize(factory, optimizer) before stepping the mesh")
        return self

    def _collect(self, futures: list, call: str) -> list:
        try:
            return gather(futures)
        except RankFailed as exc:
            coords = self.coords[exc.rank]
            where = ", ".join(f"{k} {v}" for k, v in coords.items())
            raise RankFailedError(
                f"rank {exc.rank} ({where}) failed in {call}: {exc.error}", exc.rank, coords, call
            ) from None

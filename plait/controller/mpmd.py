"""MPMD on islands: a pipeline whose stages live on different process meshes, driven from one program.

    stages = [make_stage0, make_stage1]                                 # the user's stage modules
    with plait.controller.islands(stages, dp=[2, 1], optimizer=opt, loss_fn=loss_fn,
                                  schedule="1f1b", microbatches=4) as p:
        loss = p.step((x, y))                                            # one optimizer step

Pathways' other half: each stage is an *island* (a Monarch process mesh of its own) running its
own program (its own stage module, its own data-parallel degree), and the controller moves
activations and their gradients between islands. The order of work is plait's schedules as data
(`plait.pipeline.schedules.make_schedule`: GPipe and 1F1B); the controller walks each stage's
compute actions, dispatching an action to its island as soon as its input is back (a forward
needs the previous island's output of that micro-batch, a backward the next island's input
gradient), so that islands work at the same time as the schedule allows. Inside an island the
ranks are data parallel through plait's `DataParallel` (the gradient synchroniser of every
layout), over the island's own gloo (NCCL on GPUs) group; they synchronise once per step, on
their last micro-batch's backward.

Scaling. The objective is the mean loss over the global batch. The last island's rank backprops
its micro-batch's mean loss / m; `DataParallel` averages over the island's dp, so its weights get
the gradient of the mean, and the input gradient it computes is dp_last x that of the mean. Each
island s+1 multiplies the input gradient it hands back by dp_s / dp_(s+1), so
every island's averaged gradient is the mean's: islands of different widths train exactly like
one process (tests/test_controller_islands.py).

Transfers. By default (`transfer="direct"`) activations and gradients go from island to island
over a gloo group spanning each boundary's ranks (plait.controller.links): the controller sends
only the actions and, per forward, the output's shape. `transfer="controller"` relays them
through the controller as endpoint arguments and results instead, to measure what that costs
(benchmarks/controller_islands.py). The first island's inputs and the last island's targets
come from the controller, which owns the data.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from monarch.actor import Actor, current_rank, endpoint, this_host

from plait.comm.ports import free_port, loopback_store
from plait.comm.spawn import rank_env
from plait.controller.actor import _fails_once
from plait.controller.futures import RankFailed, gather
from plait.controller.links import Incoming, Link
from plait.controller.program import RankFailedError, _closed, _opened
from plait.data.batch import split_batch
from plait.data_parallel import DataParallel
from plait.errors import ConfigError
from plait.mesh import Mesh, init_distributed
from plait.pipeline.schedules import make_schedule

SCHEDULES = ("gpipe", "1f1b")  # one stage per island and an unsplit backward
TRANSFERS = ("direct", "controller")  # island to island over gloo, or relayed by the controller
CLOSE_S = 10.0  # how long the ranks have to leave their groups before their processes are stopped


class StageActor(Actor):
    """One rank of one island: its stage module, data parallel over the island, and its ends of
    the links to the neighbouring islands (direct transfers)."""

    def __init__(self) -> None:
        self.rank = current_rank().rank
        self.failed = ""
        self.model = None
        self.links: dict[str, Link] = {}

    @endpoint
    @_fails_once
    def build(
        self, port: int, factory, optimizer, loss_fn, seed: int, island: int, dp: list, store: int | None
    ) -> None:
        """Join island `island`'s group (`port`), build the stage and, with `store` (the port of
        the controller's store; None: relayed transfers), the links to the neighbouring islands."""
        world, last = dp[island], island == len(dp) - 1
        rank_env(self.rank, world, port)
        torch.set_num_threads(1)
        init_distributed()  # the local GPU, else the CPU (gloo)
        self.mesh = Mesh(dp=world)
        torch.manual_seed(seed)
        module = factory().to(self.mesh.device)
        self.module = module
        self.model = DataParallel(module, self.mesh) if world > 1 else module
        self.optimizer = optimizer(list(module.parameters()))
        self.loss_fn, self.last = loss_fn, last
        # island s hands back dp_(s-1) / dp_s x its input gradient: the module docstring's scaling
        self.scale = dp[island - 1] / world if island else 1.0
        self.island = island
        self.saved: dict[int, tuple] = {}
        if store is not None:  # the previous link first on every island: no two wait on each other
            if island > 0:
                self.links["prev"] = Link(
                    self.mesh, store, island - 1, (dp[island - 1], world), False, self.rank
                )
            if not last:
                self.links["next"] = Link(self.mesh, store, island, (world, dp[island + 1]), True, self.rank)

    @endpoint
    @_fails_once
    def forward(self, mb: int, x, y: torch.Tensor | None, m: int):
        """Micro-batch `mb`'s forward on this rank's rows, kept for the backward. `x`: the rows, or
        `Incoming` to receive them over the previous link. Returns the mean loss of the rows (the
        last island); else the output, or, sent over the next link, its row shape and dtype."""
        if isinstance(x, Incoming):
            x = self.links["prev"].recv(mb, x.rows // self.links["prev"].mine, x.tail, x.dtype)
        # the first island's input gradient would go nowhere: not computed
        x = x.to(self.mesh.device).requires_grad_(x.is_floating_point() and self.island > 0)
        out = self.model(x)
        if self.last:
            loss = self.loss_fn(out, y.to(self.mesh.device))
            self.saved[mb] = (x, loss / m)
            return float(loss.detach())
        self.saved[mb] = (x, out)
        if "next" in self.links:
            self.links["next"].send(out, mb)
            return tuple(out.shape[1:]), out.dtype
        return out.detach().cpu()

    @endpoint
    @_fails_once
    def backward(self, mb: int, grad, sync: bool):
        """Micro-batch `mb`'s backward. `grad`: the output's gradient (these rows), None on the last
        island, or `Incoming()` to receive it over the next link; `sync`: the island's last backward of
        the step, which synchronises the gradients over dp. Returns the input's gradient, scaled
        for the previous island (None when it is sent over the link, or for token inputs)."""
        x, out = self.saved.pop(mb)
        if isinstance(grad, Incoming):
            grad = self.links["next"].recv(mb, out.shape[0], tuple(out.shape[1:]), out.dtype)
        defer = not sync and isinstance(self.model, DataParallel)
        with self.model.no_sync() if defer else contextlib.nullcontext():
            out.backward(None if grad is None else grad.to(out.device))
        if x.grad is None:
            return None
        g = x.grad.detach() * self.scale
        if "prev" in self.links:
            self.links["prev"].send(g, mb)
            return None
        return g.cpu()

    @endpoint
    @_fails_once
    def step(self) -> None:
        for link in self.links.values():
            link.wait()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    @endpoint
    @_fails_once
    def parameters(self) -> dict[str, torch.Tensor] | None:
        """The stage's parameters (replicated over the island's dp): rank 0's, on the CPU."""
        if self.rank != 0:
            return None
        return {k: v.detach().cpu().clone() for k, v in self.module.named_parameters()}

    @endpoint
    def traffic(self) -> dict:
        """The bytes this rank has sent over each of its links, and its sends not yet awaited
        (none between steps: `step` awaits them)."""
        links = self.links.items()
        return {
            "sent": {k: link.sent_bytes for k, link in links},
            "pending": sum(len(x.pending) for _, x in links),
        }

    @endpoint
    def close(self) -> None:
        if isinstance(self.model, DataParallel):
            self.model.remove_hooks()
        self.links.clear()
        if getattr(self, "mesh", None) is not None:
            self.mesh.close()
        if dist.is_initialized():
            dist.destroy_process_group()


class IslandPipeline:
    """A pipeline over islands, driven from this program: `plait.controller.islands(...)`."""

    def __init__(
        self,
        stages: Sequence[Callable],
        dp: Sequence[int],
        optimizer: Callable,
        loss_fn: Callable,
        schedule: str = "1f1b",
        microbatches: int = 4,
        seed: int = 0,
        transfer: str = "direct",
    ):
        if len(stages) < 2:
            raise ConfigError(f"islands: a pipeline needs at least 2 stages, got {len(stages)}")
        if len(dp) != len(stages) or any(not isinstance(d, int) or d < 1 for d in dp):
            raise ConfigError(f"islands: dp = {list(dp)} must give one degree >= 1 per stage ({len(stages)})")
        if schedule not in SCHEDULES:
            raise ConfigError(
                f"islands: schedule = {schedule!r} is not available; valid: {', '.join(SCHEDULES)}"
            )
        if transfer not in TRANSFERS:
            raise ConfigError(f"islands: transfer = {transfer!r} is not one of {', '.join(TRANSFERS)}")
        self.direct = transfer == "direct"
        self.store = None  # the links' store (direct transfers), hosted here on 127.0.0.1
        self.stages, self.dp, self.optimizer, self.loss_fn = list(stages), list(dp), optimizer, loss_fn
        self.seed, self.m = seed, microbatches
        self.schedule = make_schedule(schedule, len(stages), microbatches)
        self.islands: list = []  # per island: (its ProcMesh, its actors by rank)
        self.relayed_bytes = 0  # activations and gradients that went through this program

    def __enter__(self) -> IslandPipeline:
        _opened()
        try:
            for s, n in enumerate(self.dp):
                procs = this_host().spawn_procs(per_host={"dp": n})
                actors = procs.spawn(f"plait_stage{s}", StageActor)
                self.islands.append((procs, [actors.slice(dp=r) for r in range(n)]))
            if self.direct:
                self.store = loopback_store(wait_for_workers=False)
            builds = []
            for s, factory in enumerate(self.stages):
                store = self.store.port if self.direct else None
                args = (free_port(), factory, self.optimizer, self.loss_fn, self.seed, s, self.dp, store)
                builds.append([r.build.call_one(*args) for r in self.islands[s][1]])
            for s, futures in enumerate(builds):
                self._collect(s, futures, "build")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop every island's processes (idempotent). Each rank is asked to leave its groups
        first, for CLOSE_S seconds at most: after a failure a peer may still wait in a collective
        or a link for the failed rank, and its process is stopped all the same."""
        deadline = time.monotonic() + CLOSE_S
        closing = [(procs, [a.close.call_one() for a in actors]) for procs, actors in self.islands]
        for procs, futures in closing:
            for f in futures:
                with contextlib.suppress(Exception):  # failed, dead or stuck: stopped below
                    f.get(timeout=max(0.001, deadline - time.monotonic()))
            procs.stop().get()
        if self.islands:
            _closed()
        self.islands, self.store = [], None

    # --- one step --------------------------------------------------------------------------------

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        """One optimizer step on the global batch `(inputs, targets)`: the schedule's forwards and
        backwards over `microbatches` micro-batches, each island's update. Returns the mean loss."""
        x, y = batch
        rows = x.shape[0]
        if rows % self.m or any((rows // self.m) % d for d in self.dp):
            raise ConfigError(
                f"islands: a batch of {rows} rows does not split into {self.m} micro-batches of a "
                f"multiple of every island's dp ({self.dp})"
            )
        xs, ys = x.chunk(self.m), y.chunk(self.m)
        n = len(self.stages)
        queues = [list(self.schedule.compute(s)) for s in range(n)]
        outs: dict[tuple[int, int], torch.Tensor] = {}  # (stage, mb): the stage's whole output
        grads: dict[tuple[int, int], torch.Tensor] = {}  # (stage, mb): its input's whole gradient
        losses: list[float] = []
        running: dict[int, tuple] = {}  # stage: (action, futures)
        while any(queues) or running:
            for s in range(n):
                if s not in running and queues[s] and self._ready(queues[s][0], outs, grads):
                    a = queues[s].pop(0)
                    running[s] = (a, self._dispatch(s, a, xs, ys, outs, grads, last_bw=not queues[s]))
            if not running:  # nothing in flight and nothing ready: the schedule cannot go on
                waiting = [q[0] for q in queues if q]
                raise RuntimeError(f"islands: the schedule stalled with {waiting} waiting")
            done = self._wait_any(running)
            for s in done:
                a, futures = running.pop(s)
                results = self._collect(s, futures, f"{'forward' if a.kind == 'F' else 'backward'} {a.mb}")
                if a.kind == "F" and s == n - 1:
                    losses += results
                elif s == 0 and a.kind != "F":  # the first island's input gradient goes nowhere
                    pass
                elif self.direct:  # the data went over the link: a forward's output shape, or nothing
                    (outs if a.kind == "F" else grads)[(s, a.mb)] = results[0]
                else:
                    whole = (outs if a.kind == "F" else grads)[(s, a.mb)] = torch.cat(results)
                    self.relayed_bytes += 2 * whole.numel() * whole.element_size()  # in, then out
        for s in range(n):
            self._collect(s, [r.step.call_one() for r in self.islands[s][1]], "step")
        return sum(losses) / len(losses)  # equal rows: the mean of the micro-batch means

    def _ready(self, a, outs, grads) -> bool:
        if a.kind == "F":
            return a.stage == 0 or (a.stage - 1, a.mb) in outs
        return a.stage == len(self.stages) - 1 or (a.stage + 1, a.mb) in grads

    def _dispatch(self, s: int, a, xs, ys, outs, grads, last_bw: bool) -> list:
        ranks, n = self.islands[s][1], self.dp[s]
        if a.kind == "F":
            last = s == len(self.stages) - 1
            if s == 0:
                inp = [split_batch(xs[a.mb], n, i) for i in range(n)]
            elif self.direct:  # receive over the link: the micro-batch's rows, a row's shape, dtype
                inp = [Incoming(xs[a.mb].shape[0], *outs.pop((s - 1, a.mb)))] * n
            else:
                whole = outs.pop((s - 1, a.mb))
                inp = [split_batch(whole, n, i) for i in range(n)]
            return [
                r.forward.call_one(a.mb, inp[i], split_batch(ys[a.mb], n, i) if last else None, self.m)
                for i, r in enumerate(ranks)
            ]
        if s == len(self.stages) - 1:
            return [r.backward.call_one(a.mb, None, last_bw) for r in ranks]
        g = grads.pop((s + 1, a.mb))
        return [
            r.backward.call_one(a.mb, Incoming() if self.direct else split_batch(g, n, i), last_bw)
            for i, r in enumerate(ranks)
        ]

    @staticmethod
    def _wait_any(running: dict) -> list[int]:
        """The stages whose action has finished on every rank (at least one, unless none runs)."""
        while running:
            done = []
            for s, (_, futures) in running.items():
                try:
                    for f in futures:
                        f.get(timeout=0.0005)
                    done.append(s)
                except TimeoutError:
                    pass
                except Exception:  # a failure: reported by _collect
                    done.append(s)
            if done:
                return done
            time.sleep(0.0005)
        return []

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every stage's parameters, as `stage{s}.{name}`, on the CPU here."""
        out = {}
        for s, (_, ranks) in enumerate(self.islands):
            params = self._collect(s, [r.parameters.call_one() for r in ranks], "parameters")[0]
            out.update({f"stage{s}.{k}": v for k, v in params.items()})
        return out

    def link_bytes(self) -> list[tuple[int, int]]:
        """Per boundary s | s+1, the bytes sent over its link so far: forward (by island s's ranks)
        and back (by island s+1's). Zeros when transfers are relayed by the controller."""
        sent = [[t["sent"] for t in island] for island in self._traffic()]
        return [
            (sum(d.get("next", 0) for d in sent[s]), sum(d.get("prev", 0) for d in sent[s + 1]))
            for s in range(len(sent) - 1)
        ]

    def pending_sends(self) -> int:
        """The sends posted on the links and not yet awaited, over every rank (0 between steps)."""
        return sum(t["pending"] for island in self._traffic() for t in island)

    def _traffic(self) -> list[list[dict]]:
        return [
            self._collect(s, [r.traffic.call_one() for r in ranks], "traffic")
            for s, (_, ranks) in enumerate(self.islands)
        ]

    def _collect(self, s: int, futures: list, call: str) -> list:
        try:
            return gather(futures)
        except RankFailed as exc:
            coords = {"island": s, "dp": exc.rank}
            raise RankFailedError(
                f"island {s} (stage {s}), dp rank {exc.rank} failed in {call}: {exc.error}",
                exc.rank,
                coords,
                call,
            ) from None

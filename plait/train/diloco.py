"""DiLoCo and Streaming DiLoCo as an engine around any other: inner steps alone, outer steps together.

DiLoCo (Douillard et al. 2023, Algorithm 1): M replica groups each take H inner steps of the
configured optimizer on their own data, then every group computes its pseudo-gradient
Delta_m = theta_anchor - theta_m (the anchor: the parameters of the last synchronisation), the
groups average it (one all-reduce over the replica axis), and an outer optimizer steps the
anchor with it; every group continues from the new anchor.

    outer sgd:       b = mu b + Delta;  theta_anchor -= lr_out b
    outer nesterov:  b = mu b + Delta;  theta_anchor -= lr_out (Delta + mu b)

With H = 1, outer sgd, lr_out = 1 and mu = 0, theta_anchor - Delta_avg is the average of the
groups' parameters after one inner step: for a linear inner optimizer (SGD) that is data
parallelism over the groups exactly.

Streaming DiLoCo (Douillard et al. 2025): the model's blocks are cut into F fragments
(`fragment_of`); fragment p is synchronised every H steps, at the steps t with
(t + p H / F) mod H = 0 (staggered: one fragment's traffic at a time). Its exchange starts at the
end of step t and runs while the group takes tau = overlap_steps more inner steps; at the end of
step t + tau the outer step is applied to that fragment's anchor and the fragment's parameters
become alpha theta_local + (1 - alpha) theta_anchor (`mix`). The last step of the run
synchronises every fragment at once, with no overlap, so the run ends on one model.

The engine acts on the tensors the inner engine trains, as its checkpoint state holds them
(`Engine.checkpoint_state`: each rank's shards under ZeRO, its slices under tp, its stages under
pp), in place, then calls `checkpoint_loaded` so the inner engine republishes them: every inner
layout works unchanged, and each rank of a group exchanges only what it holds with the same rank
of the other groups (`plait.train.diloco_replicas`). Its own state (anchor, outer momentum, a
fragment's exchanged sum still waiting for its merge, the fragment schedule, and with
`diloco.compression` = onebit / topk / powersgd the compressor's residual per tensor: error
feedback on the pseudo-gradient, one bucket per fragment, plait.comm.compress's compressors with
the [comm] section's ratio, rank and error_feedback) goes into the
checkpoint beside the inner optimizer's, in the same layout-free form, so a run resumes bit for
bit, between synchronisations too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor

from plait.comm.compress import make_compressor
from plait.gradsync import GradBucket
from plait.state import group_options, set_group_options, sharded_tensor
from plait.train.diloco_quorum import QuorumReplicas
from plait.train.diloco_replicas import AXIS, FixedReplicas, replica_group

_BLOCK = re.compile(r"(?:^|\.)(?:blocks|layers|h|layer)\.(\d+)(?:\.|$)")
_WIRE = {"none": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def block_of(name: str) -> int | None:
    """The transformer block a parameter belongs to (`blocks.3.attn...` -> 3), or None."""
    m = _BLOCK.search(name)
    return int(m.group(1)) if m else None


def fragment_of(name: str, n_blocks: int, fragments: int) -> int:
    """Streaming DiLoCo's fragment of a parameter: block b of n belongs to fragment b F // n
    (contiguous runs of blocks); the embeddings, final norm and head belong to fragment 0."""
    b = block_of(name)
    if b is None or n_blocks == 0:
        return 0
    return b * fragments // n_blocks


def due_fragments(step: int, inner_steps: int, fragments: int) -> list[int]:
    """The fragments whose exchange starts at the end of `step` (1-based)."""
    return [p for p in range(fragments) if (step + p * inner_steps // fragments) % inner_steps == 0]


def outer_update(anchor, momentum, delta, lr: float, mu: float, nesterov: bool) -> None:
    """The outer step on one tensor, in place (SGD with momentum, torch's Nesterov form)."""
    momentum.mul_(mu).add_(delta)
    anchor.sub_(delta.add(momentum, alpha=mu) if nesterov else momentum, alpha=lr)


@dataclass
class _Tensor:
    """One local tensor the inner engine trains, with its outer state."""

    name: str
    fragment: int
    anchor: torch.Tensor
    momentum: torch.Tensor
    pending: torch.Tensor  # the summed pseudo-gradient of an exchange landed but not yet merged
    residual: torch.Tensor | None = None  # an error-feedback compressor's carried error


@dataclass
class _Flight:
    """A fragment's exchange in flight: started at `started`, merged at the end of `lands`."""

    buffer: torch.Tensor
    handle: object
    contributors: int
    lands: int


def local_tensors(engine) -> list[tuple[str, list[torch.Tensor], object]]:
    """(name, this rank's pieces of it, the checkpoint entry) for every tensor the inner engine
    trains, in checkpoint order (the same on every rank and every group)."""
    model_sd, _ = engine.checkpoint_state()
    out = []
    for name, v in model_sd.items():
        pieces = [s.tensor for s in v.local_shards()] if isinstance(v, ShardedTensor) else [v]
        out.append((name, pieces, v))
    return out


class DilocoEngine:
    """The engine contract (plait.engine) around an inner engine, with DiLoCo's outer step at
    `end_step`; everything else is the inner engine's."""

    def __init__(self, inner, diloco, replicas, total_steps: int, compressor=None):
        self.inner = inner
        self.d = diloco
        # onebit / topk / powersgd on the outer exchange (plait.comm.compress), one bucket per
        # fragment, its residual kept per tensor (saved with the outer state); None: the wire dtype
        self.compressor = compressor
        self.replicas = replicas  # plait.train.diloco_replicas: the exchange over the groups
        self.mesh = replicas.mesh
        self.total_steps = total_steps
        self.module = inner.module
        self.optimizer = inner.optimizer
        fresh = not self.optimizer.state
        held = local_tensors(inner)  # (the inner state is created to be read: see below)
        blocks = [b for name, _, _ in held if (b := block_of(name)) is not None]
        n_blocks = max(blocks) + 1 if blocks else 0
        self.tensors: list[_Tensor] = []
        for name, pieces, _ in held:
            frag = fragment_of(name, n_blocks, diloco.fragments)
            for t in pieces:
                residual = torch.zeros_like(t) if compressor is not None else None
                zeros = torch.zeros_like
                self.tensors.append(_Tensor(name, frag, t.detach().clone(), zeros(t), zeros(t), residual))
        if fresh:  # the state made to read the tensors took a step of rate 0 (Adam's count): undone
            self.optimizer.state.clear()
        self.flights: dict[int, _Flight] = {}
        # per fragment: the step whose end merges a landed exchange (-1: none), its contributors
        self.pending_lands = torch.full((diloco.fragments,), -1, dtype=torch.int64)
        self.pending_n = torch.zeros(diloco.fragments, dtype=torch.int64)
        self.outer_steps = torch.zeros((), dtype=torch.int64)
        self.n_blocks = n_blocks
        self.replica_bytes = 0.0  # this rank's bus bytes over the replica axis so far (the ledger's)

    # --- the engine contract: the inner engine's --------------------------------------------

    def __getattr__(self, name):
        # the rest of the contract (forward_backward, eval_loss_sum, grad_norm, clip_grad_norm_,
        # step, zero_grad, full_parameters) and the optional capabilities (ErrorFeedback, ...)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def memory(self) -> dict[str, int]:
        """The inner engine's model states, the outer state (anchor, momentum, landed sums) with
        the optimizer's."""
        mem = dict(self.inner.memory())
        per = 3 if self.compressor is None else 4  # anchor, momentum, pending (and the residual)
        outer = sum(per * t.anchor.numel() * t.anchor.element_size() for t in self.tensors)
        mem["optimizer"] = mem.get("optimizer", 0) + outer
        mem["total"] = mem.get("total", 0) + outer
        return mem

    def finish(self) -> None:
        """The inner engine's step in flight, and every exchange in flight, completed (their
        merges stay due at their own step: completing early changes no number)."""
        self.inner.finish()
        for flight in self.flights.values():
            flight.handle.wait()

    def close(self) -> None:
        self.finish()
        self.replicas.close()
        self.inner.close()

    # --- checkpoints -------------------------------------------------------------------------

    def checkpoint_state(self) -> tuple[dict, dict]:
        """The inner engine's state, and the outer state beside its optimizer's: per tensor
        `diloco.anchor.<name>`, `diloco.momentum.<name>`, `diloco.pending.<name>` (and with an
        error-feedback compressor `diloco.residual.<name>`) in the inner tensor's own layout
        (boxes of the whole, as the inner engine saves it), and the schedule
        (`diloco.pending_lands`, `diloco.pending_n`, `diloco.outer_steps`)."""
        self.finish()
        model_sd, optim_sd = self.inner.checkpoint_state()
        for f in list(self.flights):  # landed: kept as the pending sum until its merge step
            self._land(f)
        held = iter(self.tensors)
        keys = ("anchor", "momentum", "pending") + (("residual",) if self.compressor is not None else ())
        for name, v in model_sd.items():
            if isinstance(v, ShardedTensor):
                mine = [(s.metadata.shard_offsets, next(held)) for s in v.local_shards()]
                for key in keys:
                    optim_sd[f"diloco.{key}.{name}"] = sharded_tensor(
                        [(off, getattr(t, key)) for off, t in mine], v.size(), v._process_group
                    )
            else:
                t = next(held)
                for key in keys:
                    optim_sd[f"diloco.{key}.{name}"] = getattr(t, key)
        optim_sd["diloco.pending_lands"] = self.pending_lands
        optim_sd["diloco.pending_n"] = self.pending_n
        optim_sd["diloco.outer_steps"] = self.outer_steps
        return model_sd, optim_sd

    def checkpoint_loaded(self) -> None:
        self.inner.checkpoint_loaded()

    # --- the outer loop ----------------------------------------------------------------------

    def end_step(self, step: int, loss: float) -> dict:
        """After inner step `step`: merge the exchanges that land now, start those due (every
        fragment, without overlap, at the run's last step). Returns the step's DiLoCo record."""
        d = self.d
        record: dict = {}
        last = step == self.total_steps
        self._first = getattr(self, "_first", step)  # (the counts are this invocation's, resumed or not)
        for f in sorted(self.flights):
            if self.flights[f].lands == step or last:
                self._land(f)
        for f in range(d.fragments):
            if int(self.pending_lands[f]) == step or (last and int(self.pending_lands[f]) >= 0):
                self._merge(f, d.mix)
        due = list(range(d.fragments)) if last else due_fragments(step, d.inner_steps, d.fragments)
        if not due:
            return record
        overlap = 0 if last else d.overlap_steps
        sent = 0
        for f in due:  # (none is in flight: an exchange lands within overlap_steps < H)
            sent += self._start(f, step, overlap)
        outcome = self.replicas.outcome()
        record["diloco"] = {
            "fragments": due,
            "groups": outcome["groups"],
            "sent_elements": sent,
        }
        if overlap == 0:
            for f in due:  # the run's last merge takes the outer parameters: it ends on one model
                self._land(f)
                self._merge(f, 0.0 if last else d.mix)
            replica_loss = self.replicas.mean_loss(loss, step)
            if replica_loss is not None:
                record["replica_loss"] = replica_loss
            self.replicas.heal_joiners(self, self.run_state(step))  # groups that rejoined just now
        rows = self.mesh.ledger.rows(step)
        self.replica_bytes += sum(row.bus_bytes for (_, axis), row in rows.items() if axis == AXIS)
        record["diloco"].update(outer_steps=int(self.outer_steps), replica_bytes_total=self.replica_bytes)
        if last and self.mesh.is_rank0:
            per_step = self.replica_bytes / (step - self._first + 1) / 2**10
            print(
                f"plait: diloco: the replica axis carried {self.replica_bytes / 2**20:,.2f} MiB from this "
                f"rank in steps {self._first}..{step} ({per_step:,.1f} KiB per step); "
                f"{int(self.outer_steps)} outer steps in the run",
                flush=True,
            )
        return record

    def attach_run(self, scheduler, sampler) -> None:
        """The run's schedule and data position, which a rejoining group takes from a live one."""
        self._run = (scheduler, sampler)

    def run_state(self, step: int) -> dict:
        scheduler, sampler = self._run
        return {
            "step": step,
            "scheduler": scheduler.state_dict(),
            "sampler": sampler.state_dict(),
            "param_groups": group_options(self.optimizer),
            "outer_steps": int(self.outer_steps),
        }

    @property
    def rejoining(self) -> bool:
        """Whether this group was restarted and must heal from a live one before training."""
        return self.replicas.rejoining

    def rejoin(self) -> int:
        """Heal from a live group at the next round that admits this one; returns its step."""
        state = self.replicas.rejoin(self)
        scheduler, sampler = self._run
        set_group_options(self.optimizer, state["param_groups"])
        scheduler.load_state_dict(state["scheduler"])
        sampler.load_state_dict(state["sampler"])
        self.outer_steps.fill_(state["outer_steps"])
        return int(state["step"])

    def _fragment(self, f: int) -> list[_Tensor]:
        return [t for t in self.tensors if t.fragment == f]

    def _start(self, f: int, step: int, overlap: int) -> int:
        """Start fragment f's exchange: its pseudo-gradient anchor - local, flat, summed over the
        groups (the wire in diloco.compression's dtype); returns its element count."""
        current = self._current()
        mine = self._fragment(f)
        delta = torch.cat([(t.anchor - current[id(t)]).reshape(-1) for t in mine]) if mine else None
        if delta is None:
            delta = torch.zeros(0)
        if self.compressor is not None and mine:
            handle, n = self._compressed(f, mine, delta), self.replicas.groups
        else:
            handle, n = self.replicas.all_reduce(delta, _WIRE.get(self.d.compression, torch.float32), step, f)
        self.flights[f] = _Flight(delta, handle, n, step + overlap)
        return delta.numel()

    def _compressed(self, f: int, mine: list[_Tensor], delta: torch.Tensor):
        """Fragment f's pseudo-gradient through the compressor, as one gradient bucket: every
        group sends C(delta + residual) and keeps the rest as its residual (error feedback, in
        units of the outer step: the compressor's scale stays 1); the handle's result is the sum
        of the groups' decoded messages."""
        bucket = GradBucket(f, [t.anchor for t in mine], [t.name for t in mine], axis=AXIS)
        bucket.buffer = delta
        self.compressor.residuals[f] = torch.cat([t.residual.reshape(-1) for t in mine])
        return self.compressor(bucket, self.mesh, AXIS)

    def _land(self, f: int) -> None:
        """Fragment f's exchange completed: its sum kept as `pending` until its merge step."""
        flight = self.flights.pop(f)
        summed = flight.handle.wait()
        if self.compressor is not None and f in self.compressor.residuals:
            carried, off = self.compressor.residuals.pop(f), 0
            for t in self._fragment(f):
                t.residual.copy_(carried[off : off + t.residual.numel()].view_as(t.residual))
                off += t.residual.numel()
        off = 0
        for t in self._fragment(f):
            n = t.pending.numel()
            t.pending.copy_(summed[off : off + n].view_as(t.pending))
            off += n
        self.pending_lands[f] = flight.lands
        self.pending_n[f] = flight.contributors

    def _merge(self, f: int, mix: float) -> None:
        """The outer step on fragment f's anchor with the average of the landed sum, then its
        parameters: mix x local + (1 - mix) x anchor."""
        d = self.d
        n = max(1, int(self.pending_n[f]))
        current = self._current()
        for t in self._fragment(f):
            outer_update(
                t.anchor,
                t.momentum,
                t.pending / n,
                d.outer_lr,
                d.outer_momentum,
                d.outer_optimizer == "nesterov",
            )
            local = current[id(t)]
            if mix:
                local.mul_(mix).add_(t.anchor, alpha=1 - mix)
            else:
                local.copy_(t.anchor)
            t.pending.zero_()
        self.pending_lands[f] = -1
        self.pending_n[f] = 0
        if f == 0:
            self.outer_steps += 1
        self.inner.checkpoint_loaded()  # republish the parameters the inner engine computes with

    def _current(self) -> dict[int, torch.Tensor]:
        """id(outer tensor) -> the inner engine's live tensor it mirrors (views of its storage)."""
        pieces = [p for _, ps, _ in local_tensors(self.inner) for p in ps]
        return {id(t): p for t, p in zip(self.tensors, pieces, strict=True)}

    # --- healing a group that rejoins --------------------------------------------------------

    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor a rejoining group takes from a live one, in the same order on every
        group: the inner model and optimizer state this rank holds, and the outer state."""
        model_sd, optim_sd = self.inner.checkpoint_state()
        out = []
        for sd in (model_sd, optim_sd):
            for key in sorted(sd):  # (an optimizer's state is in the order it was created)
                v = sd[key]
                if isinstance(v, ShardedTensor):
                    out += [s.tensor for s in v.local_shards()]
                elif torch.is_tensor(v):
                    out.append(v)
        for t in self.tensors:
            out += [t.anchor, t.momentum]
        return out

    def healed(self) -> None:
        """The state tensors were overwritten by a live group's: the inner engine republishes."""
        self.inner.checkpoint_loaded()


def wrap_diloco(engine, cfg, mesh) -> DilocoEngine:
    """`engine` (one replica group's) inside DiLoCo's outer loop, over the replica axis of this
    process's group (one group when no DiLoCo launcher started it)."""
    group, groups = replica_group() or (0, 1)
    timeout = cfg.diloco.quorum_timeout_s
    kind = QuorumReplicas if cfg.diloco.fault_tolerant and groups > 1 else FixedReplicas
    replicas = kind(mesh, group, groups, timeout, cfg.train.steps)
    compressor = None
    if cfg.diloco.compression in ("onebit", "topk", "powersgd"):
        c = cfg.comm  # the [comm] section's settings of the compressor (ratio, rank, error feedback)
        compressor = make_compressor(cfg.diloco.compression, c.topk_ratio, c.error_feedback, c.powersgd_rank)
    return DilocoEngine(engine, cfg.diloco, replicas, cfg.train.steps, compressor)

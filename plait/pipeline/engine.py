"""Pipeline-parallel training of any model that can be cut into stages, behind the engine interface.

`PipelineEngine` cuts the model into ``pp x virtual_stages`` stages (plait.pipeline.stage),
keeps this rank's, runs the configured schedule (plait.pipeline.runtime) and makes the
gradients those of single-process training:

- data parallelism (pp x dp): each stage's gradients are averaged over its dp group as soon as
  the stage's last backward (BW or W) of the step has run, while the rest of the schedule goes
  on; the optimizer waits for them. With ZeRO (`zero_stage` 1-3) a `ZeroOptimizer` over this
  rank's stages reduce-scatters them at the end of the schedule instead, and each dp rank steps
  its shard of the optimizer state; under ZeRO-3 only the parameter shards are kept between
  steps, and the stages' parameters are gathered once at the start of the next one;
- tied embedding and head on different pipeline ranks: the two copies' gradients are summed
  over pp (ranks between them contribute zeros) so both copies stay equal;
- expert parallelism (pp x ep): the batch is split over dp x ep, and each gradient averaged over
  the data axes it is not split on (experts over dp, the rest over dp x ep), as outside pipelines;
- tensor parallelism (pp x tp): the stages hold the tensor-parallel layers apply_tp made; the
  sequence-parallel gradients are summed over tp as plain data parallelism does;
- the gradient norm sums squares over pp and tp, counting a tied or replicated tensor once.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from plait import comm
from plait.errors import ConfigError
from plait.gradsync import GradBucket, GradSync
from plait.mesh import Mesh
from plait.pipeline.runtime import PipelineRuntime
from plait.pipeline.schedules import make_schedule
from plait.pipeline.simulate import Event
from plait.pipeline.stage import split_model
from plait.placement import placement


class HeldStages(nn.Module):
    """The union of one rank's stages: their children by name, module dicts of layers (a GPT's
    blocks, an nn.Sequential's layers) merged, so the stages' own names are kept."""

    def __init__(self, stages: list[nn.Module], tp=None):
        super().__init__()
        for stage in stages:
            for name, child in stage.named_children():
                mine = getattr(self, name, None)
                if isinstance(child, nn.ModuleDict) and isinstance(mine, nn.ModuleDict):
                    clash = [k for k in child if k in mine and mine[k] is not child[k]]
                    if clash:
                        raise ConfigError(f"two stages held by one rank both name {name}.{clash[0]}")
                    mine.update(child)
                elif mine is not None and mine is not child:
                    raise ConfigError(
                        f"two stages held by one rank both have a child named {name!r}: name the stages' "
                        "children apart (a rank holds its stages under their own names)"
                    )
                elif isinstance(child, nn.ModuleDict):
                    setattr(self, name, nn.ModuleDict(child))
                else:
                    setattr(self, name, child)
        if tp is not None:
            self._plait_tp = tp  # read by plait.zero.state to save tensor-parallel shards whole


class PipelineEngine:
    """Train a model with pipeline parallelism over the mesh's pp axis (see module doc).

    Args:
        model: the whole model (after apply_tp, if any), identical on every rank: one that cuts
            itself (plait's GPT), an nn.Sequential (`split_model`), or any module whose stages
            are given in `stages`.
        stages: the model cut into pp x virtual_stages stage modules, in order (they share the
            model's parameters): each takes the previous stage's output, the first the input,
            and the last `(x, targets)` returns the summed loss.
        optimizer: ``optimizer(param_groups) -> torch.optim.Optimizer``.
        param_groups: ``param_groups(module) -> list of torch param groups`` for this rank's
            part (e.g. ``lambda m: plait.optim.param_groups(m, weight_decay)``), or None.
        zero_stage: 0 (each stage's gradients all-reduced over dp as soon as its last backward
            has run), 1 or 2 (ZeRO within each stage: the gradients are reduce-scattered over dp
            at the end of the schedule, each dp rank steps its shard of the optimizer state and
            the parameters are all-gathered; stage 2 keeps only the gradient shard between
            steps; `zero` holds the ZeroOptimizer), or 3 (as 2, and between steps only the
            parameter shards are kept: they are all-gathered once when the next step starts, not
            once per micro-batch, so a step moves 2Ψ as ZeRO-2, and peak memory within the step
            is ZeRO-2's).
        zero_options: more ZeroOptimizer arguments (bucket_mb, shard_axis, replicate_axis).
        data_axes: the axes the batch is split over: ("dp",), or ("dp", "ep") under expert
            parallelism (dense gradients averaged over dp x ep, experts' over dp; see
            `plait.zero.wrap`).
    """

    def __init__(
        self,
        model,
        mesh: Mesh,
        optimizer,
        *,
        schedule: str = "1f1b",
        microbatches: int | None = None,
        virtual_stages: int | None = None,
        split: str = "uniform",
        stages: list[nn.Module] | None = None,
        recompute: bool = False,
        param_groups=None,
        zero_stage: int = 0,
        zero_options: dict | None = None,
        bucket_mb: float = 25.0,
        comm_hook=None,
        data_axes: tuple[str, ...] = ("dp",),
    ):
        self.mesh = mesh
        # the whole model's parameter names (a tied tensor under its first name): checkpoints
        # keep them whatever stages this rank holds, so any layout can resume any other
        self.names = {id(q): n for n, q in model.named_parameters()}
        p = mesh.size("pp")
        m = microbatches or p
        self.schedule = make_schedule(schedule, p, m, virtual_stages)
        all_stages = list(stages) if stages is not None else split_model(model, self.schedule.n_stages, split)
        if len(all_stages) != self.schedule.n_stages:
            raise ConfigError(
                f"{len(all_stages)} stage modules given for {self.schedule.n_stages} pipeline stages"
            )
        self.rank = mesh.rank("pp")
        held = self.schedule.stages[self.rank]
        self.stages = {s: all_stages[s] for s in held}
        self.raw = HeldStages([self.stages[s] for s in held], getattr(model, "_plait_tp", None))
        self.module = self.raw
        self.runtime = PipelineRuntime(self.stages, self.schedule, mesh, recompute=recompute)
        self.runtime.on_stage_done = self._stage_done
        groups = param_groups(self.raw) if param_groups is not None else list(self.raw.parameters())
        self.zero = None
        if zero_stage in (1, 2, 3):
            from plait.zero.optimizer import ZeroOptimizer

            if not isinstance(groups[0], dict):
                groups = [{"params": groups}]
            self.zero = ZeroOptimizer(
                self.raw,
                mesh,
                optimizer,
                stage=min(zero_stage, 2),
                reshard_after_step=zero_stage == 3,
                param_groups=groups,
                trigger="manual",
                names=self.names,
                bucket_mb=bucket_mb,
                comm_hook=comm_hook,
                data_axes=data_axes,
                **(zero_options or {}),
            )
            self.zero.shards.norm_axes = ("pp",)
            self.optimizer = self.zero.optimizer
        elif zero_stage != 0:
            raise ConfigError(f"zero_stage = {zero_stage} within pipeline stages: valid: 0, 1, 2, 3")
        else:
            self.optimizer = optimizer(groups)
        # stage 0 over dp: plait's bucketed data parallelism, triggered by the schedule (a stage's
        # gradients are complete after its last backward) instead of per-parameter hooks; it also
        # sums gradients partial over tp (sequence parallelism), by their placements
        self.ddp = None
        partial = any(mesh.size(a) > 1 for q in self.raw.parameters() for a in placement(q).grad_partial)
        if zero_stage == 0 and (any(mesh.size(a) > 1 for a in data_axes) or partial):
            from plait.data_parallel import DataParallel

            self.ddp = DataParallel(
                self.raw,
                mesh,
                bucket_mb=bucket_mb,
                allow_unused=True,
                comm_hook=comm_hook,
                trigger="manual",
                axes=data_axes,
            )

        # Parameters shared by stages on different pipeline ranks (a GPT's tied embedding and
        # head): each holder keeps a copy; their gradients are summed over pp (ranks holding none
        # contribute zeros) so the copies stay equal, and the norm counts the first holder's.
        holders: dict[int, set[int]] = {}
        for s, stage in enumerate(all_stages):
            for q in stage.parameters():
                holders.setdefault(id(q), set()).add(self.schedule.rank_of(s))
        self.shared = [
            (q, self.rank in holders[id(q)]) for q in model.parameters() if len(holders.get(id(q), ())) > 1
        ]
        # their copies' gradients summed over pp by the gradient synchroniser: every pp rank
        # takes part, ranks holding none with zeros
        self._tied = None
        if self.shared:
            held = {id(q) for q, h in self.shared if h}
            bucket = GradBucket(0, [q for q, _ in self.shared], [self.names[id(q)] for q, _ in self.shared])

            def deliver(b, reduced):
                for i, q in enumerate(b.params):
                    if id(q) in held:
                        q.grad = b.view(i).clone()

            self._tied = GradSync(
                [bucket], mesh, "pp", scale=1.0, trigger="manual", missing="zeros", deliver=deliver
            )
        self._uncounted = {
            id(q)
            for q in model.parameters()
            if len(holders.get(id(q), ())) > 1
            and self.rank in holders[id(q)]
            and self.rank != min(holders[id(q)])
        }
        if self.zero is not None:
            self.zero.shards.norm_skip.update(self.names[i] for i in self._uncounted)
        # which held stages use each parameter: a shared one is reduced after all of them
        self._users: dict[int, set[int]] = {}
        for s, stage in self.stages.items():
            for q in stage.parameters():
                self._users.setdefault(id(q), set()).add(s)
        self._params = {id(q): q for q in self.raw.parameters()}
        self._finished: set[int] = set()
        self._reduced: set[int] = set()
        self._record = False

    # --- one step -----------------------------------------------------------------------------

    def forward_backward(self, micro_batches, loss_scale: float, autocast=None) -> torch.Tensor:
        """Forward and backward of every micro-batch by the schedule (the engine contract of
        plait.engine); gradients reduced over dp and tied copies summed. Returns this rank's
        summed loss (non-zero on the last stage only). After `record_next_step()` the step's
        action timings are kept for `gather_events()`."""
        record, self._record = self._record, False
        self._finished.clear()
        self._reduced.clear()
        inputs, targets = [x for x, _ in micro_batches], [y for _, y in micro_batches]
        if self.zero is not None:  # ZeRO-3: the stages' parameters, gathered once for the step
            self.zero.gather_params()
        from plait.moe.parallel import objective_scale  # auxiliary losses weighted as the main one

        with autocast() if autocast is not None else contextlib.nullcontext(), objective_scale(loss_scale):
            loss = self.runtime.step(inputs, targets, loss_scale, record=record)
        self._sync_grads()
        return loss

    def set_lr_scale(self, scale: float) -> None:
        """The coming step's learning rate over the peak, for error-feedback residuals."""
        exchange = self.zero or self.ddp
        if exchange is not None:
            exchange.set_lr_scale(scale)

    def residual_buffers(self) -> dict[str, torch.Tensor] | None:
        """Error-feedback residuals of the gradient exchange over dp (a compressor), or None."""
        exchange = self.zero or self.ddp
        return exchange.residual_buffers() if exchange is not None else None

    def record_next_step(self) -> None:
        """Time the next step's actions (every pipeline rank starts it together)."""
        comm.barrier(self.mesh, "pp")
        self._record = True

    def _stage_done(self, stage: int) -> None:
        self._finished.add(stage)
        if self.ddp is None:  # one dp rank, or ZeRO, which reduces at the end of the schedule
            return
        ready = [
            q
            for i, q in self._params.items()
            if i not in self._reduced and self._users[i] <= self._finished and q.grad is not None
        ]
        self._reduced.update(id(q) for q in ready)
        self.ddp.grads_ready(ready)  # their buckets start reducing while the schedule goes on

    def _sync_grads(self) -> None:
        if self.ddp is not None:
            self.ddp.finish_grads()
        if self._tied is not None:  # one all-reduce over pp for every shared parameter
            self._tied.grads_ready([q for q, held in self.shared if held and q.grad is not None])
            self._tied.finish()
        if self.zero is not None:  # reduce-scatter over dp; sums partial (sequence-parallel) grads
            self.zero.reduce_grads()

    # --- evaluation ---------------------------------------------------------------------------

    @torch.no_grad()
    def eval_loss_sum(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward only through the stages: the summed token loss of the rows `x`, `y`, as the
        schedule's micro-batches when the rows split into them (else as one)."""
        m = self.schedule.m if x.shape[0] % self.schedule.m == 0 else 1
        was = self.raw.training
        self.raw.eval()
        gathered = self.zero is not None and self.zero.gather_params()
        try:
            return self.runtime.forward_only(list(x.chunk(m)), list(y.chunk(m)))
        finally:
            self.raw.train(was)
            if gathered:  # ZeRO-3: back to shards only
                self.zero.release_params()

    # --- timeline -------------------------------------------------------------------------------

    def gather_events(self) -> list[Event]:
        """The last recorded step's compute events of every pipeline rank (on every rank)."""
        n = max(len(self.schedule.compute(r)) for r in range(self.schedule.p))
        rows = torch.full((n, 5), -1.0, dtype=torch.float64)
        codes = {"F": 0, "B": 1, "W": 2, "BW": 3}
        for i, e in enumerate(self.runtime.events):
            rows[i] = torch.tensor([codes[e.kind], e.mb, e.stage, e.start, e.end], dtype=torch.float64)
        rows = rows.to(self.mesh.device)
        out = torch.empty((self.schedule.p * n, 5), dtype=torch.float64, device=self.mesh.device)
        comm.all_gather(out, rows, self.mesh, "pp")
        out = out.view(self.schedule.p, n, 5)
        kinds = {v: k for k, v in codes.items()}
        events = []
        for r in range(self.schedule.p):
            for row in out[r].cpu().tolist():
                if row[0] >= 0:
                    events.append(Event(r, kinds[int(row[0])], int(row[1]), int(row[2]), row[3], row[4]))
        return events

    # --- the engine interface -------------------------------------------------------------------

    def grad_norm(self) -> float:
        """The global gradient norm over pp and tp (tied and tp-replicated tensors once)."""
        if self.zero is not None:  # over the shards too
            return self.zero.grad_norm()
        from plait.engine import global_grad_norm
        from plait.placement import norm_parts, placement

        pairs = [
            (placement(q), q.grad)
            for q in self.raw.parameters()
            if q.grad is not None and id(q) not in self._uncounted
        ]
        every = [placement(q) for q in self.raw.parameters()]
        return global_grad_norm(self.mesh, norm_parts(pairs, self.mesh, ("pp",), every))

    def clip_grad_norm_(self, max_norm: float) -> float:
        if self.zero is not None:
            return self.zero.clip_grad_norm_(max_norm)
        norm = self.grad_norm()
        params = [q for q in self.raw.parameters() if q.grad is not None]
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, torch.tensor(norm), foreach=True)
        return norm

    def step(self) -> None:
        if self.zero is not None:  # this rank's shards, then the parameters all-gathered
            self.zero.step()
        else:
            self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.zero is not None:
            self.zero.zero_grad(set_to_none)
        else:
            self.optimizer.zero_grad(set_to_none=set_to_none)
        if set_to_none:
            for q, held in self.shared:
                if held:
                    q.grad = None

    def no_sync(self):
        return contextlib.nullcontext()

    def memory(self) -> dict:
        from plait.flat import storage_bytes

        if self.zero is not None:  # the schedule's gradients live in .grad until the step's end
            mem = self.zero.memory()
            grads = sum(q.numel() * q.element_size() for q in self.raw.parameters() if q.requires_grad)
            mem["grads"] += grads
            mem["total"] += grads
            return mem

        params = storage_bytes(list(self.raw.parameters()))
        # a gradient per parameter exists during every step (zero_grad frees them between
        # steps, when this is usually asked), so count them as allocated
        grads = sum(q.numel() * q.element_size() for q in self.raw.parameters() if q.requires_grad)
        state = [t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        optim = storage_bytes(state)
        return {"params": params, "grads": grads, "optimizer": optim, "total": params + grads + optim}

    def finish(self) -> None:
        pass

    def checkpoint_state(self) -> tuple[dict, dict]:
        from plait.zero.state import plain_state

        if self.zero is not None:
            return self.zero.checkpoint_state()
        return plain_state(self.raw, self.optimizer, self.names, mesh=self.mesh)

    def checkpoint_loaded(self) -> None:
        if self.zero is not None:
            self.zero.checkpoint_loaded()

    def full_parameters(self) -> dict[str, torch.Tensor]:
        if self.zero is not None:
            return self.zero.full_parameters()
        from plait.placement import gather_full

        return {self.names[id(q)]: gather_full(q, self.mesh) for q in self.raw.parameters()}

    def close(self) -> None:
        if self.zero is not None:
            self.zero.close()

"""Pipeline parallelism (GPipe, Huang et al. 2018; 1F1B, Narayanan et al. 2019) over any model
that can be cut into stages, behind the engine contract.

`cut_pipeline` cuts the model into ``pp x virtual_stages`` stages (plait.pipeline.stage) and keeps
this rank's; `plait.apply.parallelize` then builds the engine of that part (data parallel or
ZeRO 1-3 with the "manual" trigger, and the optimizer), and `PipelineEngine` runs the configured
schedule (plait.pipeline.runtime) over it. What the pipeline itself adds to make the gradients
those of single-process training:

- the gradient exchange over dp starts as soon as a stage's last backward (BW or W) of the step
  has run, while the rest of the schedule goes on (data parallel), or once the schedule is done
  (ZeRO, which reduce-scatters and steps this rank's shards; under ZeRO-3 only the parameter
  shards are kept between steps and the stages' parameters are gathered once per step);
- tied embedding and head on different pipeline ranks: the two copies' gradients are summed
  over pp (ranks between them contribute zeros) so both copies stay equal, and the norm counts
  the first holder's copy;
- expert and tensor parallelism inside the stages need nothing more: the batch is split over
  dp x ep and each gradient averaged over the data axes it is not split on, and gradients partial
  over tp (sequence parallelism) are summed by the same exchange, by their placements;
- the gradient norm sums squares over pp too (the inner engine's `norm_axes`).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import nn

from plait import comm
from plait.engine import objective_scale
from plait.errors import ConfigError
from plait.gradsync import GradBucket, GradSync
from plait.mesh import Mesh
from plait.pipeline.gather import share_over_axis
from plait.pipeline.ir import Schedule
from plait.pipeline.runtime import PipelineRuntime
from plait.pipeline.schedules import make_schedule
from plait.pipeline.simulate import Event
from plait.pipeline.stage import split_model


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


@dataclasses.dataclass
class PipelineCut:
    """A model cut into pipeline stages, and what this pipeline rank holds of it.

    `parts` are every stage module in order (they share the model's submodules); `stages` this
    rank's, by stage index; `raw` their union (`HeldStages`), the part the rest of parallelize
    wraps; `names` the whole model's parameter names by id (a tied tensor under its first name),
    which checkpoints keep whatever stages a rank holds; `holders` the pipeline ranks holding
    each parameter (a tied embedding and head: two)."""

    schedule: Schedule
    rank: int
    parts: list[nn.Module]
    stages: dict[int, nn.Module]
    raw: HeldStages
    names: dict[int, str]
    holders: dict[int, set[int]]
    shared: list[nn.Parameter]  # held by stages on two or more pipeline ranks, in model order


def cut_pipeline(
    model: nn.Module,
    mesh: Mesh,
    schedule: str = "1f1b",
    microbatches: int | None = None,
    virtual_stages: int | None = None,
    split: str = "uniform",
    stages: list[nn.Module] | None = None,
) -> PipelineCut:
    """Cut `model` into pp x virtual_stages stages for `schedule` and keep this rank's.

    `model` is one that cuts itself (plait's GPT), an nn.Sequential (`split_model`), or any module
    whose stages are given in `stages` (they share the model's parameters: each takes the previous
    stage's output, the first the input, and the last `(x, targets)` returns the summed loss)."""
    p = mesh.size("pp")
    sched = make_schedule(schedule, p, microbatches or p, virtual_stages)
    parts = list(stages) if stages is not None else split_model(model, sched.n_stages, split)
    if len(parts) != sched.n_stages:
        raise ConfigError(f"{len(parts)} stage modules given for {sched.n_stages} pipeline stages")
    rank = mesh.rank("pp")
    held = {s: parts[s] for s in sched.stages[rank]}
    holders: dict[int, set[int]] = {}
    for s, stage in enumerate(parts):
        for q in stage.parameters():
            holders.setdefault(id(q), set()).add(sched.rank_of(s))
    return PipelineCut(
        schedule=sched,
        rank=rank,
        parts=parts,
        stages=held,
        raw=HeldStages(list(held.values()), getattr(model, "_plait_tp", None)),
        names={id(q): n for n, q in model.named_parameters()},
        holders=holders,
        shared=[q for q in model.parameters() if len(holders.get(id(q), ())) > 1],
    )


class PipelineEngine:
    """Run a pipeline schedule over this rank's stages (see module doc), with `inner` the engine
    that parallelize built over the rank's part (`cut.raw`: data parallel or ZeRO with the manual
    trigger, and the optimizer). This class builds no optimizer and knows no ZeRO stage: it
    tells `inner` when a stage's gradients are complete, sums tied copies over pp, and delegates
    the step, the norm, memory and checkpoints to it.

    `recompute`: each stage's forward is recomputed in its backward (activation checkpointing
    per stage, by the runtime).
    """

    def __init__(self, cut: PipelineCut, inner, mesh: Mesh, *, recompute: bool = False):
        self.mesh = mesh
        self.schedule, self.rank, self.stages = cut.schedule, cut.rank, cut.stages
        self.names = cut.names
        self.raw = self.module = cut.raw
        self.inner = inner
        self.optimizer = inner.optimizer
        self.runtime = PipelineRuntime(self.stages, self.schedule, mesh, recompute=recompute)
        self.runtime.on_stage_done = self._stage_done

        # Parameters shared by stages on different pipeline ranks (a GPT's tied embedding and
        # head): each holder keeps a copy; their gradients are summed over pp (ranks holding none
        # contribute zeros) so the copies stay equal, and the norm counts the first holder's.
        holders = cut.holders
        self.shared = [(q, self.rank in holders[id(q)]) for q in cut.shared]
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
        # a tied copy's gradient is counted in the norm by its first holder only
        first = {id(q): min(holders[id(q)]) for q, _ in self.shared}
        inner.skip_in_norm({self.names[id(q)] for q, h in self.shared if h and self.rank != first[id(q)]})
        # which held stages use each parameter: a shared one is reduced after all of them
        self._users: dict[int, set[int]] = {}
        for s, stage in self.stages.items():
            for q in stage.parameters():
                self._users.setdefault(id(q), set()).add(s)
        self._params = {id(q): q for q in self.raw.parameters()}
        # every stage's parameter by the whole model's name, sent by its first holder
        self._owners = [(n, min(holders[i])) for i, n in cut.names.items() if i in holders]
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
        self.inner.gather_params()  # ZeRO-3: the stages' parameters, gathered once for the step
        with autocast() if autocast is not None else contextlib.nullcontext(), objective_scale(loss_scale):
            loss = self.runtime.step(inputs, targets, loss_scale, record=record)
        self._sync_grads()
        return loss

    def set_lr_scale(self, scale: float) -> None:
        """The coming step's learning rate over the peak, for error-feedback residuals."""
        self.inner.set_lr_scale(scale)

    def residual_buffers(self) -> dict[str, torch.Tensor] | None:
        """Error-feedback residuals of the gradient exchange over dp (a compressor), or None."""
        return self.inner.residual_buffers()

    def record_next_step(self) -> None:
        """Time the next step's actions (every pipeline rank starts it together)."""
        comm.barrier(self.mesh, "pp")
        self._record = True

    def _stage_done(self, stage: int) -> None:
        self._finished.add(stage)
        if not self.inner.overlaps_backward:  # ZeRO reduces at the end of the schedule
            return
        ready = [
            q
            for i, q in self._params.items()
            if i not in self._reduced and self._users[i] <= self._finished and q.grad is not None
        ]
        self._reduced.update(id(q) for q in ready)
        self.inner.grads_ready(ready)  # their buckets start reducing while the schedule goes on

    def _sync_grads(self) -> None:
        # data parallel has reduced over dp during the schedule: wait for it, then sum the tied
        # copies over pp; ZeRO takes the tied sums into its reduce-scatter at the end
        if self.inner.overlaps_backward:
            self.inner.finish_grads()
        if self._tied is not None:  # one all-reduce over pp for every shared parameter
            self._tied.grads_ready([q for q, held in self.shared if held and q.grad is not None])
            self._tied.finish()
        if not self.inner.overlaps_backward:  # reduce-scatter over dp; sums partial (SP) grads
            self.inner.finish_grads()

    # --- evaluation ---------------------------------------------------------------------------

    @torch.no_grad()
    def eval_loss_sum(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward only through the stages: the summed token loss of the rows `x`, `y`, as the
        schedule's micro-batches when the rows split into them (else as one)."""
        m = self.schedule.m if x.shape[0] % self.schedule.m == 0 else 1
        was = self.raw.training
        self.raw.eval()
        gathered = self.inner.gather_params()
        try:
            return self.runtime.forward_only(list(x.chunk(m)), list(y.chunk(m)))
        finally:
            self.raw.train(was)
            if gathered:  # ZeRO-3: back to shards only
                self.inner.release_params()

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

    # --- the engine interface: the inner engine's ------------------------------------------------

    def grad_norm(self) -> float:
        """The global gradient norm over pp and tp (tied and tp-replicated tensors once)."""
        return self.inner.grad_norm()

    def clip_grad_norm_(self, max_norm: float) -> float:
        return self.inner.clip_grad_norm_(max_norm)

    def step(self) -> None:
        self.inner.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none)
        if set_to_none:
            for q, held in self.shared:
                if held:
                    q.grad = None

    def no_sync(self):
        return contextlib.nullcontext()

    def memory(self) -> dict:
        mem = dict(self.inner.memory())
        if not self.inner.overlaps_backward:  # ZeRO: the schedule's gradients live in .grad
            grads = sum(q.numel() * q.element_size() for q in self.raw.parameters() if q.requires_grad)
            mem["grads"] += grads
            mem["total"] += grads
        return mem

    def finish(self) -> None:
        pass

    def checkpoint_state(self) -> tuple[dict, dict]:
        return self.inner.checkpoint_state()

    def checkpoint_loaded(self) -> None:
        self.inner.checkpoint_loaded()

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter of every stage, whole, on the CPU, by the model's names, on every rank:
        this rank's stages gathered by the inner engine, the others' from their pipeline ranks (a
        collective over every axis)."""
        return share_over_axis(self.inner.full_parameters(), self._owners, self.mesh, "pp")

    def close(self) -> None:
        self.inner.close()

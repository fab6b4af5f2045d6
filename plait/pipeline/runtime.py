"""The one executor of pipeline schedules: runs a rank's action list on its real stages.

Each compute action works on one (micro-batch, stage) pair:

- F: the stage's input (token ids on stage 0, else a received or locally handed-over tensor
  made a leaf that requires grad) goes through the stage; the last stage returns the summed
  token loss, which is multiplied by ``loss_scale`` (1 / tokens per dp rank per step) so the
  gradients summed over micro-batches are those of the full batch's mean loss.
- B / BW: backward from the stage output with the received output gradient (the scaled loss on
  the last stage). B queues the linear layers' weight-gradient products (plait.pipeline.wgrad),
  BW computes them at once. The input gradient is then sent (or handed to the previous stage
  on this rank) and the stage's saved activations are released.
- W: runs the weight-gradient products B queued for the pair.

Consecutive communication actions are posted as one batch (`comm.batch_isend_irecv`); the
runtime waits for a received tensor only when a compute action needs it, and for sends when
they complete (checked as it goes) or at the end of the step. After a stage's last backward a
callback fires (`on_stage_done`) so data parallelism can reduce that stage's gradients while
the schedule goes on.

The message shapes are discovered once, by a chain pass of one micro-batch through the stages
in order (`infer_shapes`), so any stage modules work, not only a GPT's.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from plait import comm
from plait.errors import PipelineError
from plait.mesh import Mesh
from plait.pipeline.check import check_schedule
from plait.pipeline.ir import Action, Schedule
from plait.pipeline.simulate import Event
from plait.pipeline.wgrad import DeferredLinears, WeightGradStore


class PipelineRuntime:
    """Executes `schedule` for this rank's stages over the mesh's `axis` (default "pp").

    Args:
        stages: {global stage index: module} for the stages this rank holds (those of
            ``schedule.stages[rank]``). Each is called as ``stage(x)``, and the last one as
            ``stage(x, targets)`` returning the summed loss of the micro-batch.
        schedule: a checked Schedule (checked again here).
        recompute: stage indices whose forward is recomputed in backward (activation
            checkpointing per stage; Chen et al. 2016), or True for every stage.
    """

    def __init__(
        self,
        stages: dict[int, nn.Module],
        schedule: Schedule,
        mesh: Mesh,
        axis: str = "pp",
        recompute: bool | set[int] = False,
    ):
        check_schedule(schedule)
        if mesh.size(axis) != schedule.p:
            raise PipelineError(
                f"the schedule is for {schedule.p} pipeline ranks but the mesh's '{axis}' axis has "
                f"{mesh.size(axis)}"
            )
        self.rank = mesh.rank(axis)
        held = set(schedule.stages[self.rank])
        if set(stages) != held:
            raise PipelineError(
                f"pipeline rank {self.rank} holds stages {sorted(held)} in the schedule but was given "
                f"{sorted(stages)}"
            )
        self.stages, self.schedule, self.mesh, self.axis = stages, schedule, mesh, axis
        self.last_stage = schedule.n_stages - 1
        self.recompute = set(stages) if recompute is True else set(recompute or ())
        self.store = WeightGradStore()
        # only schedules with W actions route linear layers through the splittable Function
        self._mode = DeferredLinears(self.store) if schedule.split_backward else contextlib.nullcontext()
        self.on_stage_done: Callable[[int], None] | None = None
        self.shapes: dict[int, tuple[torch.Size, torch.dtype]] | None = None  # output of stage s
        self.events: list[Event] = []
        comm.barrier(mesh, axis)  # NCCL: every rank of the group joins its first p2p together

    # --- shapes -------------------------------------------------------------------------------

    @torch.no_grad()
    def infer_shapes(self, example: torch.Tensor, targets: torch.Tensor | None = None) -> None:
        """Run one micro-batch through every stage in order, passing the outputs along, to learn
        each stage's output shape and dtype. Random streams are restored afterwards."""
        devices = [self.mesh.device] if self.mesh.device.type == "cuda" else []
        shapes = {}
        with torch.random.fork_rng(devices=devices):
            x = None
            for s in range(self.schedule.n_stages):
                owner = self.schedule.rank_of(s)
                prev_owner = self.schedule.rank_of(s - 1) if s else None
                if owner != self.rank:
                    if prev_owner == self.rank:  # we produced its input
                        self._send_header(x, owner)
                        comm.send(x.contiguous(), self.mesh, self.axis, owner)
                    x = None
                    continue
                if s == 0:
                    x = example
                elif prev_owner != self.rank:
                    x = self._recv_header_and_tensor(prev_owner)
                    shapes[s - 1] = (x.shape, x.dtype)
                if s < self.last_stage:
                    x = self.stages[s](x)
                    shapes[s] = (x.shape, x.dtype)
                else:
                    self.stages[s](x, targets) if targets is not None else self.stages[s](x)
        self.shapes = shapes

    _DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64)

    def _send_header(self, x: torch.Tensor, peer: int) -> None:
        if x.dim() > 6:
            raise PipelineError(f"stage outputs of more than 6 dims are not supported, got {tuple(x.shape)}")
        header = torch.zeros(8, dtype=torch.int64, device=self.mesh.device)
        header[0], header[1] = x.dim(), self._DTYPES.index(x.dtype)
        header[2 : 2 + x.dim()] = torch.tensor(x.shape)
        comm.send(header, self.mesh, self.axis, peer)

    def _recv_header_and_tensor(self, peer: int) -> torch.Tensor:
        header = comm.recv(
            torch.zeros(8, dtype=torch.int64, device=self.mesh.device), self.mesh, self.axis, peer
        )
        ndim, dtype = int(header[0]), self._DTYPES[int(header[1])]
        shape = torch.Size(int(d) for d in header[2 : 2 + ndim])
        return comm.recv(torch.empty(shape, dtype=dtype, device=self.mesh.device), self.mesh, self.axis, peer)

    def _input_shape(self, stage: int) -> tuple[torch.Size, torch.dtype]:
        """Shape and dtype of the tensor stage `stage` receives (the output of stage-1)."""
        if stage - 1 not in self.shapes:
            raise PipelineError(
                f"the shape of stage {stage - 1}'s output is unknown on pipeline rank {self.rank}; "
                "call infer_shapes first"
            )
        return self.shapes[stage - 1]

    # --- one step -----------------------------------------------------------------------------

    def step(
        self,
        inputs: list[torch.Tensor],
        targets: list[torch.Tensor],
        loss_scale: float = 1.0,
        record: bool = False,
    ) -> torch.Tensor:
        """Run the whole schedule on `m` micro-batches; returns this rank's summed (unscaled)
        loss over the micro-batches as a float64 scalar (zero unless it holds the last stage).
        With `record`, `self.events` holds the compute actions' start and end times (seconds
        from the step's start; CUDA is synchronised around each action)."""
        sched = self.schedule
        if len(inputs) != sched.m or len(targets) != sched.m:
            raise PipelineError(f"the schedule runs {sched.m} micro-batches per step, got {len(inputs)}")
        if self.shapes is None:
            self.infer_shapes(inputs[0], targets[0])
        self._inputs, self._targets, self._scale = inputs, targets, loss_scale
        self._x: dict[tuple[int, int], torch.Tensor] = {}  # stage inputs (leaves)
        self._y: dict[tuple[int, int], torch.Tensor] = {}  # stage outputs / scaled losses
        self._grad_in: dict[tuple[int, int], torch.Tensor] = {}  # output grads handed over locally
        self._sent_grads: dict[tuple[int, int], torch.Tensor] = {}  # input grads waiting for SEND_B
        self._pending: dict[tuple[str, int, int], comm.Handle] = {}  # receives in flight
        self._sends: list[comm.Handle] = []
        self._left = {s: sched.m * (2 if sched.split_backward else 1) for s in self.stages}
        self._loss = torch.zeros((), dtype=torch.float64, device=self.mesh.device)
        self.events = []
        cuda = self.mesh.device.type == "cuda"
        t0 = time.perf_counter()
        actions = sched.actions[self.rank]
        i = 0
        while i < len(actions):
            if actions[i].is_comm:
                j = i
                while j < len(actions) and actions[j].is_comm:
                    j += 1
                self._post(actions[i:j])
                i = j
                continue
            a = actions[i]
            if record and cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            self._compute(a)
            if record:
                if cuda:
                    torch.cuda.synchronize()
                self.events.append(
                    Event(self.rank, a.kind, a.mb, a.stage, start - t0, time.perf_counter() - t0)
                )
            self._sends = [h for h in self._sends if not h.is_completed()]
            i += 1
        for h in self._sends:
            h.wait()
        if self._pending or self._x or self.store:
            raise PipelineError(
                f"pipeline rank {self.rank}: the step ended with work left (receives "
                f"{sorted(self._pending)}, activations {sorted(self._x)}, weight gradients "
                f"{len(self.store)}); the schedule is incomplete"
            )
        self._sends = []
        return self._loss

    def _post(self, batch: list[Action]) -> None:
        ops, keys = [], []
        for a in batch:
            if a.kind == "SEND_F":
                ops.append(("send", self._y[(a.mb, a.stage)].detach().contiguous(), a.peer))
            elif a.kind == "SEND_B":
                ops.append(("send", self._grad_out_of_input(a.mb, a.stage), a.peer))
            else:
                shape, dtype = self._input_shape(a.stage if a.kind == "RECV_F" else a.stage + 1)
                ops.append(("recv", torch.empty(shape, dtype=dtype, device=self.mesh.device), a.peer))
            keys.append((a.kind, a.mb, a.stage))
        for (kind, *_), key, handle in zip(
            ops, keys, comm.batch_isend_irecv(ops, self.mesh, self.axis), strict=True
        ):
            if kind == "send":
                self._sends.append(handle)
            else:
                self._pending[key] = handle

    def _grad_out_of_input(self, mb: int, stage: int) -> torch.Tensor:
        return self._sent_grads.pop((mb, stage)).contiguous()

    def _received(self, kind: str, mb: int, stage: int) -> torch.Tensor:
        handle = self._pending.pop((kind, mb, stage), None)
        if handle is None:
            raise PipelineError(
                f"pipeline rank {self.rank}: {kind[5:]}{mb}@{stage} needs a tensor that was never received"
            )
        return handle.wait()

    def _compute(self, a: Action) -> None:
        key = (a.mb, a.stage)
        if a.kind == "F":
            if a.stage == 0:
                x = self._inputs[a.mb]
            elif self.schedule.rank_of(a.stage - 1) == self.rank:
                x = self._y[(a.mb, a.stage - 1)].detach().requires_grad_()
            else:
                x = self._received("RECV_F", a.mb, a.stage).requires_grad_()
            if a.stage == self.last_stage:
                loss = self._call(a.stage, x, self._targets[a.mb])
                self._loss += loss.detach().double()
                y = loss * self._scale
            else:
                y = self._call(a.stage, x)
            self._x[key], self._y[key] = x, y
        elif a.kind in ("B", "BW"):
            x, y = self._x.pop(key), self._y.pop(key)
            if a.stage == self.last_stage:
                grad = None
            elif self.schedule.rank_of(a.stage + 1) == self.rank:
                grad = self._grad_in.pop(key)
            else:
                grad = self._received("RECV_B", a.mb, a.stage)
            with self.store.collect(key) if a.kind == "B" else contextlib.nullcontext():
                torch.autograd.backward(y, grad)
            if a.stage > 0:
                if self.schedule.rank_of(a.stage - 1) == self.rank:
                    self._grad_in[(a.mb, a.stage - 1)] = x.grad
                else:
                    self._sent_grads[key] = x.grad
            self._done(a.stage)
        elif a.kind == "W":
            self.store.flush(key)
            self._done(a.stage)
        else:
            raise PipelineError(f"not a compute action: {a}")

    def _call(self, stage: int, *args) -> torch.Tensor:
        if stage in self.recompute:  # keep only the stage input; recompute the rest in backward
            return checkpoint(self._forward, stage, *args, use_reentrant=False)
        return self._forward(stage, *args)

    def _forward(self, stage: int, *args) -> torch.Tensor:
        # the mode is entered here, inside what checkpoint replays, so a recomputed forward
        # builds the same splittable linear nodes as the original one
        with self._mode:
            return self.stages[stage](*args)

    def _done(self, stage: int) -> None:
        self._left[stage] -= 1
        if self._left[stage] == 0 and self.on_stage_done is not None:
            self.on_stage_done(stage)

    # --- evaluation ---------------------------------------------------------------------------

    @torch.no_grad()
    def forward_only(self, inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> torch.Tensor:
        """The summed loss of every micro-batch, forward only (stage by stage, in stage order);
        zero on ranks that do not hold the last stage."""
        if self.shapes is None:
            self.infer_shapes(inputs[0], targets[0])
        total = torch.zeros((), dtype=torch.float64, device=self.mesh.device)
        outs: dict[int, torch.Tensor] = {}
        sends = []
        for s in range(self.schedule.n_stages):
            owner = self.schedule.rank_of(s)
            if owner != self.rank:
                continue
            prev = self.schedule.rank_of(s - 1) if s else None
            nxt = self.schedule.rank_of(s + 1) if s < self.last_stage else None
            for mb in range(len(inputs)):
                if s == 0:
                    x = inputs[mb]
                elif prev == self.rank:
                    x = outs.pop(mb)
                else:
                    shape, dtype = self._input_shape(s)
                    x = comm.recv(
                        torch.empty(shape, dtype=dtype, device=self.mesh.device), self.mesh, self.axis, prev
                    )
                if s == self.last_stage:
                    total += self.stages[s](x, targets[mb]).double()
                    continue
                y = self.stages[s](x)
                if nxt == self.rank:
                    outs[mb] = y
                else:
                    sends.append(comm.isend(y.contiguous(), self.mesh, self.axis, nxt))
        for h in sends:
            h.wait()
        return total

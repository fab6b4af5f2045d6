"""`ParallelModel`: what `plait.parallelize` (plait.api) returns: the user's model wrapped for its
layout, its optimizer, and one training step as `forward_backward(batch)` then `step()`;
checkpoints through plait.train.checkpoint (layout-free)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist

from plait import comm
from plait.data.batch import map_tensors, split_batch
from plait.errors import ConfigError
from plait.train.checkpoint import MANIFEST, choose_checkpoint, load_checkpoint, save_checkpoint


class _NoState:
    """Stands for the scheduler or sampler a checkpoint holds when the loop has none."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


PP_LOSS = (
    "under a pipeline (pp > 1) a batch is (inputs, targets), and loss_fn(model, batch) runs on the last "
    "stage once per micro-batch, where model(inputs) returns the last stage's output"
)


def _scalar(loss) -> torch.Tensor:
    if not (torch.is_tensor(loss) and loss.dim() == 0):
        shape = tuple(loss.shape) if torch.is_tensor(loss) else type(loss).__name__
        raise ConfigError(
            f"forward_backward needs a scalar loss, got {shape}: pass loss_fn(model, batch) -> the "
            "mean loss over the batch's rows to parallelize, or make the model return it"
        )
    return loss


class PipelineOutput:
    """What `loss_fn(model, batch)` is given as `model` on a pipeline's last stage: called once on
    the micro-batch's inputs, it returns the last stage's output (the stages before it ran on their
    own ranks), so one loss_fn serves one process and every layout. Anything else a loss could do
    with the whole model (call it on other inputs, twice, or read its attributes) is refused."""

    def __init__(self, output: torch.Tensor, inputs):
        self._output, self._inputs, self._called = output, inputs, False

    def __call__(self, *args, **kwargs):
        x = args[0] if len(args) == 1 and not kwargs else None
        same = x is self._inputs or (
            torch.is_tensor(x) and torch.is_tensor(self._inputs) and x.shape == self._inputs.shape
            and bool(torch.equal(x, self._inputs))
        )  # fmt: skip
        if self._called or not same:
            raise ConfigError(
                f"parallelize: {PP_LOSS}: call model once, on the batch's inputs (model(batch[0])), "
                "not on other arguments or twice"
            )
        self._called = True
        return self._output

    def __getattr__(self, name: str):
        raise ConfigError(
            f"parallelize: {PP_LOSS}; that model has no attribute {name!r} (the layers are split "
            "over the pipeline ranks)"
        )


def stage_loss(loss_fn):
    """The last pipeline stage's `(output, (inputs, targets)) -> loss` from the user's
    `loss_fn(model, batch)` (the micro-batch's mean loss)."""

    def loss(output: torch.Tensor, batch) -> torch.Tensor:
        return _scalar(loss_fn(PipelineOutput(output, batch[0]), batch))

    return loss


class ParallelModel:
    """What `parallelize` returns: the model wrapped for its layout, its optimizer, and one
    training step as `forward_backward(batch)` then `step()`.

    Attributes:
        model: the module to call (wrapped: data parallel's `DataParallel`, or the user's module
            with ZeRO-3's gather hooks; under ZeRO-3 its parameters hold nothing between
            forwards, so read them with `full_parameters()`).
        unwrapped: the user's module (tensor-parallel layers replaced where a plan split them).
        optimizer: the torch optimizer the factory built (over this rank's shards from stage 1).
        scheduler: the learning-rate scheduler built by `scheduler`, or None.
        mesh: the plait Mesh (named axes, ranks, the communication ledger).
        engine: the plait engine underneath (plait.engine's contract).
        rank, world: this process's global rank and the number of processes.
        dp_rank, dp: this rank's coordinate over the axes the batch is split on (dp, or dp x ep
            under expert parallelism) and their size (tp peers, pipeline stages and cp ranks see
            the same rows).
        cp_rank, cp: this rank's coordinate on the context-parallel axis and its size: under
            cp > 1 `forward_backward` keeps this rank's part of every sequence (`sequence_part`).
        is_main: global rank 0 (print and write files there).
        device: the device this rank computes on.
        steps: optimizer steps taken (restored by `load`).
    """

    def __init__(self, engine, mesh, raw, *, loss_fn, grad_clip, scheduler, owns):
        self.engine = engine
        self.mesh = mesh
        self.model = engine.module
        self.unwrapped = raw
        self.optimizer = engine.optimizer
        self.scheduler = scheduler(self.optimizer) if scheduler is not None else None
        self.loss_fn = loss_fn
        self.grad_clip = grad_clip
        self.rank, self.world = mesh.global_rank, mesh.world_size
        self._data_axes = ("dp", "ep") if mesh.size("ep") > 1 else ("dp",)
        axis = mesh.axis_over(self._data_axes)
        self.dp_rank, self.dp = mesh.rank(axis), mesh.size(axis)
        self.cp_rank, self.cp = mesh.rank("cp"), mesh.size("cp")
        self.is_main = mesh.is_rank0
        self.steps = 0
        self.device = mesh.device
        self._owns_group, self._owns_mesh = owns

    # --- one step ---------------------------------------------------------------------------

    def shard(self, batch):
        """This rank's rows of a global batch (every rank passes the same one): dp rank r takes
        rows [r * B / dp, (r + 1) * B / dp). B must be a multiple of dp."""
        return split_batch(batch, self.dp, self.dp_rank)

    def _loss(self, batch) -> torch.Tensor:
        if self.loss_fn is not None:
            loss = self.loss_fn(self.model, batch)
        elif isinstance(batch, Mapping):
            loss = self.model(**batch)
        elif isinstance(batch, (tuple, list)):
            loss = self.model(*batch)
        else:
            loss = self.model(batch)
        return _scalar(loss)

    def forward_backward(self, batch, *, micro_batches: int = 1, average: bool = True) -> float:
        """Forward and backward of this rank's rows; gradients synchronised over dp.

        Args:
            batch: this rank's part of the global batch (a tensor, or a tuple, list or dict of
                tensors sharing their first dimension; moved to the rank's device, `device`);
                every dp rank must hold the same number
                of rows (use `shard` to cut a global batch). The loss must be the *mean* over the
                rows it is given: the engine averages gradients over dp, so the gradient is then
                exactly one process's on the global batch.
            micro_batches: cut the rows into this many equal micro-batches and accumulate their
                gradients (communication after the last one only, where the layout allows),
                each weighted by its share of the rows, so the gradient is unchanged.
            average: return the loss averaged over dp (one scalar all-reduce); False returns
                this rank's own mean loss without communicating (under cp, over its part of each
                sequence; under a pipeline, the dp rank's, reduced over its stages and cp).

        Under context parallelism (cp > 1) pass whole sequences: each cp rank keeps its tokens of
        every tensor of two or more dimensions (`sequence_part`), the model attends through
        `plait.context_parallel.attention` and takes `positions` (docs/context-parallel.md), and
        the loss must be the mean over the tokens it is given (a token-level mean, as cross
        entropy's): each rank's is weighted by its share of the sequence.

        Call `step()` before the next `forward_backward`: the gradients of one step are
        synchronised once, so accumulate with `micro_batches`, not with repeated calls.

        Returns the mean loss over the global batch (with average=True) as a float.
        """
        batch = map_tensors(batch, lambda t: t.to(self.device, non_blocking=True))
        split, batch = self.sequence_part(batch)
        if self.mesh.size("pp") > 1:
            total = self._pipeline_step(batch, split)  # the dp rank's mean (summed over cp)
            return comm.all_reduce_scalar(total, self.mesh, self._data_axes) / self.dp if average else total
        parts = (
            [batch]
            if micro_batches == 1
            else [split_batch(batch, micro_batches, i) for i in range(micro_batches)]
        )
        # Under cp each rank's mean is over its tokens: weighted by its share of each sequence (and
        # by cp, as the gradient is averaged over dp x cp), the sum over cp is the dp rank's mean.
        weight = 1.0 if split is None else self.cp * self.engine.share(split)
        total = 0.0
        with self._attending(split):
            for i, part in enumerate(parts):
                last = i == len(parts) - 1
                with contextlib.nullcontext() if last else self.engine.no_sync():
                    loss = self._loss(part)
                    (loss * (weight / len(parts))).backward()
                total += float(loss.detach()) / len(parts)
        if not average:
            return total
        axes = self._data_axes + (("cp",) if split is not None else ())
        return comm.all_reduce_scalar(total * weight, self.mesh, axes) / (self.dp * self.cp)

    def sequence_part(self, batch):
        """`(split, this rank's part of batch)` under context parallelism, `(None, batch)` without:
        every tensor of two or more dimensions holds the sequence on dim 1 (rows, tokens, ...),
        all of one length T, and keeps this cp rank's tokens of it (head-tail chunks for the ring,
        contiguous for Ulysses: `plait.context_parallel.SequenceSplit`); tensors of one dimension
        (per-row values) are kept whole."""
        if self.cp == 1:
            return None, batch
        lengths: set[int] = set()
        map_tensors(batch, lambda t: lengths.add(t.shape[1]) if t.dim() >= 2 else None)
        if len(lengths) != 1:
            got = f"lengths {sorted(lengths)} on dim 1" if lengths else "no tensor of two or more dimensions"
            raise ConfigError(
                f"parallelize: under cp = {self.cp} every batch tensor of two or more dimensions holds "
                f"the sequence on dim 1 (rows, tokens, ...), all of one length; got {got}: pass "
                "(rows, tokens) tensors such as input ids, targets and attention masks"
            )
        split = self.engine.split(lengths.pop())
        return split, map_tensors(batch, lambda t: self.engine.take(t, split) if t.dim() >= 2 else t)

    def _attending(self, split):
        return contextlib.nullcontext() if split is None else self.engine.attending(split)

    def _pipeline_step(self, batch, split) -> float:
        """One step of the pipeline schedule over `(inputs, targets)`, cut into the schedule's
        micro-batches. With a loss_fn, the last stage computes each micro-batch's mean loss
        (`stage_loss`) and the step's is their mean (equal cuts of the rows); without one, the
        model's last stage computes the summed loss, divided by the targets' elements (its
        tokens). Under cp (`split`: this rank's part of the sequence) the inner engine runs on
        this rank's tokens, each rank's part weighted as in `forward_backward`. Returns the dp
        rank's mean."""
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2 and all(map(torch.is_tensor, batch))):
            raise ConfigError(f"parallelize: {PP_LOSS}; got a {type(batch).__name__}, not two tensors")
        x, y = batch
        engine, axes = (self.engine, ("pp",)) if split is None else (self.engine.inner, ("pp", "cp"))
        m = engine.schedule.m
        if self.loss_fn is None:  # summed losses: the tokens of the dp rank's whole sequences
            tokens = y.numel() if split is None else y.numel() * split.T // y.shape[1]
            with self._attending(split):
                loss_sum = engine.forward_backward(list(zip(x.chunk(m), y.chunk(m))), self.cp / tokens)
            return comm.all_reduce_scalar(float(loss_sum), self.mesh, axes) / tokens
        if x.shape[0] % m or y.shape[0] != x.shape[0]:
            raise ConfigError(
                f"parallelize: under a pipeline with a loss_fn, this rank's {x.shape[0]} rows of inputs "
                f"(and {y.shape[0]} of targets) must be cut into {m} equal micro-batches: give a "
                f"multiple of {m} rows per dp rank, or set microbatches"
            )
        share = 1.0 if split is None else self.engine.share(split)
        parts = [(xi, (xi, yi)) for xi, yi in zip(x.chunk(m), y.chunk(m), strict=True)]
        with self._attending(split):
            loss_sum = engine.forward_backward(parts, self.cp * share / m)
        return comm.all_reduce_scalar(float(loss_sum) * share, self.mesh, axes) / m

    def step(self) -> float:
        """Clip the gradients' global norm to `grad_clip` (when set), take the optimizer step,
        step the scheduler, and zero the gradients. Returns the global gradient norm before
        clipping (computed without clipping too: one small all-reduce)."""
        norm = self.engine.clip_grad_norm_(self.grad_clip) if self.grad_clip else self.engine.grad_norm()
        self.engine.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.engine.zero_grad()
        self.steps += 1
        return norm

    def grad_norm(self) -> float:
        """The global gradient norm over every rank's shards (a collective: call on every rank)."""
        return self.engine.grad_norm()

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter, whole, on the CPU, by the user's names, on every rank under every
        layout (a pipeline's other stages included; a collective)."""
        return self.engine.full_parameters()

    # --- checkpoints --------------------------------------------------------------------------

    def save(self, directory: str | Path, keep: int = 2) -> Path:
        """Save model, optimizer, scheduler and step as `directory/step_N` (DCP, every rank writing
        its own shards; `latest` names it) and keep the `keep` newest; returns its path. Call on
        every rank. The checkpoint loads at any number of ranks and any ZeRO stage."""
        sched = self.scheduler if self.scheduler is not None else _NoState()
        return save_checkpoint(directory, self.steps, self.mesh, self.engine, sched, _NoState(), keep=keep)

    def load(self, path: str | Path) -> int:
        """Restore a checkpoint written by `save` (a `step_N` directory, or the directory given
        to `save`: its `latest`), resharded to this layout; returns and restores `steps`."""
        path = Path(path)
        if not (path / MANIFEST).exists():
            path, _ = choose_checkpoint(path)
        sched = self.scheduler if self.scheduler is not None else _NoState()
        self.steps = load_checkpoint(path, self.mesh, self.engine, sched, _NoState())
        return self.steps

    def close(self) -> None:
        """Remove the engine's hooks; stop the mesh's watchdog and destroy the process group if
        `parallelize` created them (a Mesh passed in stays open)."""
        self.engine.close()
        if self._owns_mesh:
            self.mesh.close()
        if self._owns_group and dist.is_initialized():
            # Every rank leaves together (gloo torn down under a live peer can abort it), and no
            # reference keeps a group, so destroying it joins its threads now, not at exit.
            self.mesh.release_groups()
            if self.world > 1:
                dist.barrier()
            dist.destroy_process_group()

    def __enter__(self) -> ParallelModel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

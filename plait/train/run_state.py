"""What one run's step loop works with: the `Run` record (built once by `plait.train.loop._setup`,
read by the loop and by `plait.train.report`) and the mesh axes the batch is split over."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from plait.data import DistributedBatchSampler
from plait.engine import Engine
from plait.mesh import Mesh
from plait.train.checkpointer import Checkpointer
from plait.train.config import Config
from plait.train.metrics import MetricsWriter
from plait.train.preempt import StopRequest


def data_axes(mesh: Mesh) -> tuple[str, ...]:
    """The axes the batch is split over: dp, and ep under expert parallelism (each ep rank
    routes its own rows' tokens to the experts of every ep rank)."""
    return ("dp", "ep") if mesh.size("ep") > 1 else ("dp",)


def data_axis(mesh: Mesh) -> str:
    """`data_axes` as one (combined) mesh axis: its size and this rank's index in it split the
    rows of every batch."""
    return mesh.axis_over(data_axes(mesh))


@dataclasses.dataclass
class Run:
    """What the step loop works with, built once by `plait.train.loop._setup`."""

    cfg: Config
    mesh: Mesh
    run_dir: Path
    corpus: object
    sampler: DistributedBatchSampler
    val: list
    raw: torch.nn.Module  # plait's GPT, or a python: source's model
    engine: Engine
    scheduler: torch.optim.lr_scheduler.LRScheduler
    metrics: MetricsWriter
    start: int  # the last step already taken (0, or the checkpoint's)
    last: int  # the last step this invocation takes (train.stop_at or train.steps)
    n_params: int
    tokens_per_step: int
    local_tokens: int  # tokens per dp rank per step: the loss is divided by it
    flops_per_token: float
    peak_flops: float
    timeline_step: int  # the step whose action timeline is recorded (engines that record one)
    stop: StopRequest  # SIGTERM's request to stop, read at every step boundary
    val_tokens_bytes: tuple[int, int] = (1, 1)  # tokens the held-out loss averages over, their bytes
    skipped_in_a_row: int = 0  # consecutive steps skipped for a non-finite loss or gradient norm
    skipped: int = 0  # all steps skipped so far in this invocation
    checkpointer: Checkpointer | None = None  # how checkpoints are saved (train.checkpoint_async)

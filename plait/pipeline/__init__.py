"""Pipeline parallelism: schedules as data (GPipe, 1F1B, interleaved 1F1B, Zero Bubble),
a checker, a simulator, a timeline renderer, model splitting and the runtime that executes a
schedule over the mesh's pp axis."""

from plait.pipeline.ir import COMM_KINDS, COMPUTE_KINDS, Action, Schedule

__all__ = ["COMM_KINDS", "COMPUTE_KINDS", "Action", "Schedule"]

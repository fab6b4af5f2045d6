"""The pipeline schedule as data: for each pipeline rank, the ordered list of actions it runs.

A model is cut into ``n_stages = p * v`` consecutive stages (global indices 0..n_stages-1);
pipeline rank r holds the stages ``Schedule.stages[r]`` (its "chunks", in order). One step
pushes micro-batches 0..m-1 through every stage and back.

Actions (``Action.kind``):

- ``F``  forward of micro-batch ``mb`` through ``stage``;
- ``B``  the input gradient of that forward (activation gradients only; Qi et al. 2023, §2);
- ``W``  the weight gradient of that forward (after its ``B``);
- ``BW`` both at once: the ordinary backward, for schedules that do not split it;
- ``SEND_F`` / ``RECV_F``: the output activation of ``stage`` sent to the rank that holds
  ``stage + 1`` / the input activation of ``stage`` received from the rank that holds
  ``stage - 1``;
- ``SEND_B`` / ``RECV_B``: the input gradient of ``stage`` sent to the rank that holds
  ``stage - 1`` / the output gradient of ``stage`` received from the rank that holds
  ``stage + 1``.

``peer`` is the pipeline rank on the other side of a communication action (None for compute).
Neighbouring stages held by one rank (ZB-V's turn) pass tensors locally and have no
communication actions.

Communication semantics, shared by the checker and the runtime: a run of consecutive
communication actions in one rank's list is one *batch*, posted together (like
``torch.distributed.batch_isend_irecv``). Between any ordered pair of ranks, the k-th send is
matched with the k-th receive. The checker's model, which is at least as strict as what either
backend does: each rank computes in list order, an F/B/BW waiting only for the batch holding
its own RECV; each rank's batches run one after another in list order (as NCCL runs them on one
stream; gloo does not even serialise them), a batch starting once the compute before it is done;
an operation completes once its batch and its match's batch are both running and the operations
before it in its batch to the same peer have completed (NCCL runs those in order), and a batch once
all of its operations have. The runtime posts a batch when it reaches it and waits for a receive just
before the first compute action that needs it, so a schedule the checker accepts cannot deadlock
the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass, field

COMPUTE_KINDS = ("F", "B", "W", "BW")
COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
KINDS = COMPUTE_KINDS + COMM_KINDS


@dataclass(frozen=True)
class Action:
    """One step of one rank's schedule: a compute or a communication action."""

    kind: str
    mb: int
    stage: int
    peer: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown action kind {self.kind!r}; valid: {', '.join(KINDS)}")

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM_KINDS

    def __str__(self) -> str:
        """Compact label, e.g. ``F3@1`` (forward of micro-batch 3 through stage 1),
        ``SEND_F3@1>2`` (its output sent to rank 2)."""
        s = f"{self.kind}{self.mb}@{self.stage}"
        if self.peer is not None:
            s += (">" if self.kind.startswith("SEND") else "<") + str(self.peer)
        return s


@dataclass
class Schedule:
    """A whole pipeline schedule: ``actions[r]`` is pipeline rank r's ordered action list."""

    kind: str
    """Name of the generator that made it ("gpipe", "1f1b", ...), or "custom"."""
    p: int
    """Pipeline ranks."""
    m: int
    """Micro-batches per step."""
    v: int
    """Stages (model chunks) per rank."""
    stages: tuple[tuple[int, ...], ...]
    """stages[r]: the global stage indices rank r holds, in chunk order."""
    actions: list[list[Action]] = field(default_factory=list)

    @property
    def n_stages(self) -> int:
        return self.p * self.v

    def rank_of(self, stage: int) -> int:
        """The pipeline rank that holds global stage `stage`."""
        for r, held in enumerate(self.stages):
            if stage in held:
                return r
        raise ValueError(f"stage {stage} is held by no rank (n_stages = {self.n_stages})")

    @property
    def split_backward(self) -> bool:
        """True when backward is split into B and W actions (Zero Bubble schedules)."""
        return any(a.kind in ("B", "W") for acts in self.actions for a in acts)

    def compute(self, rank: int) -> list[Action]:
        """Rank `rank`'s compute actions (F, B, W, BW) in order."""
        return [a for a in self.actions[rank] if not a.is_comm]

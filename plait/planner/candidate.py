"""The planner's candidate: one way to run a step of a GPT (the record the search enumerates and
the cost model prices): a `plait.layout.Layout` (its `layout`) with the micro-batching and the
schedule the cost model needs. plait has one Layout; this is what the planner adds to it, with the
`[diloco]` keys a DiLoCo candidate runs (`plait.planner.diloco`)."""

from __future__ import annotations

import dataclasses

from plait import layout as plait_layout


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One way to run a step: the mesh, the sharding, the micro-batching, the schedule."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    """Context parallelism: every sequence split over cp ranks (the planner prices ring attention)."""
    zero_stage: int = 0
    hybrid_shard: int = 0
    sequence_parallel: bool = False
    microbatch_size: int = 1
    microbatches: int = 1
    """Pipeline micro-batches with pp > 1; gradient-accumulation micro-batches with pp = 1."""
    schedule: str = "none"
    virtual_stages: int = 1
    recompute: bool = False
    offload: str = "none"
    diloco_inner_steps: int = 0
    """DiLoCo's H (`diloco.inner_steps`): 0 = plain data parallel, every step's gradients reduced
    over all of dp."""
    diloco_replicas: int = 0
    """DiLoCo's M (`diloco.replicas`, resolved: it divides dp); the groups' dp is dp / M."""
    diloco_fragments: int = 1
    """Streaming DiLoCo's F (`diloco.fragments`)."""
    diloco_overlap_steps: int = 0
    """Streaming DiLoCo's tau (`diloco.overlap_steps`)."""
    diloco_compression: str = "none"
    """The outer exchange's dtype (`diloco.compression`): none (fp32), fp16 or bf16."""

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp * self.ep * self.cp

    @property
    def diloco(self) -> bool:
        return self.diloco_inner_steps > 0

    @property
    def group_dp(self) -> int:
        """dp inside one replica group: dp / M under DiLoCo, else dp."""
        return self.dp // self.diloco_replicas if self.diloco else self.dp

    def name(self) -> str:
        parts = [f"dp{self.dp}", f"tp{self.tp}", f"pp{self.pp}"]
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        parts.append(f"z{self.zero_stage}")
        if self.hybrid_shard:
            parts.append(f"hs{self.hybrid_shard}")
        if self.sequence_parallel:
            parts.append("sp")
        parts.append(f"b{self.microbatch_size}x{self.microbatches}")
        if self.pp > 1:
            parts.append(
                self.schedule + (f"-v{self.virtual_stages}" if self.schedule == "interleaved" else "")
            )
        if self.recompute:
            parts.append("rc")
        if self.offload != "none":
            parts.append(f"off-{self.offload}")
        if self.diloco:
            parts.append(f"diloco{self.diloco_replicas}-h{self.diloco_inner_steps}")
            if self.diloco_fragments > 1:
                parts.append(f"f{self.diloco_fragments}")
            if self.diloco_overlap_steps:
                parts.append(f"tau{self.diloco_overlap_steps}")
            if self.diloco_compression != "none":
                parts.append(self.diloco_compression)
        return "-".join(parts)

    @property
    def layout(self) -> plait_layout.Layout:
        """The `plait.layout.Layout` this candidate runs (what the combination table reads)."""
        pp = self.pp > 1
        return plait_layout.Layout(
            pp=self.pp, dp=self.dp, ep=self.ep, cp=self.cp, tp=self.tp, dp_shard=self.hybrid_shard,
            zero_stage=self.zero_stage, sequence_parallel=self.sequence_parallel,
            schedule=self.schedule if pp else "1f1b", microbatches=self.microbatches if pp else 0,
            virtual_stages=self.virtual_stages if pp else 0, activation_checkpointing=self.recompute,
            offload=self.offload,
        )  # fmt: skip

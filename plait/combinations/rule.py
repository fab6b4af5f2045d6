"""A row of the table of combinations (`Rule`) and the features rows name (`FEATURES`)."""

from __future__ import annotations

import dataclasses

FEATURES = {  # name: what turns it on
    "dp": "data parallelism: parallel.dp > 1",
    "tp": "tensor parallelism: parallel.tp > 1",
    "pp": "pipeline parallelism: parallel.pp > 1",
    "ep": "expert parallelism: parallel.ep > 1",
    "sp": "sequence parallelism: parallel.sequence_parallel",
    "cp": "context parallelism: parallel.cp > 1",
    "cp-ring": "ring attention: parallel.cp > 1 with parallel.cp_style = ring",
    "zero": "ZeRO: parallel.zero_stage >= 1",
    "zero3": "ZeRO-3: parallel.zero_stage = 3",
    "hybrid": "hybrid sharding: parallel.hybrid_shard > 0",
    "offload": "optimizer offload: offload.optimizer = cpu or disk",
    "offload-disk": "disk offload: offload.optimizer = disk",
    "delayed": "ZeRO-Offload's delayed parameter update: offload.delayed_update",
    "compression": "gradient compression: comm.compression other than none",
    "ef-compressor": "an error-feedback compressor: comm.compression = onebit, topk or powersgd",
    "1-bit-adam": "1-bit Adam: comm.target = momentum",
    "bf16": "ZeRO's bf16 mixed precision: train.bf16 with parallel.zero_stage >= 1",
    "recompute": "activation checkpointing: train.activation_checkpointing",
    "grad-accum": "gradient accumulation: train.micro_batches > 1",
    "adamw": "optim.name = adamw",
    "lamb/lars": "a layer-wise optimizer: optim.name = lamb or lars",
    "moe": "a mixture-of-experts model: model.experts > 0",
    "dropout": "model.dropout > 0",
    "tokenizer": "a tokenizer other than bytes: data.tokenizer",
    "hf": "a Hugging Face model: model.source = hf:*",
    "python": "a factory's model: model.source = python:*",
    "ps": "the parameter server: ps.servers > 0",
    "auto": "the planner chooses the layout: parallel.plan = auto",
    "api": "the custom-loop API: plait.parallelize",
    "controller": "the single controller: runtime.kind = controller",
    "eval-island": "evaluation on a process mesh of its own: runtime.eval_island",
    "diloco": "DiLoCo's replica groups: diloco.inner_steps > 0",
    "diloco-ef": "an error-feedback compressor on DiLoCo's outer exchange: diloco.compression",
    "diloco-ft": "replica groups that drop out and rejoin: diloco.fault_tolerant",
    "diloco-overlap": "Streaming DiLoCo's overlapped exchange: diloco.overlap_steps > 0",
}
# The features a generated row names: (config key, its name in the message templates, its value
# when off, a value that turns it on for the row's example config).
SWITCHES = {
    "tp": ("parallel.tp", "tp", 1, "2"),
    "pp": ("parallel.pp", "pp", 1, "2"),
    "ep": ("parallel.ep", "ep", 1, "2"),
    "cp": ("parallel.cp", "cp", 1, "2"),
    "zero": ("parallel.zero_stage", "zero_stage", 0, "1"),
    "hybrid": ("parallel.hybrid_shard", "hybrid_shard", 0, "2"),
    "compression": ("comm.compression", "compression", "none", "fp16"),
    "offload": ("offload.optimizer", "offload", "none", "cpu"),
    "moe": ("model.experts", "experts", 0, "4"),
    "dropout": ("model.dropout", "dropout", 0.0, "0.1"),
    "ps": ("ps.servers", "servers", 0, "1"),
    "tokenizer": ("data.tokenizer", "tokenizer", "bytes", "bpe"),
}
LAYOUT_TEST = "tests/test_layout.py::test_refusal_is_raised_from_a_config"


@dataclasses.dataclass(frozen=True)
class Rule:
    """One row: the features `all` together (with one of `any`, when given, and none of `none`)."""

    id: str
    all: frozenset[str]
    supported: bool
    reason: str  # refused: why; supported: what the row covers
    keys: tuple[str, ...]  # the config keys to name (refused) or to set (supported)
    test: str  # the pytest node (or file) that proves the row
    what: str = ""  # refused: the combination as the message names it, over the job's values
    fix: str = ""  # refused: what to change, over the job's values
    any: frozenset[str] = frozenset()
    none: frozenset[str] = frozenset()
    python: str = ""  # supported: how to ask for it from Python
    # refused: config overrides the row refuses (api rows: Layout and Job fields)
    example: tuple[tuple[str, object], ...] = ()
    api: bool = False  # refused by plait.parallelize (the custom-loop API), not by a config
    then: str = "; "  # between the reason and the fix in the message

    def applies(self, features: frozenset[str]) -> bool:
        return (
            self.all <= features
            and (not self.any or bool(self.any & features))
            and not (self.none & features)
        )

    def message(self, values: dict) -> str:
        """The error: the combination with its values, why, and what to change (one line)."""
        return f"{self.what.format_map(values)}: {self.reason}{self.then}{self.fix.format_map(values)}"

    def combination(self) -> str:
        """The features as a reader reads them: `tp x lamb/lars`, `hybrid without zero`."""
        text = " x ".join(f for f in FEATURES if f in self.all)
        if self.any:
            text += " x (" + " or ".join(f for f in FEATURES if f in self.any) + ")"
        if self.none:
            text += " without " + " or ".join(f for f in FEATURES if f in self.none)
        return text

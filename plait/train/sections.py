"""The sections of a plait configuration: a dataclass each, with a doc per field.

`plait.train.config` loads them from TOML and `--section.key` flags and validates them; `plait
train --help` prints `describe_keys()`.
"""

from __future__ import annotations

import dataclasses
import json


def _f(default, doc: str, **kw):
    """A dataclass field carrying its documentation (shown by `plait train --help`)."""
    if isinstance(default, list | dict):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata={"doc": doc}, **kw)
    return dataclasses.field(default=default, metadata={"doc": doc}, **kw)


@dataclasses.dataclass
class ModelConfig:
    """The model to train: plait's GPT of a named size, or a Hugging Face model; sizes overridable."""

    source: str = _f(
        "plait",
        "what builds the model: 'plait' (its GPT), 'hf:ARCH' (transformers' causal LM of model_type ARCH "
        "built from the size keys and model.hf_config, needs pip install plait[hf]: hf:gpt2, hf:llama, "
        "hf:gpt_neox, hf:mistral, hf:qwen2, ... any whose config has a base_model_pp_plan) or "
        "'python:PKG.MODULE:FUNC' (your function, called with the resolved [model] sizes; "
        "docs/your-model.md)",
    )
    name: str = _f("small", "named size: tiny, small, 3m, 20m, gpt2, gpt2-medium, gpt2-large, gpt2-xl")
    n_layer: int | None = _f(None, "transformer blocks (default: from the named size)")
    n_head: int | None = _f(None, "attention heads per block (default: from the named size)")
    d_model: int | None = _f(None, "hidden size h (default: from the named size)")
    d_ff: int | None = _f(None, "MLP inner size (default: 4 x d_model)")
    seq_len: int | None = _f(None, "context length in tokens (default: from the named size)")
    vocab_size: int | None = _f(
        None, "token ids (default: from the named size; 256 bytes for the corpora of plait.data)"
    )
    dropout: float = _f(0.0, "dropout probability on attention, residual and embedding outputs")
    tie_weights: bool = _f(True, "share the token embedding with the output head")
    experts: int = _f(0, "experts per mixture-of-experts layer (plait.moe); 0 = a dense model")
    moe_every: int = _f(2, "with experts: every moe_every-th block has a MoE layer as its MLP")
    top_k: int = _f(2, "experts per token: 1 (Switch) or 2 (GShard)")
    capacity_factor: float = _f(
        1.25, "expert capacity per sequence: ceil(top_k x factor x seq_len / experts); 0 = dropless"
    )
    aux_loss_coef: float = _f(0.01, "weight of the load-balancing loss, per MoE layer (Switch's alpha)")
    z_loss_coef: float = _f(0.001, "weight of the router z-loss, per MoE layer (ST-MoE)")
    n_kv_head: int | None = _f(
        None, "hf:* with grouped-query attention (llama, mistral, qwen2...): key/value heads (default n_head)"
    )
    weights: str = _f("", "hf:*: a save_pretrained directory (safetensors) to load the weights from")
    hf_config: str = _f(
        "",
        "hf:* but gpt2: the architecture's other config keys: a config.json, the directory holding one, or "
        "an inline JSON object ('{\"use_parallel_residual\": false}'); the size keys set in [model] override "
        "it, unset ones are read from it (seq_len excepted)",
    )


@dataclasses.dataclass
class DataConfig:
    """The text to train on."""

    corpus: str = _f(
        "pydoc",
        "'pydoc' (CPython's bundled documentation text), a text file, a directory of .txt / .jsonl files "
        "(jsonl: a 'text' field per line; sorted, documents joined by a blank line), or 'file:PATH'",
    )
    held_out_fraction: float = _f(0.05, "fraction of the corpus (its end) kept for the held-out loss")
    tokenizer: str = _f(
        "bytes",
        "'bytes' (UTF-8 bytes, 256 ids), 'bpe' (a byte-level BPE of data.vocab_size trained on the training "
        "split, saved as <run_dir>/tokenizer.json) or the path of a tokenizer.json",
    )
    vocab_size: int = _f(4096, "data.tokenizer = 'bpe': the BPE's vocabulary size, 256 .. 1,048,576")
    cache_dir: str = _f(
        "", "token cache (memory-mapped tokens, trained BPEs); default $PLAIT_CACHE_DIR or ~/.cache/plait"
    )


@dataclasses.dataclass
class LogConfig:
    """What the run logs besides metrics.jsonl."""

    tensorboard: bool = _f(
        False, "write TensorBoard event files into <run_dir>/tensorboard (pip install plait[tensorboard])"
    )
    placements: bool = _f(
        False, "write <run_dir>/placements/rank_R.json: where the layout put each parameter of rank R"
    )
    modules: bool = _f(
        False,
        "write <run_dir>/modules/rank_R.*: every module's input, output and their gradients at step 1 "
        "(plait verify names the first module that differs from them; sized like the step's activations)",
    )


@dataclasses.dataclass
class TrainConfig:
    """The optimisation and the run."""

    steps: int = _f(300, "optimizer steps to train for")
    global_batch: int = _f(16, "sequences per optimizer step, summed over all data-parallel ranks")
    micro_batches: int = _f(1, "gradient-accumulation micro-batches per step on each rank")
    lr: float = _f(3e-3, "peak learning rate (AdamW)")
    min_lr: float = _f(3e-4, "learning rate at the end of the cosine decay")
    warmup_steps: int = _f(30, "linear warm-up steps before the cosine decay")
    weight_decay: float = _f(0.1, "AdamW weight decay on matrices (not on biases, norms)")
    beta1: float = _f(0.9, "AdamW beta1")
    beta2: float = _f(0.95, "AdamW beta2")
    grad_clip: float = _f(1.0, "clip the global gradient norm to this (0 = no clipping)")
    bf16: bool = _f(False, "compute in bfloat16 autocast (parameters and optimizer stay fp32)")
    activation_checkpointing: bool = _f(False, "recompute each block's activations in backward")
    seed: int = _f(0, "seed of the model initialisation, the data order and dropout")
    log_every: int = _f(10, "print a summary line and flush metrics every this many steps")
    eval_every: int = _f(100, "held-out evaluation every this many steps (0 = only at the end)")
    eval_batches: int = _f(8, "held-out batches (of global_batch sequences) per evaluation")
    checkpoint_every: int = _f(100, "save a checkpoint every this many steps (0 = only at the end)")
    keep_checkpoints: int = _f(2, "how many recent checkpoints to keep")
    checkpoint_async: bool = _f(
        False,
        "save checkpoints in the background: the step waits only for a copy of the state to host "
        "memory; `latest` moves once every rank's files are written",
    )
    stop_at: int = _f(
        0, "stop after this step as if interrupted (0 = run all steps); for tests and pre-emption"
    )
    run_dir: str = _f("", "where the run writes its files (default: runs/<timestamp> under the current dir)")
    sample_tokens: int = _f(200, "bytes of text to sample from the model at the end (0 = none)")
    device: str = _f("auto", "'auto' (CUDA if available), 'cpu' or 'cuda'")
    progress: bool = _f(True, "show a progress bar on rank 0")
    peak_tflops: float = _f(
        0.0, "peak TFLOP/s per rank for MFU (0 = measure on the CPU / datasheet on a GPU)"
    )
    nonfinite: str = _f(
        "skip", "a step with a non-finite loss or gradient norm: 'skip' it (parameters untouched) or 'stop'"
    )
    max_nonfinite: int = _f(10, "nonfinite = 'skip': stop after this many consecutive skipped steps")
    max_restarts: int = _f(
        0, "restart the job from its newest checkpoint this many times when a rank dies or raises"
    )
    replica_check_every: int = _f(
        100, "compare the hashes of replicated parameters across ranks every this many steps (0 = never)"
    )


@dataclasses.dataclass
class ParallelConfig:
    """How the work is split; the world size is the product pp x dp x ep x cp x tp."""

    dp: int = _f(2, "data-parallel degree")
    tp: int = _f(1, "tensor-parallel degree (Megatron-LM: heads, MLP and vocabulary split over tp ranks)")
    pp: int = _f(1, "pipeline-parallel degree: the model's blocks cut into pp x virtual_stages stages")
    schedule: str = _f("1f1b", "pipeline schedule (pp > 1): gpipe, 1f1b, interleaved, zb-h1, zb-h2, zb-v")
    microbatches: int = _f(0, "pipeline micro-batches per step (pp > 1); 0 = 2 x pp")
    virtual_stages: int = _f(
        0, "stages per pipeline rank: 0 = the schedule's own (2 for interleaved and zb-v)"
    )
    ep: int = _f(
        1, "expert-parallel degree: each MoE layer's experts split over ep ranks (needs model.experts)"
    )
    cp: int = _f(
        1,
        "context-parallel degree: every sequence split over cp ranks, attention exact across them "
        "(docs/context-parallel.md)",
    )
    cp_style: str = _f(
        "ring", "context parallelism's attention: ring (K/V passed round the ranks) or ulysses (all-to-all)"
    )
    bucket_mb: float = _f(25.0, "gradient bucket size in MB for the data-parallel all-reduce")
    sequence_parallel: bool = _f(
        False, "with tp > 1: LayerNorm, dropout and residual regions split along the sequence"
    )
    zero_stage: int = _f(
        0, "ZeRO stage: 0 data parallel, 1 shard optimizer state, 2 + gradients, 3 + parameters (FSDP)"
    )
    hybrid_shard: int = _f(
        0, "shard within groups of this many dp ranks and replicate across groups (0 = shard over all dp)"
    )
    plan: str = _f(
        "manual",
        "manual (the keys above) or auto: plait plan chooses the layout of parallel.world processes on "
        "this machine (calibrated); layout keys set to other than their default are kept as constraints",
    )
    world: int = _f(0, "parallel.plan = auto: processes to run (0 = pp x dp x ep x cp x tp as configured)")


@dataclasses.dataclass
class OffloadConfig:
    """ZeRO-Offload / ZeRO-Infinity: where the optimizer state and step live (zero_stage >= 1)."""

    optimizer: str = _f("none", "none; cpu (master, state and step on the host); disk (state in files)")
    path: str = _f("", "directory for disk offload files (default: <run_dir>/offload)")
    delayed_update: bool = _f(
        False, "one-step delayed parameter update: the step overlaps the next iteration"
    )


@dataclasses.dataclass
class CommConfig:
    """Communication."""

    timeout_s: float = _f(300.0, "a collective pending longer than this is a hang: the job is stopped")
    compression: str = _f(
        "none",
        "gradient compression of the dp all-reduce (ZeRO-1/2: reduce-scatter): "
        "none, fp16, onebit, topk, powersgd",
    )
    topk_ratio: float = _f(0.01, "fraction of gradient entries topk sends each step, in (0, 1]")
    powersgd_rank: int = _f(4, "rank of powersgd's low-rank approximation of each weight matrix, >= 1")
    error_feedback: bool = _f(True, "carry the compression error into the next step (onebit, topk, powersgd)")
    target: str = _f(
        "gradient",
        "what onebit/topk/powersgd compress: gradient (the dp all-reduce) or momentum (1-bit Adam: AdamW's "
        "momentum, variance frozen after comm.freeze_step uncompressed steps; 1-bit SGD under optim.name = "
        "sgd: the momentum, error feedback after it; needs optim.name = adamw or sgd)",
    )
    freeze_step: int = _f(100, "target = momentum: uncompressed steps (AdamW: then the variance freezes)")


@dataclasses.dataclass
class OptimConfig:
    """The optimizer (learning rate, betas and weight decay are in [train])."""

    name: str = _f("adamw", "adamw, lamb, lars or sgd")
    momentum: float = _f(0.9, "momentum of sgd and lars")


@dataclasses.dataclass
class PsConfig:
    """Parameter server (plait.async_training; Li et al. 2014): servers own key ranges of the
    parameters and apply the optimizer, parallel.dp workers push gradients and pull parameters."""

    servers: int = _f(
        0, "server processes, each owning a key range of the parameters (0 = no parameter server)"
    )
    consistency: str = _f(
        "bsp", "bsp (every worker's clock c before any reads c+1), ssp (bounded staleness), async (Downpour)"
    )
    staleness: int = _f(2, "ps.consistency = ssp: a worker waits when more than this many clocks ahead")
    server_optimizer: str = _f("adamw", "the servers' optimizer: sgd, adagrad (as in Downpour) or adamw")


@dataclasses.dataclass
class RuntimeConfig:
    """Who runs the loop: spmd (every rank runs it, started by torch elastic) or controller (one
    driver program owns the loop and the data, Monarch actors run the steps: docs/controller.md)."""

    kind: str = _f("spmd", "spmd (one program per rank) or controller (single controller on Monarch)")
    run_ahead: int = _f(2, "runtime.kind = controller: steps dispatched before the oldest one's loss is back")
    eval_island: bool = _f(
        False,
        "runtime.kind = controller: held-out evaluations (but the last) on a process of their own, "
        "while training goes on",
    )


@dataclasses.dataclass
class DilocoConfig:
    """DiLoCo (Douillard et al. 2023) and Streaming DiLoCo (2025): diloco.replicas groups each train
    alone for diloco.inner_steps steps, then average their parameter change (the pseudo-gradient)
    and take an outer step; a group is one dp replica, and inside it every layout works
    (docs/diloco.md)."""

    inner_steps: int = _f(0, "H: inner steps between synchronisations (0 = DiLoCo off)")
    replicas: int = _f(0, "M: replica groups (0 = parallel.dp: one per dp rank); must divide parallel.dp")
    outer_optimizer: str = _f("nesterov", "the outer step on the averaged pseudo-gradient: nesterov or sgd")
    outer_lr: float = _f(0.7, "outer learning rate (the paper's 0.7)")
    outer_momentum: float = _f(0.9, "outer momentum (the paper's 0.9; 0 = none)")
    fragments: int = _f(
        1, "Streaming DiLoCo: the model's blocks cut into this many fragments, synced at staggered steps"
    )
    overlap_steps: int = _f(
        0, "Streaming's tau: a fragment's exchange runs under this many inner steps before it is merged"
    )
    mix: float = _f(
        0.0, "Streaming's alpha: merged = alpha x local + (1 - alpha) x outer-updated (0 = take the outer)"
    )
    compression: str = _f(
        "none", "the outer exchange: none (fp32), fp16, bf16, or plait.comm's onebit, topk, powersgd"
    )
    fault_tolerant: bool = _f(
        False, "a group whose rank dies is dropped, restarted, healed from a live group, rejoined"
    )
    max_rejoins: int = _f(3, "fault_tolerant: restarts of each group before the job gives up on it")
    quorum_timeout_s: float = _f(
        120.0, "a synchronisation waits this long for the live groups to arrive before it is a hang"
    )


@dataclasses.dataclass
class Config:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    comm: CommConfig = dataclasses.field(default_factory=CommConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    offload: OffloadConfig = dataclasses.field(default_factory=OffloadConfig)
    ps: PsConfig = dataclasses.field(default_factory=PsConfig)
    log: LogConfig = dataclasses.field(default_factory=LogConfig)
    runtime: RuntimeConfig = dataclasses.field(default_factory=RuntimeConfig)
    diloco: DilocoConfig = dataclasses.field(default_factory=DilocoConfig)

    @property
    def world_size(self) -> int:
        p = self.parallel
        return p.pp * p.dp * p.ep * p.cp * p.tp

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        """The resolved configuration as TOML (unset optional keys are left out)."""
        out = []
        for section, values in self.to_dict().items():
            out.append(f"[{section}]")
            for key, value in values.items():
                if value is not None:
                    out.append(f"{key} = {json.dumps(value)}")
            out.append("")
        return "\n".join(out)


SECTION_TYPES = {
    "model": ModelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "parallel": ParallelConfig,
    "comm": CommConfig,
    "optim": OptimConfig,
    "offload": OffloadConfig,
    "ps": PsConfig,
    "log": LogConfig,
    "runtime": RuntimeConfig,
    "diloco": DilocoConfig,
}


def describe_keys() -> str:
    """Every key with its type, default and doc, for `plait train --help`."""
    lines = []
    for section, cls in SECTION_TYPES.items():
        lines.append(f"[{section}]  {cls.__doc__.strip()}")
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            lines.append(f"  --{section}.{f.name} (default {default!r}): {f.metadata.get('doc', '')}")
    return "\n".join(lines)

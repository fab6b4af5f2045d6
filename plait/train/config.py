"""Training configuration: dataclasses with a doc per field, loaded from TOML, overridden on the CLI.

    [train]
    steps = 300

    plait train configs/default.toml --train.steps 50 --parallel.dp 2

Loading is strict. An unknown section or key is an error naming the nearest valid one; a value
of the wrong type, a negative or out-of-range size (`_BOUNDS`, docs/fault-tolerance.md) or an
inconsistent combination (the world size not divisible into the batch, heads not divisible by
tp, ...) is rejected here, in the launching process, before any rank starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import tomllib
import types
import typing
from pathlib import Path

from plait.errors import ConfigError


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
        "what builds the model: 'plait' (its GPT), 'hf:gpt2' or 'hf:llama' (transformers' model built from "
        "the size keys, needs pip install plait[hf]) or 'python:PKG.MODULE:FUNC' (your function, called "
        "with the resolved [model] sizes; docs/your-model.md)",
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
    n_kv_head: int | None = _f(None, "hf:llama: key/value heads (grouped-query attention; default n_head)")
    weights: str = _f("", "hf:*: a save_pretrained directory (safetensors) to load the weights from")


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
    """How the work is split; the world size is the product pp x dp x ep x tp."""

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
    world: int = _f(0, "parallel.plan = auto: processes to run (0 = pp x dp x ep x tp as configured)")


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
        "momentum, variance frozen after comm.freeze_step uncompressed steps; needs optim.name = adamw)",
    )
    freeze_step: int = _f(100, "target = momentum: uncompressed AdamW steps before the variance freezes")


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

    @property
    def world_size(self) -> int:
        p = self.parallel
        return p.pp * p.dp * p.ep * p.tp

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


_SECTION_TYPES = {
    "model": ModelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "parallel": ParallelConfig,
    "comm": CommConfig,
    "optim": OptimConfig,
    "offload": OffloadConfig,
    "ps": PsConfig,
    "log": LogConfig,
}


def _nearest(name: str, choices) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f"; did you mean '{close[0]}'?" if close else f"; valid: {', '.join(sorted(choices))}"


def _field_types(cls) -> dict[str, tuple[type, bool]]:
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        optional = False
        if isinstance(t, types.UnionType) or typing.get_origin(t) is typing.Union:
            args = [a for a in typing.get_args(t) if a is not type(None)]
            optional, t = True, args[0]
        out[f.name] = (t, optional)
    return out


def _coerce(where: str, value, t: type, optional: bool, from_cli: bool):
    if from_cli and isinstance(value, str):
        if optional and value.lower() in ("none", "null", ""):
            return None
        try:
            if t is bool:
                low = value.lower()
                if low not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError
                return low in ("true", "1", "yes")
            if t is int:
                try:
                    return int(value)  # exact, however long ("9999999999999999999999")
                except ValueError:
                    f = float(value)  # "1e6"
                if not f.is_integer():
                    raise ValueError
                return int(f)
            if t is float:
                f = float(value)
                if not math.isfinite(f):
                    raise ValueError
                return f
            return t(value)
        except ValueError:
            raise ConfigError(f"{where}: expected {t.__name__}, got {value!r}") from None
    if value is None and optional:
        return None
    if t is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if t is float and isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where}: expected a finite number, got {value!r}")
    if not isinstance(value, t) or (t is int and isinstance(value, bool)):
        raise ConfigError(f"{where}: expected {t.__name__}, got {type(value).__name__} {value!r}")
    return value


def set_key(cfg: Config, section: str, key: str, value, from_cli: bool) -> None:
    """Set `section.key` of `cfg` to `value`, checked and coerced to the key's type (a ConfigError
    names an unknown key, with the nearest valid one, or a value of the wrong type)."""
    if section not in _SECTION_TYPES:
        raise ConfigError(f"unknown section [{section}]{_nearest(section, _SECTION_TYPES)}")
    types_ = _field_types(_SECTION_TYPES[section])
    if key not in types_:
        full = [f"{section}.{k}" for k in types_]
        raise ConfigError(f"unknown key '{section}.{key}'{_nearest(f'{section}.{key}', full)}")
    t, optional = types_[key]
    setattr(getattr(cfg, section), key, _coerce(f"{section}.{key}", value, t, optional, from_cli))


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """['--train.steps', '50', '--parallel.dp=2'] -> [('train.steps', '50'), ('parallel.dp', '2')]."""
    out, i = [], 0
    while i < len(args):
        a = args[i]
        if not a.startswith("--") or "." not in a:
            raise ConfigError(f"unexpected argument {a!r}: overrides look like --section.key value")
        if "=" in a:
            k, v = a[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"{a} needs a value")
            k, v = a[2:], args[i + 1]
            i += 2
        out.append((k, v))
    return out


def load_config(path: str | Path | None = None, overrides: list[tuple[str, str]] = ()) -> Config:
    """Defaults <- TOML file <- command-line overrides, then validated."""
    cfg = Config()
    if path is not None:
        p = Path(path)
        try:
            data = tomllib.loads(_read_config_text(p))
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{p}: not valid TOML: {exc}") from None
        for section, values in data.items():
            if not isinstance(values, dict):
                raise ConfigError(
                    f"{p}: top-level key {section!r} must be a [section]{_nearest(section, _SECTION_TYPES)}"
                )
            for key, value in values.items():
                set_key(cfg, section, key, value, from_cli=False)
    for dotted, value in overrides:
        section, _, key = dotted.partition(".")
        set_key(cfg, section, key, value, from_cli=True)
    validate(cfg)
    return cfg


def _read_config_text(p: Path) -> str:
    """The text of config file `p`, or a ConfigError that says what `p` is instead."""
    if p.is_dir():
        raise ConfigError(
            f"config file {str(p)!r} is a directory; give a TOML file, e.g. configs/default.toml"
        )
    if not p.exists():
        raise ConfigError(f"config file {str(p)!r} not found")
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"config file {str(p)!r} cannot be read ({exc.strerror or exc})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ConfigError(
            f"config file {str(p)!r} is not UTF-8 text (byte 0x{raw[exc.start]:02x} on line {line}); "
            "a TOML config is UTF-8: is it the right file, or saved in another encoding?"
        ) from None


def config_from_dict(data: dict, check_data: bool = True) -> Config:
    """The inverse of `Config.to_dict()` (validated; `check_data=False` skips the check that
    loads the corpus, for processes whose launcher made it already)."""
    cfg = Config()
    for section, values in data.items():
        for key, value in values.items():
            set_key(cfg, section, key, value, from_cli=False)
    validate(cfg, data=check_data)
    return cfg


COMM_TARGETS = ("gradient", "momentum")
PLANS = ("manual", "auto")


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


# Upper bounds of the sizes (docs/fault-tolerance.md, "Before start"): far above any real run, low
# enough that a slip (a pasted number, a few zeros too many) is refused before start rather than
# running for ever, looping over it, or overflowing a 64-bit field later.
MAX_STEPS = 10**9
"""Step counts (steps, warm-up, intervals, stop_at, freeze_step): 30 years at one step a second."""
MAX_SIZE = 2**20
"""Model dimensions, parallel degrees and their product, batch sizes: 1,048,576."""
MAX_SAMPLE_TOKENS = 2**16
"""train.sample_tokens: one forward pass each."""
MAX_TIMEOUT_S = 10**6
"""comm.timeout_s (11.6 days): torch's process-group timeout derives from it."""
MAX_PIPELINE_ACTIONS = 2**15
"""parallel.pp x microbatches x virtual_stages."""
_INT64_MAX = 2**63 - 1
_BOUNDS = {
    **dict.fromkeys(
        ("train.steps", "train.warmup_steps", "train.stop_at", "train.log_every", "train.eval_every")
        + ("train.checkpoint_every", "train.keep_checkpoints", "comm.freeze_step"),
        (MAX_STEPS, "a billion steps"),
    ),
    **dict.fromkeys(
        ("model.n_layer", "model.n_head", "model.d_model", "model.d_ff", "model.seq_len", "model.experts")
        + ("model.vocab_size", "model.n_kv_head")
        + ("model.moe_every", "parallel.dp", "parallel.tp", "parallel.pp", "parallel.ep")
        + ("parallel.microbatches", "parallel.virtual_stages", "parallel.hybrid_shard", "parallel.world")
        + ("train.global_batch", "train.micro_batches", "train.eval_batches", "comm.powersgd_rank")
        + ("ps.servers", "ps.staleness"),
        (MAX_SIZE, "2**20"),
    ),
    "train.sample_tokens": (MAX_SAMPLE_TOKENS, "one forward pass per token"),
    "comm.timeout_s": (MAX_TIMEOUT_S, "11.6 days: a collective pending that long is a hang"),
}


def _check_bounds(cfg: Config) -> None:
    """Every integer key fits 64 bits and every bounded key is at most its bound (`_BOUNDS`)."""
    for section, values in cfg.to_dict().items():
        for key, value in values.items():
            name = f"{section}.{key}"
            limit, why = _BOUNDS.get(name, (None, ""))
            if limit is not None and value is not None and value > limit:
                raise ConfigError(f"{name} = {value} is out of range: at most {limit:,} ({why})")
            if isinstance(value, int) and not isinstance(value, bool) and abs(value) > _INT64_MAX:
                raise ConfigError(f"{name} = {value} does not fit a 64-bit integer: at most {_INT64_MAX:,}")
    world = cfg.world_size
    _require(
        world <= MAX_SIZE,
        f"parallel.pp x dp x ep x tp = {world:,} ranks is out of range: at most {MAX_SIZE:,}",
    )


def validate(cfg: Config, data: bool = True) -> None:
    """Reject inconsistent values with a message that says what to change.

    ``data=False`` leaves out the one check that reads the corpus on this machine (that it holds a
    global batch); the planner validates layouts for clusters whose data is elsewhere."""
    _check_bounds(cfg)
    from plait.models.source import validate_source

    validate_source(cfg)  # the model's source first: an hf model refuses what it does not support
    t, p = cfg.train, cfg.parallel
    for name in ("dp", "tp", "pp", "ep"):
        _require(getattr(p, name) >= 1, f"parallel.{name} must be >= 1, got {getattr(p, name)}")
    _require(p.plan in PLANS, f"parallel.plan = {p.plan!r} is not valid; valid: {', '.join(PLANS)}")
    _require(p.world >= 0, f"parallel.world must be >= 0 (0 = pp x dp x ep x tp), got {p.world}")
    if p.plan == "auto":
        _require(
            cfg.model.source == "plait",
            f"parallel.plan = 'auto' plans plait's own GPT (the cost model's FLOPs and memory are its "
            f"formulas), not model.source = {cfg.model.source!r}: set the layout by hand (parallel.dp, "
            "tp, pp, zero_stage) or use plait plan on an equivalent GPT",
        )
        from plait.planner.auto import check_auto

        check_auto(cfg, data=data)  # the layout is the planner's: checked over its candidates
        return
    _require(
        p.world in (0, cfg.world_size),
        f"parallel.world = {p.world} but parallel.pp x dp x ep x tp = {cfg.world_size}: with "
        "parallel.plan = 'manual' the degrees give the world; set parallel.world = 0 (or "
        f"{cfg.world_size}), or parallel.plan = 'auto' to have the layout chosen",
    )
    python = cfg.model.source.startswith("python:")  # validate_source checked the spec's form
    if not python:  # a python: source refuses these features of plait's GPT itself
        _validate_ps(cfg)
        _validate_moe(cfg)
    _require(p.bucket_mb > 0, f"parallel.bucket_mb must be positive, got {p.bucket_mb}")
    for name in ("steps", "global_batch", "micro_batches", "log_every", "eval_batches", "keep_checkpoints"):
        _require(getattr(t, name) >= 1, f"train.{name} must be >= 1, got {getattr(t, name)}")
    for name in ("warmup_steps", "eval_every", "checkpoint_every", "stop_at", "sample_tokens", "seed"):
        _require(getattr(t, name) >= 0, f"train.{name} must be >= 0, got {getattr(t, name)}")
    _require(
        t.lr > 0 and 0 <= t.min_lr <= t.lr,
        f"need 0 <= train.min_lr <= train.lr and lr > 0 (lr={t.lr}, min_lr={t.min_lr})",
    )
    _require(0 <= t.beta1 < 1 and 0 <= t.beta2 < 1, "train.beta1 and train.beta2 must be in [0, 1)")
    _require(t.grad_clip >= 0 and t.weight_decay >= 0, "train.grad_clip and train.weight_decay must be >= 0")
    _require(t.device in ("auto", "cpu", "cuda"), f"train.device must be auto, cpu or cuda, got {t.device!r}")
    _require(t.peak_tflops >= 0, "train.peak_tflops must be >= 0")
    _require(
        t.nonfinite in ("skip", "stop"), f"train.nonfinite = {t.nonfinite!r} is not valid; valid: skip, stop"
    )
    for name in ("max_restarts", "replica_check_every"):
        _require(getattr(t, name) >= 0, f"train.{name} must be >= 0, got {getattr(t, name)}")
    _require(t.max_nonfinite >= 1, f"train.max_nonfinite must be >= 1, got {t.max_nonfinite}")
    per = p.dp * p.ep * t.micro_batches  # the batch is split over dp x ep
    if t.global_batch % per:
        lo, hi = (t.global_batch // per) * per, math.ceil(t.global_batch / per) * per
        ranks = f"parallel.dp = {p.dp}" + (f" x parallel.ep = {p.ep}" if p.ep > 1 else "")
        raise ConfigError(
            f"train.global_batch = {t.global_batch} does not split into {ranks} ranks x "
            f"train.micro_batches = {t.micro_batches}: use a multiple of {per} (e.g. {lo or hi} or {hi})"
        )
    _require(
        0 < cfg.data.held_out_fraction <= 0.5,
        f"data.held_out_fraction must be in (0, 0.5], got {cfg.data.held_out_fraction}",
    )
    _require(0 <= cfg.model.dropout < 1, f"model.dropout must be in [0, 1), got {cfg.model.dropout}")
    _require(cfg.comm.timeout_s > 0, f"comm.timeout_s must be positive, got {cfg.comm.timeout_s}")
    from plait.comm.compress import COMPRESSIONS
    from plait.optim import OPTIMIZER_NAMES

    _require(
        cfg.comm.compression in COMPRESSIONS,
        f"comm.compression = {cfg.comm.compression!r} is unknown; valid: {', '.join(COMPRESSIONS)}",
    )
    _require(0 < cfg.comm.topk_ratio <= 1, f"comm.topk_ratio must be in (0, 1], got {cfg.comm.topk_ratio}")
    _require(cfg.comm.powersgd_rank >= 1, f"comm.powersgd_rank must be >= 1, got {cfg.comm.powersgd_rank}")
    _validate_momentum_target(cfg)
    _require(
        cfg.optim.name in OPTIMIZER_NAMES,
        f"optim.name = {cfg.optim.name!r} is unknown; valid: {', '.join(OPTIMIZER_NAMES)}",
    )
    _require(0 <= cfg.optim.momentum < 1, f"optim.momentum must be in [0, 1), got {cfg.optim.momentum}")
    _validate_zero(cfg)
    from plait.models import gpt_config

    base = gpt_config(cfg.model.name)  # an unknown name is an error listing the valid ones
    sizes = {
        k: getattr(cfg.model, k) if getattr(cfg.model, k) is not None else getattr(base, k)
        for k in ("n_layer", "n_head", "d_model", "seq_len", "vocab_size")
    }
    for name, value in sizes.items():
        _require(value >= 1, f"model.{name} must be >= 1, got {value}")
    _require(
        sizes["d_model"] % sizes["n_head"] == 0,
        f"model.d_model = {sizes['d_model']} is not divisible by model.n_head = {sizes['n_head']}",
    )
    _validate_data_keys(cfg)
    m = model_config(cfg)
    if data and cfg.data.tokenizer == "bytes":
        _require(
            m.vocab_size >= 256,
            f"model.vocab_size = {m.vocab_size} is below the 256 byte values of plait's corpora: "
            "use model.vocab_size >= 256",
        )
    if data:
        _check_data_fits(cfg, m.seq_len)
    # plait's GPT's own splits; a python: source's plan splits its own layers (apply_tp checks them)
    _require(
        python or m.n_head % p.tp == 0, f"model.n_head = {m.n_head} is not divisible by parallel.tp = {p.tp}"
    )
    _require(
        python or m.ff_dim % p.tp == 0, f"model.d_ff = {m.ff_dim} is not divisible by parallel.tp = {p.tp}"
    )
    _require(
        not p.sequence_parallel or m.seq_len % p.tp == 0,
        f"model.seq_len = {m.seq_len} is not divisible by parallel.tp = {p.tp} (parallel.sequence_parallel)",
    )
    _require(
        not p.sequence_parallel or p.tp > 1,
        "parallel.sequence_parallel needs parallel.tp > 1 (it splits tensor-parallel regions' neighbours)",
    )
    _require(
        p.tp == 1 or cfg.optim.name not in ("lamb", "lars"),
        f"optim.name = {cfg.optim.name!r} with parallel.tp = {p.tp} is not available: its per-layer trust "
        "ratio needs the norm of each whole layer, and tensor-parallel layers are split over tp; use "
        "optim.name = 'adamw' or 'sgd' with tp",
    )
    _require(
        p.tp == 1 or cfg.model.dropout == 0 or not cfg.train.activation_checkpointing,
        "tensor parallelism with model.dropout > 0 and train.activation_checkpointing: recomputation "
        "would replay per-rank dropout masks from the wrong stream; drop one of the two",
    )
    _require(
        (p.tp == 1 and p.pp == 1) or cfg.comm.target == "gradient",
        "comm.target = 'momentum' (1-bit Adam) with parallel.tp > 1 or parallel.pp > 1 is not available "
        "yet: its momentum exchange is built over dp alone (data parallel and ZeRO-1/2), not over "
        "tensor-parallel placements or a pipeline's stages; use comm.target = 'gradient'",
    )
    _validate_pipeline(cfg, None if python else m.n_layer)
    if python:  # last: the factory is imported and called once the cheap checks passed
        from plait.models.python_source import check_source

        check_source(cfg)


PS_CONSISTENCY = ("bsp", "ssp", "async")
PS_OPTIMIZERS = ("sgd", "adagrad", "adamw")


def _validate_ps(cfg: Config) -> None:
    """The parameter server (plait.async_training): its keys, and what it does not combine with."""
    s, p = cfg.ps, cfg.parallel
    _require(s.servers >= 0, f"ps.servers must be >= 0 (0 = no parameter server), got {s.servers}")
    _require(
        s.consistency in PS_CONSISTENCY,
        f"ps.consistency = {s.consistency!r} is unknown; valid: {', '.join(PS_CONSISTENCY)}",
    )
    _require(s.staleness >= 0, f"ps.staleness must be >= 0 (0 = bsp), got {s.staleness}")
    _require(
        s.server_optimizer in PS_OPTIMIZERS,
        f"ps.server_optimizer = {s.server_optimizer!r} is unknown; valid: {', '.join(PS_OPTIMIZERS)}",
    )
    if not s.servers:
        return
    others = {  # key: (value, its default)
        "parallel.tp": (p.tp, 1),
        "parallel.pp": (p.pp, 1),
        "parallel.ep": (p.ep, 1),
        "parallel.zero_stage": (p.zero_stage, 0),
        "parallel.hybrid_shard": (p.hybrid_shard, 0),
        "comm.compression": (cfg.comm.compression, "none"),
        "offload.optimizer": (cfg.offload.optimizer, "none"),
        "model.experts": (cfg.model.experts, 0),
        "data.tokenizer": (cfg.data.tokenizer, "bytes"),
    }
    for key, (value, default) in others.items():
        _require(
            value == default,
            f"ps.servers = {s.servers} with {key} = {value!r} is not available: parameter-server workers "
            f"each hold the whole model and push whole gradients; set {key} = {default!r}, or ps.servers = 0",
        )
    import torch

    from plait.models import GPT

    with torch.device("meta"):
        n = len(list(GPT(model_config(cfg)).parameters()))
    _require(
        s.servers <= n,
        f"ps.servers = {s.servers} is more than the model's {n} parameter tensors (each server owns a "
        f"range of whole tensors); use ps.servers <= {n}",
    )


def _validate_momentum_target(cfg: Config) -> None:
    c = cfg.comm
    _require(
        c.target in COMM_TARGETS,
        f"comm.target = {c.target!r} is unknown; valid: {', '.join(COMM_TARGETS)}",
    )
    if c.target != "momentum":
        return
    _require(
        c.compression in ("onebit", "topk", "powersgd"),
        f"comm.target = 'momentum' (1-bit Adam) needs comm.compression = 'onebit', 'topk' or 'powersgd', "
        f"got {c.compression!r}",
    )
    _require(
        cfg.optim.name == "adamw",
        f"comm.target = 'momentum' (1-bit Adam) compresses AdamW's momentum: set optim.name = 'adamw' "
        f"(got {cfg.optim.name!r}), or comm.target = 'gradient'",
    )
    _require(
        c.freeze_step < cfg.train.steps,
        f"comm.freeze_step = {c.freeze_step} >= train.steps = {cfg.train.steps}: the run would never "
        "compress; lower comm.freeze_step (the paper: 15-25% of training)",
    )
    _require(
        1 <= c.freeze_step,
        f"comm.freeze_step must be >= 1 (uncompressed AdamW steps that learn the variance), "
        f"got {c.freeze_step}",
    )


def _validate_pipeline(cfg: Config, n_layer: int | None) -> None:
    """Pipeline settings (plait.pipeline): checked here, before any process starts."""
    from plait.pipeline.schedules import SCHEDULES

    p, t = cfg.parallel, cfg.train
    _require(
        p.schedule in SCHEDULES,
        f"parallel.schedule = {p.schedule!r} is not valid; valid: {', '.join(SCHEDULES)}",
    )
    _require(p.microbatches >= 0, f"parallel.microbatches must be >= 0, got {p.microbatches}")
    _require(p.virtual_stages >= 0, f"parallel.virtual_stages must be >= 0, got {p.virtual_stages}")
    if p.pp == 1:
        return
    m, v = pipeline_shape(cfg)
    _require(
        p.pp * m * v <= MAX_PIPELINE_ACTIONS,
        f"parallel.pp x microbatches x virtual_stages = {p.pp} x {m} x {v} = {p.pp * m * v:,} is out of "
        f"range: at most {MAX_PIPELINE_ACTIONS:,} (the schedule is built and checked action by action, "
        "before start and on every rank); lower parallel.microbatches",
    )
    problem = _schedule_problem(p.schedule, p.pp, m, v)
    if problem:
        raise ConfigError(f"[parallel] pp = {p.pp}, schedule = {p.schedule!r}, microbatches = {m}: {problem}")
    n = p.pp * v
    if n_layer is not None and n_layer % n:  # None: a python: model, cut by its own split
        valid = [k for k in range(1, n_layer + 1) if n_layer % k == 0]
        raise ConfigError(
            f"model.n_layer = {n_layer} is not divisible into parallel.pp x virtual_stages = {p.pp} x {v} = "
            f"{n} pipeline stages; pp x virtual_stages must be one of {valid}"
        )
    _require(
        t.micro_batches == 1,
        f"train.micro_batches = {t.micro_batches} with parallel.pp = {p.pp}: the pipeline splits each "
        "step's batch itself; set train.micro_batches = 1 and parallel.microbatches instead",
    )
    ranks = p.dp * p.ep  # the batch is split over dp x ep
    rows = t.global_batch // ranks
    where = "dp rank" if p.ep == 1 else "dp x ep rank"
    _require(
        rows % m == 0,
        f"train.global_batch = {t.global_batch} gives {rows} rows per {where}, not divisible into "
        f"parallel.microbatches = {m} pipeline micro-batches; use a global_batch multiple of {ranks * m}",
    )
    _require(
        cfg.offload.optimizer == "none",
        f"parallel.pp = {p.pp} with offload.optimizer = {cfg.offload.optimizer!r} is not available yet; "
        "set offload.optimizer = 'none'",
    )


@functools.lru_cache(maxsize=256)
def _schedule_problem(kind: str, pp: int, m: int, v: int) -> str:
    """'' if the schedule builds and checks, else why not. Cached: building and checking a long
    schedule takes seconds, and the planner validates many layouts that share one."""
    from plait.pipeline.schedules import make_schedule

    try:
        make_schedule(kind, pp, m, v)
    except ConfigError as exc:
        return str(exc)
    return ""


def pipeline_shape(cfg: Config) -> tuple[int, int]:
    """(micro-batches, virtual stages per rank) of the configured pipeline, defaults resolved."""
    from plait.pipeline.schedules import default_virtual_stages

    p = cfg.parallel
    return (p.microbatches or 2 * p.pp), (p.virtual_stages or default_virtual_stages(p.schedule))


def _validate_zero(cfg: Config) -> None:
    """ZeRO stage, hybrid sharding and offload settings (plait.zero)."""
    p, o = cfg.parallel, cfg.offload
    _require(
        p.zero_stage in (0, 1, 2, 3), f"parallel.zero_stage = {p.zero_stage} is not valid; valid: 0, 1, 2, 3"
    )
    _require(
        p.hybrid_shard >= 0 and (p.hybrid_shard == 0 or p.dp % p.hybrid_shard == 0),
        f"parallel.hybrid_shard = {p.hybrid_shard} must divide parallel.dp = {p.dp} (or be 0 for no hybrid)",
    )
    _require(
        p.hybrid_shard == 0 or p.zero_stage >= 1,
        "parallel.hybrid_shard needs parallel.zero_stage >= 1 (there is nothing to shard at stage 0)",
    )
    _require(
        o.optimizer in ("none", "cpu", "disk"),
        f"offload.optimizer = {o.optimizer!r} is not valid; valid: none, cpu, disk",
    )
    _require(
        o.optimizer == "none" or p.zero_stage >= 1,
        f"offload.optimizer = {o.optimizer!r} needs parallel.zero_stage >= 1 (offload moves the shards)",
    )
    _require(
        not o.delayed_update or o.optimizer != "none",
        "offload.delayed_update needs offload.optimizer = 'cpu' or 'disk'",
    )
    _require(
        not (o.delayed_update and cfg.optim.name in ("lamb", "lars") and p.dp > 1 and p.zero_stage >= 1),
        "offload.delayed_update cannot run optim.name = lamb/lars: their per-layer norms need a collective "
        "inside the step, which runs in a background thread; use adamw or sgd",
    )
    _require(
        not (o.optimizer == "disk" and cfg.optim.name in ("lamb", "lars") and p.dp > 1),
        "offload.optimizer = 'disk' cannot run optim.name = lamb/lars on sharded layers (their norms "
        "need all of a layer at once); use cpu offload or adamw/sgd",
    )
    c = cfg.comm
    if c.target == "momentum":  # 1-bit Adam (plait.optim.onebit_adam) under ZeRO
        _require(
            p.zero_stage <= 2,
            "comm.target = 'momentum' (1-bit Adam) runs with parallel.zero_stage = 0, 1 or 2, got 3: its "
            "ZeRO path forms each rank's momentum over ZeRO-1/2's buckets of whole parameters, and is not "
            "built over ZeRO-3's units (gradient compression itself works under ZeRO-3); use zero_stage = 2",
        )
        _require(
            p.hybrid_shard == 0,
            "comm.target = 'momentum' (1-bit Adam) with parallel.hybrid_shard is not available: the momentum "
            "is exchanged over the whole dp axis, which hybrid sharding splits into shard and replica "
            "groups; set parallel.hybrid_shard = 0",
        )
        _require(
            o.optimizer == "none",
            f"comm.target = 'momentum' (1-bit Adam) with offload.optimizer = {o.optimizer!r} is not "
            "available: the compressed momentum exchange runs inside the optimizer step on the compute "
            "device, which offload moves to the host (or, delayed, to a background thread); set "
            "offload.optimizer = 'none'",
        )
    _require(
        p.zero_stage <= 2 or c.compression == "none" or p.tp == 1 or p.pp > 1,
        f"comm.compression = {c.compression!r} with parallel.zero_stage = 3 and parallel.tp = {p.tp}: a "
        "ZeRO-3 unit's gradient mixes tp-sharded, replicated and partial parameters, and a lossy "
        "compressor over it would let tp replicas drift apart; use zero_stage = 1 or 2 (one placement "
        "per bucket) or comm.compression = 'none'",
    )
    _require(
        p.zero_stage == 0 or c.compression == "none" or not cfg.train.bf16,
        f"comm.compression = {c.compression!r} with parallel.zero_stage = {p.zero_stage} needs fp32 "
        "gradients: set train.bf16 = false, or comm.compression = 'none'",
    )
    if o.optimizer == "disk" and o.path:
        check_writable_dir(o.path, "offload.path")


def _validate_moe(cfg: Config) -> None:
    """Mixture of experts (`model.experts`) and expert parallelism (`parallel.ep`)."""
    m, p = cfg.model, cfg.parallel
    _require(m.experts >= 0, f"model.experts must be >= 0 (0 = dense), got {m.experts}")
    _require(
        p.ep == 1 or m.experts > 0,
        f"parallel.ep = {p.ep} splits the experts of mixture-of-experts layers, and the model is dense: "
        "set model.experts (e.g. 4) or parallel.ep = 1",
    )
    if not m.experts:
        return
    _require(m.top_k in (1, 2), f"model.top_k = {m.top_k} is not valid; valid: 1 (Switch), 2 (GShard)")
    _require(m.top_k <= m.experts, f"model.top_k = {m.top_k} is more than model.experts = {m.experts}")
    _require(
        m.experts % p.ep == 0,
        f"model.experts = {m.experts} does not divide over parallel.ep = {p.ep}: use a multiple of {p.ep}",
    )
    _require(
        m.capacity_factor >= 0, f"model.capacity_factor must be >= 0 (0 = dropless), got {m.capacity_factor}"
    )
    _require(m.moe_every >= 1, f"model.moe_every must be >= 1, got {m.moe_every}")
    _require(
        m.aux_loss_coef >= 0 and m.z_loss_coef >= 0,
        f"model.aux_loss_coef and model.z_loss_coef must be >= 0, got {m.aux_loss_coef}, {m.z_loss_coef}",
    )
    if p.ep > 1:
        _require(
            not p.hybrid_shard,
            f"parallel.ep = {p.ep} with parallel.hybrid_shard = {p.hybrid_shard} is not available: ZeRO "
            "shards experts over their replica group (dp) and dense parameters over dp x ep; set "
            "parallel.hybrid_shard = 0",
        )
        _require(
            cfg.optim.name not in ("lamb", "lars"),
            f"optim.name = {cfg.optim.name!r} with parallel.ep = {p.ep} is not available: its per-layer "
            "trust ratio needs the norm of each whole expert tensor, which is split over ep; use "
            "optim.name = 'adamw' or 'sgd'",
        )
        _require(
            cfg.comm.compression == "none" or cfg.comm.target == "gradient",
            f"parallel.ep = {p.ep} with comm.target = 'momentum' (1-bit Adam) is not available: its "
            "momentum is exchanged over dp alone, and dense layers need dp x ep; set "
            "comm.target = 'gradient' (compressed gradients work with ep)",
        )


def check_writable_dir(path: str, key: str) -> None:
    """Create `path` if needed and write a probe file, or raise a ConfigError naming `key`."""
    import os
    import tempfile

    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".plait-probe-"):
            pass
        if not os.access(path, os.W_OK):
            raise PermissionError(f"no write permission on {path}")
    except OSError as exc:
        raise ConfigError(f"{key} = {path!r} is not a writable directory ({exc}); choose another") from None


def _check_data_fits(cfg: Config, seq_len: int) -> None:
    """The corpus must hold a global batch for training and one for the held-out evaluation."""
    from plait.data import DistributedBatchSampler, load_corpus

    t, d = cfg.train, cfg.data
    if d.cache_dir:
        check_writable_dir(d.cache_dir, "data.cache_dir")
    # an unknown name, a bad path, an empty directory, a bad jsonl line: ConfigError. A BPE is trained
    # and the corpus tokenized here, once, into the token cache that the ranks then read.
    tokenizer = d.tokenizer
    saved = Path(t.run_dir) / "tokenizer.json" if t.run_dir else None
    if (
        tokenizer != "bytes"
        and saved is not None
        and saved.is_file()
        and (saved.parent / "checkpoints").exists()
    ):
        tokenizer = str(saved)  # a resumed run keeps the tokenizer it was trained with
    corpus = load_corpus(d.corpus, d.held_out_fraction, tokenizer, d.vocab_size, d.cache_dir or None, True)
    DistributedBatchSampler(
        corpus.train, seq_len, t.global_batch, 0, cfg.parallel.dp, t.seed, micro_batches=t.micro_batches
    )
    windows = len(corpus.val) // (seq_len + 1)
    _require(
        windows >= t.global_batch,
        f"the held-out split holds {windows} sequences of {seq_len + 1} tokens, fewer than one evaluation "
        f"batch of train.global_batch = {t.global_batch}: raise data.held_out_fraction "
        f"(now {cfg.data.held_out_fraction}), or lower train.global_batch or model.seq_len",
    )


def model_config(cfg: Config):
    """The model config the run builds: the named size with the overrides applied (the vocabulary,
    when not set, follows a tokenizer other than bytes; for a Hugging Face source, its
    `plait.models.hf.HFConfig`: the same size fields, read the same way)."""
    from plait.models import gpt_config

    m = cfg.model
    if m.source.startswith("hf:"):
        from plait.models.source import hf_model_config

        return hf_model_config(cfg)
    overrides = {
        k: getattr(m, k)
        for k in ("n_layer", "n_head", "d_model", "d_ff", "seq_len", "vocab_size")
        if getattr(m, k) is not None
    }
    if m.vocab_size is None and cfg.data.tokenizer != "bytes":
        overrides["vocab_size"] = tokenizer_vocab_size(cfg.data)
    moe = {
        k: getattr(m, k)
        for k in ("experts", "moe_every", "top_k", "capacity_factor", "aux_loss_coef", "z_loss_coef")
    }
    return gpt_config(m.name, dropout=m.dropout, tie_weights=m.tie_weights, **overrides, **moe)


MAX_BPE_VOCAB = 2**20


def tokenizer_vocab_size(d: DataConfig) -> int:
    """Token ids of the configured tokenizer: 256 bytes, data.vocab_size for a BPE to train (it may
    learn fewer), or the size of the tokenizer.json at data.tokenizer."""
    if d.tokenizer == "bytes":
        return 256
    if d.tokenizer == "bpe":
        return d.vocab_size
    path = Path(d.tokenizer).expanduser()
    try:
        stamp = path.stat().st_mtime_ns
    except OSError:
        stamp = None
    return _tokenizer_file_size(str(path), stamp)


@functools.lru_cache(maxsize=16)
def _tokenizer_file_size(path: str, stamp) -> int:
    from plait.data.tokenizer import load_tokenizer_file

    return load_tokenizer_file(path).vocab_size  # missing or malformed: a ConfigError naming the key


def _validate_data_keys(cfg: Config) -> None:
    """data.tokenizer, data.vocab_size and [log] (the corpus itself: `_check_data_fits`)."""
    d, m = cfg.data, cfg.model
    _require(
        256 <= d.vocab_size <= MAX_BPE_VOCAB,
        f"data.vocab_size = {d.vocab_size} is out of range: a byte-level BPE has 256 .. "
        f"{MAX_BPE_VOCAB:,} ids",
    )
    _require(
        d.tokenizer.strip() != "",
        "data.tokenizer is empty; valid: 'bytes', 'bpe', or the path of a tokenizer.json",
    )
    if d.tokenizer != "bytes":
        size = tokenizer_vocab_size(d)
        _require(
            m.vocab_size is None or m.vocab_size >= size,
            f"model.vocab_size = {m.vocab_size} is smaller than the {size} ids of data.tokenizer = "
            f"{d.tokenizer!r}; leave model.vocab_size unset (it follows the tokenizer) or use >= {size}",
        )
    if cfg.log.tensorboard:
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise ConfigError(
                "log.tensorboard = true needs the tensorboard package: pip install plait[tensorboard]"
            ) from None


def describe_keys() -> str:
    """Every key with its type, default and doc, for `plait train --help`."""
    lines = []
    for section, cls in _SECTION_TYPES.items():
        lines.append(f"[{section}]  {cls.__doc__.strip()}")
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            lines.append(f"  --{section}.{f.name} (default {default!r}): {f.metadata.get('doc', '')}")
    return "\n".join(lines)

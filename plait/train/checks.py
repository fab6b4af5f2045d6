"""The checks `plait.train.config.validate` runs, apart from the combination table.

Two kinds: each value's own range (`check_values`: a size at least 1, a name among the valid ones,
nothing past its bound, docs/fault-tolerance.md), and whether the model and the data fit the
layout (`check_fits`: heads divisible by tp, layers by the pipeline's stages, the batch by the
micro-batches, the corpus holding a batch). Which features combine is `plait.layout.check`'s.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import tempfile
from pathlib import Path

import torch

from plait.comm.compress import COMPRESSIONS
from plait.context_parallel import STYLES as CP_STYLES
from plait.context_parallel import check_heads, split_for
from plait.data import DistributedBatchSampler, load_corpus
from plait.data.sources import binary_note
from plait.data.tokenizer import MAX_BPE_VOCAB, tokenizer_vocab_size
from plait.errors import ConfigError
from plait.layout import OFFLOADS, ZERO_STAGES, Layout
from plait.models import GPT, gpt_config
from plait.models.resolve import SIZE_KEYS, model_config
from plait.optim import OPTIMIZER_NAMES
from plait.pipeline.schedules import SCHEDULES, make_schedule

COMM_TARGETS = ("gradient", "momentum")
PLANS = ("manual", "auto")
PS_CONSISTENCY = ("bsp", "ssp", "async")
PS_OPTIMIZERS = ("sgd", "adagrad", "adamw")
RUNTIMES = ("spmd", "controller")

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


def require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def check_bounds(cfg) -> None:
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
    require(
        world <= MAX_SIZE,
        f"parallel.pp x dp x ep x cp x tp = {world:,} ranks is out of range: at most {MAX_SIZE:,}",
    )


def _valid(section_key: str, value, valid, known: str = "is unknown") -> None:
    require(value in valid, f"{section_key} = {value!r} {known}; valid: {', '.join(map(str, valid))}")


def check_values(cfg) -> None:
    """Each key's own range, section by section (module docstring)."""
    _check_parallel(cfg.parallel)
    _check_train(cfg.train)
    d, c, o = cfg.data, cfg.comm, cfg.optim
    require(
        0 < d.held_out_fraction <= 0.5,
        f"data.held_out_fraction must be in (0, 0.5], got {d.held_out_fraction}",
    )
    require(
        256 <= d.vocab_size <= MAX_BPE_VOCAB,
        f"data.vocab_size = {d.vocab_size} is out of range: a byte-level BPE has 256 .. "
        f"{MAX_BPE_VOCAB:,} ids",
    )
    require(
        d.tokenizer.strip() != "",
        "data.tokenizer is empty; valid: 'bytes', 'bpe', or the path of a tokenizer.json",
    )
    require(c.timeout_s > 0, f"comm.timeout_s must be positive, got {c.timeout_s}")
    _valid("comm.compression", c.compression, COMPRESSIONS)
    require(0 < c.topk_ratio <= 1, f"comm.topk_ratio must be in (0, 1], got {c.topk_ratio}")
    require(c.powersgd_rank >= 1, f"comm.powersgd_rank must be >= 1, got {c.powersgd_rank}")
    _valid("comm.target", c.target, COMM_TARGETS)
    if c.target == "momentum":
        require(
            c.freeze_step < cfg.train.steps,
            f"comm.freeze_step = {c.freeze_step} >= train.steps = {cfg.train.steps}: the run would never "
            "compress; lower comm.freeze_step (the paper: 15-25% of training)",
        )
        require(
            1 <= c.freeze_step,
            f"comm.freeze_step must be >= 1 (uncompressed AdamW steps that learn the variance), "
            f"got {c.freeze_step}",
        )
    _valid("optim.name", o.name, OPTIMIZER_NAMES)
    require(0 <= o.momentum < 1, f"optim.momentum must be in [0, 1), got {o.momentum}")
    _valid("offload.optimizer", cfg.offload.optimizer, OFFLOADS, "is not valid")
    _check_ps(cfg.ps)
    _valid("runtime.kind", cfg.runtime.kind, RUNTIMES)
    require(cfg.runtime.run_ahead >= 1, f"runtime.run_ahead must be >= 1, got {cfg.runtime.run_ahead}")
    _check_model(cfg.model)
    if cfg.log.tensorboard:
        try:
            import tensorboard  # noqa: F401  (optional: pip install plait[tensorboard])
        except ImportError:
            raise ConfigError(
                "log.tensorboard = true needs the tensorboard package: pip install plait[tensorboard]"
            ) from None


def _check_parallel(p) -> None:
    for name in ("dp", "tp", "pp", "ep", "cp"):
        require(getattr(p, name) >= 1, f"parallel.{name} must be >= 1, got {getattr(p, name)}")
    _valid("parallel.cp_style", p.cp_style, CP_STYLES, "is not valid")
    _valid("parallel.plan", p.plan, PLANS, "is not valid")
    require(p.world >= 0, f"parallel.world must be >= 0 (0 = pp x dp x ep x cp x tp), got {p.world}")
    require(p.bucket_mb > 0, f"parallel.bucket_mb must be positive, got {p.bucket_mb}")
    _valid("parallel.zero_stage", p.zero_stage, ZERO_STAGES, "is not valid")
    require(
        p.hybrid_shard >= 0 and (p.hybrid_shard == 0 or p.dp % p.hybrid_shard == 0),
        f"parallel.hybrid_shard = {p.hybrid_shard} must divide parallel.dp = {p.dp} (or be 0 for no hybrid)",
    )
    _valid("parallel.schedule", p.schedule, SCHEDULES, "is not valid")
    require(p.microbatches >= 0, f"parallel.microbatches must be >= 0, got {p.microbatches}")
    require(p.virtual_stages >= 0, f"parallel.virtual_stages must be >= 0, got {p.virtual_stages}")


def _check_train(t) -> None:
    for name in ("steps", "global_batch", "micro_batches", "log_every", "eval_batches", "keep_checkpoints"):
        require(getattr(t, name) >= 1, f"train.{name} must be >= 1, got {getattr(t, name)}")
    for name in ("warmup_steps", "eval_every", "checkpoint_every", "stop_at", "sample_tokens", "seed"):
        require(getattr(t, name) >= 0, f"train.{name} must be >= 0, got {getattr(t, name)}")
    require(
        t.lr > 0 and 0 <= t.min_lr <= t.lr,
        f"need 0 <= train.min_lr <= train.lr and lr > 0 (lr={t.lr}, min_lr={t.min_lr})",
    )
    require(0 <= t.beta1 < 1 and 0 <= t.beta2 < 1, "train.beta1 and train.beta2 must be in [0, 1)")
    require(t.grad_clip >= 0 and t.weight_decay >= 0, "train.grad_clip and train.weight_decay must be >= 0")
    require(t.device in ("auto", "cpu", "cuda"), f"train.device must be auto, cpu or cuda, got {t.device!r}")
    require(t.peak_tflops >= 0, "train.peak_tflops must be >= 0")
    _valid("train.nonfinite", t.nonfinite, ("skip", "stop"), "is not valid")
    for name in ("max_restarts", "replica_check_every"):
        require(getattr(t, name) >= 0, f"train.{name} must be >= 0, got {getattr(t, name)}")
    require(t.max_nonfinite >= 1, f"train.max_nonfinite must be >= 1, got {t.max_nonfinite}")


def _check_ps(s) -> None:
    require(s.servers >= 0, f"ps.servers must be >= 0 (0 = no parameter server), got {s.servers}")
    _valid("ps.consistency", s.consistency, PS_CONSISTENCY)
    require(s.staleness >= 0, f"ps.staleness must be >= 0 (0 = bsp), got {s.staleness}")
    _valid("ps.server_optimizer", s.server_optimizer, PS_OPTIMIZERS)


def _check_model(m) -> None:
    require(0 <= m.dropout < 1, f"model.dropout must be in [0, 1), got {m.dropout}")
    require(m.experts >= 0, f"model.experts must be >= 0 (0 = dense), got {m.experts}")
    if m.experts:
        require(m.top_k in (1, 2), f"model.top_k = {m.top_k} is not valid; valid: 1 (Switch), 2 (GShard)")
        require(m.top_k <= m.experts, f"model.top_k = {m.top_k} is more than model.experts = {m.experts}")
        require(
            m.capacity_factor >= 0,
            f"model.capacity_factor must be >= 0 (0 = dropless), got {m.capacity_factor}",
        )
        require(m.moe_every >= 1, f"model.moe_every must be >= 1, got {m.moe_every}")
        require(
            m.aux_loss_coef >= 0 and m.z_loss_coef >= 0,
            f"model.aux_loss_coef and model.z_loss_coef must be >= 0, got {m.aux_loss_coef}, {m.z_loss_coef}",
        )
    base = gpt_config(m.name)  # an unknown name is an error listing the valid ones
    sizes = {k: getattr(m, k) if getattr(m, k) is not None else getattr(base, k) for k in SIZE_KEYS}
    for name, value in sizes.items():
        require(value >= 1, f"model.{name} must be >= 1, got {value}")
    require(
        sizes["d_model"] % sizes["n_head"] == 0,
        f"model.d_model = {sizes['d_model']} is not divisible by model.n_head = {sizes['n_head']}",
    )


def check_writable_dir(path: str, key: str) -> None:
    """Create `path` if needed and write a probe file, or raise a ConfigError naming `key`."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".plait-probe-"):
            pass
        if not os.access(path, os.W_OK):
            raise PermissionError(f"no write permission on {path}")
    except OSError as exc:
        raise ConfigError(f"{key} = {path!r} is not a writable directory ({exc}); choose another") from None


def check_fits(cfg, layout: Layout, data: bool) -> None:
    """The model and the data against the layout (module docstring); `data=False` leaves out the
    corpus (the planner validates layouts for clusters whose data is elsewhere)."""
    p, m = cfg.parallel, cfg.model
    python = m.source.startswith("python:")  # its factory's model splits itself (check_source)
    if m.experts and not python:
        require(
            m.experts % p.ep == 0,
            f"model.experts = {m.experts} does not divide over parallel.ep = {p.ep}: use a multiple "
            f"of {p.ep}",
        )
    _check_batch_split(cfg)
    if cfg.data.tokenizer != "bytes":
        size = tokenizer_vocab_size(cfg.data)
        require(
            m.vocab_size is None or m.vocab_size >= size,
            f"model.vocab_size = {m.vocab_size} is smaller than the {size} ids of data.tokenizer = "
            f"{cfg.data.tokenizer!r}; leave model.vocab_size unset (it follows the tokenizer) or use "
            f">= {size}",
        )
    model = model_config(cfg)
    if data and cfg.data.tokenizer == "bytes":
        require(
            model.vocab_size >= 256,
            f"model.vocab_size = {model.vocab_size} is below the 256 byte values of plait's corpora: "
            "use model.vocab_size >= 256",
        )
    if data:
        _check_data_fits(cfg, model.seq_len)
    # plait's GPT's own splits; a python: source's plan splits its own layers (apply_tp checks them)
    require(
        python or model.n_head % p.tp == 0,
        f"model.n_head = {model.n_head} is not divisible by parallel.tp = {p.tp}",
    )
    require(
        python or model.ff_dim % p.tp == 0,
        f"model.d_ff = {model.ff_dim} is not divisible by parallel.tp = {p.tp}",
    )
    require(
        not p.sequence_parallel or model.seq_len % p.tp == 0,
        f"model.seq_len = {model.seq_len} is not divisible by parallel.tp = {p.tp} "
        "(parallel.sequence_parallel)",
    )
    if p.cp > 1:
        _check_cp_fits(cfg, model, python)
    if p.pp > 1:
        _check_pipeline_fits(cfg, layout, None if python else model.n_layer)
    if cfg.ps.servers and m.source == "plait":
        _check_ps_fits(cfg)
    if cfg.offload.optimizer == "disk" and cfg.offload.path:
        check_writable_dir(cfg.offload.path, "offload.path")


def _check_cp_fits(cfg, model, python: bool) -> None:
    """Context parallelism: the sequence splits into the style's chunks (`split_for` says why
    not), each rank's part splits over tp under sequence parallelism, Ulysses' heads divide by
    tp x cp, and the model attends through plait's `attention` (a transformers layer of the
    generic path computes its own)."""
    p = cfg.parallel
    split = split_for(model.seq_len, p.cp, p.cp_style)
    if p.sequence_parallel:
        lens = sorted({split.local_len(r) for r in range(p.cp)})
        require(
            all(n % p.tp == 0 for n in lens),
            f"model.seq_len = {model.seq_len} over parallel.cp = {p.cp} gives each rank "
            f"{' or '.join(map(str, lens))} tokens, which do not split over parallel.tp = {p.tp} "
            f"(parallel.sequence_parallel): use a seq_len that is a multiple of {2 * p.cp * p.tp}",
        )
    if p.cp_style == "ulysses" and not python:
        kv = getattr(model, "n_kv_head", None) or model.n_head  # grouped-query attention's, or n_head
        check_heads(model.n_head // p.tp, kv // p.tp, p.cp)
    source = cfg.model.source
    require(
        not source.startswith("hf:") or not model.generic,
        f"parallel.cp = {p.cp} needs a model whose attention is plait's (plait's GPT, hf:llama, "
        f"hf:gpt2, or a python: model that calls plait.context_parallel.interface); model.source = "
        f"{source!r} runs transformers' own layers: set parallel.cp = 1",
    )


def _check_batch_split(cfg) -> None:
    t, p = cfg.train, cfg.parallel
    per = p.dp * p.ep * t.micro_batches  # the batch is split over dp x ep
    if t.global_batch % per:
        lo, hi = (t.global_batch // per) * per, math.ceil(t.global_batch / per) * per
        ranks = f"parallel.dp = {p.dp}" + (f" x parallel.ep = {p.ep}" if p.ep > 1 else "")
        raise ConfigError(
            f"train.global_batch = {t.global_batch} does not split into {ranks} ranks x "
            f"train.micro_batches = {t.micro_batches}: use a multiple of {per} (e.g. {lo or hi} or {hi})"
        )


@functools.lru_cache(maxsize=256)
def _schedule_problem(kind: str, pp: int, m: int, v: int) -> str:
    """'' if the schedule builds and checks, else why not. Cached: building and checking a long
    schedule takes seconds, and the planner validates many layouts that share one."""
    try:
        make_schedule(kind, pp, m, v)
    except ConfigError as exc:
        return str(exc)
    return ""


def _check_pipeline_fits(cfg, layout: Layout, n_layer: int | None) -> None:
    """The schedule builds, the layers cut into its stages and the rows into its micro-batches."""
    p, t = cfg.parallel, cfg.train
    m, v = layout.pipeline_microbatches, layout.stages_per_rank
    require(
        p.pp * m * v <= MAX_PIPELINE_ACTIONS,
        f"parallel.pp x microbatches x virtual_stages = {p.pp} x {m} x {v} = {p.pp * m * v:,} is out of "
        f"range: at most {MAX_PIPELINE_ACTIONS:,} (the schedule is built and checked action by action, "
        "before start and on every rank); lower parallel.microbatches",
    )
    problem = _schedule_problem(p.schedule, p.pp, m, v)
    if problem:
        raise ConfigError(f"[parallel] pp = {p.pp}, schedule = {p.schedule!r}, microbatches = {m}: {problem}")
    n = layout.n_stages
    if n_layer is not None and n_layer % n:  # None: a python: model, cut by its own split
        valid = [k for k in range(1, n_layer + 1) if n_layer % k == 0]
        raise ConfigError(
            f"model.n_layer = {n_layer} is not divisible into parallel.pp x virtual_stages = {p.pp} x {v} = "
            f"{n} pipeline stages; pp x virtual_stages must be one of {valid}"
        )
    ranks = p.dp * p.ep  # the batch is split over dp x ep
    rows = t.global_batch // ranks
    where = "dp rank" if p.ep == 1 else "dp x ep rank"
    require(
        rows % m == 0,
        f"train.global_batch = {t.global_batch} gives {rows} rows per {where}, not divisible into "
        f"parallel.microbatches = {m} pipeline micro-batches; use a global_batch multiple of {ranks * m}",
    )


def _check_ps_fits(cfg) -> None:
    """Each parameter server owns a range of whole tensors: at most one server per tensor."""
    with torch.device("meta"):
        n = len(list(GPT(model_config(cfg)).parameters()))
    require(
        cfg.ps.servers <= n,
        f"ps.servers = {cfg.ps.servers} is more than the model's {n} parameter tensors (each server owns a "
        f"range of whole tensors); use ps.servers <= {n}",
    )


def _check_data_fits(cfg, seq_len: int) -> None:
    """The corpus must hold a global batch for training and one for the held-out evaluation."""
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
    if tokenizer == "bytes" and (note := binary_note(d.corpus)):  # (a BPE refuses what is not UTF-8)
        print(f"plait: warning: {note}", file=sys.stderr, flush=True)
    DistributedBatchSampler(
        corpus.train, seq_len, t.global_batch, 0, cfg.parallel.dp, t.seed, micro_batches=t.micro_batches
    )
    windows = len(corpus.val) // (seq_len + 1)
    require(
        windows >= t.global_batch,
        f"the held-out split holds {windows} sequences of {seq_len + 1} tokens, fewer than one evaluation "
        f"batch of train.global_batch = {t.global_batch}: raise data.held_out_fraction "
        f"(now {d.held_out_fraction}), or lower train.global_batch or model.seq_len",
    )

"""What `plait train --resume RUN_DIR --section.key value` may change, key by key.

Every key of the configuration is in exactly one class (`resume_rule`), and the resumed run's
config.toml records only values the run uses:

* **fixed**: the checkpoint holds what the key made (the model, the data and its order, the
  optimizer's kind and state, 1-bit Adam's frozen variance, a parameter server's state), or the
  key is the run itself (its directory). A value other than the run's is refused with one line
  before any rank starts.
* **resharded**: the layout; checkpoints are layout-free (`plait.zero.state`) and DCP reads the
  shards the new layout needs.
* **reapplied**: the checkpoint restores the optimizer's parameter groups (learning rate, weight
  decay, betas, momentum) and the LR schedule; `reapply_config` then sets them from the
  configuration, so the new schedule (lr, min_lr, warm-up, steps) takes over from the step reached
  and rank 0 says so: "plait: resume: lr 0.003 -> 0.001 from step 120".
* **live**: read from the configuration when the run starts or at every step (clipping, logging,
  evaluation, checkpointing, precision, recomputation, compression, timeouts, offload, ...).
"""

from __future__ import annotations

from pathlib import Path

from plait.errors import ConfigError
from plait.state import group_options, set_group_options
from plait.train.sections import SECTION_TYPES, Config

FIXED = "fixed"
RESHARDED = "resharded"
REAPPLIED = "reapplied"
LIVE = "live"

_FIXED_SECTIONS = ("model", "data")
_FIXED_KEYS = {
    "train.global_batch": "the batch and the sampler's position in the data",
    "train.micro_batches": "the sampler's position in the data",
    "train.seed": "the initialisation and the data order",
    "train.run_dir": "--resume names the run directory",
    "parallel.plan": "the layout is chosen once (give the layout keys instead)",
    "parallel.world": "the layout is chosen once (give the layout keys instead)",
    "optim.name": "the optimizer state in the checkpoint is that optimizer's",
    "comm.target": "the optimizer state in the checkpoint is that optimizer's",
    "comm.freeze_step": "1-bit Adam's variance froze at that step",
    "ps.servers": "a parameter-server run and a plain run keep different checkpoints",
    "ps.server_optimizer": "the servers' optimizer state is that optimizer's",
}
RESHARDABLE = (
    "parallel.pp",
    "parallel.schedule",
    "parallel.microbatches",
    "parallel.virtual_stages",
    "parallel.dp",
    "parallel.ep",
    "parallel.tp",
    "parallel.sequence_parallel",
    "parallel.zero_stage",
    "parallel.hybrid_shard",
    "parallel.bucket_mb",
)
_REAPPLIED_KEYS = (
    "train.lr",
    "train.min_lr",
    "train.warmup_steps",
    "train.steps",
    "train.weight_decay",
    "train.beta1",
    "train.beta2",
    "optim.momentum",
)

# a parameter-server run's servers load their optimizer (its options too) from their checkpoint
_PS_RESTORED = ("train.weight_decay", "train.beta1", "train.beta2", "optim.momentum")


def all_keys() -> list[str]:
    """Every `section.key` of the configuration."""
    return [f"{s}.{f}" for s, cls in SECTION_TYPES.items() for f in cls.__dataclass_fields__]


def resume_rule(key: str) -> str:
    """FIXED, RESHARDED, REAPPLIED or LIVE for `key` ("section.key")."""
    if key == "data.cache_dir":  # where the tokens are cached, not what they are
        return LIVE
    if key.split(".")[0] in _FIXED_SECTIONS or key in _FIXED_KEYS:
        return FIXED
    if key in RESHARDABLE:
        return RESHARDED
    if key in _REAPPLIED_KEYS:
        return REAPPLIED
    return LIVE


def check_resume_changes(old: Config, new: Config, given: list[str], run_dir) -> None:
    """Refuse, in one line, a key given on the command line whose new value the checkpoint
    would override (`FIXED`); the same value as the run's passes."""
    changed = []
    for key in given:
        section, _, name = key.partition(".")
        was, now = getattr(getattr(old, section), name), getattr(getattr(new, section), name)
        if key == "train.run_dir":  # the same directory, however written, passes
            was, now = str(Path(run_dir).resolve()), str(Path(now).resolve())
        why = _FIXED_KEYS.get(key, "the checkpoint holds that model and data")
        if new.ps.servers and key in _PS_RESTORED:
            why = "a parameter server restores its optimizer's options from its checkpoint"
        elif resume_rule(key) != FIXED:
            continue
        if was != now:
            changed.append(f"{key} cannot change on resume ({was!r} -> {now!r}: {why})")
    if changed:
        raise ConfigError(
            f"--resume continues the run as configured; {'; '.join(changed)}: start a new run instead. "
            "What may change: the layout (parallel.dp, tp, pp, ep, zero_stage, ...), the schedule and "
            "optimizer options (train.lr, min_lr, warmup_steps, steps, weight_decay, beta1, beta2, "
            "optim.momentum) and what the run reads as it goes (logging, checkpoints, clipping, "
            "compression, offload)"
        )


def _fmt(v) -> str:
    if isinstance(v, float | int) and not isinstance(v, bool):
        return f"{v:.4g}"
    if isinstance(v, list | tuple):
        return "(" + ", ".join(_fmt(x) for x in v) + ")"
    return repr(v)


def reapply_config(
    optimizer, scheduler, fresh_groups: list[dict], fresh_base_lrs: list, step: int
) -> list[str]:
    """After a checkpoint's load: give the optimizer's groups the options the configuration built
    them with (`fresh_groups`, taken before the load) and the schedule its configured base rates,
    and set each group's rate to the configured schedule's at `step`. Returns the lines saying
    what changed ("lr 0.003 -> 0.001 from step 120"); none when the configuration is the
    checkpoint's (then the rates are those saved, bit for bit: the same formula)."""
    loaded = group_options(optimizer)
    lines: list[str] = []
    options = []
    for was, want in zip(loaded, fresh_groups, strict=True):
        options.append({k: v for k, v in want.items() if k not in ("lr", "initial_lr")})
        for k, v in options[-1].items():
            line = f"{k} {_fmt(was.get(k))} -> {_fmt(v)} from step {step}"
            if k in was and was[k] != v and line not in lines:
                lines.append(line)
    set_group_options(optimizer, options)
    old_lr = float(optimizer.param_groups[0]["lr"])
    scheduler.base_lrs = list(fresh_base_lrs)
    for g, base, fn in zip(optimizer.param_groups, fresh_base_lrs, scheduler.lr_lambdas, strict=True):
        g["initial_lr"] = base
        g["lr"] = base * fn(scheduler.last_epoch)
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]  # get_last_lr(), as after a step
    new_lr = float(optimizer.param_groups[0]["lr"])
    if new_lr != old_lr:
        lines.insert(0, f"lr {_fmt(old_lr)} -> {_fmt(new_lr)} from step {step}")
    return lines

"""[diloco]'s checks: each key's own range (validation), and who may start it (its launcher).
Its runtime is plait.train.diloco, its pricing plait.planner.diloco."""

from __future__ import annotations

import os

from plait.errors import ConfigError
from plait.train.checks import _valid, require
from plait.train.diloco_replicas import ENV_GROUP

DILOCO_OUTER = ("nesterov", "sgd")
DILOCO_COMPRESSIONS = ("none", "fp16", "bf16", "onebit", "topk", "powersgd")


def check_diloco(d, p, t=None) -> None:
    """[diloco]'s own ranges (its pricing is plait.planner.diloco; its runtime: check_trainable)."""
    if d.inner_steps and t is not None and t.max_restarts:
        raise ConfigError(
            f"train.max_restarts = {t.max_restarts} does not apply to DiLoCo (diloco.inner_steps = "
            f"{d.inner_steps}): a failed replica group is restarted by diloco.fault_tolerant = true "
            "(at most diloco.max_rejoins times); set train.max_restarts = 0"
        )
    require(d.inner_steps >= 0, f"diloco.inner_steps must be >= 0 (0 = DiLoCo off), got {d.inner_steps}")
    require(d.replicas >= 0, f"diloco.replicas must be >= 0 (0 = parallel.dp), got {d.replicas}")
    if d.replicas:
        require(
            p.dp % d.replicas == 0,
            f"diloco.replicas = {d.replicas} does not divide parallel.dp = {p.dp}: a replica group is "
            f"dp / replicas whole dp ranks; valid: the divisors of {p.dp}",
        )
    _valid("diloco.outer_optimizer", d.outer_optimizer, DILOCO_OUTER)
    _valid("diloco.compression", d.compression, DILOCO_COMPRESSIONS)
    require(d.outer_lr > 0, f"diloco.outer_lr must be positive, got {d.outer_lr}")
    require(0 <= d.outer_momentum < 1, f"diloco.outer_momentum must be in [0, 1), got {d.outer_momentum}")
    require(d.fragments >= 1, f"diloco.fragments must be >= 1, got {d.fragments}")
    require(d.overlap_steps >= 0, f"diloco.overlap_steps must be >= 0, got {d.overlap_steps}")
    require(0 <= d.mix <= 1, f"diloco.mix must be in [0, 1], got {d.mix}")
    if d.inner_steps:
        require(
            d.fragments <= d.inner_steps,
            f"diloco.fragments = {d.fragments} > diloco.inner_steps = {d.inner_steps}: each fragment "
            "needs a step of its own in the H steps between its synchronisations",
        )
        require(
            d.overlap_steps < d.inner_steps,
            f"diloco.overlap_steps = {d.overlap_steps} must be below diloco.inner_steps = {d.inner_steps}: "
            "a fragment's exchange must land before its next one starts",
        )


def check_trainable(cfg) -> None:
    """A DiLoCo job is started by its own launcher (plait.train.diloco_launch, as plait train
    does), not by plait.train.launch nor under an outer torchrun: its replica groups are worlds
    of their own. Refused before any process starts."""
    if cfg.diloco.inner_steps and os.environ.get(ENV_GROUP) is None:
        raise ConfigError(
            f"diloco.inner_steps = {cfg.diloco.inner_steps}: DiLoCo's replica groups are started by "
            "plait train itself (plait.train.diloco_launch.launch_diloco), not by plait.train.launch "
            "or under torchrun"
        )

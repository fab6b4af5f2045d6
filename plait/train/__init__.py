"""Training: configuration, the loop, metrics, checkpoints and the launcher."""

from plait.recompute import apply_activation_checkpointing
from plait.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint, verify_checkpoint
from plait.train.config import Config, config_from_dict, describe_keys, load_config, model_config, validate
from plait.train.launch import launch

__all__ = [
    "Config",
    "apply_activation_checkpointing",
    "config_from_dict",
    "describe_keys",
    "latest_checkpoint",
    "launch",
    "load_checkpoint",
    "load_config",
    "model_config",
    "save_checkpoint",
    "validate",
    "verify_checkpoint",
]

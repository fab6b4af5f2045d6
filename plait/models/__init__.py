"""Plain PyTorch models; parallelism is applied to them from outside (see plait.tensor_parallel)."""

from plait.models.cnn import DigitsCNN
from plait.models.flops import gpt_param_estimate, gpt_train_flops_per_token
from plait.models.gpt import GPT, GPT_CONFIG_NAMES, Block, CausalSelfAttention, GPTConfig, gpt_config
from plait.models.mlp import MLP

__all__ = [
    "GPT",
    "GPTConfig",
    "Block",
    "CausalSelfAttention",
    "MLP",
    "DigitsCNN",
    "gpt_config",
    "GPT_CONFIG_NAMES",
    "gpt_train_flops_per_token",
    "gpt_param_estimate",
]

"""The pieces of a Hugging Face decoder that `plait.models.hf.HFCausalLM` drives itself (see its
docstring): plait's blocks holding each transformers layer's submodules, the attention they
compute, GPT-2's Conv1D <-> Linear layouts, and the transformers class of an architecture.

A module of its own so that the model (`hf`), its parallel layouts (`hf_parallel`) and its
weight files (`hf_weights`) all build on it without importing one another in a circle.
"""

from __future__ import annotations

import torch
from torch import nn

from plait.context_parallel import attention, positions


def hf_model_class(arch: str):
    """What builds a model of `arch` from its transformers config: GPT2LMHeadModel,
    LlamaForCausalLM, or for any other architecture ``AutoModelForCausalLM.from_config`` (imported
    when asked: transformers is an optional dependency)."""
    from transformers import AutoModelForCausalLM, GPT2LMHeadModel, LlamaForCausalLM

    own = {"gpt2": GPT2LMHeadModel, "llama": LlamaForCausalLM}
    return own.get(arch, AutoModelForCausalLM.from_config)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of (B, heads, T, hd) q on (B, kv heads, T, hd) k, v: each key/value head
    serves the consecutive group of query heads it is repeated for (grouped-query attention),
    through plait's `attention` (exact across the ranks under context parallelism). `scale` is
    1/sqrt(hd) for both models: the configs plait builds use neither GPT-2's per-layer scaling
    nor Llama's separate head_dim."""
    return attention(q, k, v, scale=scale)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2021) in the half-split layout Llama uses: the pair
    (x_i, x_{i + hd/2}) is rotated by the angle of frequency i."""
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + turned * sin


class LlamaBlock(nn.Module):
    """One Llama decoder layer (pre-RMSNorm attention with rotary positions, then SwiGLU MLP)
    holding the transformers layer's submodules under their names."""

    def __init__(self, layer: nn.Module, rotary: nn.Module):
        super().__init__()
        self.input_layernorm = layer.input_layernorm
        self.self_attn = layer.self_attn
        self.post_attention_layernorm = layer.post_attention_layernorm
        self.mlp = layer.mlp
        self._rotary = (rotary,)  # shared by the layers, owned by the model (a tuple: no submodule)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._attend(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))

    def _attend(self, h: torch.Tensor) -> torch.Tensor:
        a = self.self_attn
        q, k, v = a.q_proj(h), a.k_proj(h), a.v_proj(h)
        B, T, _ = q.shape  # the whole sequence, also when h is a sequence shard
        q, k, v = (t.view(B, T, -1, a.head_dim).transpose(1, 2) for t in (q, k, v))
        # 0..T-1, or this rank's own positions under context parallelism: the rotary angles
        cos, sin = self._rotary[0](q, positions(T, q.device).unsqueeze(0))
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        y = _sdpa(_rotate(q, cos, sin), _rotate(k, cos, sin), v, a.head_dim**-0.5)
        return a.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class GPT2Block(nn.Module):
    """One GPT-2 block (pre-LayerNorm attention with a fused qkv, then the GELU MLP) holding the
    transformers block's submodules under their names."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = block.ln_1, block.attn, block.ln_2, block.mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._attend(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))

    def _attend(self, h: torch.Tensor) -> torch.Tensor:
        a = self.attn
        qkv = a.c_attn(h)
        B, T, _ = qkv.shape
        q, k, v = (t.view(B, T, -1, a.head_dim).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
        y = _sdpa(q, k, v, a.head_dim**-0.5)
        return a.resid_dropout(a.c_proj(y.transpose(1, 2).reshape(B, T, -1)))


CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
"""GPT-2's Conv1D layers, by name within a block (converted to nn.Linear, transposed)."""


def _linear_from_conv1d(conv: nn.Module) -> nn.Linear:
    n_in, n_out = conv.weight.shape  # Conv1D keeps (in, out): y = x W + b
    lin = nn.Linear(n_in, n_out, device=conv.weight.device, dtype=conv.weight.dtype)
    with torch.no_grad():
        lin.weight.copy_(conv.weight.t())
        lin.bias.copy_(conv.bias)
    return lin


def hf_state_from(arch: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` in plait's layout (names are transformers') -> transformers' layouts."""
    if arch != "gpt2":
        return dict(state)
    conv = tuple(f"{n}.weight" for n in CONV1D)
    return {k: (v.t() if k.endswith(conv) else v) for k, v in state.items()}

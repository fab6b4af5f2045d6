"""A GPT-2 style decoder-only transformer in plain PyTorch.

The architecture follows GPT-2 (Radford et al. 2019, "Language Models are Unsupervised Multitask
Learners", §2.3): learned token and position embeddings, pre-LayerNorm residual blocks
(``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``), a final LayerNorm and a language-model head
whose weight is tied to the token embedding (Press & Wolf 2017).

Nothing here knows about parallelism. Tensor, pipeline and data parallelism are applied from
outside and find the layers by name, so the module names are part of the interface::

    wte, wpe, blocks.N.ln_1, blocks.N.attn.qkv, blocks.N.attn.proj,
    blocks.N.ln_2, blocks.N.mlp.fc, blocks.N.mlp.proj, ln_f, lm_head

How the GPT is cut for them (its pipeline stages, its tensor-parallel plan) is in
`plait.models.gpt_parallel`; ``GPT.pipeline_split`` and ``GPT.tp_plan`` return those cuts to
the generic `plait.pipeline` and `plait.tensor_parallel`.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from plait.context_parallel import attention, positions
from plait.models.gpt_config import GPT_CONFIG_NAMES, GPTConfig, gpt_config
from plait.models.gpt_parallel import gpt_plan, split_gpt
from plait.moe import MoE, attach_loss
from plait.moe.parallel import StatsHolder, current_objective_scale

__all__ = [
    "GPT",
    "GPT_CONFIG_NAMES",
    "AttentionCore",
    "Block",
    "CausalSelfAttention",
    "FeedForward",
    "GPTConfig",
    "MoEFeedForward",
    "cross_entropy",
    "gpt_config",
]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention (Vaswani et al. 2017, §3.2.2) with one fused qkv GEMM.

    The qkv output is laid out as ``[q | k | v]``, each ``d_model`` wide and head-major inside.
    The number of heads is read from the qkv output width at run time, so a tensor-parallel
    plan that keeps whole heads of q, k and v on each rank (Megatron-LM §3) needs no change here.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)

        self.core = AttentionCore(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)
        B, T, _ = qkv.shape  # (a sequence-parallel qkv returns more positions than x has)
        q, k, v = qkv.chunk(3, dim=-1)
        n_head = q.shape[-1] // self.head_dim
        q, k, v = (t.view(B, T, n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = self.core(q, k, v)
        y = y.transpose(1, 2).reshape(B, T, n_head * self.head_dim)
        return self.resid_dropout(self.proj(y))


class AttentionCore(nn.Module):
    """softmax(q k^T / sqrt(d) + causal mask) v with attention dropout: no parameters.

    A module of its own so that a parallel plan can wrap it (tensor parallelism runs it on a
    per-rank random stream: each rank drops out its own heads). It calls plait's `attention`,
    which is scaled dot-product attention except under context parallelism, where it attends
    over the whole sequence of which this rank holds a part (plait.context_parallel)."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.dropout = dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attention(q, k, v, dropout_p=self.dropout if self.training else 0.0)


class FeedForward(nn.Module):
    """The position-wise MLP of GPT-2: ``proj(gelu(fc(x)))`` with the tanh GELU approximation."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.ff_dim, bias=cfg.bias)
        self.proj = nn.Linear(cfg.ff_dim, cfg.d_model, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x), approximate="tanh")))


class MoEFeedForward(nn.Module):
    """A mixture-of-experts MLP (plait.moe): the tokens of each sequence are one routing group;
    the load-balancing and z losses, weighted by their coefficients, join the objective on the
    output's backward (`plait.moe.attach_loss`, scaled as `plait.moe.objective_scale` says), and
    the routing statistics of training forwards are kept for the trainer's log (`stats`)."""

    def __init__(self, cfg: GPTConfig, moe_index: int = 0) -> None:
        super().__init__()
        self.moe_index = moe_index  # its place among the model's MoE layers (for the log)
        self.moe = MoE(cfg.d_model, cfg.ff_dim, cfg.experts, cfg.top_k, cfg.capacity_factor, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)
        self.aux_coef, self.z_coef = cfg.aux_loss_coef, cfg.z_loss_coef
        self.stats = StatsHolder()
        # The share of the auxiliary losses this process adds: a parallel plan that computes the
        # same tokens on several ranks lowers it (plait.tp_plan.ExpertsReplicated).
        self.loss_share = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.moe.group_size = x.shape[-2]  # one sequence per group, whatever the layout
        y, stats = self.moe(x)
        if self.training and torch.is_grad_enabled():
            self.stats.add(stats)
            scale = current_objective_scale()
            tokens = x.numel() // x.shape[-1]
            weight = 1.0 if scale is None else scale * tokens  # coef x aux per forward, or its share
            weight *= self.loss_share
            y = attach_loss(y, self.aux_coef * stats.aux_loss + self.z_coef * stats.z_loss, weight)
        return self.dropout(y)


class Block(nn.Module):
    """One pre-LayerNorm transformer block (GPT-2 §2.3); with `moe`, a mixture-of-experts MLP."""

    def __init__(self, cfg: GPTConfig, moe: bool = False, moe_index: int = 0) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = MoEFeedForward(cfg, moe_index) if moe else FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Token-level cross-entropy of (B, T, V) logits against (B, T) targets, in fp32."""
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), reduction=reduction
    )


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


class GPT(nn.Module):
    """GPT-2 style language model; see the module docstring for the layout."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(
            Block(cfg, cfg.is_moe(i), sum(cfg.is_moe(j) for j in range(i))) for i in range(cfg.n_layer)
        )
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.wte.weight
        # Hooks a parallel plan may replace (plait.tensor_parallel.apply_tp does, for a head whose
        # output is a vocabulary shard): the loss of logits and targets, and the logits returned
        # when no targets are given.
        self.loss_fn = cross_entropy
        self.output_fn = _identity
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re-)initialise every parameter as GPT-2 does.

        Weights are N(0, 0.02); the two projections that write into the residual stream are
        scaled by 1/sqrt(2 * n_layer) (GPT-2 §2.3) so the residual variance does not grow with
        depth; biases are zero and LayerNorms the identity. Public so that a model built on the
        meta device can be materialised with ``to_empty`` and initialised afterwards.
        """
        std = 0.02
        resid_std = std / math.sqrt(2 * self.cfg.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                if name == "lm_head" and self.cfg.tie_weights:
                    continue  # shares wte.weight, initialised with the embeddings
                scaled = name.endswith("attn.proj") or name.endswith("mlp.proj")
                nn.init.normal_(module.weight, mean=0.0, std=resid_std if scaled else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()

    def plait_blocks(self) -> list[nn.Module]:
        """The repeated transformer blocks: ZeRO-3's units and what activation checkpointing
        recomputes (plait.engine.model_blocks)."""
        return list(self.blocks)

    def pipeline_split(self, n_stages: int, split="uniform") -> list[nn.Module]:
        """Cut into `n_stages` pipeline stages by blocks (plait.models.gpt_parallel.split_gpt):
        the embeddings with the first, the final LayerNorm, head and loss with the last."""
        return split_gpt(self, n_stages, split)

    def tp_plan(self) -> dict:
        """Megatron-LM's tensor-parallel plan of this GPT (plait.models.gpt_parallel.gpt_plan),
        tied or untied head as configured: what plait.tensor_parallel.apply_tp uses by default."""
        cfg = self.cfg
        moe = tuple(i for i in range(cfg.n_layer) if cfg.is_moe(i))
        return gpt_plan(cfg.tie_weights, moe, cfg.n_layer)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, reduction: str = "mean"
    ) -> torch.Tensor:
        """Logits of shape (B, T, vocab) or, given ``targets`` (B, T), the cross-entropy loss.

        ``reduction="sum"`` returns the summed loss so that a data-parallel trainer can divide
        by the number of tokens across all ranks and micro-batches instead of per rank.
        """
        B, T = idx.shape
        if T > self.cfg.seq_len:
            raise ValueError(
                f"sequence of {T} tokens is longer than the model's seq_len={self.cfg.seq_len}; "
                "crop the input or build the model with a larger seq_len"
            )
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
        pos = positions(T, idx.device)  # 0..T-1, or this rank's own under context parallelism
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return self.output_fn(logits)
        return self.loss_fn(logits, targets, reduction)

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Sample ``max_new_tokens`` tokens after ``idx`` (B, T); returns (B, T + max_new_tokens).

        The context is cropped to the last ``seq_len`` tokens. ``temperature=0`` picks the most
        likely token. Dropout is switched off while sampling and the mode restored afterwards.
        """
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        was_training = self.training
        self.eval()
        try:
            for _ in range(max_new_tokens):
                logits = self(idx[:, -self.cfg.seq_len :])[:, -1, :].float()
                if temperature == 0:
                    nxt = logits.argmax(dim=-1, keepdim=True)
                else:
                    logits = logits / temperature
                    if top_k is not None:
                        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                        logits = logits.masked_fill(logits < kth, float("-inf"))
                    probs = F.softmax(logits, dim=-1)
                    nxt = torch.multinomial(probs, num_samples=1, generator=generator)
                idx = torch.cat([idx, nxt], dim=1)
        finally:
            self.train(was_training)
        return idx

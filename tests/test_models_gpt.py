"""GPT, MLP and the analytical counts of plait.models."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop
from torch.utils.flop_counter import FlopCounterMode

from plait.errors import ConfigError
from plait.models import (
    GPT,
    GPT_CONFIG_NAMES,
    MLP,
    Block,
    GPTConfig,
    gpt_config,
    gpt_param_estimate,
    gpt_train_flops_per_token,
)


def _tiny(**overrides) -> GPT:
    torch.manual_seed(0)
    return GPT(gpt_config("tiny", **overrides))


def _batch(cfg: GPTConfig, B: int = 3, T: int | None = None, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    T = cfg.seq_len if T is None else T
    idx = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    tgt = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    return idx, tgt


def test_logits_shape_and_loss_matches_cross_entropy():
    model = _tiny()
    idx, tgt = _batch(model.cfg, B=3, T=20)
    logits = model(idx)
    assert logits.shape == (3, 20, model.cfg.vocab_size)
    expected = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))
    loss = model(idx, tgt)
    assert loss.ndim == 0
    torch.testing.assert_close(loss, expected)
    # An untrained model at init predicts close to uniform: loss near ln(V).
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.5
    torch.testing.assert_close(model(idx, tgt, reduction="sum"), loss * idx.numel())
    with pytest.raises(ValueError, match="reduction"):
        model(idx, tgt, reduction="none")


def test_too_long_input_raises():
    model = _tiny()
    idx, _ = _batch(model.cfg, B=1, T=model.cfg.seq_len + 1)
    with pytest.raises(ValueError, match="seq_len"):
        model(idx)


def test_weight_tying_shares_storage_and_can_be_off():
    tied = _tiny()
    assert tied.lm_head.weight is tied.wte.weight
    assert tied.lm_head.weight.data_ptr() == tied.wte.weight.data_ptr()
    untied = _tiny(tie_weights=False)
    assert untied.lm_head.weight.data_ptr() != untied.wte.weight.data_ptr()


@pytest.mark.parametrize(
    "overrides",
    [{}, {"tie_weights": False}, {"bias": False}, {"d_ff": 48, "n_layer": 3}],
)
def test_n_params_is_exact(overrides):
    model = _tiny(**overrides)
    # parameters() deduplicates shared tensors, so the tied weight is counted once.
    assert model.cfg.n_params() == sum(p.numel() for p in model.parameters())


def test_module_names_are_the_interface_tensor_parallel_relies_on():
    names = {n for n, _ in _tiny().named_modules()}
    for expected in [
        "wte", "wpe", "blocks.1.ln_1", "blocks.1.attn.qkv", "blocks.1.attn.proj",
        "blocks.1.ln_2", "blocks.1.mlp.fc", "blocks.1.mlp.proj", "ln_f", "lm_head",
    ]:  # fmt: skip
        assert expected in names
    assert isinstance(_tiny().blocks[0], Block)


def test_init_is_deterministic_and_gpt2_style():
    a, b = _tiny(), _tiny()
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    torch.manual_seed(1)
    c = GPT(gpt_config("tiny"))
    assert not torch.equal(a.wte.weight, c.wte.weight)

    big = GPT(gpt_config("tiny", d_model=256, n_head=4, n_layer=8))
    assert abs(big.blocks[0].mlp.fc.weight.std().item() - 0.02) < 0.002
    assert abs(big.blocks[0].attn.proj.weight.std().item() - 0.02 / 4) < 0.0005  # 1/sqrt(2*8)
    assert big.blocks[0].attn.qkv.bias.abs().sum().item() == 0.0
    assert torch.equal(big.ln_f.weight, torch.ones(256))


def test_causal_future_tokens_do_not_change_past_logits():
    model = _tiny()
    idx, _ = _batch(model.cfg, B=2)
    changed = idx.clone()
    changed[:, 10:] = (changed[:, 10:] + 7) % model.cfg.vocab_size
    before, after = model(idx), model(changed)
    torch.testing.assert_close(before[:, :10], after[:, :10])
    assert not torch.allclose(before[:, 10:], after[:, 10:])


def test_dropout_only_in_training_mode():
    model = _tiny(dropout=0.3)
    idx, _ = _batch(model.cfg, B=2)
    model.eval()
    torch.testing.assert_close(model(idx), model(idx))
    model.train()
    assert not torch.allclose(model(idx), model(idx))


def test_generate_length_cropping_and_determinism():
    model = _tiny()
    model.train()
    prompt = torch.zeros(2, 5, dtype=torch.long)
    n_new = model.cfg.seq_len + 4  # longer than the context: exercises cropping
    out1 = model.generate(prompt, n_new, top_k=10, generator=torch.Generator().manual_seed(3))
    out2 = model.generate(prompt, n_new, top_k=10, generator=torch.Generator().manual_seed(3))
    assert out1.shape == (2, 5 + n_new)
    assert torch.equal(out1[:, :5], prompt)
    assert torch.equal(out1, out2)
    assert model.training  # mode restored
    greedy = model.generate(prompt, 3, temperature=0)
    assert torch.equal(greedy[:, 5], model(prompt)[:, -1].argmax(-1))


def test_training_reduces_loss():
    model = _tiny()
    idx, _ = _batch(model.cfg, B=4)
    tgt = torch.roll(idx, -1, dims=1)  # a learnable mapping: predict the token to the right
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = model(idx, tgt).item()
    for _ in range(30):
        opt.zero_grad()
        model(idx, tgt).backward()
        opt.step()
    assert model(idx, tgt).item() < first - 1.0


def test_gpt_config_names_and_errors():
    assert {"tiny", "small", "3m", "20m", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"} <= set(
        GPT_CONFIG_NAMES
    )
    a = gpt_config("small")
    a.n_layer = 99
    assert gpt_config("small").n_layer == 4  # fresh copy every call
    assert gpt_config("tiny", dropout=0.1).dropout == 0.1
    with pytest.raises(ConfigError, match="gpt2-medium"):
        gpt_config("gpt3")
    with pytest.raises(ConfigError, match="n_layer"):
        gpt_config("tiny", n_layers=3)
    with pytest.raises(ConfigError, match="n_head"):
        GPTConfig(d_model=30, n_head=4)


@pytest.mark.parametrize(
    "name, millions", [("3m", 3), ("20m", 20), ("gpt2", 124), ("gpt2-medium", 350), ("gpt2-xl", 1558)]
)
def test_named_sizes_and_param_estimate(name, millions):
    cfg = gpt_config(name)
    n = cfg.n_params()
    assert abs(n / 1e6 - millions) / millions < 0.12
    # The estimate omits only the final LayerNorm of a tied, biased model.
    assert n - gpt_param_estimate(cfg) == 2 * cfg.d_model
    assert abs(gpt_param_estimate(cfg) - n) / n < 0.01


def _counted_train_flops(model: GPT, idx, tgt, recompute: bool) -> int:
    """FLOPs torch's own counter sees in one forward + backward of ``model``."""
    if recompute:
        # Full recomputation: each block's forward runs again during backward.
        blocks = list(model.blocks)

        class Recomputed(nn.Module):
            def __init__(self, block):
                super().__init__()
                self.block = block

            def forward(self, x):
                # Without early stop, so the block's last GEMM is recomputed too, as in the paper.
                with set_checkpoint_early_stop(False):
                    return checkpoint(self.block, x, use_reentrant=False)

        model.blocks = nn.ModuleList(Recomputed(b) for b in blocks)
    # The math backend decomposes attention into matmuls the counter knows; it computes the
    # full s x s score matrix, as the paper's count assumes, even under a causal mask.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(idx, tgt).backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("recompute", [False, True])
def test_train_flops_formula_matches_counted_flops(recompute):
    cfg = gpt_config("tiny", n_layer=3, d_model=48, n_head=3, seq_len=24, vocab_size=100)
    torch.manual_seed(0)
    model = GPT(cfg)
    idx, tgt = _batch(cfg, B=2)
    counted = _counted_train_flops(model, idx, tgt, recompute)
    assert counted == gpt_train_flops_per_token(cfg, recompute=recompute) * idx.numel()


def test_recompute_costs_one_more_forward_of_the_layers():
    cfg = gpt_config("gpt2")
    plain, recomputed = gpt_train_flops_per_token(cfg), gpt_train_flops_per_token(cfg, recompute=True)
    # 124M params -> roughly 6 * params FLOPs per token (Kaplan et al. 2020).
    assert 0.9 < plain / (6 * cfg.n_params()) < 1.3
    # Below 4/3 because the logit layer is not recomputed; its share is large at V=50257.
    assert 1.2 < recomputed / plain < 4 / 3


def test_mlp_shapes_layers_and_errors():
    torch.manual_seed(0)
    model = MLP([8, 16, 16, 4], activation="gelu")
    assert model(torch.randn(5, 8)).shape == (5, 4)
    linears = [m for m in model if isinstance(m, nn.Linear)]
    assert [m.out_features for m in linears] == [16, 16, 4]
    assert isinstance(model[-1], nn.Linear)  # no activation after the output layer
    assert sum(isinstance(m, nn.GELU) for m in model) == 2
    assert MLP([3, 2], bias=False)[0].bias is None
    with pytest.raises(ConfigError, match="activation"):
        MLP([3, 2], activation="swish2")
    with pytest.raises(ConfigError):
        MLP([3])


def test_activation_checkpointing_gives_the_same_gradients():
    from plait.models import GPT, gpt_config
    from plait.train import apply_activation_checkpointing

    cfg = gpt_config("tiny")
    torch.manual_seed(0)
    plain = GPT(cfg)
    torch.manual_seed(0)
    recomputed = GPT(cfg)
    assert apply_activation_checkpointing(recomputed) == cfg.n_layer
    x = torch.randint(0, 256, (2, cfg.seq_len))
    plain(x, x).backward()
    recomputed(x, x).backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), recomputed.named_parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name


def test_gpt_declares_its_own_pipeline_split_and_tensor_parallel_plan():
    """plait.pipeline and plait.tensor_parallel cut a GPT by what the model declares."""
    from plait.models.gpt_parallel import GPTStage, gpt_plan
    from plait.pipeline.stage import split_model
    from plait.tensor_parallel import VocabHead, apply_tp

    stages = split_model(_tiny(n_layer=4), 2)
    assert [type(s) for s in stages] == [GPTStage, GPTStage]
    assert [(s.lo, s.hi) for s in stages] == [(0, 2), (2, 4)]
    for tie in (True, False):
        plan = _tiny(tie_weights=tie).tp_plan()
        assert plan == gpt_plan(tie)
        assert plan["lm_head"] == VocabHead(tie="wte" if tie else None, dim="vocab")
    with pytest.raises(ConfigError, match="declares no tensor-parallel plan.*tp_plan"):
        apply_tp(nn.Sequential(nn.Linear(4, 4)), mesh=None)


def test_pipeline_and_tensor_parallel_name_no_gpt_layer():
    """No module of plait.pipeline or plait.tensor_parallel imports plait.models or names a
    GPT layer or config field in its code (docstrings and comments aside): the GPT's cuts live
    in plait.models.gpt_parallel."""
    import ast
    import pkgutil
    import subprocess
    import sys
    import tokenize
    from pathlib import Path

    import plait.pipeline
    import plait.tensor_parallel

    packages = (plait.pipeline, plait.tensor_parallel)
    modules = [f"{p.__name__}.{m.name}" for p in packages for m in pkgutil.iter_modules(p.__path__)]
    code = f"import sys, {', '.join(modules)}; print([m for m in sys.modules if 'plait.models' in m])"
    root = Path(plait.pipeline.__file__).parents[2]  # run the same checkout's plait
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    out = out.stdout
    assert out.strip() == "[]", f"importing {modules} imported {out.strip()}"

    gpt_names = {"wte", "wpe", "lm_head", "ln_f", "ln_1", "ln_2", "qkv", "n_layer", "tie_weights"}
    gpt_names |= {"GPT", "GPTConfig", "GPTStage", "gpt_config", "split_gpt", "gpt_plan"}
    found = []
    for path in sorted(f for p in packages for f in Path(p.__path__[0]).glob("*.py")):
        with open(path, "rb") as fh:
            for tok in tokenize.tokenize(fh.readline):
                word = tok.string
                if tok.type == tokenize.STRING:
                    try:
                        word = ast.literal_eval(tok.string)
                    except (ValueError, SyntaxError):
                        continue
                if tok.type in (tokenize.NAME, tokenize.STRING) and word in gpt_names:
                    found.append(f"{path.name}:{tok.start[0]} {tok.string}")
    assert not found, found

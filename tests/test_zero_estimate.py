"""The ZeRO memory estimator against the paper's numbers, a real model and hand computations."""

import json
import math

import pytest

from plait.cli import main
from plait.errors import ConfigError
from plait.models import GPT, gpt_config
from plait.zero.estimate import activation_bytes, dtype_preset, estimate_memory, model_state_bytes_formula


def _sig3(x: float) -> float:
    """x rounded to three significant figures, the precision of the ZeRO paper's figures."""
    return round(x, 2 - math.floor(math.log10(abs(x))))


def test_zero_paper_table_7_5b_on_64_gpus():
    # Rajbhandari et al. 2019, Figure 1: Ψ = 7.5B, N_d = 64, K = 12.
    paper = {0: 120, 1: 31.4, 2: 16.6, 3: 1.88}
    for stage, gb in paper.items():
        total = model_state_bytes_formula(7_500_000_000, 64, stage)["total"]
        assert _sig3(total / 1e9) == gb, (stage, total)
        assert _sig3(estimate_memory(params=7.5e9, dp=64, zero_stage=stage)["model_state_gb"]) == gb
    b = model_state_bytes_formula(7_500_000_000, 64, 2)
    assert b == {
        "params": 15_000_000_000,
        "grads": 234_375_000,
        "optimizer": 1_406_250_000,
        "total": 16_640_625_000,
    }


def test_breakdown_hybrid_fp32_and_presets():
    psi = 1000
    # Each stage shards one more state; 4 + 4 + 8 bytes for fp32 Adam (no master copy).
    fp32 = dict(param_bytes=4, grad_bytes=4, optimizer_k=8)
    assert model_state_bytes_formula(psi, 4, 0, **fp32) == {
        "params": 4000,
        "grads": 4000,
        "optimizer": 8000,
        "total": 16000,
    }
    assert model_state_bytes_formula(psi, 4, 1, **fp32)["optimizer"] == 2000
    assert model_state_bytes_formula(psi, 4, 2, **fp32) == {
        "params": 4000,
        "grads": 1000,
        "optimizer": 2000,
        "total": 7000,
    }
    assert model_state_bytes_formula(psi, 4, 3, **fp32)["total"] == 4000
    # Hybrid sharding divides by the shard group F, not by dp; stage 3 over F=2 of dp=8 is 16Ψ/2.
    assert model_state_bytes_formula(psi, 8, 3, shard=2)["total"] == 8000
    assert model_state_bytes_formula(psi, 8, 3, shard=8) == model_state_bytes_formula(psi, 8, 3)
    # A count that does not split evenly rounds up, as a padded flat shard does.
    assert model_state_bytes_formula(10, 4, 3)["params"] == 3 * 2
    assert dtype_preset("bf16", "adam") == (2, 2, 12) == dtype_preset("fp16", "adamw")
    assert dtype_preset("fp32", "adam") == (4, 4, 8) == dtype_preset("fp32", "lamb")
    assert dtype_preset("bf16", "sgd") == (2, 2, 8) == dtype_preset("bf16", "lars")
    assert dtype_preset("fp32", "sgd") == (4, 4, 4)
    r = estimate_memory(params=psi, dp=4, zero_stage=1, precision="fp32", optimizer="sgd")
    assert r["K"] == 4 and r["model_state_bytes"]["total"] == 4000 + 4000 + 1000


@pytest.mark.parametrize(
    "call,words",
    [
        (lambda: model_state_bytes_formula(100, 4, 5), ["zero_stage", "0, 1, 2, 3", "5"]),
        (lambda: estimate_memory(params=100, zero_stage=-1), ["zero_stage", "0, 1, 2, 3"]),
        (lambda: model_state_bytes_formula(100, 6, 3, shard=4), ["shard=4", "dp=6", "1, 2, 3, 6"]),
        (lambda: model_state_bytes_formula(100, 0, 1), ["dp", ">= 1"]),
        (lambda: model_state_bytes_formula(0, 4, 1), ["params", "positive"]),
        (lambda: estimate_memory(params=1.5), ["params", "1.5"]),
        (
            lambda: estimate_memory(params=100, optimizer="rmsprop"),
            ["rmsprop", "adam, adamw, sgd, lamb, lars"],
        ),
        (lambda: estimate_memory(params=100, precision="fp8"), ["fp8", "fp32, bf16, fp16"]),
        (lambda: estimate_memory(model=gpt_config("gpt5")), ["gpt5", "tiny", "gpt2-xl"]),
        (lambda: estimate_memory(), ["params", "model"]),
        (lambda: estimate_memory(params=100, model=gpt_config("tiny")), ["params", "model"]),
        (lambda: estimate_memory(params=100, batch=2), ["give model"]),
        (lambda: estimate_memory(model=gpt_config("tiny"), batch=2, seq=64), ["seq=64", "seq_len=32"]),
        (lambda: activation_bytes(gpt_config("tiny"), 1, tp=3), ["tp=3", "n_head=2", "1, 2"]),
    ],
)
def test_bad_input_names_the_key_and_valid_values(call, words):
    with pytest.raises(ConfigError) as info:
        call()
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_named_model_uses_its_exact_parameter_count():
    for name in ("tiny", "small"):
        real = sum(p.numel() for p in GPT(gpt_config(name)).parameters())
        assert estimate_memory(model=gpt_config(name))["params"] == real
    r = estimate_memory(model=gpt_config("gpt2"), dp=8, zero_stage=3)
    assert r["params"] == 124_439_808  # GPT-2 small with tied embeddings, as commonly quoted
    assert r["model_state_bytes"]["total"] == 16 * 124_439_808 // 8


def test_activation_formula_by_hand():
    cfg = gpt_config("small")  # h=128, a=4, l=4, s=128
    s, b, h, a, L = 128, 2, 128, 4, 4
    # Korthikanti et al. 2022 §4.1: s·b·h·(34 + 5·a·s/h) bytes per layer: 32768 · (34 + 20) = 1769472.
    assert activation_bytes(cfg, b) == L * s * b * h * (34 + 5 * a * s // h) == 7_077_888
    assert activation_bytes(cfg, b, precision="fp32") == 2 * 7_077_888
    assert activation_bytes(cfg, b, recompute=True) == L * 2 * s * b * h
    # Half the sequence: the attention term shrinks with s as well.
    assert activation_bytes(cfg, b, 64) == L * 64 * b * h * (34 + 5 * a * 64 // h)
    # Tensor parallel, t=2: s·b·h·(10 + 24/t + 5as/(ht)); with sequence parallel all of it over t.
    assert activation_bytes(cfg, b, tp=2) == L * s * b * h * (10 + 12 + 10)
    assert activation_bytes(cfg, b, tp=2, sequence_parallel=True) == 7_077_888 // 2
    r = estimate_memory(model=gpt_config("small"), batch=b, recompute=True)
    assert r["seq"] == 128 and r["activation_bytes"] == L * 2 * s * b * h
    assert r["activation_gb"] == r["activation_bytes"] / 1e9
    assert r["total_gb"] == pytest.approx(r["model_state_gb"] + r["activation_gb"])


def test_cli_json_and_table(capsys):
    assert main(["estimate", "--params", "7.5e9", "--dp", "64", "--zero-stage", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {
        "params",
        "dp",
        "zero_stage",
        "model_state_gb",
        "model_state_bytes",
        "precision",
        "optimizer",
        "K",
    } <= set(out)
    assert (out["params"], out["dp"], out["zero_stage"], out["K"]) == (7_500_000_000, 64, 2, 12)
    assert _sig3(out["model_state_gb"]) == 16.6
    argv = ["estimate", "--model", "small", "--dp", "4", "--zero-stage", "3", "--shard", "2", "--batch", "2"]
    assert main(argv + ["--json", "--recompute", "--precision", "fp32"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["shard"] == 2 and out["K"] == 8 and out["activation_gb"] > 0
    assert main(["estimate", "--params", "7.5B", "--dp", "64", "--zero-stage", "1"]) == 0
    table = capsys.readouterr().out
    for cell in ("120.00", "31.41", "16.64", "1.88", "P_os+g+p"):
        assert cell in table, cell
    chosen = [line for line in table.splitlines() if "<- chosen" in line]
    assert len(chosen) == 1 and "P_os " in chosen[0]


def test_cli_errors_are_one_line(capsys):
    for argv, word in (
        (["estimate", "--params", "1e9", "--zero-stage", "5"], "0, 1, 2, 3"),
        (["estimate", "--params", "1e9", "--dp", "6", "--shard", "4"], "1, 2, 3, 6"),
        (["estimate", "--params", "lots"], "--params"),
        (["estimate", "--dp", "2"], "--params"),
        (["estimate", "--model", "small", "--bogus"], "--bogus"),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("plait: config error: ") and "\n" not in err and word in err, err


def test_context_parallelism_splits_the_activations_and_zero_shards_over_dp_x_cp(capsys):
    """cp = 4: a device holds ceil(s/4) tokens of each sequence, so the activations are Korthikanti's
    at s/4 (sbh(34 + 5as/h) per layer in 16-bit, worked here by hand); ZeRO-3 shards over dp x cp."""
    cfg = gpt_config("small")  # h 128, a 4, s 128, 4 layers
    out = estimate_memory(model=cfg, dp=2, zero_stage=3, batch=2, cp=4)
    s, b, h, a, L = 128 // 4, 2, 128, 4, 4
    assert out["seq_per_device"] == s and out["activation_bytes"] == L * s * b * h * (34 + 5 * a * s / h)
    psi = cfg.n_params()
    assert out["model_state_bytes"]["params"] == math.ceil(psi / 8) * 2  # bf16, over 2 x 4 ranks
    assert main(["estimate", "--model", "small", "--dp", "2", "--cp", "4", "--batch", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["activation_bytes"] == out["activation_bytes"]
    with pytest.raises(ConfigError, match="hybrid sharding .* with context parallelism"):
        estimate_memory(params=10**6, dp=4, shard=2, cp=2)

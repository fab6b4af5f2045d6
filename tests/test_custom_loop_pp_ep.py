"""`plait.parallelize` in a custom loop under pipeline and expert parallelism: the same one
parallelize path as `plait train`, so a user's loop gains pp and ep. Each layout trains a small
GPT with SGD (momentum, no clipping: a gradient of the wrong scale moves the parameters from the
first step) and must follow one process on the same global batches: losses and every parameter
this rank holds, to 1e-5."""

from __future__ import annotations

import pytest
import torch

import plait
from plait.models import GPT
from plait.models.gpt import GPTConfig
from plait.testing import run_ranks

STEPS, ROWS, SEQ = 4, 8, 16
TOL = 1e-5
DENSE = dict(vocab_size=64, seq_len=SEQ, n_layer=4, n_head=2, d_model=16, dropout=0.0)
MOE = dict(DENSE, experts=4, top_k=2, moe_every=2)
# name: (ranks, model config, layout keys)
CASES = {
    "pp2-1f1b": (2, DENSE, {"pp": 2, "microbatches": 2}),
    "pp2-interleaved": (2, DENSE, {"pp": 2, "microbatches": 4, "schedule": "interleaved"}),
    "pp2xdp2-zero1": (4, DENSE, {"pp": 2, "dp": 2, "zero_stage": 1, "microbatches": 2}),
    # offload within pipeline stages: the same ZeRO engine, its step on the host
    "pp2xdp2-zero2-offload": (4, DENSE, {"pp": 2, "dp": 2, "zero_stage": 2, "offload": "cpu"}),
    "ep2": (2, MOE, {"ep": 2}),
    "ep2-zero3": (2, MOE, {"ep": 2, "zero_stage": 3}),
    "pp2xep2-zero2": (4, MOE, {"pp": 2, "ep": 2, "zero_stage": 2, "microbatches": 2}),
}


def _sgd(params):
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def _batches():
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randint(0, 64, (ROWS, SEQ), generator=g), torch.randint(0, 64, (ROWS, SEQ), generator=g))
        for _ in range(STEPS)
    ]


def _model(cfg: dict) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**cfg))


def _reference(cfg: dict) -> tuple[list[float], dict]:
    """One process, the whole global batch per step: written without plait's engines."""
    model = _model(cfg)
    opt = _sgd(model.parameters())
    losses = []
    for x, y in _batches():
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _parallel(name: str) -> dict:
    _, cfg, keys = CASES[name]
    engine = plait.parallelize(_model(cfg), _sgd, keys)
    losses = []
    for batch in _batches():
        losses.append(engine.forward_backward(engine.shard(batch)))
        engine.step()
    params = engine.full_parameters()
    engine.close()
    return {"losses": losses, "params": params}


@pytest.fixture(scope="module")
def runs():
    out = {}
    for ranks in (2, 4):
        names = [n for n, case in CASES.items() if case[0] == ranks]
        both = run_ranks(_cases, ranks, args=(names,), timeout=300)
        out.update(both[0])
    return out


def _cases(names: list[str]) -> dict:
    return {name: _parallel(name) for name in names}


@pytest.mark.parametrize("name", list(CASES))
def test_pipeline_and_experts_follow_one_process(runs, name):
    losses, params = _reference(CASES[name][1])
    got = runs[name]
    assert len(got["losses"]) == STEPS
    for step, (a, b) in enumerate(zip(got["losses"], losses, strict=True)):
        assert abs(a - b) <= TOL * max(1.0, abs(b)), f"{name} step {step}: loss {a} vs one process {b}"
    assert got["params"], f"{name}: rank 0 holds no parameters"
    for n, p in got["params"].items():
        ref = params[n]
        err = float((p - ref).abs().max() / ref.abs().max().clamp_min(1e-12))
        assert err <= TOL, f"{name}: {n} off one process by {err:.2e} (relative)"
    moved = max(float((p - _model(CASES[name][1]).state_dict()[n]).abs().max()) for n, p in params.items())
    assert moved > 100 * TOL  # the reference trained: parameters that did not move would match anything

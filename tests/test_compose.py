"""Compositions on one mesh against one process: ZeRO 1-3 over a tensor-parallel GPT (2-D FSDP +
TP), with and without sequence parallelism, hybrid sharding x tp, ZeRO-1 within pipeline stages
(pp x dp, and pp x dp x tp with sequence parallelism at 8 ranks). fp32, 20 steps; AdamW with
clipping, and SGD without clipping (a gradient of the wrong scale changes the trajectory at
once). Losses, gradient norms and gathered parameters within 1e-5. End to end, `plait train`
checkpoints saved under one layout resume under another with the uninterrupted run's losses."""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from conftest import (
    SGD,
    TINY,
    assert_runs_match,
    gpt_adamw,
    gpt_reference,
    gpt_sgd,
    resume_job,
    side_by_side,
    tiny_gpt,
    token_batches,
    train_job,
)

from plait.apply import parallelize
from plait.layout import Layout
from plait.optim import param_groups
from plait.testing import (
    assert_clipped,
    assert_close_grad_norms,
    assert_close_losses,
    assert_close_params,
    grad_norm,
    run_ranks,
    state_of,
)

STEPS = 20
BATCH = 8
# 4 heads and 250 rows: tp 4 splits the heads and pads the vocabulary (250 rows do not split
# over 4: 63 per rank, 2 of them padding), which must change nothing ("z3-tp4-sp")
CFG = dict(n_head=4, vocab_size=250)


_adamw, _sgd = gpt_adamw, gpt_sgd


def _model():
    return tiny_gpt(**CFG)


def _batches():
    return token_batches(STEPS, BATCH, 32, vocab=250)


def _reference(sgd: bool):
    ref = gpt_reference(_model, _sgd if sgd else _adamw, _batches(), clip=0.0 if sgd else 0.5)
    return ref.losses, ref.grad_norms, ref.params


def _hook(name: str | None):
    """A gradient compressor by name; "topk-all" keeps every entry (lossless: the plumbing of
    compression must then change nothing)."""
    from plait.comm.compress import make_compressor

    if name is None:
        return None
    return make_compressor(name.split("-")[0], topk_ratio=1.0 if name == "topk-all" else 0.05)


def _train(mesh, stage: int, sp: bool, sgd: bool = False, hybrid: int | None = None, hook=None):
    from plait.tensor_parallel import apply_tp
    from plait.zero import wrap

    dp = mesh.size("dp")
    model = apply_tp(_model(), mesh, sequence_parallel=sp)
    engine = wrap(
        model,
        mesh,
        stage,
        _sgd if sgd else _adamw,
        param_groups=param_groups(model, 0.1),
        hybrid_shard=hybrid,
        comm_hook=_hook(hook),
        bucket_mb=0.05,  # several buckets: replicated, sharded and partial gradients apart
    )
    r = mesh.rank("dp")
    rows = BATCH // dp
    losses, norms = [], []
    for x, y in _batches():
        loss = engine.module(x[r * rows : (r + 1) * rows], y[r * rows : (r + 1) * rows])
        loss.backward()
        norms.append(engine.grad_norm() if sgd else engine.clip_grad_norm_(0.5))
        if not sgd:
            assert_clipped(engine.grad_norm(), norms[-1], 0.5)
        engine.step()
        engine.zero_grad()
        t = loss.detach().reshape(1).clone()
        dist.all_reduce(t)  # every tp rank holds its dp row's loss: average over the world
        losses.append(float(t) / mesh.world_size)
    params = engine.full_parameters()
    engine.close()
    return {"losses": losses, "grad_norms": norms, "params": params}


def _pipeline(mesh, sp=False, sgd=False, kind="1f1b", m=2, zero=1, hook=None):
    """ZeRO-1 within the stages of a 2-stage pipeline (tensor parallel when the mesh has tp):
    per step the global loss and norm; the whole parameters of this rank's stages."""
    from plait import comm

    layout = Layout(**mesh.sizes, zero_stage=zero, sequence_parallel=sp, schedule=kind, microbatches=m)
    engine = parallelize(
        _model(),
        dataclasses.replace(layout, bucket_mb=0.05),
        mesh,
        _sgd if sgd else _adamw,
        param_groups=lambda mod: param_groups(mod, 0.1),
        comm_hook=_hook(hook),
    )
    dp, r = mesh.size("dp"), mesh.rank("dp")
    rows = BATCH // dp
    losses, norms = [], []
    for x, y in _batches():
        x, y = x[r * rows : (r + 1) * rows], y[r * rows : (r + 1) * rows]
        loss_sum = engine.forward_backward(list(zip(x.chunk(m), y.chunk(m))), 1.0 / (rows * 32))
        norms.append(engine.grad_norm() if sgd else engine.clip_grad_norm_(0.5))
        if not sgd:
            assert_clipped(engine.grad_norm(), norms[-1], 0.5)
        engine.step()
        engine.zero_grad()
        losses.append(comm.all_reduce_scalar(float(loss_sum), mesh, ("pp", "dp")) / (BATCH * 32))
    # model-state bytes between steps, and the parameters' bytes of this rank's stages, whole
    held = {
        "memory": engine.memory(),
        "stage_bytes": sum(q.numel() * 4 for q in engine.raw.parameters()),
        "shard_bytes": sum(b.layout.shard_numel * 4 for b in engine.inner.buckets) if zero else 0,
    }
    params = engine.full_parameters()
    engine.close()
    return {"losses": losses, "grad_norms": norms, "params": params, **held}


def _tied_sequential():
    """Not a GPT: an nn.Sequential language model whose output layer shares the embedding's
    weight, so its first and last pipeline stages share a parameter."""
    torch.manual_seed(0)
    emb, head = torch.nn.Embedding(250, 32), torch.nn.Linear(32, 250, bias=False)
    head.weight = emb.weight
    layers = [emb] + [m for _ in range(3) for m in (torch.nn.Linear(32, 32), torch.nn.Tanh())] + [head]
    seq = torch.nn.Sequential(*layers)
    seq.loss_fn = lambda logits, y: torch.nn.functional.cross_entropy(
        logits.reshape(-1, 250), y.reshape(-1), reduction="sum"
    )
    return seq


def _sequential_reference():
    seq = _tied_sequential()
    opt = _adamw(param_groups(seq, 0.1))
    losses, norms = [], []
    for x, y in _batches():
        loss = seq.loss_fn(seq(x), y) / y.numel()
        loss.backward()
        norms.append(grad_norm(seq.parameters()))
        torch.nn.utils.clip_grad_norm_(seq.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, norms, state_of(seq)


def _sequential_pipeline(mesh):
    """The tied nn.Sequential cut into 2 stages (split by parameter count) with ZeRO-1 over dp."""
    from plait import comm

    engine = parallelize(
        _tied_sequential(),
        Layout(**mesh.sizes, zero_stage=1, microbatches=2),
        mesh,
        _adamw,
        split="params",
        param_groups=lambda mod: param_groups(mod, 0.1),
    )
    dp, r = mesh.size("dp"), mesh.rank("dp")
    rows = BATCH // dp
    losses, norms = [], []
    for x, y in _batches():
        x, y = x[r * rows : (r + 1) * rows], y[r * rows : (r + 1) * rows]
        loss_sum = engine.forward_backward(list(zip(x.chunk(2), y.chunk(2))), 1.0 / (rows * 32))
        norms.append(engine.clip_grad_norm_(0.5))
        engine.step()
        engine.zero_grad()
        losses.append(comm.all_reduce_scalar(float(loss_sum), mesh, ("pp", "dp")) / (BATCH * 32))
    params = engine.full_parameters()
    engine.close()
    return {"losses": losses, "grad_norms": norms, "params": params}


def _all_4():
    from plait.mesh import Mesh

    mesh = Mesh(dp=2, tp=2, timeout_s=180)
    out = {}
    for stage in (1, 2, 3):
        for sp in (False, True):
            out[f"z{stage}-tp2{'-sp' if sp else ''}"] = _train(mesh, stage, sp)
    out["z1-tp2-sp-sgd"] = _train(mesh, 1, True, sgd=True)
    out["z3-tp2-sp-sgd"] = _train(mesh, 3, True, sgd=True)
    mesh.close()
    mesh = Mesh(pp=2, dp=2, timeout_s=180)
    out["pp2-dp2-z1"] = _pipeline(mesh)
    out["pp2-dp2-z1-zbh1-sgd"] = _pipeline(mesh, sgd=True, kind="zb-h1")
    out["sequential:pp2-dp2-z1"] = _sequential_pipeline(mesh)
    out["pp2-dp2-z2-sgd"] = _pipeline(mesh, sgd=True, zero=2)
    out["pp2-dp2-z3"] = _pipeline(mesh, zero=3)
    out["pp2-dp2-z3-zbh1-sgd"] = _pipeline(mesh, sgd=True, kind="zb-h1", zero=3)
    # compression in a pipeline, by data parallelism (stage 0) or ZeRO-1's reduce-scatter
    out["pp2-dp2-topk-all"] = _pipeline(mesh, zero=0, hook="topk-all")
    out["pp2-dp2-z1-topk-all"] = _pipeline(mesh, hook="topk-all")
    out["lossy:pp2-dp2-onebit"] = _pipeline(mesh, zero=0, hook="onebit")
    mesh.close()
    mesh = Mesh(dp=2, tp=2, timeout_s=180)
    # compression over a tensor-parallel model
    out["tp2-dp2-sp-topk-all"] = _train(mesh, 0, True, hook="topk-all")
    out["z2-tp2-sp-topk-all"] = _train(mesh, 2, True, hook="topk-all")
    out["lossy:tp2-dp2-sp-onebit"] = _train(mesh, 0, True, hook="onebit")
    out["lossy:z1-tp2-onebit"] = _train(mesh, 1, False, hook="onebit")
    mesh.close()
    out.update(_tp4())
    return out


def _tp4():
    """ZeRO-3 beside tp 4 with sequence parallelism: padded vocabulary shards in flat buffers."""
    from plait.mesh import Mesh

    mesh = Mesh(tp=4, timeout_s=180)
    out = {"z3-tp4-sp": _train(mesh, 3, True)}
    mesh.close()
    return out


def _all_8():
    from plait.mesh import Mesh

    mesh = Mesh(dp=4, tp=2, dp_shard=2, timeout_s=300)
    out = {"hybrid-z3-tp2-sp": _train(mesh, 3, True, hybrid=2)}
    out["hybrid-z2-tp2-sgd"] = _train(mesh, 2, False, sgd=True, hybrid=2)
    mesh.close()
    mesh = Mesh(pp=2, dp=2, tp=2, timeout_s=300)
    out["pp2-dp2-tp2-z1-sp"] = _pipeline(mesh, sp=True)
    out["pp2-dp2-tp2-z3-sp"] = _pipeline(mesh, sp=True, zero=3)
    mesh.close()
    return out


def _merge(per_rank: list[dict]) -> dict:
    """One result per configuration: rank 0's losses and norms (every rank holds the same), the
    parameters of every pipeline stage (each rank returns its stages', whole). A lossy
    compressor's run keeps every rank's parameters, to check that the replicas stayed equal."""
    out = per_rank[0]
    for name, res in out.items():
        if name.startswith("lossy:"):
            res["per_rank"] = [other[name]["params"] for other in per_rank]
        for other in per_rank[1:]:
            res["params"] = {**other[name]["params"], **res["params"]}
    return out


@pytest.fixture(scope="module")
def results():
    out = _merge(run_ranks(_all_4, 4, timeout=900))
    out.update(_merge(run_ranks(_all_8, 8, timeout=900)))
    return out


@pytest.fixture(scope="module")
def reference():
    return {"adamw": _reference(False), "sgd": _reference(True), "sequential": _sequential_reference()}


NAMES = [
    "z1-tp2",
    "z1-tp2-sp",
    "z2-tp2",
    "z2-tp2-sp",
    "z3-tp2",
    "z3-tp2-sp",
    "z3-tp4-sp",
    "z1-tp2-sp-sgd",
    "z3-tp2-sp-sgd",
    "hybrid-z3-tp2-sp",
    "hybrid-z2-tp2-sgd",
    "pp2-dp2-z1",
    "pp2-dp2-z1-zbh1-sgd",
    "pp2-dp2-tp2-z1-sp",
    "pp2-dp2-topk-all",
    "pp2-dp2-z1-topk-all",
    "tp2-dp2-sp-topk-all",
    "z2-tp2-sp-topk-all",
    "sequential:pp2-dp2-z1",
    "pp2-dp2-z2-sgd",
    "pp2-dp2-z3",
    "pp2-dp2-z3-zbh1-sgd",
    "pp2-dp2-tp2-z3-sp",
]


@pytest.mark.parametrize("name", NAMES)
def test_composition_follows_one_process(results, reference, name):
    kind = "sequential" if name.startswith("sequential:") else "sgd" if name.endswith("sgd") else "adamw"
    losses, norms, params = reference[kind]
    res = results[name]
    assert_close_grad_norms(res["grad_norms"], norms, rtol=1e-5, what=name)  # first: the clearest
    assert_close_losses(res["losses"], losses, atol=1e-5, what=name)
    want = {k: v for k, v in params.items() if k != "lm_head.weight"}  # GPT's is wte.weight
    assert_close_params(res["params"], want, atol=1e-5, what=name)


def test_pipeline_zero3_keeps_only_parameter_shards_between_steps(results):
    """ZeRO-3 within pipeline stages: between steps a rank holds its 1/dp shard of its stages'
    parameters (padding aside), where ZeRO-1 holds them whole."""
    z1, z3 = results["pp2-dp2-z1"], results["pp2-dp2-z3"]
    assert z1["memory"]["params"] >= z1["stage_bytes"], z1["memory"]
    assert z3["memory"]["params"] == z3["shard_bytes"], (z3["memory"], z3["shard_bytes"])
    assert 0 <= 2 * z3["shard_bytes"] - z3["stage_bytes"] < 64, (z3["shard_bytes"], z3["stage_bytes"])


@pytest.mark.parametrize("name", ["lossy:pp2-dp2-onebit", "lossy:tp2-dp2-sp-onebit", "lossy:z1-tp2-onebit"])
def test_lossy_compression_keeps_replicas_equal(results, reference, name):
    """1-bit compression changes the trajectory, but every rank holding a tensor (dp replicas,
    tp replicas of LayerNorms and biases) holds the same values, and the losses stay near the
    uncompressed run's (the data are random tokens: there is nothing to learn, only to break)."""
    res = results[name]
    shared = set.intersection(*(set(p) for p in res["per_rank"]))
    assert shared, name
    for other in res["per_rank"][1:]:
        for k in shared:
            assert torch.equal(other[k], res["per_rank"][0][k]), f"{name}: {k} differs between ranks"
    want = reference["adamw"][0]
    worst = max(abs(a - b) for a, b in zip(res["losses"], want, strict=True))
    assert worst < 0.05, f"{name}: losses drift {worst:.3f} from the uncompressed run's"


# --- `plait train`: compositions end to end, and checkpoints from any layout to any other -------

TP = ("--model.n_head", "4")


def _layout(pp=1, dp=1, tp=1, zero=0, sp=False):
    """Every layout key, so that a resumed run overrides all of the saved run's."""
    return (
        *("--parallel.pp", str(pp), "--parallel.dp", str(dp), "--parallel.tp", str(tp)),
        *("--parallel.zero_stage", str(zero), "--parallel.sequence_parallel", str(sp).lower()),
    )


LAYOUTS = {
    "dp2": _layout(dp=2),
    "dp2xtp2-z3-sp": _layout(dp=2, tp=2, zero=3, sp=True),
    "pp2xtp2": _layout(pp=2, tp=2),
    "dp4-z2": _layout(dp=4, zero=2),
    "pp2xdp2-z3": _layout(pp=2, dp=2, zero=3),
    "one": _layout(),
    "dp2xtp2-z1": _layout(dp=2, tp=2, zero=1),
}
# (saved under, resumed under): the three, each a different mechanism on each side
#
# The resume matrix is not filled to its product: a checkpoint holds the layout-free form
# (plait.train.checkpoint: every tensor by name, one 1-D range; a rank writes its stage's names,
# under ZeRO or ep its range of them), where savers and loaders meet, so each layout must write
# it and read it once, not every pair. Saved -> resumed: one -> pp2 and pp2 -> pp2
# (test_pipeline_train.py); dp2 ZeRO-3 -> dp4 ZeRO-3, ZeRO-1, one (test_zero_train.py); dp2 ->
# dp2 and ZeRO-2 -> ZeRO-2 (test_train_run.py); ep layouts (test_moe_train.py); RESUMES here.
# Left out: a checkpoint written under pp x ZeRO; its two partitions (stage: names, dp: ranges)
# are each written here (pp2xtp2, dp4-z2) and read together by pp2xdp2-z3.
RESUMES = [("dp2xtp2-z3-sp", "pp2xdp2-z3"), ("pp2xtp2", "one"), ("dp4-z2", "dp2xtp2-z1")]


@pytest.fixture(scope="module")
def train_runs(tmp_path_factory):
    """An uninterrupted data-parallel SGD run (no clipping), runs cut after step 4 under each
    saving layout, and each cut run resumed (in a copy) under its other layout; side by side."""
    base = tmp_path_factory.mktemp("compose")
    jobs = {}
    for name, layout in [("full", LAYOUTS["dp2"])] + [(s, LAYOUTS[s]) for s, _ in RESUMES]:
        cut = () if name == "full" else ("--train.stop_at", "4")
        jobs[name] = train_job(base / name, *TINY, *TP, *SGD, *layout, *cut, timeout=300)
    for saved, resumed in RESUMES:
        run = base / f"{saved}-to-{resumed}"
        jobs[run.name] = resume_job(jobs[saved], run, *LAYOUTS[resumed], timeout=300)
    return side_by_side(jobs)


@pytest.mark.parametrize("saved, resumed", RESUMES, ids=[f"{a}-to-{b}" for a, b in RESUMES])
def test_checkpoint_resumes_across_layouts(train_runs, saved, resumed):
    """Steps 1-4 under the saving layout and steps 5-8 after resuming under another follow the
    uninterrupted run: loss and gradient norm per step within 1e-5."""
    for name in ("full", saved):
        _, r = train_runs[name]
        assert r.returncode == 0, f"{name}: {r.stderr[-3000:]}"
    full = train_runs["full"][0]
    assert_runs_match(train_runs[saved][0], full, steps=range(1, 5), what=saved)
    run, r = train_runs[f"{saved}-to-{resumed}"]
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout and "step_00000004" in r.stdout
    assert_runs_match(run, full, steps=range(5, 9), what=f"{saved} resumed on {resumed}")

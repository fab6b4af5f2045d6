"""Context parallelism in training, against one process: plait's GPT through `plait.apply.parallelize`
with the sequence split over cp, ring and Ulysses, at cp = 2 with dp, tp + SP, ZeRO-3, a pipeline
and activation checkpointing, at cp = 4 with sequences that do and do not divide into 2·cp
chunks. fp32, dropout off; SGD without clipping (a gradient of the wrong scale changes the
trajectory at once) and AdamW with clipping. Losses and gradient norms per step, the whole first
step's gradients and the final parameters within 1e-5 of plain torch on one process; the
ledger's cp bytes per step equal the formulas; a planted bug that skips the cp average of the
gradients, or attends only to the rank's own tokens, fails by far more than 3x the tolerance.
End to end, `plait train --parallel.cp 2` (ring and Ulysses) gives the loss curve of
`--parallel.dp 2`, and its checkpoint resumes under dp 2 and back."""

import dataclasses
import re

import pytest
import torch
from conftest import (
    SGD,
    TINY,
    assert_runs_match,
    gpt_adamw,
    gpt_reference,
    gpt_sgd,
    metrics,
    resume_job,
    side_by_side,
    tiny_gpt,
    token_batches,
    train_job,
)

from plait.apply import parallelize
from plait.context_parallel import attention as cp_attention
from plait.context_parallel import positions as cp_positions
from plait.errors import ConfigError
from plait.layout import Layout
from plait.optim import param_groups
from plait.testing import assert_close_grad_norms, assert_close_losses, assert_close_params, run_ranks

STEPS = 6
BATCH = 8
CFG = dict(n_head=4, seq_len=40)  # 4 heads: Ulysses splits them over cp 4, or over tp 2 x cp 2
TOL = 1e-5


def _model():
    return tiny_gpt(**CFG)


def _batches(T):
    return token_batches(STEPS, BATCH, T, vocab=256)


def _first_gradients(T) -> dict:
    """The first step's gradient of one process (the mean loss over the global batch)."""
    model = _model()
    x, y = _batches(T)[0]
    model(x, y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _unwrapped(name: str) -> str:
    return name.removeprefix("module.")


def _run(mesh, sgd: bool, T: int = 32, grads=False, ledger=False, accum: int = 1, **kw) -> dict:
    """`STEPS` steps of the tiny GPT under mesh's layout with `kw` (cp_style, zero_stage, ...):
    the global loss and gradient norm per step, the final parameters whole; with `grads` the first
    step's gradients (data parallel: whole on every rank), with `ledger` the cp axis's bytes."""
    from plait import comm

    layout = Layout(**mesh.sizes, **kw)
    engine = parallelize(
        _model(),
        dataclasses.replace(layout, bucket_mb=0.05),
        mesh,
        gpt_sgd if sgd else gpt_adamw,
        param_groups=lambda mod: param_groups(mod, 0.1),
    )
    dp, r = mesh.size("dp"), mesh.rank("dp")
    rows = BATCH // dp
    m = layout.pipeline_microbatches if layout.pp > 1 else accum
    out = {"losses": [], "grad_norms": [], "cp_bytes": []}
    mesh.ledger.clear()  # the steps of this run only
    for step, (x, y) in enumerate(_batches(T), start=1):
        x, y = x[r * rows : (r + 1) * rows], y[r * rows : (r + 1) * rows]
        mesh.ledger.set_step(step)
        loss_sum = engine.forward_backward(list(zip(x.chunk(m), y.chunk(m))), 1.0 / (rows * T))
        if grads and step == 1:
            out["grads"] = {_unwrapped(n): p.grad.clone() for n, p in engine.module.named_parameters()}
        out["grad_norms"].append(engine.grad_norm() if sgd else engine.clip_grad_norm_(0.5))
        engine.step()
        engine.zero_grad()
        mesh.ledger.set_step(-1)
        if ledger:
            rows_ = mesh.ledger.rows(step)
            out["cp_bytes"].append({op: row.bus_bytes for (op, axis), row in rows_.items() if axis == "cp"})
        out["losses"].append(comm.all_reduce_scalar(float(loss_sum), mesh, ("pp", "dp")) / (BATCH * T))
    out["params"] = engine.full_parameters()
    engine.close()
    return out


def _planted(mesh) -> dict:
    """Two bugs planted in a cp2 x dp2 SGD run: the gradient averaged over dp only (the cp ranks'
    parts never summed), and attention over the rank's own tokens only (no ring)."""
    import plait.context_parallel.interface as cp_attention

    out = {}
    keep = Layout.data_axes
    Layout.data_axes = property(lambda self: ("dp",))
    try:
        out["no-cp-average"] = _run(mesh, True, grads=True)
    finally:
        Layout.data_axes = keep
    keep_ring = cp_attention.ring_attention
    cp_attention.ring_attention = lambda q, k, v, mesh, axis, split, scale: cp_attention.sdpa_gqa(
        q, k, v, scale
    )
    try:
        out["own-tokens-only"] = _run(mesh, True, grads=True)
    finally:
        cp_attention.ring_attention = keep_ring
    return out


class _OwnAttention(torch.nn.Module):
    """A model attending with torch's own attention: under cp it would see its own tokens only."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(256, 8), torch.nn.Linear(8, 256)

    def forward(self, x, y, reduction="sum"):
        h = self.emb(x).unsqueeze(1)
        h = torch.nn.functional.scaled_dot_product_attention(h, h, h, is_causal=True).squeeze(1)
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), y.flatten(), reduction=reduction)


def _refused(mesh) -> str:
    engine = parallelize(_OwnAttention(), Layout(**mesh.sizes), mesh, gpt_sgd)
    x, y = _batches(32)[0]
    try:
        engine.forward_backward([(x[:4], y[:4])], 1.0 / 128)
    except ConfigError as exc:
        return str(exc)
    finally:
        engine.close()
    return "accepted"


def _all_4() -> dict:
    from plait.mesh import Mesh

    out = {}
    mesh = Mesh(dp=2, cp=2, timeout_s=180)
    out["cp2-dp2-ring-sgd"] = _run(mesh, True, grads=True, ledger=True)
    out["cp2-dp2-ulysses-sgd"] = _run(mesh, True, grads=True, ledger=True, cp_style="ulysses")
    out["cp2-dp2-ring"] = _run(mesh, False)
    out["cp2-dp2-ring-z3-sgd"] = _run(mesh, True, zero_stage=3)
    out["cp2-dp2-ulysses-z3"] = _run(mesh, False, zero_stage=3, cp_style="ulysses")
    out["cp2-dp2-ring-recompute-sgd"] = _run(mesh, True, grads=True, activation_checkpointing=True)
    out["cp2-dp2-ring-accum-sgd"] = _run(mesh, True, grads=True, accum=2)  # gradient accumulation
    out.update(_planted(mesh))
    out["refused"] = _refused(mesh)
    mesh.close()
    out.update(_api_cases())
    mesh = Mesh(cp=4, timeout_s=180)
    out["cp4-ring-sgd"] = _run(mesh, True, grads=True)
    out["cp4-ring-uneven-sgd"] = _run(mesh, True, T=35, grads=True)  # 8 chunks of 4 or 5 tokens
    out["cp4-ulysses-sgd"] = _run(mesh, True, grads=True, cp_style="ulysses")
    mesh.close()
    mesh = Mesh(cp=2, tp=2, timeout_s=180)
    out["cp2-tp2-sp-ring-sgd"] = _run(mesh, True, sequence_parallel=True)
    out["cp2-tp2-sp-ulysses"] = _run(mesh, False, sequence_parallel=True, cp_style="ulysses")
    out["cp2-tp2-ring-z3-sgd"] = _run(mesh, True, zero_stage=3)
    mesh.close()
    mesh = Mesh(pp=2, cp=2, timeout_s=180)
    out["cp2-pp2-ring-sgd"] = _run(mesh, True, zero_stage=1, microbatches=2)
    out["cp2-pp2-ulysses"] = _run(mesh, False, microbatches=2, cp_style="ulysses")
    mesh.close()
    return out


# --- the custom loop: plait.parallelize with cp --------------------------------------------------

V, D, H, H_KV = 256, 16, 4, 2


class UserAttention(torch.nn.Module):
    """A user's grouped-query attention block (not plait's), opting in to context parallelism by
    calling plait.context_parallel.attention; `own=True` is the same block written with torch's
    attention alone, for the one-process reference."""

    def __init__(self, own: bool = False):
        super().__init__()
        self.own = own
        self.norm, self.q = torch.nn.LayerNorm(D), torch.nn.Linear(D, D)
        self.kv, self.o = torch.nn.Linear(D, 2 * H_KV * (D // H)), torch.nn.Linear(D, D)

    def forward(self, x):
        B, L, _ = x.shape
        h = self.norm(x)
        q = self.q(h).view(B, L, H, D // H).transpose(1, 2)
        k, v = self.kv(h).view(B, L, 2, H_KV, D // H).permute(2, 0, 3, 1, 4)
        if self.own:
            k, v = k.repeat_interleave(H // H_KV, dim=1), v.repeat_interleave(H // H_KV, dim=1)
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = cp_attention(q, k, v)
        return x + self.o(y.transpose(1, 2).reshape(B, L, D))


class UserEmbed(torch.nn.Module):
    def __init__(self, own: bool = False):
        super().__init__()
        self.own, self.tok, self.pos = own, torch.nn.Embedding(V, D), torch.nn.Embedding(64, D)

    def forward(self, ids):
        L = ids.shape[1]
        pos = torch.arange(L, device=ids.device) if self.own else cp_positions(L, ids.device)
        return self.tok(ids) + self.pos(pos)


def user_lm(own: bool = False) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(UserEmbed(own), UserAttention(own), UserAttention(own), torch.nn.Linear(D, V))


def user_loss(model, batch):
    """The mean token loss, as one process computes it (here over the rank's tokens)."""
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


class UserLM(torch.nn.Module):
    """The user's model returning its own loss from a dict batch (`model(**batch)`)."""

    def __init__(self, own: bool = False):
        super().__init__()
        self.net = user_lm(own)

    def forward(self, ids, labels, row_weight):
        assert row_weight.shape == (ids.shape[0],)  # a per-row tensor arrives whole
        return user_loss(self.net, (ids, labels))


def _api_batches(T: int) -> list:
    return token_batches(STEPS, BATCH, T, vocab=V, seed=5)


def _dict(batch):
    return {"ids": batch[0], "labels": batch[1], "row_weight": torch.ones(batch[0].shape[0])}


# name: (model, T, layout keys, forward_backward keywords)
API = {
    "api-cp2-dp2-ring-accum": ("dict", 32, {"dp": 2, "cp": 2}, {"micro_batches": 2}),
    "api-cp2-dp2-ulysses-z3": ("dict", 32, {"dp": 2, "cp": 2, "cp_style": "ulysses", "zero_stage": 3}, {}),
    "api-cp4-ring-uneven": ("seq", 35, {"cp": 4}, {}),  # 8 chunks of 4 or 5 tokens: shares weigh
    # the first stage holds the embedding only: the attention check counts the pipeline's calls
    "api-cp2-pp2-ulysses": ("seq", 32, {"pp": 2, "cp": 2, "cp_style": "ulysses", "microbatches": 2}, {}),
    "api-gpt-cp2-tp2-sp": ("gpt", 32, {"cp": 2, "tp": 2, "sequence_parallel": True}, {}),
    "api-gpt-cp2-pp2": ("gpt", 35, {"pp": 2, "cp": 2, "microbatches": 2}, {}),  # summed losses
}


def _api_model(kind: str, own: bool = False):
    return {"dict": lambda: UserLM(own), "seq": lambda: user_lm(own), "gpt": _model}[kind]()


def _api_run(name: str) -> dict:
    import plait

    kind, T, keys, kw = API[name]
    extra = dict(loss_fn=user_loss, stages=lambda m: [m[:1], m[1:]]) if kind == "seq" else {}
    engine = plait.parallelize(_api_model(kind), gpt_sgd, keys, **extra)
    losses = []
    for batch in _api_batches(T):
        losses.append(engine.forward_backward(engine.shard(_dict(batch) if kind == "dict" else batch), **kw))
        engine.step()
    out = {"losses": losses, "params": engine.full_parameters()}
    engine.close()
    return out


def _api_errors() -> list[str]:
    import plait

    engine = plait.parallelize(user_lm(), gpt_sgd, {"cp": 4})
    errors = []
    x, y = _api_batches(32)[0]
    for bad in ((x, y[:, :16]), (x[:, 0], y[:, 0])):  # two sequence lengths; no sequence at all
        try:
            engine.forward_backward(bad)
        except ConfigError as exc:
            errors.append(str(exc))
    engine.close()
    return errors


def _api_cases() -> dict:
    out = {name: _api_run(name) for name in API}
    out["api-errors"] = {"errors": _api_errors(), "params": {}}
    return out


def _api_reference(name: str) -> tuple[list[float], dict]:
    """One process, plain torch and the blocks' own attention: SGD on the global batches."""
    kind, T, _, _ = API[name]
    model = _api_model(kind, own=True)
    opt = gpt_sgd(model.parameters())
    losses = []
    for batch in _api_batches(T):
        loss = (
            model(**_dict(batch))
            if kind == "dict"
            else user_loss(model, batch)
            if kind == "seq"
            else model(*batch)
        )
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", list(API))
def test_a_custom_loop_under_cp_follows_one_process(results, name):
    """`plait.parallelize(model, factory, {"cp": ...})` on whole sequences: a user's own blocks
    calling plait's attention and positions (a dict batch with a per-row tensor, an nn.Sequential
    with a loss_fn and stages) and plait's GPT; losses on every rank and the final parameters
    within 1e-5 of one process (SGD, no clipping)."""
    losses, params = _api_reference(name)
    for rank, per in enumerate(results["_per_rank"]):
        assert_close_losses(per[name]["losses"], losses, atol=TOL, what=f"{name} rank {rank}")
    got = results[name]["params"]
    assert sorted(got) == sorted(params), name
    assert_close_params(got, params, atol=TOL, what=name)
    moved = max(
        float((p - _api_model(API[name][0], own=True).state_dict()[n]).abs().max()) for n, p in params.items()
    )
    assert moved > 100 * TOL  # the reference trained


def test_a_custom_loop_batch_without_one_sequence_length_is_refused(results):
    for per in results["_per_rank"]:
        first, second = per["api-errors"]["errors"]
        assert "lengths [16, 32] on dim 1" in first and "cp = 4" in first, first
        assert "no tensor of two or more dimensions" in second, second


@pytest.fixture(scope="module")
def results() -> dict:
    per_rank = run_ranks(_all_4, 4, timeout=900)
    out = per_rank[0]
    for name, res in out.items():  # a pipeline rank returns its stages' parameters
        if name == "refused":
            continue
        for other in per_rank[1:]:
            res["params"] = {**other[name]["params"], **res["params"]}
    out["_per_rank"] = per_rank
    return out


@pytest.fixture(scope="module")
def reference() -> dict:
    refs = {}
    for T in (32, 35):
        for sgd in (False, True):
            ref = gpt_reference(_model, gpt_sgd if sgd else gpt_adamw, _batches(T), clip=0.0 if sgd else 0.5)
            refs[(T, sgd)] = (ref.losses, ref.grad_norms, ref.params)
        refs[(T, "grads")] = _first_gradients(T)
    return refs


NAMES = [
    "cp2-dp2-ring-sgd",
    "cp2-dp2-ulysses-sgd",
    "cp2-dp2-ring",
    "cp2-dp2-ring-z3-sgd",
    "cp2-dp2-ulysses-z3",
    "cp2-dp2-ring-recompute-sgd",
    "cp2-dp2-ring-accum-sgd",
    "cp4-ring-sgd",
    "cp4-ring-uneven-sgd",
    "cp4-ulysses-sgd",
    "cp2-tp2-sp-ring-sgd",
    "cp2-tp2-sp-ulysses",
    "cp2-tp2-ring-z3-sgd",
    "cp2-pp2-ring-sgd",
    "cp2-pp2-ulysses",
]


def _T(name: str) -> int:
    return 35 if "uneven" in name else 32


def _max_grad_error(got: dict, want: dict) -> float:
    return max((got[n] - want[n]).abs().max().item() for n in want)


@pytest.mark.parametrize("name", NAMES)
def test_context_parallel_training_follows_one_process(results, reference, name):
    T, sgd = _T(name), name.endswith("sgd")
    losses, norms, params = reference[(T, sgd)]
    res = results[name]
    assert_close_grad_norms(res["grad_norms"], norms, rtol=TOL, what=name)
    assert_close_losses(res["losses"], losses, atol=TOL, what=name)
    want = {k: v for k, v in params.items() if k != "lm_head.weight"}  # GPT's is wte.weight
    assert_close_params(res["params"], want, atol=TOL, what=name)
    if "grads" in res:  # every parameter's whole gradient, on every rank
        ref = reference[(T, "grads")]
        for rank, per in enumerate(results["_per_rank"]):
            err = _max_grad_error(per[name]["grads"], ref)
            assert err < TOL, f"{name}: rank {rank}'s first-step gradient is off by {err:.2e}"


def test_ledger_cp_bytes_equal_the_formulas(results):
    """Per step on the cp axis (cp2 x dp2, B = 4 rows per dp rank, L = 16 tokens per rank, h·d =
    32, fp32, 2 layers; the gradients travel on dp*cp): the ring sends K and V over cp − 1 hops per
    layer forward, and K, V and their gradients backward: 3 x 2(cp−1)·B·L·h_kv·d·4 per layer.
    Ulysses: four all-to-alls per layer forward and four backward, each (cp−1)/cp of B·L·h·d·4."""
    B, L, hd, layers, cp, b = 4, 16, 32, 2, 2, 4
    ring = 3 * 2 * (cp - 1) * B * L * hd * b * layers
    ulysses = 8 * (cp - 1) / cp * B * L * hd * b * layers
    for rank, per in enumerate(results["_per_rank"]):
        for step in per["cp2-dp2-ring-sgd"]["cp_bytes"]:
            assert step == {"send": ring, "recv": ring}, (rank, step, ring)  # each hop: one of each
        for step in per["cp2-dp2-ulysses-sgd"]["cp_bytes"]:
            assert step == {"all_to_all": ulysses}, (rank, step, ulysses)


@pytest.mark.parametrize("bug", ["no-cp-average", "own-tokens-only"])
def test_planted_bugs_are_caught_by_far_more_than_the_tolerance(results, reference, bug):
    ref = reference[(32, "grads")]
    err = _max_grad_error(results[bug]["grads"], ref)
    assert err > 3 * TOL, f"{bug}: the first-step gradient is off by only {err:.2e}"
    losses = reference[(32, True)][0]
    worst = max(abs(a - b) for a, b in zip(results[bug]["losses"][1:], losses[1:], strict=True))
    assert worst > 3 * TOL, f"{bug}: the losses are off by only {worst:.2e}"


def test_a_model_that_attends_by_itself_is_refused_after_its_first_step(results):
    for per in results["_per_rank"]:
        assert "never called plait.context_parallel.attention" in per["refused"], per["refused"]
        assert "parallel.cp = 1" in per["refused"]


# --- end to end: plait train ----------------------------------------------------------------------

LAYOUTS = {
    "dp2": ("--parallel.dp", "2"),
    "cp2-ring": ("--parallel.dp", "1", "--parallel.cp", "2"),
    "cp2-ulysses": ("--parallel.dp", "1", "--parallel.cp", "2", "--parallel.cp_style", "ulysses"),
}


@pytest.fixture(scope="module")
def train_runs(tmp_path_factory):
    """`plait train` under dp 2, cp 2 ring and cp 2 Ulysses (8 steps each, SGD, no clipping), the
    Ulysses run's checkpoint of step 4 resumed under dp 2 and dp 2's under cp 2 ring."""
    base = tmp_path_factory.mktemp("cp")
    EVAL = ("--train.eval_every", "4")  # held-out evaluation at steps 4 and 8, through the cp engine
    jobs = {}
    for name in ("dp2", "cp2-ring", "cp2-ulysses"):
        jobs[name] = train_job(base / name, *TINY, *SGD, *EVAL, *LAYOUTS[name], timeout=300)
    jobs["cp2-ulysses-to-dp2"] = resume_job(jobs["cp2-ulysses"], base / "u2d", *LAYOUTS["dp2"], timeout=300)
    jobs["dp2-to-cp2-ring"] = resume_job(jobs["dp2"], base / "d2c", *LAYOUTS["cp2-ring"], timeout=300)
    return side_by_side(jobs)


def test_plait_train_under_cp_gives_the_loss_curve_of_dp(train_runs):
    for name, (_, r) in train_runs.items():
        assert r.returncode == 0, f"{name}: {r.stderr[-3000:]}"
    full = train_runs["dp2"][0]
    assert_runs_match(train_runs["cp2-ring"][0], full, what="cp2 ring")
    want = metrics(full)
    for name in ("cp2-ring", "cp2-ulysses"):  # held-out: each rank's part of every sequence, summed
        got = metrics(train_runs[name][0])
        for step in (4, 8):
            assert abs(got[step]["val_loss"] - want[step]["val_loss"]) <= 1e-5 * want[step]["val_loss"]
    assert_runs_match(train_runs["cp2-ulysses"][0], full, what="cp2 ulysses")
    assert_runs_match(train_runs["cp2-ulysses-to-dp2"][0], full, steps=range(5, 9), what="ulysses -> dp2")
    assert_runs_match(train_runs["dp2-to-cp2-ring"][0], full, steps=range(5, 9), what="dp2 -> cp2 ring")


# --- refused before any process starts ------------------------------------------------------------

BAD = {
    "too short for 2 cp chunks": (
        (("model.seq_len", "6"), ("parallel.cp", "4")),
        "a sequence of 6 tokens cannot be split into the 8 chunks that parallel.cp = 4 needs",
    ),
    "ulysses: heads by cp": (
        (("parallel.cp", "8"), ("parallel.cp_style", "ulysses")),
        "model.n_head = 4 does not divide by it",
    ),
    "ulysses: sequence by cp": (
        (("model.seq_len", "126"), ("parallel.cp", "4"), ("parallel.cp_style", "ulysses")),
        "needs sequences that divide by parallel.cp = 4, got 126 tokens",
    ),
    "sp: a rank's part by tp": (
        (("model.seq_len", "126"), ("parallel.cp", "2"), ("parallel.tp", "2"))
        + (("parallel.sequence_parallel", "true"),),
        "gives each rank 63 tokens, which do not split over parallel.tp = 2",
    ),
    "style": (
        (("parallel.cp", "2"), ("parallel.cp_style", "rings")),
        "parallel.cp_style = 'rings' is not valid",
    ),
    "degree": ((("parallel.cp", "0"),), "parallel.cp must be >= 1, got 0"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_cp_configs_are_refused_naming_the_key(case):
    from plait.train.config import read_config, validate

    keys, message = BAD[case]
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(read_config(None, (("model.name", "small"), ("parallel.dp", "1"), *keys)), data=False)


def test_the_memory_check_before_start_counts_a_ranks_part_of_each_sequence():
    """The pre-start memory check (plait.train.preflight): activations and logits of seq/cp tokens,
    dense model states sharded by ZeRO over dp x cp."""
    from plait.train.config import read_config
    from plait.train.preflight import rank_memory

    def mem(*keys):
        return rank_memory(read_config(None, (("model.name", "small"), ("parallel.dp", "2"), *keys)), False)

    one, four = mem(), mem(("parallel.cp", "4"))
    assert four["activations"] * 4 == one["activations"]  # 128 tokens: 32 per rank, exactly a quarter
    z_one, z_four = mem(("parallel.zero_stage", "3")), mem(("parallel.zero_stage", "3"), ("parallel.cp", "4"))
    assert z_four["params"] * 4 == z_one["params"]  # 842,496 parameters over 2 x 4 ranks, not 2

"""The ledger of a composition is the sum of its parts' formulas: one training step of a tiny GPT.

Every (op, axis) row that the second step of each composition records (the first also runs the
pipeline's shape inference and ZeRO-3's unit ordering) must equal, in count, payload and ring
bus bytes, what the formulas of its parts give from the model's shapes, with nothing left over:

* ZeRO over dp (Rajbhandari et al. 2019, §7): reduce-scatter Ψ + all-gather Ψ = 2Ψ for stages 1
  and 2, all-gather Ψ forward + all-gather Ψ backward + reduce-scatter Ψ = 3Ψ for stage 3, with Ψ
  the tp-LOCAL parameters as the engine flattened them (its buckets' or units' padded layouts);
* Megatron tensor parallelism over tp (Shoeybi et al. 2019, §3): per layer 4 all-reduces of the
  b·s·h activations (2 forward, 2 backward), or with sequence parallelism (Korthikanti et al.
  2022, §4.2.2) 4 all-gathers and 4 reduce-scatters of the same tensors: 8·b·s·h·(t-1)/t bus
  elements either way; outside the blocks, the vocab-parallel embedding's forward reduction and
  the head's entry (its backward) are two more such tensors, and the vocab-parallel loss
  all-reduces 3·b·s numbers forward (the max, then the sum of exponentials with the target logit);
* with sequence parallelism, the parameters whose gradient is partial over tp (their placement:
  LayerNorms, row-parallel biases, the position embedding) have this rank's reduced ZeRO shard of
  them summed over tp: one all-reduce per such bucket (stages 1-2) or unit (stage 3);
* the global gradient norm (clipping): one all-reduce over dp of a float64 per norm part (the
  tp-replicated and the tp-sharded parameters) and one over tp of the sharded part's float64;
* pp2 x dp2 with ZeRO-1 or ZeRO-3 within the stages: per pipeline rank 2Ψ_stage over dp, each micro-batch's
  activation forward and its gradient backward over pp (b·s·h fp32 each way per micro-batch at
  the one boundary), the tied embedding's gradient all-reduced over pp, the norm over dp and pp.

dp2 x tp2 pads nothing (every tp-local tensor of this GPT has an even size); dp3 x tp2 pads
the flat groups, and the sequence-parallel shards, by one or two elements.

Every expected figure is computed here from these formulas and the shapes; the ranks report only
the ledger and static facts (flat layouts, placements).
"""

import pytest
import torch
from conftest import gpt_adamw, tiny_gpt

from plait.apply import parallelize
from plait.layout import Layout
from plait.models import gpt_config
from plait.optim import param_groups
from plait.testing import run_ranks

ROWS, SEQ = 4, 32  # sequences per data-parallel rank per step, and their length
TP, PP, MICRO = 2, 2, 2
CFG = dict(n_head=4, vocab_size=250)
F32, F64 = 4, 8
MEASURED = 1  # the step whose ledger is checked


def _cfg(n_layer: int = 2):
    return gpt_config("tiny", n_layer=n_layer, **CFG)


def _model(n_layer: int = 2):
    return tiny_gpt(n_layer=n_layer, **CFG)


_adamw = gpt_adamw


def _my_rows(mesh):
    """This dp rank's rows of each step's global batch."""
    g = torch.Generator().manual_seed(3)
    dp, r = mesh.size("dp"), mesh.rank("dp")
    for _ in range(MEASURED + 1):
        x, y = (torch.randint(0, 250, (ROWS * dp, SEQ), generator=g) for _ in range(2))
        yield x[r * ROWS : (r + 1) * ROWS], y[r * ROWS : (r + 1) * ROWS]


def _rows(mesh) -> dict:
    return {k: (r.count, r.payload_bytes, r.bus_bytes) for k, r in mesh.ledger.rows(MEASURED).items()}


def _group(layout, params, dp_rank: int) -> dict:
    """What the parent needs of one flat group (a ZeRO-1/2 bucket or a ZeRO-3 unit): its sizes,
    which of its parameters have a gradient partial over tp, and their lengths in this rank's
    shard."""
    from plait.placement import placement

    return {
        "numel": layout.numel,
        "padded": layout.padded,
        "shard_numel": layout.shard_numel,
        "numels": list(layout.numels),
        "partial": ["tp" in placement(p).grad_partial for p in params],
        "seg_lengths": [s.length for s in layout.segments(dp_rank)],
    }


def _zero_tp(mesh, stage: int, sp: bool, n_layer: int) -> dict:
    from plait.placement import placement
    from plait.tensor_parallel import apply_tp
    from plait.zero import wrap

    model = apply_tp(_model(n_layer), mesh, sequence_parallel=sp)
    local_numel = sum(p.numel() for p in model.parameters())  # distinct, tp-local
    kinds = sorted({placement(p).sharded_axes for p in model.parameters()})
    engine = wrap(model, mesh, stage, _adamw, param_groups=param_groups(model, 0.1))
    mesh.ledger.clear()
    for step, (x, y) in enumerate(_my_rows(mesh)):
        mesh.ledger.set_step(step)
        engine.module(x, y).backward()
        engine.clip_grad_norm_(0.5)
        engine.step()
        engine.zero_grad()
    mesh.ledger.set_step(-1)
    flat = (
        [(u.layout, u.params) for u in engine.units]
        if stage == 3
        else [(b.layout, b.params) for b in engine.buckets]
    )
    out = {
        "rows": _rows(mesh),
        "local_numel": local_numel,
        "norm_kinds": kinds,
        "groups": [_group(layout, params, mesh.rank("dp")) for layout, params in flat],
    }
    engine.close()
    return out


def _pipeline(mesh, zero: int) -> dict:
    engine = parallelize(
        _model(),
        Layout(**mesh.sizes, zero_stage=zero, microbatches=MICRO),
        mesh,
        _adamw,
        param_groups=lambda mod: param_groups(mod, 0.1),
    )
    local_numel = sum(p.numel() for p in engine.raw.parameters())  # this pipeline rank's stage
    mesh.ledger.clear()
    for step, (x, y) in enumerate(_my_rows(mesh)):
        mesh.ledger.set_step(step)
        engine.forward_backward(list(zip(x.chunk(MICRO), y.chunk(MICRO))), 1.0 / (ROWS * SEQ))
        engine.clip_grad_norm_(0.5)
        engine.step()
        engine.zero_grad()
    mesh.ledger.set_step(-1)
    out = {
        "rows": _rows(mesh),
        "local_numel": local_numel,
        "groups": [_group(b.layout, b.params, mesh.rank("dp")) for b in engine.inner.buckets],
    }
    engine.close()
    return out


# (name, dp, ZeRO stage, sequence parallel, layers): dp x tp2
CONFIGS = [(f"dp2-z{s}-tp2{'-sp' if sp else ''}", 2, s, sp, 2) for s in (1, 2, 3) for sp in (False, True)]
CONFIGS += [(f"dp2-z3-tp2{'-sp' if sp else ''}-1layer", 2, 3, sp, 1) for sp in (False, True)]
CONFIGS += [("dp3-z1-tp2-sp", 3, 1, True, 2), ("dp3-z3-tp2-sp", 3, 3, True, 2)]


def _run(world: int):
    from plait.mesh import Mesh

    torch.set_num_threads(1)
    dp = world // TP
    mesh = Mesh(dp=dp, tp=TP, timeout_s=120)
    out = {c[0]: _zero_tp(mesh, *c[2:]) for c in CONFIGS if c[1] == dp}
    mesh.close()
    if world == PP * 2:
        mesh = Mesh(pp=PP, dp=2, timeout_s=120)
        out["pp2-dp2-z1"] = _pipeline(mesh, 1)
        out["pp2-dp2-z3"] = _pipeline(mesh, 3)
        mesh.close()
    return out


@pytest.fixture(scope="module")
def results_4():
    return run_ranks(_run, 4, (4,), timeout=300)


@pytest.fixture(scope="module")
def results_6():
    return run_ranks(_run, 6, (6,), timeout=300)


# --- the formulas ---------------------------------------------------------------------------------

RING = {  # bytes each rank sends per payload byte under the ring algorithm, over n ranks
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "send": lambda n: 1.0,
    "recv": lambda n: 1.0,
}


def _add(rows: dict, op: str, axis: str, count: int, payload: int) -> None:
    c, b = rows.get((op, axis), (0, 0))
    rows[(op, axis)] = (c + count, b + payload)


def _zero_dp(rows: dict, groups: list[dict], stage: int) -> int:
    """ZeRO's dp traffic: 2Ψ (stages 1, 2) or 3Ψ (stage 3), one collective per flat group and
    pass, Ψ the padded flat groups; returns Ψ."""
    k, psi = len(groups), sum(g["padded"] for g in groups)
    _add(rows, "reduce_scatter", "dp", k, psi * F32)
    passes = 2 if stage == 3 else 1  # the forward and backward gathers, or the step's publishing
    _add(rows, "all_gather", "dp", passes * k, passes * psi * F32)
    return psi


def _tp_activations(rows: dict, n_layer: int, sp: bool) -> None:
    """Megatron's activation traffic of b = ROWS sequences over tp: per block 4 tensors of b·s·h
    (f and g of attention and of the MLP, forward and backward), plus the vocab-parallel
    embedding's g (forward) and the head's f (backward); with sequence parallelism each
    all-reduce becomes a reduce-scatter and an all-gather of the same tensor."""
    act = ROWS * SEQ * _cfg().d_model * F32
    n = 4 * n_layer + 2
    if sp:
        _add(rows, "all_gather", "tp", n, n * act)
        _add(rows, "reduce_scatter", "tp", n, n * act)
    else:
        _add(rows, "all_reduce", "tp", n, n * act)


def _vocab_loss(rows: dict) -> None:
    """The vocab-parallel cross-entropy: the max over the vocabulary shards (b·s fp32), then the
    sum of exponentials and the target logit together ([2, b·s] fp32); no backward traffic."""
    _add(rows, "all_reduce", "tp", 2, 3 * ROWS * SEQ * F32)


def _norm(rows: dict, kinds: list, data_axes: tuple[str, ...]) -> None:
    """The global gradient norm: a float64 of squares per norm part (parameters grouped by the
    model axes they are sharded on) summed over the data axes; the parts sharded on tp summed
    over tp too. One all-reduce per axis."""
    for axis in data_axes:
        _add(rows, "all_reduce", axis, 1, len(kinds) * F64)
    tp_parts = sum("tp" in k for k in kinds)
    if tp_parts:
        _add(rows, "all_reduce", "tp", 1, tp_parts * F64)


def _sequence_parallel_grads(rows: dict, groups: list[dict], stage: int) -> int:
    """This rank's reduced ZeRO shard of the parameters whose gradient is partial over tp is
    summed over tp: the gradient synchroniser all-reduces, per bucket (a ZeRO-3 unit), the
    concatenated runs of them that this dp rank's shard holds, padding not included (stages 1-2
    keep them in buckets of their own). Returns the elements summed."""
    count = elems = 0
    for g in groups:
        if stage != 3:
            assert len(set(g["partial"])) == 1, "a ZeRO-1/2 bucket mixes partial and whole gradients"
        k = sum(n for n, partial in zip(g["seg_lengths"], g["partial"]) if partial)
        if k:
            count, elems = count + 1, elems + k
    if count:
        _add(rows, "all_reduce", "tp", count, elems * F32)
    return elems


def _check(measured: dict, expected: dict, sizes: dict, what: str) -> None:
    got = {k: (c, b) for k, (c, b, _) in measured.items()}
    assert got == expected, f"{what}: (op, axis): (count, payload bytes)\nmeasured {got}\nexpected {expected}"
    for (op, axis), (_, payload) in expected.items():
        bus = RING[op](sizes[axis]) * payload
        assert measured[(op, axis)][2] == pytest.approx(bus), (what, op, axis)


def _check_layout(res: dict, dp: int, what: str) -> None:
    """The flat groups cover the tp-local parameters exactly once, each padded by less than one
    element per dp rank."""
    assert sum(g["numel"] for g in res["groups"]) == res["local_numel"], what
    for g in res["groups"]:
        assert 0 <= g["padded"] - g["numel"] < dp and g["padded"] == dp * g["shard_numel"], (what, g)


def _by_name(request, name: str) -> list[dict]:
    dp = next(c[1] for c in CONFIGS if c[0] == name)
    return [per_rank[name] for per_rank in request.getfixturevalue(f"results_{dp * TP}")]


# --- the tests ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, dp, stage, sp, n_layer", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_zero_over_tp_ledger_is_the_sum_of_the_formulas(request, name, dp, stage, sp, n_layer):
    for rank, res in enumerate(_by_name(request, name)):
        what = f"{name} rank {rank}"
        _check_layout(res, dp, what)
        want: dict = {}
        psi = _zero_dp(want, res["groups"], stage)
        _tp_activations(want, n_layer, sp)
        _vocab_loss(want)
        _norm(want, res["norm_kinds"], ("dp",))
        partial = _sequence_parallel_grads(want, res["groups"], stage)
        assert (partial > 0) == sp, (what, partial)  # partial gradients: sequence parallelism only
        # and they are the ones sequence parallelism makes partial (Korthikanti et al. §4.2.2):
        # the position embedding's rows, per block 2 LayerNorms and 2 row-parallel biases, ln_f
        h = _cfg().d_model
        partial_numel = sum(k for g in res["groups"] for k, p in zip(g["numels"], g["partial"]) if p)
        want_partial = _cfg().seq_len * h + (6 * n_layer + 2) * h if sp else 0
        assert partial_numel == want_partial, (
            f"{what}: {partial_numel} partial-gradient elements, expected {want_partial}"
        )
        _check(res["rows"], want, {"dp": dp, "tp": TP}, what)
        # the headline: ZeRO moves 3Ψ (stage 3) or 2Ψ over dp, Ψ the tp-local flat parameters
        dp_bytes = sum(
            p for (op, axis), (_, p, _) in res["rows"].items() if axis == "dp" and op != "all_reduce"
        )
        assert dp_bytes == (3 if stage == 3 else 2) * psi * F32, what
    if dp == 3:  # these layouts pad: the figures above include the padding
        assert sum(g["padded"] - g["numel"] for g in res["groups"]) > 0


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_tp_traffic_per_layer_under_zero3(request, sp):
    """One more transformer layer adds 8·b·s·h·(t-1)/t bus elements over tp, as 4 all-reduces or,
    with sequence parallelism, 4 all-gather/reduce-scatter pairs of the same volume."""
    ops = ("all_gather", "reduce_scatter") if sp else ("all_reduce",)
    name = f"dp2-z3-tp2{'-sp' if sp else ''}"
    for two, one in zip(_by_name(request, name), _by_name(request, f"{name}-1layer"), strict=True):
        two, one = two["rows"], one["rows"]
        count = sum(two[(op, "tp")][0] - one[(op, "tp")][0] for op in ops)
        bus = sum(two[(op, "tp")][2] - one[(op, "tp")][2] for op in ops)
        assert count == (8 if sp else 4)
        assert bus / F32 == pytest.approx(8 * ROWS * SEQ * _cfg().d_model * (TP - 1) / TP)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_sequence_parallel_moves_the_same_activation_volume(request, stage):
    """Sequence parallelism turns each activation all-reduce over tp into an all-gather and a
    reduce-scatter: the same bus bytes."""
    for plain, sp in zip(
        _by_name(request, f"dp2-z{stage}-tp2"), _by_name(request, f"dp2-z{stage}-tp2-sp"), strict=True
    ):
        loss_and_norm = RING["all_reduce"](TP) * (3 * ROWS * SEQ * F32 + F64)
        all_reduces = plain["rows"][("all_reduce", "tp")][2] - loss_and_norm
        pairs = sp["rows"][("all_gather", "tp")][2] + sp["rows"][("reduce_scatter", "tp")][2]
        assert pairs == pytest.approx(all_reduces)


@pytest.mark.parametrize("name", ["pp2-dp2-z1", "pp2-dp2-z3"])
def test_pipeline_zero_ledger_is_the_sum_of_the_formulas(results_4, name):
    """pp2 x dp2, ZeRO-1 or ZeRO-3 within the stages, 1F1B with 2 micro-batches, per pipeline
    rank: 2Ψ_stage over dp (ZeRO-3 gathers the parameters once per step, at its start, instead
    of after the step: the same reduce-scatter Ψ + all-gather Ψ); each micro-batch's b·s·h
    activation sent forward and its gradient sent back over pp; the tied embedding/head
    gradient (V x h) all-reduced over pp; the norm over dp and pp."""
    cfg = _cfg()
    psis = {}
    for rank, per_rank in enumerate(results_4):
        res = per_rank[name]
        what = f"{name} rank {rank}"
        _check_layout(res, 2, what)
        want: dict = {}
        psis[rank] = _zero_dp(want, res["groups"], 1)
        p2p = MICRO * (ROWS // MICRO) * SEQ * cfg.d_model * F32
        _add(want, "send", "pp", MICRO, p2p)  # activations (stage 0) or their gradients (stage 1)
        _add(want, "recv", "pp", MICRO, p2p)
        _add(want, "all_reduce", "pp", 1, cfg.vocab_size * cfg.d_model * F32)  # tied wte / lm_head
        _norm(want, [()], ("dp", "pp"))  # one norm part: nothing is sharded on a model axis
        _check(res["rows"], want, {"dp": 2, "pp": PP}, what)
    # global ranks 0, 1 hold pipeline stage 0 (embeddings, block 0), 2, 3 stage 1 (block 1, ln_f,
    # the tied head): Ψ_stage is each stage's own
    assert psis[0] == psis[1] and psis[2] == psis[3] and psis[0] != psis[2], psis

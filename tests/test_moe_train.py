"""Mixture of experts in plait's GPT and `plait train`: expert parallelism and every layout follow
one process, the routing statistics are layout-free, and bad settings are refused before start.

Every run routes each sequence as one group, so the capacity, the dropped tokens and the
auxiliary losses do not depend on how the batch is split: one process with 2 accumulation
micro-batches, dp2, ep2 and dp2 x ep2 see the same groups and must give the same losses,
gradient norms and statistics (within 1e-5); so must ZeRO 2-3 under ep (experts sharded over dp,
the rest over dp x ep) and pipelines with ep. Three layouts run SGD without clipping, where a
wrong gradient scale on the experts (reduced over dp x ep instead of dp, or not averaged) moves
the parameters off the reference at once. Checkpoints cut under one expert layout resume under
another.
"""

from __future__ import annotations

import pytest
import torch
from conftest import SGD, TINY, assert_runs_match, metrics, resume_job, side_by_side

from plait.errors import ConfigError
from plait.models import GPT, GPTConfig, gpt_train_flops_per_token
from plait.train.config import load_config

MOE = ("--model.experts", "4", "--model.top_k", "2", "--train.log_every", "2")

LAYOUTS = {
    "one": ("--parallel.dp", "1", "--train.micro_batches", "2"),
    "dp2": ("--parallel.dp", "2"),
    "ep2": ("--parallel.dp", "1", "--parallel.ep", "2"),
    "dp2xep2": ("--parallel.dp", "2", "--parallel.ep", "2"),
    "zero3": ("--parallel.dp", "2", "--parallel.zero_stage", "3"),
    "one-sgd": ("--parallel.dp", "1", *SGD),
    "ep2-sgd": ("--parallel.dp", "1", "--parallel.ep", "2", *SGD),
    "ep2xtp2": ("--parallel.dp", "1", "--parallel.ep", "2", "--parallel.tp", "2"),
    "tp2-sp": ("--parallel.dp", "1", "--parallel.tp", "2", "--parallel.sequence_parallel", "true"),
    "pp2": ("--parallel.dp", "1", "--parallel.pp", "2"),
    "pp2xep2-zbh1": (
        "--parallel.dp",
        "1",
        "--parallel.ep",
        "2",
        "--parallel.pp",
        "2",
        "--parallel.schedule",
        "zb-h1",
    ),
    "pp2xep2-z3-sgd": (
        *("--parallel.dp", "1", "--parallel.ep", "2", "--parallel.pp", "2", "--parallel.zero_stage", "3"),
        *SGD,
    ),
    "one-dropless": ("--parallel.dp", "1", "--model.capacity_factor", "0", "--model.top_k", "1"),
    "ep2-dropless": (
        *("--parallel.dp", "1", "--parallel.ep", "2"),
        *("--model.capacity_factor", "0", "--model.top_k", "1"),
    ),
    # ZeRO shards the experts over their replica group (dp) and the rest over dp x ep
    "dp2xep2-z3": ("--parallel.dp", "2", "--parallel.ep", "2", "--parallel.zero_stage", "3"),
    "dp2xep2-z2-sgd": ("--parallel.dp", "2", "--parallel.ep", "2", "--parallel.zero_stage", "2", *SGD),
}


def _every_key(dp=1, ep=1, tp=1, zero=0):
    """Every layout key, so that a resumed run overrides all of the saved run's."""
    return (
        *("--parallel.dp", str(dp), "--parallel.ep", str(ep), "--parallel.tp", str(tp)),
        *("--parallel.zero_stage", str(zero)),
    )


# checkpoints of step 4 under one layout resumed under another (saved, resumed): the experts'
# ZeRO-3 shards over dp read back as ep slices, and ep slices as ZeRO-3 shards
RESUMES = {
    "dp2xep2-z3-to-ep2xtp2": ("dp2xep2-z3", _every_key(ep=2, tp=2)),
    "ep2-to-dp2-z3": ("ep2", _every_key(dp=2, zero=3)),
}


@pytest.fixture(scope="module")
def runs(shared_runs, tmp_path_factory):
    """{name: run dir}: each of LAYOUTS, and "cut-<resume>": the saving layout's run as stopped
    after step 4 (`cut_copy`), resumed under the other layout; side by side."""
    base = tmp_path_factory.mktemp("moe")
    jobs = {name: shared_runs.job(*TINY, *MOE, *layout, timeout=300) for name, layout in LAYOUTS.items()}
    for name, (saved, again) in RESUMES.items():
        jobs[f"cut-{name}"] = resume_job(jobs[saved], base / f"cut-{name}", *again, timeout=300)
    done = side_by_side(jobs)
    for name, (_, r) in done.items():
        assert r.returncode == 0, f"{name}: {r.stderr[-3000:]}"
    return {name: run for name, (run, _) in done.items()}


@pytest.mark.parametrize(
    "name, reference",
    [
        ("dp2", "one"),
        ("ep2", "one"),
        ("dp2xep2", "one"),
        ("zero3", "one"),
        ("ep2xtp2", "one"),
        ("tp2-sp", "one"),
        ("pp2", "one"),
        ("pp2xep2-zbh1", "one"),
        ("pp2xep2-z3-sgd", "one-sgd"),
        ("ep2-sgd", "one-sgd"),
        ("ep2-dropless", "one-dropless"),
        ("dp2xep2-z3", "one"),
        ("dp2xep2-z2-sgd", "one-sgd"),
    ],
)
def test_every_layout_follows_one_process(runs, name, reference):
    assert_runs_match(runs[name], runs[reference], what=f"{name} vs {reference}")


@pytest.mark.parametrize("saved", RESUMES)
def test_checkpoint_resumes_across_expert_layouts(runs, saved):
    """Steps 1-4 under the saving layout and 5-8 resumed under another follow one process: the
    experts are saved whole (chunks of each expert tensor), whatever split them."""
    cut = runs[f"cut-{saved}"]
    assert max(metrics(cut)) == 8, "the resumed run continues in the cut run's directory"
    assert_runs_match(cut, runs["one"], what=f"{saved} resumed on {RESUMES[saved][1]}")


LAYOUT_FREE = ["dp2", "ep2", "dp2xep2", "zero3", "ep2xtp2", "tp2-sp", "pp2", "pp2xep2-zbh1", "dp2xep2-z3"]


@pytest.mark.parametrize("name", LAYOUT_FREE)
def test_routing_statistics_do_not_depend_on_the_layout(runs, name):
    """Claims per expert and dropped fraction are equal; the auxiliary losses within 1e-5."""
    want, got = metrics(runs["one"]), metrics(runs[name])
    logged = [s for s in want if "moe" in want[s]]
    assert logged == [2, 4, 6, 8], logged
    for step in logged:
        a, b = got[step]["moe"], want[step]["moe"]
        assert a["tokens_per_expert"] == b["tokens_per_expert"], (name, step)
        assert a["dropped_fraction"] == pytest.approx(b["dropped_fraction"], abs=1e-12), (name, step)
        for key in ("aux_loss", "z_loss"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), (name, step, key)


def test_statistics_count_every_claim_and_drop_only_over_capacity(runs):
    one, dropless = metrics(runs["one"]), metrics(runs["one-dropless"])
    tokens = 8 * 32  # global batch x seq_len of the tiny model
    for step in (2, 4, 6, 8):
        # one MoE layer (block 1 of 2); 2 steps per log window; top-2 and top-1 claims
        assert [sum(row) for row in one[step]["moe"]["tokens_per_expert"]] == [2 * tokens * 2]
        assert [sum(row) for row in dropless[step]["moe"]["tokens_per_expert"]] == [2 * tokens * 1]
        assert dropless[step]["moe"]["dropped_fraction"] == 0.0
    # capacity 1.25 x k x S / E on random tokens: some claims are dropped
    assert any(one[s]["moe"]["dropped_fraction"] > 0 for s in (2, 4, 6, 8))
    # Switch's loss is E·Σ f_e·P_e >= 1 in expectation for top-1 routing, 1 when balanced
    assert all(m["moe"]["aux_loss"] > 0.5 for m in one.values() if "moe" in m)
    for name in ("one", "ep2", "dp2xep2"):
        assert (runs[name] / "expert_load.png").stat().st_size > 1000, name


def test_expert_parallelism_holds_each_rank_its_experts(runs):
    """ep2 holds half the expert parameters per rank: the model state per rank shrinks by the
    experts' share (4 experts' MLPs, half of them elsewhere); ZeRO-3 over dp2 x ep2 a quarter."""
    cfg = GPTConfig(vocab_size=256, seq_len=32, n_layer=2, n_head=2, d_model=32, experts=4)
    expert_params = 4 * (2 * 32 * 128 + 128 + 32)  # w1, w2, b1, b2 of 4 experts
    one = metrics(runs["one"])[8]["model_state_bytes"]["params"]
    ep2 = metrics(runs["ep2"])[8]["model_state_bytes"]["params"]
    assert one == 4 * cfg.n_params()
    assert one - ep2 == 4 * expert_params // 2
    # ZeRO-3 at dp2 x ep2: experts sharded over dp within their ep slice, the rest over dp x ep:
    # a quarter of everything, plus each unit's padding to a multiple of its shard count
    z3 = metrics(runs["dp2xep2-z3"])[8]["model_state_bytes"]["params"]
    units = 2 + 2  # the root and the dense block; the MoE block's dense part and its experts
    assert one // 4 <= z3 <= one // 4 + 4 * 3 * units, (z3, one // 4)


def test_moe_parameter_count_and_active_flops():
    cfg = GPTConfig(vocab_size=256, seq_len=32, n_layer=4, n_head=2, d_model=32, experts=4, top_k=2)
    model = GPT(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.n_params()
    assert [cfg.is_moe(i) for i in range(4)] == [False, True, False, True]
    dense = GPTConfig(vocab_size=256, seq_len=32, n_layer=4, n_head=2, d_model=32)
    # per MoE layer and token: one more expert MLP (2 GEMMs of 32 x 128) and the router (32 x 4),
    # 2 FLOPs per multiply-add, forward + backward = 3 passes
    extra = 2 * 3 * (2 * 2 * 32 * 128 + 2 * 32 * 4)
    assert gpt_train_flops_per_token(cfg) - gpt_train_flops_per_token(dense) == extra
    top1 = GPTConfig(vocab_size=256, seq_len=32, n_layer=4, n_head=2, d_model=32, experts=4, top_k=1)
    assert gpt_train_flops_per_token(top1) - gpt_train_flops_per_token(dense) == 2 * 3 * 2 * 32 * 4


def test_aux_loss_weight_follows_the_objective_scale():
    """Outside an engine the MoE losses join a mean loss with their coefficients; inside
    `objective_scale(s)` their weight is s x tokens of the forward (the engine's sum-of-token-losses
    objective), so both give the same router gradient for a one-micro-batch step."""
    from plait.moe.parallel import objective_scale

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=16, experts=4, aux_loss_coef=0.5)
    model = GPT(cfg)
    x = torch.randint(0, 64, (4, 16))
    model(x, x).backward()
    router = model.blocks[1].mlp.moe.router
    mean_grad = next(router.parameters()).grad.clone()
    model.zero_grad()
    with objective_scale(1.0 / x.numel()):
        (model(x, x, reduction="sum") / x.numel()).backward()
    torch.testing.assert_close(next(router.parameters()).grad, mean_grad, rtol=1e-5, atol=1e-7)
    model.zero_grad()
    cfg0 = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=16, experts=4, aux_loss_coef=0.0)
    torch.manual_seed(0)
    plain = GPT(cfg0)
    plain.blocks[1].mlp.z_coef = 0.0
    model.blocks[1].mlp.z_coef = 0.0
    plain(x, x).backward()
    model(x, x).backward()
    # the load-balancing term changes the router's gradient (it is not silently dropped)
    assert not torch.allclose(
        next(router.parameters()).grad, next(plain.blocks[1].mlp.moe.router.parameters()).grad
    )


@pytest.mark.parametrize(
    "overrides, message",
    [
        ([("parallel.ep", "2")], "the model is dense: set model.experts"),
        ([("model.experts", "3"), ("parallel.ep", "2")], "does not divide over parallel.ep = 2"),
        ([("model.experts", "4"), ("model.top_k", "3")], "valid: 1 (Switch), 2 (GShard)"),
        ([("model.experts", "1"), ("model.top_k", "2")], "more than model.experts = 1"),
        ([("model.experts", "4"), ("model.capacity_factor", "-1")], "capacity_factor must be >= 0"),
        (
            [
                ("model.experts", "4"),
                ("parallel.ep", "2"),
                ("parallel.dp", "2"),
                ("parallel.zero_stage", "1"),
                ("parallel.hybrid_shard", "1"),
            ],
            "parallel.hybrid_shard = 0",
        ),
        ([("model.experts", "4"), ("parallel.ep", "2"), ("optim.name", "lamb")], "whole expert tensor"),
        (
            [("model.experts", "4"), ("parallel.ep", "2"), ("comm.compression", "onebit")]
            + [("comm.target", "momentum")],
            "comm.target = 'gradient' (compressed gradients work with ep)",
        ),
        (
            [("model.experts", "4"), ("parallel.ep", "2"), ("parallel.dp", "2"), ("parallel.pp", "2")]
            + [("train.global_batch", "8")],
            "gives 2 rows per dp x ep rank, not divisible into parallel.microbatches = 4",
        ),
        (
            [("model.experts", "4"), ("parallel.ep", "2"), ("train.global_batch", "6")],
            "parallel.ep = 2 ranks",
        ),
    ],
)
def test_bad_moe_settings_are_refused_before_start(overrides, message):
    with pytest.raises(
        ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")
    ):
        load_config(None, overrides)

"""plait plan: the stage DP against brute force, the pipeline extrapolation against the simulator,
memory against the estimator, rejections with their reasons, the --json schema, planning a 175B
GPT on 1024 devices, and plans that plait's own config validation accepts; the calibration's
cache, its tp probe against plait's tensor parallelism (2 and 4 processes), and one
`plait train --parallel.plan auto` run."""

from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest

from plait.cli import main
from plait.models.gpt import GPTConfig
from plait.pipeline.simulate import Costs, simulate
from plait.planner.cluster import PRESETS, axis_links, load_cluster
from plait.planner.cost import Candidate, evaluate, stage_params
from plait.planner.search import check_runnable, layout_config, load_plan_config, plan
from plait.planner.stages import _GENERATORS, balanced_stages, brute_force_stages, inter_op_dp, pipeline_time
from plait.train.config import model_config, validate
from plait.zero.estimate import activation_bytes, dtype_preset, model_state_bytes_formula

A100 = PRESETS["dgx-a100"]
GPT175 = GPTConfig(vocab_size=51200, seq_len=2048, n_layer=96, n_head=96, d_model=12288)
ARGS_175B = [
    "--model.n_layer", "96", "--model.d_model", "12288", "--model.n_head", "96",
    "--model.seq_len", "2048", "--model.vocab_size", "51200", "--train.global_batch", "1536",
]  # fmt: skip


def test_inter_op_dp_equals_brute_force_on_random_cases():
    rng = random.Random(0)
    for _ in range(200):
        L = rng.randint(1, 7)
        S = rng.randint(1, L)
        B = rng.randint(1, 8)
        layer = [rng.uniform(0.1, 3.0) for _ in range(L)]
        overhead = rng.uniform(0.0, 1.0)
        cap = rng.uniform(2.0, 12.0)  # a memory-like limit: longer ranges do not fit

        def cost(i, j, layer=layer, overhead=overhead, cap=cap):
            t = sum(layer[i:j]) + overhead * (j - i) ** 0.5  # not additive: Alpa's general case
            return math.inf if t > cap else t

        dp_best, dp_bounds = inter_op_dp(cost, L, S, B)
        bf_best, _ = brute_force_stages(cost, L, S, B)
        if math.isinf(bf_best):
            assert math.isinf(dp_best) and dp_bounds is None
            continue
        assert dp_best == pytest.approx(bf_best, rel=1e-12)
        times = [cost(a, b) for a, b in zip(dp_bounds, dp_bounds[1:], strict=False)]
        assert len(times) == S and dp_bounds[0] == 0 and dp_bounds[-1] == L
        assert sum(times) + (B - 1) * max(times) == pytest.approx(dp_best, rel=1e-12)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "interleaved", "zb-h1"])
def test_pipeline_extrapolation_equals_a_full_simulation(kind):
    p, m = 4, 48  # simulated with 16 micro-batches, extrapolated to 48
    v = 2 if kind == "interleaved" else 1
    f, b, w, comm, head_f, head_b = 2.0, 2.5, 1.5, 0.25, 0.5, 1.0
    got = pipeline_time(kind, p, m, v, f, b, w, comm, 0.0, head_f, head_b)
    assert got["m_simulated"] < m
    n = p * v
    costs = Costs(F=f, B=b, W=w, comm=comm)
    costs.per_stage = {("F", 0): f / v, ("F", n - 1): f / v + head_f}
    if kind == "zb-h1":
        costs.per_stage |= {("B", n - 1): b / v + head_b / 2, ("W", n - 1): w / v + head_b / 2}
    else:
        costs.per_stage[("BW", n - 1)] = (b + w) / v + head_b
    full = simulate(_GENERATORS[kind](p, m, v), costs)
    assert got["makespan"] == pytest.approx(full.makespan, rel=1e-9)
    assert got["peak_activations"] == pytest.approx(max(full.peak_activations), rel=1e-9)


def test_memory_predictions_equal_the_estimator():
    lay = Candidate(dp=16, tp=8, pp=8, zero_stage=1, sequence_parallel=True, microbatch_size=2,
                    microbatches=48, schedule="1f1b", recompute=False)  # fmt: skip
    got = evaluate(GPT175, 1536, lay, A100)["terms"]
    p_bytes, g_bytes, k = dtype_preset("bf16", "adamw")
    psi = stage_params(GPT175, lay)
    assert got["params_per_device"] == psi
    states = model_state_bytes_formula(psi, 16, 1, param_bytes=p_bytes, grad_bytes=g_bytes, optimizer_k=k)
    assert got["model_state_bytes"] == states["total"]
    stage = dataclasses.replace(GPT175, n_layer=96 // 8)
    per_mb = activation_bytes(stage, 2, tp=8, sequence_parallel=True, stored_scores=False)
    assert got["activation_bytes_per_microbatch"] == per_mb
    assert got["in_flight_microbatches"] == 8  # 1F1B's first rank holds p micro-batches
    logits = 2 * 2048 * 51200 * 4 // 8
    assert got["activation_bytes"] == per_mb * 8 + logits
    # The whole model's parameters, summed over tp and pp, are the GPT's own count (to the copy of
    # the tied embedding the last stage holds, and the ln_f / position embedding split).
    flat = Candidate(dp=1, tp=1, pp=1)
    assert stage_params(GPT175, flat) == GPT175.n_params()


def test_an_infeasible_layout_is_rejected_with_its_reason():
    lay = Candidate(dp=1, tp=8, pp=1, microbatch_size=1, microbatches=8)
    out = evaluate(GPT175, 8, lay, A100)
    assert not out["feasible"]
    assert out["reason"].startswith("out of memory: needs ") and "GB over" in out["reason"]
    over = float(out["reason"].split("(")[1].split(" GB over")[0])
    assert over == pytest.approx(out["memory_gb"] - 80 * 0.9, abs=0.06)
    base = load_plan_config(None, [("model.name", "small")])
    # 4 heads do not split over tp = 8: plait's validation says so, and the plan is refused.
    reason = check_runnable(base, Candidate(dp=1, tp=8, pp=1))
    assert reason.startswith("not runnable:") and "n_head" in reason


def test_json_schema_and_plans_pass_config_validation(capsys):
    code = main(["plan", "--model.name", "small", "--train.global_batch", "32", "--devices", "8", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    plans = out["plans"]
    assert plans and plans[0]["feasible"]
    required = ("dp", "tp", "pp", "ep", "zero_stage", "microbatches", "schedule", "recompute", "feasible")
    required += ("step_s", "tflops_per_device", "memory_gb")
    seen_infeasible = False
    for r in plans:
        assert all(k in r for k in required)
        assert r["dp"] * r["tp"] * r["pp"] * r["ep"] * r["cp"] == 8
        seen_infeasible |= not r["feasible"]
        if seen_infeasible:
            assert not r["feasible"] and r["reason"]  # infeasible ones come after
    feasible = [r for r in plans if r["feasible"]]
    assert [r["step_s"] for r in feasible] == sorted(r["step_s"] for r in feasible)
    base = load_plan_config(None, [("model.name", "small"), ("train.global_batch", "32")])
    for r in feasible:
        lay = Candidate(**{f.name: r[f.name] for f in dataclasses.fields(Candidate)})
        validate(layout_config(base, lay), data=False)  # raises if plait would refuse it


def test_a_175b_gpt_on_1024_a100s_gets_a_feasible_plan():
    # How long planning takes is measured by benchmarks/plan_published.py (its "planning s"
    # column, up to 3072 devices), not asserted here.
    base = load_plan_config(None, [(a[2:], b) for a, b in zip(ARGS_175B[::2], ARGS_175B[1::2], strict=True)])
    result = plan(base, GPT175, 1536, 1024, A100, top=5)
    best = result["plans"][0]
    assert best["feasible"] and best["memory_gb"] <= 72
    assert 0 < best["mfu"] < 1 and best["tflops_per_device"] < A100.peak_tflops
    assert result["candidates"] > 1000 and result["simulated"] < result["candidates"]


def test_cli_errors_are_one_line(capsys):
    assert main(["plan", "--devices", "8", "--cluster", "nowhere"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "preset" in err
    assert main(["plan", "--devices", "0"]) == 2
    assert main(["plan", "--devices", "8", "--model.nope", "1"]) == 2
    assert "unknown key" in capsys.readouterr().err


def test_cluster_file_and_axis_placement(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(
        'name = "mine"\ngpus_per_node = 4\npeak_tflops = 100.0\nmemory_gb = 40.0\n'
        "[intra]\nalpha_us = 2.0\nbeta_gbps = 100.0\n[inter]\nalpha_us = 20.0\nbeta_gbps = 10.0\n"
    )
    c = load_cluster(str(path))
    assert c.name == "mine" and c.intra.beta_bps == 100e9 and c.inter.alpha_s == pytest.approx(20e-6)
    links = axis_links(c, {"tp": 2, "ep": 1, "dp": 2, "pp": 2})
    assert links["tp"] is c.intra and links["dp"] is c.intra and links["pp"] is c.inter
    links = axis_links(c, {"tp": 4, "dp": 2})
    assert links["tp"] is c.intra and links["dp"] is c.inter
    path.write_text('gpus_per_node = 4\npeak_tflops = "fast"\nmemory_gb = 1\n[intra]\n[inter]\n')
    with pytest.raises(Exception, match="peak_tflops must be a number"):
        load_cluster(str(path))


def test_balanced_stages_take_blocks_off_the_stage_with_the_logits():
    got = balanced_stages(block_s=1.0, head_s=3.0, n_layers=8, n_stages=4, microbatches=8)
    assert got["uniform_t_star_s"] == 8 + 3 + 7 * 5  # stages 2, 2, 2, 2 + 3
    assert got["t_star_s"] == 8 + 3 + 7 * 4 and got["bounds"][-2] == 7  # the last stage: 1 block + head
    assert got["t_star_s"] == brute_force_stages(lambda i, j: (j - i) + 3.0 * (j == 8), 8, 4, 8)[0]


def test_model_vocab_size_is_a_config_key():
    from plait.errors import ConfigError
    from plait.train.config import load_config, model_config

    assert model_config(load_config(None, [("model.vocab_size", "512")])).vocab_size == 512
    assert model_config(load_config(None, [])).vocab_size == 256  # the named size's
    with pytest.raises(ConfigError, match="below the 256 byte values"):
        load_config(None, [("model.vocab_size", "100")])
    with pytest.raises(ConfigError, match="out of range"):
        load_config(None, [("model.vocab_size", str(2**21))])
    # Planning does not read the corpus: a 175B GPT's batch need not fit this machine's text.
    base = load_plan_config(None, [("model.vocab_size", "51200"), ("model.seq_len", "2048")])
    assert model_config(base).vocab_size == 51200


def test_a_plan_plait_refuses_is_rejected_and_the_search_goes_on():
    # Gradient compression needs fp32 gradients from ZeRO stage 1 on, and plans train in bf16: plait
    # refuses those layouts. The enumeration does not know that rule, so plait's validation must
    # catch every such plan and the search refill the top K with others.
    overrides = [("model.name", "small"), ("train.global_batch", "32"), ("comm.compression", "fp16")]
    base = load_plan_config(None, overrides)
    result = plan(base, model_config(base), 32, 8, A100, top=5)
    feasible = [r for r in result["plans"] if r["feasible"]]
    assert len(feasible) == 5 and all(r["zero_stage"] == 0 for r in feasible)
    refused = [r for r in result["plans"] if r["reason"].startswith("not runnable:")]
    assert refused and all("comm.compression" in r["reason"] for r in refused)
    assert refused[0]["step_s"] <= feasible[-1]["step_s"]  # it would have ranked among them


def test_presets_and_optional_cluster_fields(tmp_path):
    h100 = load_cluster("dgx-h100")
    assert h100.peak_tflops == 989.0 and h100.intra.beta_bps > A100.intra.beta_bps
    assert h100.inter.beta_bps == 2 * A100.inter.beta_bps  # 400 vs 200 Gb/s per GPU
    path = tmp_path / "c.toml"
    path.write_text(
        "gpus_per_node = 8\npeak_tflops = 312.0\nmemory_gb = 40.0\nefficiency = 0.5\npcie_gbps = 12.5\n"
        "[intra]\nalpha_us = 5.0\nbeta_gbps = 300.0\n[inter]\nalpha_us = 10.0\nbeta_gbps = 25.0\n"
    )
    c = load_cluster(str(path))
    assert c.name == "c" and c.efficiency == 0.5 and c.pcie_gbps == 12.5 and c.memory_gb == 40.0
    lay = Candidate(dp=8, microbatch_size=1, microbatches=2)
    cfg = GPTConfig(vocab_size=51200, seq_len=1024, n_layer=12, n_head=12, d_model=768)
    # Half the memory, five sixths of the efficiency: same memory figure, a slower step.
    a, b = evaluate(cfg, 16, lay, A100), evaluate(cfg, 16, lay, c)
    assert a["memory_gb"] == b["memory_gb"] and b["step_s"] > a["step_s"]
    path.write_text(path.read_text().replace("efficiency = 0.5", "efficiency = 2"))
    with pytest.raises(Exception, match="out of range"):
        load_cluster(str(path))
    from plait.errors import ConfigError

    good = path.read_text().replace("efficiency = 2", "efficiency = 0.5")
    path.write_text(good + '[pipeline_overhead_ms]\n1f1b = 1.5\n"zb-v" = 2\n')
    c = load_cluster(str(path))
    assert c.pipeline_overhead_s("1f1b") == pytest.approx(1.5e-3) and c.pipeline_overhead_s("zb-v") == 2e-3
    assert c.pipeline_overhead_s("gpipe") == 0.0
    for rows in ("[[64, 128, 1, 0.2]]", "[[64, 128, 2.5, 0.2]]"):  # tp 1 belongs to efficiency_curve
        path.write_text(f"efficiency_curve = [[64, 128, 0.3]]\ntp_efficiency = {rows}\n" + good)
        with pytest.raises(ConfigError, match="integer >= 2"):
            load_cluster(str(path))
    for bad, why in (("2f2b = 1.0", "valid: gpipe, 1f1b"), ("1f1b = -1", "milliseconds >= 0")):
        path.write_text(good + f"[pipeline_overhead_ms]\n{bad}\n")
        with pytest.raises(ConfigError, match=why):
            load_cluster(str(path))


def test_the_pipeline_engine_overhead_is_priced_per_micro_batch():
    """The calibrated time plait's pipeline engine adds per micro-batch is spread over the
    micro-batch's actions (F and BW, or F, B and W): the busiest rank pays it once per
    micro-batch, so a long pipeline's step grows by m x o and, for 1F1B and ZB-H1, by little more
    (ZB-V's V-shaped chain idles a third more with these costs); a layout without a pipeline does
    not pay it."""
    o, m = 2e-3, 32
    with_o = dataclasses.replace(A100, pipeline_overhead=(("1f1b", o), ("zb-h1", o), ("zb-v", o)))
    cfg = GPTConfig(vocab_size=256, seq_len=128, n_layer=4, n_head=4, d_model=128)
    for schedule, most in (("1f1b", 1.05), ("zb-h1", 1.05), ("zb-v", 1.6)):
        lay = Candidate(dp=4, pp=2, microbatch_size=1, microbatches=m, schedule=schedule)
        a, b = evaluate(cfg, 4 * m, lay, A100), evaluate(cfg, 4 * m, lay, with_o)
        assert b["terms"]["pipeline_engine_s"] == pytest.approx(m * o)
        assert a["terms"]["pipeline_engine_s"] == 0
        assert m * o * 0.99 <= b["step_s"] - a["step_s"] <= most * m * o, schedule
    flat = Candidate(dp=8, microbatch_size=16)
    priced = evaluate(cfg, 4 * m, flat, with_o)
    assert priced["step_s"] == evaluate(cfg, 4 * m, flat, A100)["step_s"]
    assert priced["terms"]["pipeline_engine_s"] == 0


def test_config_file_before_or_after_the_options(tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text('[model]\nname = "small"\nvocab_size = 512\n[train]\nglobal_batch = 32\n')
    outs = []
    for argv in (
        ["plan", str(path), "--devices", "4", "--json"],
        ["plan", "--devices", "4", str(path), "--json"],
    ):
        assert main(argv) == 0
        outs.append(json.loads(capsys.readouterr().out)["plans"][0])
    assert outs[0] == outs[1]
    assert outs[0]["dp"] * outs[0]["tp"] * outs[0]["pp"] == 4


# --- calibration, the cluster `this`, plait train --parallel.plan auto ---------------------------


def _fake_calibration(**key_changes) -> dict:
    """The fields `plait plan --calibrate` writes, with made-up figures (nothing is measured)."""
    from plait.planner.calibrate import machine_key

    coll = [
        {"op": op, "ranks": n, "world": w, "alpha_us": 200.0 * n, "beta_gbps": 1.0}
        for op in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")
        for n, w in ((2, 2), (2, 4), (4, 4))
    ] + [{"op": "send", "ranks": 2, "world": w, "alpha_us": 100.0, "beta_gbps": 2.0} for w in (2, 4)]
    return {
        "name": "this",
        "gpus_per_node": 1024,
        "peak_tflops": 0.05,
        "memory_gb": 16.0,
        "efficiency": 0.5,
        "memory_bw_gbps": 1.0,
        "cores": 2,
        "precision": "fp32",
        "rank_tflops": [[1, 0.05], [2, 0.04], [4, 0.02]],
        "efficiency_curve": [[64, 128, 0.2], [64, 1024, 0.3], [512, 128, 0.5], [512, 1024, 0.6]],
        "tp_efficiency": [
            [h, n, tp, round(e * (1.0 - 0.1 * tp), 4)]
            for h, n, e in ((64, 128, 0.2), (64, 1024, 0.3), (512, 128, 0.5), (512, 1024, 0.6))
            for tp in (2, 4)
        ],
        "note": "made up for a test",
        "intra": {"alpha_us": 50.0, "beta_gbps": 5.0},  # not the fits: a test sees which was used
        "inter": {"alpha_us": 50.0, "beta_gbps": 5.0},
        "collective": coll,
        "calibration": machine_key() | key_changes | {"date": "2026-01-01 00:00 UTC"},
    }


@pytest.fixture
def this_cache(tmp_path, monkeypatch):
    """A cached calibration of this machine in a private cache directory; measuring is an error."""
    from plait.planner import calibrate

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))

    def no_measuring(quiet=False):
        raise AssertionError("calibrate() ran: the cache should have been used")

    monkeypatch.setattr(calibrate, "calibrate", no_measuring)
    calibrate.write_cache(_fake_calibration())
    return calibrate.cache_path()


def test_alpha_beta_fit_recovers_known_alpha_and_beta():
    from plait.planner.calibrate import fit_alpha_beta

    alpha, beta = 150e-6, 2.5e9
    sizes = [4096, 65536, 524288, 4 * 2**20, 16 * 2**20]
    rng = random.Random(1)
    exact = [alpha + n / beta for n in sizes]
    a, b = fit_alpha_beta(sizes, exact)
    assert a == pytest.approx(alpha, rel=1e-9) and b == pytest.approx(beta, rel=1e-9)
    noisy = [t * (1 + rng.uniform(-0.01, 0.01)) for t in exact]
    a, b = fit_alpha_beta(sizes, noisy)
    assert b == pytest.approx(beta, rel=0.03) and a == pytest.approx(alpha, abs=60e-6)
    # A series whose intercept would come out negative is refitted through the origin.
    a, b = fit_alpha_beta([1000, 2000, 4000], [0.0, 1.5e-6, 4.5e-6])
    assert a == 0.0 and b > 0


def test_calibration_cache_round_trips_and_a_changed_key_measures_again(this_cache, monkeypatch):
    from plait.planner import calibrate

    c = calibrate.load_this()
    assert c.name == "this" and c.cores == 2 and c.precision == "fp32"
    assert c.rank_tflops == ((1, 0.05), (2, 0.04), (4, 0.02))
    assert c.collective_link("all_reduce", 2, 4).alpha_s == pytest.approx(400e-6)
    assert c.collective_link("send", 2, 3).beta_bps == pytest.approx(2e9)  # the nearest world
    assert c.collective_link("all_reduce", 8, 8) is None
    assert c.efficiency_at(64, 128) == pytest.approx(0.2) and c.efficiency_at(512, 1024) == pytest.approx(0.6)
    assert c.efficiency_at(4096, 8192) == pytest.approx(0.6)  # flat beyond the grid
    mid = c.efficiency_at(math.sqrt(64 * 512), 128)  # half way in log d_model
    assert mid == pytest.approx(0.35)
    # A tp rank's share: the measured shares, half way between them in log tp, flat beyond.
    assert c.efficiency_at(512, 1024, tp=1) == pytest.approx(0.6)
    assert c.efficiency_at(512, 1024, tp=2) == pytest.approx(0.6 * 0.8)
    assert c.efficiency_at(512, 1024, tp=4) == pytest.approx(0.6 * 0.6)
    assert c.efficiency_at(512, 1024, tp=math.sqrt(8)) == pytest.approx(0.6 * 0.7)
    assert c.efficiency_at(512, 1024, tp=64) == pytest.approx(0.6 * 0.6)
    assert c.efficiency_at(64, 128, tp=2) == pytest.approx(0.2 * 0.8)
    # Another torch version (or host, CPU, core count): the cache no longer describes this machine.
    calibrate.write_cache(_fake_calibration(torch="0.0.1"))
    measured = []
    monkeypatch.setattr(calibrate, "calibrate", lambda quiet=False: measured.append(1) or _fake_calibration())
    again = calibrate.load_this(quiet=True)
    assert measured == [1] and again == c
    assert calibrate.load_this(quiet=True) == c and measured == [1]  # now cached
    calibrate.load_this(recalibrate=True, quiet=True)  # --calibrate measures whatever the cache
    assert measured == [1, 1]
    without_tp = _fake_calibration()
    del without_tp["tp_efficiency"]  # a cluster file without tp shares: the unsplit model's figure
    calibrate.write_cache(without_tp)
    assert load_cluster(str(calibrate.cache_path())).efficiency_at(512, 1024, tp=4) == pytest.approx(0.6)
    broken = _fake_calibration()
    broken["efficiency_curve"] = [[64, 0.2]]  # this machine's key, a field that does not load
    calibrate.write_cache(broken)
    assert calibrate.load_this(quiet=True) == c and measured == [1, 1, 1]


def test_rank_rate_models_ranks_sharing_cores():
    from plait.planner.cluster import Cluster, Link

    link = Link(1e-4, 1e9)
    c = Cluster("cpu", 1024, 0.05, 16.0, link, link, cores=2, rank_tflops=((1, 0.05), (2, 0.04), (4, 0.03)))
    assert c.rank_flops(2) == pytest.approx(0.04e12)
    assert c.rank_flops(3) == pytest.approx(0.10e12 / 3)  # the node's totals 0.08 and 0.12, interpolated
    assert c.rank_flops(8) == pytest.approx(0.12e12 / 8)  # the cores are full: the node's total is shared
    # Three of four ranks busy at a time: the node's total with three busy (0.10, interpolated),
    # shared by them; one busy would get the node's whole total, more than a rank's one thread
    # reaches alone, so it gets that.
    assert c.rank_flops(4, computing=3) == pytest.approx(0.10e12 / 3)
    assert c.rank_flops(4, computing=2) == pytest.approx(0.08e12 / 2)
    assert c.rank_flops(4, computing=1) == pytest.approx(0.05e12)


def test_cost_model_uses_measured_collectives_and_shares_a_cpu_node(this_cache):
    c = load_cluster("this")
    cfg = GPTConfig(vocab_size=256, seq_len=128, n_layer=4, n_head=4, d_model=128)
    lay = Candidate(dp=2, microbatch_size=8, microbatches=1)
    got = evaluate(cfg, 16, lay, c)
    psi = stage_params(cfg, lay)
    # fp32 gradients, one bucket, the measured 2-of-2 all-reduce: alpha + bus bytes / beta, exposed on a CPU.
    assert got["terms"]["dp_grad_s"] == pytest.approx(400e-6 + psi * 4 / 1e9, rel=1e-12)
    assert got["terms"]["dp_exposed_s"] == got["terms"]["dp_grad_s"]
    four = evaluate(cfg, 16, Candidate(dp=4, microbatch_size=4, microbatches=1), c)
    # Half the rows per rank, at the rate of 4 ranks on 2 cores (the node's total shared by the ranks
    # computing at a time) and the efficiency of 512-token micro-batches instead of 1024.
    rate2, rate4 = (c.rank_flops(n, r["terms"]["computing_ranks"]) for n, r in ((2, got), (4, four)))
    assert 1 < four["terms"]["computing_ranks"] <= 4 and rate4 < rate2
    ratio = 0.5 * (rate2 / rate4) * c.efficiency_at(128, 1024) / c.efficiency_at(128, 512)
    assert four["terms"]["compute_s"] == pytest.approx(got["terms"]["compute_s"] * ratio, rel=1e-12)
    # The fixed point: the ranks busy are the ranks x the share of the step spent computing or in
    # a collective (gloo's copies and reductions take the same cores).
    t = four["terms"]
    busy = (t["compute_s"] + t["tp_ep_s"] + t["dp_exposed_s"] + t["step_sync_s"]) / four["step_s"]
    assert t["computing_ranks"] == pytest.approx(4 * busy, rel=0.02)
    assert four["memory_gb"] < c.memory_gb * 0.9 / 4
    # tp 4: part of the step in collectives, and still every rank busy; a pipeline's bubble is
    # what frees cores (1F1B over 4 stages and 4 micro-batches: 3/7 of the step idle).
    tp4 = evaluate(cfg, 16, Candidate(tp=4, sequence_parallel=True, microbatch_size=16), c)
    assert tp4["terms"]["computing_ranks"] > 3.9 > 4 * tp4["terms"]["compute_s"] / tp4["step_s"]
    pp4 = evaluate(cfg, 16, Candidate(pp=4, microbatch_size=4, microbatches=4, schedule="1f1b"), c)
    assert pp4["bubble"] > 0.3 and pp4["terms"]["computing_ranks"] < 4 * (1 - 0.3)


def test_cluster_this_plans_from_the_cache(this_cache, capsys):
    assert main(["plan", "--cluster", "this", "--devices", "4", "--model.name", "small", "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    assert plans[0]["feasible"] and plans[0]["offload"] == "none"
    assert all(r["dp"] * r["tp"] * r["pp"] * r["ep"] == 4 for r in plans)


def test_plan_auto_resolves_to_a_layout_that_validate_accepts(this_cache):
    from plait.planner.auto import resolve_auto
    from plait.train.config import load_config

    for extra, world in (
        ([], 2),
        ([("parallel.world", "4")], 4),
        ([("parallel.world", "4"), ("parallel.tp", "2")], 4),
    ):
        cfg = load_config(None, [("parallel.plan", "auto"), *extra])
        chosen, best = resolve_auto(cfg)
        validate(chosen)  # raises if plait would refuse it
        p = chosen.parallel
        assert p.plan == "manual" and chosen.world_size == world and not chosen.train.bf16
        assert best["feasible"] and best["dp"] == p.dp and best["tp"] == p.tp and best["pp"] == p.pp
        if ("parallel.tp", "2") in extra:
            assert p.tp == 2  # a layout key set explicitly is a constraint
    # The pick is the planner's first plan for that world.
    cfg = load_config(None, [("parallel.plan", "auto"), ("parallel.world", "4")])
    ranked = plan(
        load_plan_config(None, []), model_config(cfg), 16, 4, load_cluster("this"), top=1, bf16=False
    )
    assert ranked["plans"][0]["layout"] == resolve_auto(cfg)[1]["layout"]


def test_plan_auto_refuses_an_impossible_world_and_bad_keys():
    from plait.errors import ConfigError
    from plait.planner.auto import check_auto
    from plait.train.config import load_config

    # validate checks an auto config's keys; its layouts are the planner's (resolve_auto checks them)
    with pytest.raises(ConfigError, match=r"parallel.world = 3: no layout .* with a layout: 1, 2, 4, 8"):
        check_auto(load_config(None, [("parallel.plan", "auto"), ("parallel.world", "3")]))
    with pytest.raises(ConfigError, match="parallel.plan = 'magic' is not valid; valid: manual, auto"):
        load_config(None, [("parallel.plan", "magic")])
    with pytest.raises(ConfigError, match="parallel.world = 4 but parallel.pp x dp x ep x cp x tp = 2"):
        load_config(None, [("parallel.world", "4")])
    with pytest.raises(ConfigError, match="parallel.tp = 8"):  # a constraint no layout can keep
        check_auto(
            load_config(None, [("parallel.plan", "auto"), ("parallel.world", "8"), ("parallel.tp", "8")])
        )


def test_plait_train_with_plan_auto_runs_the_chosen_layout(this_cache, tmp_path, capsys):
    run = tmp_path / "run"
    args = ["train", "--parallel.plan", "auto", "--model.name", "tiny", "--train.steps", "2"]
    args += ["--train.sample_tokens", "0", "--train.eval_batches", "1", "--train.progress", "false"]
    args += ["--train.run_dir", str(run)]
    assert main(args) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("plait: parallel.plan auto:"))
    import tomllib

    saved = tomllib.loads((run / "config.toml").read_text())["parallel"]
    assert saved["plan"] == "manual" and saved["dp"] * saved["tp"] * saved["pp"] == 2
    assert f"dp{saved['dp']}-tp{saved['tp']}-pp{saved['pp']}" in line


def test_tensor_parallel_prices_the_collectives_plait_sends(this_cache):
    """Per block 2 forward and 2 backward tp collectives: all-reduces, or under SP an all-gather
    and a reduce-scatter each, priced by their own measured alpha-beta; plus the edges (the
    vocab-parallel embedding's, the head's, the loss's two all-reduces); and once a step the
    small synchronous ones: SP's partial gradients, the gradient norm's and the loss's sums (the
    counts and sizes test_compose_ledger checks against the ledger)."""
    from plait.comm.ledger import bus_bytes

    c = load_cluster("this")
    cfg = GPTConfig(vocab_size=256, seq_len=128, n_layer=4, n_head=4, d_model=128)
    b, k = 8, 4
    act = b * 128 * 128 * 4  # fp32 activations of one micro-batch

    def t(op, payload):  # the fake calibration's 2-of-2 fit: alpha 400 us, 1 GB/s
        return 400e-6 + bus_bytes(op, payload, 2) / 1e9

    # The vocab-parallel loss: the logits' max (a float per token), then the sum of exponentials
    # stacked with the target's logit (two).
    loss = t("all_reduce", b * 128 * 4) + t("all_reduce", 2 * b * 128 * 4)
    norm = t("all_reduce", 8)  # the gradient norm's float64 over tp, once a step
    h = 128
    # SP, once a step: per block the two norms' weight and bias with the row-parallel layer's bias,
    # then the positions with the final norm: their gradients are partial over tp.
    partial = 2 * k * t("all_reduce", 3 * h * 4) + t("all_reduce", (128 + 2) * h * 4)
    for sp, per in ((False, t("all_reduce", act)), (True, t("all_gather", act) + t("reduce_scatter", act))):
        got = evaluate(cfg, b, Candidate(tp=2, sequence_parallel=sp, microbatch_size=b, microbatches=1), c)
        want = 2 * k * per + 2 * k * per + (per + loss) + per
        assert got["terms"]["tp_ep_s"] == pytest.approx(want, rel=1e-12), sp
        assert got["terms"]["step_sync_s"] == pytest.approx(norm + (partial if sp else 0.0), rel=1e-12), sp
    # ZeRO-1 over dp 2: the norm over the shards, and the loss over dp (a float64 each).
    z1 = evaluate(cfg, 2 * b, Candidate(dp=2, zero_stage=1, microbatch_size=b, microbatches=1), c)
    assert z1["terms"]["step_sync_s"] == pytest.approx(2 * norm, rel=1e-12)


def _tp_rank_shapes(cfg) -> dict:
    import torch.distributed as dist

    from plait.mesh import Mesh
    from plait.models import GPT
    from plait.tensor_parallel import apply_tp

    model = apply_tp(GPT(cfg), Mesh(tp=dist.get_world_size(), watchdog=False))
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


@pytest.mark.parametrize("tp", [2, 4])
def test_the_efficiency_probe_computes_what_a_tp_rank_holds(tp):
    """The calibration's tp probe (`plait.planner.probes.tp_rank_model`) has, parameter by
    parameter, the shapes plait's tensor parallelism gives one of tp ranks of the same GPT: it
    times a rank's share."""
    from plait.planner.probes import tp_rank_model
    from plait.testing import run_ranks

    cfg = GPTConfig(vocab_size=256, seq_len=32, n_layer=2, n_head=4, d_model=64)
    probe = {name: tuple(p.shape) for name, p in tp_rank_model(cfg, tp).named_parameters()}
    ranks = run_ranks(_tp_rank_shapes, tp, args=(cfg,))
    assert all(r == ranks[0] for r in ranks)
    assert probe == ranks[0]
    assert probe["blocks.0.attn.qkv.weight"] == (3 * 64 // tp, 64)


def test_the_step_sync_and_the_tp_share_enter_the_step(this_cache):
    """step_sync_s is part of step_s; evaluate prices compute with the tp share's efficiency; SP's
    partial gradients follow the blocks of a pipeline rank (k = L / pp) and the norm's bias-less
    size, and under ZeRO-3 one all-reduce per unit of this rank's shard; the gradient norm and the
    loss go over pp too."""
    from plait.comm.ledger import bus_bytes
    from plait.planner.cost import _evaluate

    c = load_cluster("this")
    cfg = GPTConfig(vocab_size=256, seq_len=128, n_layer=4, n_head=4, d_model=128)
    h, s = 128, 128

    def t(op, payload):  # the fake calibration's 2-of-4 fit: alpha 400 us, 1 GB/s
        return 400e-6 + bus_bytes(op, payload, 2) / 1e9

    norm = t("all_reduce", 8)
    lay = Candidate(tp=2, pp=2, sequence_parallel=True, microbatch_size=1, microbatches=2, schedule="1f1b")
    r = evaluate(cfg, 2, lay, c)
    x = r["terms"]
    assert r["step_s"] == pytest.approx(
        x["pipeline_s"] + x["dp_exposed_s"] + x["step_sync_s"] + x["optimizer_step_s"], rel=1e-12
    )
    k = 2  # blocks per pipeline rank
    for bias, ln in ((True, 2), (False, 1)):
        got = evaluate(dataclasses.replace(cfg, bias=bias), 2, lay, c)["terms"]["step_sync_s"]
        partial = 2 * k * t("all_reduce", (ln + int(bias)) * h * 4) + t("all_reduce", (s + ln) * h * 4)
        # the norm over tp and over pp, the loss over pp
        assert got == pytest.approx(partial + 3 * norm, rel=1e-12), bias
    # dp2 x tp2 + SP under ZeRO-3: the partial gradients summed once per unit (4 blocks and the
    # root), this rank's half of them; the norm over tp and over the shards, the loss over dp.
    z3 = Candidate(dp=2, tp=2, sequence_parallel=True, zero_stage=3, microbatch_size=4)
    got = evaluate(cfg, 8, z3, c)["terms"]["step_sync_s"]
    half = (2 * 4 * 3 + s + 2) * h * 4 / 2
    assert got == pytest.approx(5 * 400e-6 + bus_bytes("all_reduce", half, 2) / 1e9 + 3 * norm, rel=1e-12)
    # compute at a fixed number of busy ranks: the tp share's efficiency, not the whole model's
    one = Candidate(tp=2, microbatch_size=8)
    whole = dataclasses.replace(c, tp_efficiency=())
    a = _evaluate(cfg, 8, one, c, computing=2.0)["terms"]["compute_s"]
    b = _evaluate(cfg, 8, one, whole, computing=2.0)["terms"]["compute_s"]
    assert a / b == pytest.approx(c.efficiency_at(h, 8 * s) / c.efficiency_at(h, 8 * s, 2), rel=1e-12)

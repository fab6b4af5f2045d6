"""plait plan prices DiLoCo (Douillard et al. 2023) and Streaming DiLoCo: the outer exchange's bytes
and time against their closed forms (docs/planner.md, "DiLoCo"), the inner step on a replica
group's own degrees, cluster files with islands joined by a slow link, and the crossover: with a
slow link between islands DiLoCo H = 8..128 beats DDP's predicted step, with a fast one it does not
(no process is started).

Tolerance: EXACT (1e-9 relative) where the model is a closed form. The planted errors the tests
must see are far larger: the exchange priced every step instead of every H (x H = 8), a ring
all-reduce's (M-1)/M instead of 2(M-1)/M (x 1/2), a fragment's peak priced as the whole model's
(x F = 4), each checked below to miss the formula by more than 3 x EXACT.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from plait.cli import main
from plait.errors import ConfigError
from plait.models.gpt import GPTConfig
from plait.planner.cluster import PRESETS, axis_links, load_cluster
from plait.planner.cost import Candidate, evaluate, stage_params
from plait.planner.diloco import DilocoSpec, spec_from_config, variants
from plait.planner.hardware import Cluster, Link
from plait.planner.search import layout_config, load_plan_config, plan
from plait.train.config import validate
from plait.train.sections import DilocoConfig

EXACT = 1e-9
BUCKET = 25e6
ISLANDS_FILE = Path(__file__).resolve().parent.parent / "configs" / "cluster_two_islands.toml"
GPT = GPTConfig(vocab_size=512, seq_len=128, n_layer=4, n_head=4, d_model=256)
GPT13 = GPTConfig(vocab_size=51200, seq_len=2048, n_layer=24, n_head=16, d_model=2048)
ISLAND = Link(alpha_s=5e-3, beta_bps=1.5625e9)  # 200 Gb/s between two islands, over 16 GPUs


def _cluster(island: Link = ISLAND, island_devices: int = 8, gpus_per_node: int = 4) -> Cluster:
    """Nodes of 4 devices, islands of 8: every link different, so a wrong link shows."""
    return Cluster(
        name="islands",
        gpus_per_node=gpus_per_node,
        peak_tflops=100.0,
        memory_gb=80.0,
        intra=Link(alpha_s=2e-6, beta_bps=200e9),
        inter=Link(alpha_s=20e-6, beta_bps=20e9),
        efficiency=1.0,
        island_devices=island_devices,
        island=island,
    )


def _diloco(lay: Candidate, M: int, H: int, F: int = 1, tau: int = 0, compression: str = "none"):
    return dataclasses.replace(
        lay,
        diloco_inner_steps=H,
        diloco_replicas=M,
        diloco_fragments=F,
        diloco_overlap_steps=tau,
        diloco_compression=compression,
    )


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("M", [2, 4])
@pytest.mark.parametrize("H", [1, 8])
@pytest.mark.parametrize("F", [1, 4])
@pytest.mark.parametrize("compression", ["none", "fp16"])
def test_the_outer_exchange_equals_its_formula(M, H, F, compression):
    """Per rank: 2(M-1)/M x held x b bus bytes every H steps; F fragments of 1/F each; one ring
    all-reduce of X/F on the link between islands, α per 25 MB bucket and ring step; the inner
    step is a plain layout's over the group's dp."""
    cluster = _cluster()
    inner = 16 // M  # 16 devices in two islands of 8: the replica axis (all of dp) crosses them
    plain = Candidate(dp=M * inner, tp=1, pp=1, zero_stage=0, microbatch_size=2, microbatches=2)
    lay = _diloco(plain, M, H, F, compression=compression)
    out = evaluate(GPT, 4 * M * inner, lay, cluster)
    t = out["terms"]
    psi = stage_params(GPT, lay)
    b = {"none": 4, "fp16": 2}[compression]
    X = psi * b
    per_step = 2 * (M - 1) / M * X / H
    peak = 2 * (M - 1) / M * X / F
    assert t["diloco_payload_bytes"] == X
    assert _rel(t["diloco_bus_bytes_per_step"], per_step) < EXACT
    assert _rel(t["diloco_bus_bytes_per_exchange"], peak) < EXACT
    link = ISLAND
    exchange = math.ceil(X / F / BUCKET) * 2 * (M - 1) * link.alpha_s + peak / link.beta_bps
    assert _rel(t["diloco_exchange_s"], exchange) < EXACT
    assert t["diloco_hidden_s"] == 0.0
    assert _rel(t["diloco_exposed_s"], F * exchange / H) < EXACT
    # The inner step: the same layout over one group's dp alone.
    group = evaluate(GPT, 4 * inner, dataclasses.replace(plain, dp=inner), cluster)
    assert _rel(t["inner_step_s"], group["step_s"]) < EXACT
    assert _rel(out["step_s"], group["step_s"] + F * exchange / H) < EXACT
    # Memory: the outer parameters and momentum (8 bytes each) and one fragment's buffer.
    assert t["diloco_state_bytes"] == math.ceil(psi * 8 + X / F)
    assert out["terms"]["model_state_bytes"] == group["terms"]["model_state_bytes"] + t["diloco_state_bytes"]
    # The planted errors miss by far more than the tolerance.
    every_step = 2 * (M - 1) / M * X
    half_ring = (M - 1) / M * X / H
    whole_peak = 2 * (M - 1) / M * X
    assert _rel(half_ring, t["diloco_bus_bytes_per_step"]) > 3 * EXACT
    if H > 1:
        assert _rel(every_step, t["diloco_bus_bytes_per_step"]) > 3 * EXACT
    if F > 1:
        assert _rel(whole_peak, t["diloco_bus_bytes_per_exchange"]) > 3 * EXACT


@pytest.mark.parametrize("M", [2, 4])
def test_the_replica_axis_crosses_the_islands_and_the_groups_do_not(M):
    """16 devices in two islands of 8: dp 16 in M groups. The replica axis (dp's outer factor)
    spans all 16, on the islands' link; a group's dp (16 / M consecutive ranks) stays inside an
    island for M >= 2, on the nodes' link (inter) or inside a node."""
    cluster = _cluster()
    lay = _diloco(Candidate(dp=16, microbatch_size=1, microbatches=1), M, 8)
    t = evaluate(GPT, 16, lay, cluster)["terms"]
    X = stage_params(GPT, lay) * 4
    peak = 2 * (M - 1) / M * X
    exchange = math.ceil(X / BUCKET) * 2 * (M - 1) * ISLAND.alpha_s + peak / ISLAND.beta_bps
    assert _rel(t["diloco_exchange_s"], exchange) < EXACT
    inner = 16 // M
    group = evaluate(GPT, inner, Candidate(dp=inner, microbatch_size=1, microbatches=1), cluster)
    assert _rel(t["inner_step_s"], group["step_s"]) < EXACT
    assert cluster.link_for(inner) is (cluster.intra if inner <= 4 else cluster.inter)
    # DDP over all 16 reduces over the islands' link every step.
    ddp = evaluate(GPT, 16, Candidate(dp=16, microbatch_size=1, microbatches=1), cluster)
    assert ddp["terms"]["dp_grad_s"] > 0.5 * 2 * 15 / 16 * stage_params(GPT, lay) * 2 / ISLAND.beta_bps


def test_zero3_exchanges_its_shard_and_tp_pp_divide_what_a_rank_holds():
    cluster = _cluster(island_devices=16, gpus_per_node=8)
    plain = Candidate(dp=8, tp=2, pp=2, zero_stage=3, microbatch_size=1, microbatches=4, schedule="1f1b")
    lay = _diloco(plain, 2, 8)
    t = evaluate(GPT, 32, lay, cluster)["terms"]
    psi = stage_params(GPT, lay)
    assert psi < GPT.n_params() / 2  # tp 2 and pp 2 divide it
    held = psi / 4  # ZeRO-3 over the group's dp of 4
    assert _rel(t["diloco_payload_bytes"], held * 4) < EXACT
    assert _rel(t["diloco_bus_bytes_per_step"], 2 * (2 - 1) / 2 * held * 4 / 8) < EXACT


def test_streaming_overlap_hides_up_to_tau_steps_and_no_more_than_h_over_f():
    cluster = _cluster()
    plain = Candidate(dp=16, microbatch_size=1, microbatches=1)
    base = evaluate(GPT, 16, _diloco(plain, 2, 8, F=4), cluster)["terms"]
    exchange, step = base["diloco_exchange_s"], base["inner_step_s"]
    assert exchange > 2 * step  # the slow link: an exchange outlasts the overlap window
    for tau, window in ((1, 1), (2, 2), (8, 2)):  # capped at H / F = 2 inner steps
        t = evaluate(GPT, 16, _diloco(plain, 2, 8, F=4, tau=tau), cluster)["terms"]
        assert _rel(t["diloco_hidden_s"], window * step) < EXACT
        assert _rel(t["diloco_exposed_s"], 4 * (exchange - window * step) / 8) < EXACT
    # A fast link: the whole exchange hides; on a CPU node (cores) nothing does.
    fast = _cluster(island=Link(alpha_s=1e-6, beta_bps=1e12))
    t = evaluate(GPT, 16, _diloco(plain, 2, 8, F=4, tau=2), fast)["terms"]
    assert t["diloco_exposed_s"] == 0.0 and t["diloco_hidden_s"] == t["diloco_exchange_s"] > 0
    cpu = dataclasses.replace(fast, cores=64)
    t = evaluate(GPT, 16, _diloco(plain, 2, 8, F=4, tau=2), cpu)["terms"]
    assert t["diloco_hidden_s"] == 0.0 and _rel(t["diloco_exposed_s"], 4 * t["diloco_exchange_s"] / 8) < EXACT


def _families(cluster, hs=(8, 16, 32, 64, 128), allowed=None, devices=16, batch=64):
    r = plan(None, GPT13, batch, devices, cluster, top=3, diloco=DilocoSpec(inner_steps=hs), allowed=allowed)
    return {f["diloco_inner_steps"]: f for f in r["families"]}, r


def test_with_a_slow_link_between_islands_diloco_beats_ddp_and_with_a_fast_one_it_does_not():
    """A 1.3B GPT on 16 H100s in two islands of one node. DDP (pp = 1: dp's reduction every step
    across the islands): slow link (1.5625 GB/s per GPU), DiLoCo with M = 2 (one group per island)
    is faster at every H from 8 to 128, and faster the larger H; fast link (the nodes' own 50
    GB/s), DDP is no more than 0.5% slower at any H (DiLoCo's inner step skips DDP's last
    exposed bucket) and faster at H = 8."""
    h100 = PRESETS["dgx-h100"]
    slow = dataclasses.replace(h100, name="slow", island_devices=8, island=ISLAND)
    fast = dataclasses.replace(h100, name="fast", island_devices=8, island=h100.inter)
    ddp_only = lambda c: c.pp == 1  # noqa: E731
    fam, _ = _families(slow, allowed=ddp_only)
    ddp = fam[0]["best"]["step_s"]
    steps = [fam[h]["best"]["step_s"] for h in (8, 16, 32, 64, 128)]
    assert all(fam[h]["best"]["diloco_replicas"] == 2 for h in (8, 16, 32, 64, 128))
    assert all(s < ddp for s in steps) and steps == sorted(steps, reverse=True)
    assert ddp / steps[0] > 2  # H = 8 already more than twice DDP's speed here
    fam, _ = _families(fast, allowed=ddp_only)
    ddp = fam[0]["best"]["step_s"]
    assert all(ddp <= 1.005 * fam[h]["best"]["step_s"] for h in (8, 16, 32, 64, 128))
    assert ddp < fam[8]["best"]["step_s"]
    # The whole search (pipelines may cross the islands instead): DiLoCo still ranks first.
    fam, r = _families(slow, hs=(8, 128))
    assert r["plans"][0]["diloco_inner_steps"] == 128
    assert fam[8]["best"]["step_s"] < fam[0]["best"]["step_s"]
    assert fam[8]["as_ddp"]["step_s"] > fam[8]["best"]["step_s"]


def test_variants_split_dp_into_whole_groups_only():
    cluster = _cluster()
    spec = DilocoSpec(inner_steps=(8, 32))
    got = list(variants(Candidate(dp=16), spec, cluster))  # 16 devices, 2 islands: M = 2
    assert [(v.diloco_replicas, v.diloco_inner_steps) for v in got] == [(2, 8), (2, 32)]
    assert got[0].group_dp == 8 and got[0].name().endswith("-diloco2-h8")
    # Inside one island, or without islands: diloco.replicas = 0's own meaning, M = dp.
    assert [v.diloco_replicas for v in variants(Candidate(dp=4), spec, cluster)] == [4, 4]
    no_islands = _cluster(island_devices=0)
    assert [v.diloco_replicas for v in variants(Candidate(dp=16), spec, no_islands)] == [16, 16]
    assert [v.group_dp for v in variants(Candidate(dp=16), DilocoSpec((8,), replicas=4), cluster)] == [4]
    assert list(variants(Candidate(dp=2, zero_stage=1), DilocoSpec((8,), replicas=2), cluster)) == []
    assert list(variants(Candidate(dp=6), DilocoSpec((8,), replicas=4), cluster)) == []
    named = _diloco(Candidate(dp=4), 2, 16, F=4, tau=1, compression="bf16").name()
    assert named.endswith("-diloco2-h16-f4-tau1-bf16")


def test_the_spec_comes_from_the_flag_or_the_config_and_refuses_what_it_cannot_price():
    assert spec_from_config(DilocoConfig()) is None
    assert spec_from_config(DilocoConfig(inner_steps=32)).inner_steps == (32,)
    spec = spec_from_config(DilocoConfig(inner_steps=32, fragments=4, compression="fp16"), (128, 8))
    assert spec == DilocoSpec(inner_steps=(8, 128), fragments=4, compression="fp16")
    with pytest.raises(ConfigError, match="onebit"):
        spec_from_config(DilocoConfig(compression="onebit"), (8,))


def test_a_cluster_file_describes_islands(tmp_path):
    c = load_cluster(str(ISLANDS_FILE))
    assert c.island_devices == 16 and c.island.beta_bps == 1.5625e9
    assert c.island.alpha_s == pytest.approx(5e-3)
    links = axis_links(c, {"tp": 8, "dp": 4})
    assert links["tp"] is c.intra and links["dp"] is c.island
    assert axis_links(c, {"tp": 8, "dp": 2})["dp"] is c.inter
    assert c.islands(32) == 2 and c.islands(16) == 1
    text = ISLANDS_FILE.read_text()
    for bad, message in (
        (text.replace("devices = 16", "devices = 12"), "whole number of nodes"),
        (text.replace("devices = 16\n", ""), r"\[islands\] needs exactly"),
    ):
        path = tmp_path / "c.toml"
        path.write_text(bad)
        with pytest.raises(ConfigError, match=message):
            load_cluster(str(path))


ARGS13 = [
    "--model.n_layer", "24", "--model.d_model", "2048", "--model.n_head", "16", "--model.seq_len", "2048",
    "--model.vocab_size", "51200", "--train.global_batch", "128", "--devices", "32",
    "--cluster", str(ISLANDS_FILE), "--top", "3",
]  # fmt: skip


def test_plait_plan_diloco_prints_the_families_and_json_round_trips(capsys):
    assert main(["plan", *ARGS13, "--diloco", "8,128"]) == 0
    out = capsys.readouterr().out
    assert "2 islands of 16 (between them 5 ms, 1.5625 GB/s per device)" in out
    rows = {line.split()[0] + line.split()[1]: line for line in out.splitlines() if line.startswith("  ")}
    assert "-diloco2-h128" in out.splitlines()[2]  # the best plan
    assert "noDiLoCo" in rows and "H=" in "".join(rows)
    h8 = next(line for line in out.splitlines() if line.startswith("  H = 8 "))
    assert float(h8.split()[5].rstrip("x")) > 1.0  # faster than the best without DiLoCo
    assert main(["plan", *ARGS13, "--diloco", "8", "--diloco.fragments", "4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    fam = result["families"]
    assert [f["diloco_inner_steps"] for f in fam] == [0, 8] and fam[1]["as_ddp"]["diloco_inner_steps"] == 0
    base = load_plan_config(None, [(a[2:], b) for a, b in zip(ARGS13[:12:2], ARGS13[1:12:2], strict=True)])
    for r in result["plans"]:
        if r["feasible"] and r["diloco_inner_steps"]:
            lay = Candidate(**{f.name: r[f.name] for f in dataclasses.fields(Candidate)})
            cfg = layout_config(base, lay)
            assert (cfg.diloco.inner_steps, cfg.diloco.replicas, cfg.diloco.fragments) == (8, 2, 4)
            validate(cfg, data=False)


def test_plait_plan_diloco_errors_are_one_line(capsys):
    assert main(["plan", "--devices", "8", "--diloco", "0"]) == 2
    assert "inner steps H" in capsys.readouterr().err
    assert main(["plan", "--devices", "8", "--diloco", "8", "--diloco.compression", "topk"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not priced" in err

"""The pipeline simulator against the papers' bubble and memory formulas (REFERENCE.md,
"Pipeline parallel"): GPipe (Huang et al. 2018), 1F1B and interleaved 1F1B (Narayanan et al.
2021), Zero Bubble ZB-H1/ZB-H2/ZB-V (Qi et al. 2023); the cost model, the renderers, the CLI."""

from __future__ import annotations

import json

import pytest

from plait.cli import main
from plait.errors import ConfigError, ScheduleError
from plait.pipeline.ir import Action, Schedule
from plait.pipeline.render import render_png, render_text
from plait.pipeline.simulate import Costs, Event, formula_bubble, formula_bubble_time, simulate

CASES = [(p, m) for p in (2, 4) for m in (p, 2 * p, 3 * p)]


def hand_1f1b(p: int, m: int, gpipe: bool = False) -> Schedule:
    """1F1B (or GPipe) compute order written out by hand, independent of the generators: rank r runs
    p-r-1 warm-up forwards, then alternates F and BW, then drains."""
    acts = []
    for r in range(p):
        warm = m if gpipe else min(p - r - 1, m)
        a = [Action("F", i, r) for i in range(warm)]
        for i in range(m - warm):
            a += [Action("F", warm + i, r), Action("BW", i, r)]
        a += [Action("BW", i, r) for i in range(m - warm, m)]
        acts.append(a)
    return Schedule("gpipe" if gpipe else "1f1b", p, m, 1, tuple((r,) for r in range(p)), acts)


def ideal(m: int, costs: Costs | None = None) -> float:
    c = costs or Costs()
    return m * (c.F + c.B + c.W)


# --- hand-made schedules: the simulator itself ---------------------------------------------------


@pytest.mark.parametrize("p,m", CASES)
@pytest.mark.parametrize("gpipe", [True, False])
def test_hand_gpipe_1f1b_bubble_and_peak(p, m, gpipe):
    res = simulate(hand_1f1b(p, m, gpipe))
    assert res.makespan == pytest.approx(3 * (m + p - 1))
    assert res.bubble_fraction == pytest.approx([(p - 1) / (m + p - 1)] * p)
    # GPipe holds all m micro-batches on every rank; 1F1B holds p - r on rank r.
    assert res.peak_activations == ([m] * p if gpipe else [p - r for r in range(p)])


def test_deadlock_and_missing_dependencies():
    cycle = Schedule("custom", 2, 1, 1, ((0,), (1,)), [[Action("BW", 0, 0), Action("F", 0, 0)], []])
    cycle.actions[1] = [Action("F", 0, 1), Action("BW", 0, 1)]
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(cycle)
    missing = Schedule("custom", 1, 1, 1, ((0,),), [[Action("F", 0, 0), Action("W", 0, 0)]])
    with pytest.raises(ScheduleError, match="needs B0@0"):
        simulate(missing)
    twice = Schedule("custom", 1, 1, 1, ((0,),), [[Action("F", 0, 0), Action("F", 0, 0)]])
    with pytest.raises(ScheduleError, match="twice"):
        simulate(twice)


def test_comm_actions_are_not_timed():
    s = hand_1f1b(2, 2)
    s.actions[0].insert(1, Action("SEND_F", 0, 0, peer=1))
    s.actions[1].insert(0, Action("RECV_F", 0, 1, peer=0))
    assert simulate(s).makespan == pytest.approx(9.0)


# --- the generators against the formulas ---------------------------------------------------------


def make(kind: str, p: int, m: int, v: int | None = None) -> Schedule:
    from plait.pipeline.check import check_schedule
    from plait.pipeline.schedules import make_schedule

    s = make_schedule(kind, p, m, v)
    check_schedule(s)
    return s


@pytest.mark.parametrize("p,m", CASES)
@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_gpipe_1f1b_formula(kind, p, m):
    res = simulate(make(kind, p, m))
    assert res.bubble_fraction == pytest.approx([(p - 1) / (m + p - 1)] * p)
    assert res.bubble_fraction == pytest.approx([formula_bubble(kind, p, m, 1, Costs())] * p)
    assert res.peak_activations[0] == (m if kind == "gpipe" else p)


@pytest.mark.parametrize("p,m", CASES)
def test_interleaved_formula(p, m):
    s = make("interleaved", p, m)
    v = s.v
    assert v == 2
    res = simulate(s)
    # Bubble time (1/v)(p-1)(T_F+T_B+T_W), i.e. (1/v)(p-1)/m of the ideal time.
    assert res.makespan - ideal(m) == pytest.approx((p - 1) * 3 / v)
    assert res.idle_within[0] == pytest.approx(formula_bubble_time("interleaved", p, m, v, Costs()))
    assert res.bubble_fraction[0] == pytest.approx(formula_bubble("interleaved", p, m, v, Costs()))


@pytest.mark.parametrize("p,m", CASES)
def test_zb_h1_formula(p, m):
    res = simulate(make("zb-h1", p, m))
    # (p-1)(T_F+T_B-T_W) = p-1 with unit costs: a third of 1F1B's 3(p-1).
    assert res.makespan - ideal(m) == pytest.approx(p - 1)
    assert res.idle_within[0] == pytest.approx(formula_bubble_time("zb-h1", p, m, 1, Costs()))
    assert max(res.peak_activations) <= p


@pytest.mark.parametrize("p,m", CASES)
def test_zb_h2_formula(p, m):
    res = simulate(make("zb-h2", p, m))
    # (p-1)(T_F+T_B-2T_W) = 0 with unit costs. Within one step the makespan cannot be below
    # 3m + (p-1): the last rank's first forward waits for p-1 forwards. The paper's zero bubble is
    # that no rank idles inside its own span (a parallelogram that overlaps the next step); the
    # generator achieves it for m >= 2p. At m = p there are too few micro-batches to fill the warm-up.
    assert res.makespan - ideal(m) == pytest.approx(p - 1)
    if m >= 2 * p:
        assert res.idle_within == pytest.approx([0.0] * p, abs=1e-9)
    else:
        assert max(res.idle_within) <= p - 1 + 1e-9
    assert max(res.peak_activations) <= 2 * p - 1


@pytest.mark.parametrize("p,m", CASES)
def test_zb_v_formula(p, m):
    res = simulate(make("zb-v", p, m))
    # No formula in REFERENCE.md; the step's lower bound is 3m + (p-1)·T_F/2: the forward of
    # micro-batch 0 crosses p-1 half-size chunks before the last rank starts. The generator hits it.
    assert res.makespan - ideal(m) == pytest.approx((p - 1) / 2)
    assert max(res.peak_activations) <= p


# --- 1F1B with communication latency -------------------------------------------------------------


def one_f_one_b_makespan(p: int, m: int, c: float) -> float:
    """Makespan of 1F1B under the simulator's rules with T_F = 1, T_BW = 2 and latency c per edge.

    Without latency it is 3(m+p-1). The latency adds c per cross-rank edge on the longest path.
    The obvious path (micro-batch 0 down, the last rank's m F/BW pairs, micro-batch m-1 back up)
    crosses 2(p-1) edges, giving 3m + (p-1)(3+2c), a lower bound only. A path of the same compute
    length can zig-zag: from BW(k) on rank r+1 to BW(k) on rank r, then F(k+p-r) on rank r and back
    to rank r+1, 3 units of compute like the F, BW pair it replaces on rank r+1, but 2 more edges.
    Every micro-batch after the second adds such a zig-zag except one in every p, where rank 0's
    next forward waits on the backward that frees it (p micro-batches in flight: the loop is 3p of
    compute and 2(p-1) edges per p micro-batches, so the steady state runs at 3 + 2c(p-1)/p per
    micro-batch, not 3). Counting: edges = 2(p-1) + 2((m-2) - floor((m-2)/p)) for m >= 1.
    """
    edges = 2 * (p - 1) + 2 * ((m - 2) - (m - 2) // p)
    return 3 * (m + p - 1) + c * edges


@pytest.mark.parametrize("c", [0.0, 0.25, 1.0, 2.0])
@pytest.mark.parametrize("p,m", CASES + [(3, 5), (4, 7)])
def test_1f1b_comm_latency(p, m, c):
    costs = Costs(F=1, B=2, W=0, comm=c)
    assert costs.cost("BW", 0) == 2
    expected = one_f_one_b_makespan(p, m, c)
    assert simulate(hand_1f1b(p, m), costs).makespan == pytest.approx(expected)
    assert simulate(make("1f1b", p, m), costs).makespan == pytest.approx(expected)
    assert expected >= 3 * m + (p - 1) * (3 + 2 * c)


# --- the cost model ------------------------------------------------------------------------------


def test_costs_parse():
    assert Costs.parse("1,2,3") == Costs(F=1, B=2, W=3)
    c = Costs.parse(" 1 , 2 ", comm=0.5)
    assert (c.F, c.B, c.W, c.comm, c.cost("BW", 0)) == (1, 1, 1, 0.5, 2)
    for bad in ("a,b,c", "1", "1,2,3,4", "-1,1,1", "1,inf", ""):
        with pytest.raises(ConfigError, match="e.g."):
            Costs.parse(bad)


def test_costs_per_stage():
    c = Costs(F=1, B=2, W=3, per_stage={("F", 1): 5.0, ("B", 1): 4.0, ("BW", 2): 0.5})
    assert [c.cost("F", 0), c.cost("F", 1), c.cost("BW", 0), c.cost("BW", 1), c.cost("BW", 2)] == [
        1,
        5,
        5,
        7,
        0.5,
    ]


def test_from_events_round_trip():
    costs = Costs(F=1.0, B=1.5, W=0.7, per_stage={("F", 0): 2.25, ("BW", 3): 0.1, ("BW", 1): 3.3})
    res = simulate(hand_1f1b(4, 8), costs)
    back = Costs.from_events(res.events)
    for e in res.events:
        assert back.cost(e.kind, e.stage) == pytest.approx(costs.cost(e.kind, e.stage))
    assert back.comm == 0.0 and Costs.from_events(res.events, comm=0.3).comm == 0.3
    # Events survive JSON, and the timeline replays to the same makespan.
    again = [Event.from_dict(json.loads(json.dumps(e.to_dict()))) for e in res.events]
    assert again == res.events
    assert simulate(hand_1f1b(4, 8), back).makespan == pytest.approx(res.makespan)


def test_from_events_round_trip_chunks():
    # With v chunks per rank one action costs F/v; measured per-action times come back as overrides
    # and the per-rank F/B/W as v times the mean action.
    s = make("interleaved", 2, 4)
    costs = Costs(F=1.0, B=1.2, W=0.8, per_stage={("BW", 1): 0.3})
    res = simulate(s, costs)
    assert {e.duration for e in res.events if e.kind == "F"} == {0.5}
    back = Costs.from_events(res.events)
    assert back.F == pytest.approx(1.0)
    for e in res.events:
        assert back.cost(e.kind, e.stage, 2) == pytest.approx(costs.cost(e.kind, e.stage, 2))
    assert simulate(s, back).makespan == pytest.approx(res.makespan)


def test_to_json():
    out = simulate(hand_1f1b(2, 4)).to_json()
    assert {"makespan", "bubble_fraction", "peak_activations", "idle_within", "kind", "p", "m", "v"} <= set(
        out
    )
    assert len(out["bubble_fraction"]) == len(out["peak_activations"]) == 2
    assert "events" in simulate(hand_1f1b(2, 4)).to_json(events=True)


# --- rendering -----------------------------------------------------------------------------------


def test_render_text():
    res = simulate(hand_1f1b(4, 8))
    text = render_text(res, 4, width=100)
    rows = [line for line in text.splitlines() if line.startswith("rank")]
    assert len(rows) == 4
    # Makespan 33 in 100 columns: 3 columns per time unit; the last rank idles 3 units, then F0.
    assert rows[3].startswith("rank 3 |" + "." * 9 + "F0f")
    assert "legend" in text
    # Non-integer times still give one row per rank, `width` columns wide.
    res = simulate(hand_1f1b(3, 6), Costs(F=1.1, B=1.3, W=0.2, comm=0.05))
    rows = [line for line in render_text(res, 3, width=50).splitlines() if line.startswith("rank")]
    assert len(rows) == 3 and all(len(r.split("|")[1]) == 50 for r in rows)


def test_render_png(tmp_path):
    sim = simulate(hand_1f1b(2, 4))
    # As if measured: seconds from an arbitrary clock origin.
    measured = [
        Event(e.rank, e.kind, e.mb, e.stage, 100 + e.start / 1e3, 100 + e.end / 1e3) for e in sim.events
    ]
    path = render_png([("simulated", sim, 2), ("measured", measured, 2)], tmp_path / "t.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


# --- the CLI -------------------------------------------------------------------------------------


def test_cli_json(capsys):
    assert main(["schedule", "--kind", "1f1b", "--stages", "2", "--microbatches", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"makespan", "bubble_fraction", "peak_activations"} <= set(out)
    assert out["bubble_fraction"] == pytest.approx([0.2, 0.2])
    assert (out["kind"], out["p"], out["m"], out["v"]) == ("1f1b", 2, 4, 1)


def test_cli_text_and_png(capsys, tmp_path):
    png = tmp_path / "zb.png"
    argv = ["schedule", "--kind", "zb-h1", "--stages", "4", "--microbatches", "8", "--out", str(png)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "makespan 27" in out and "formula" in out and str(png) in out
    assert sum(line.startswith("rank ") and "|" in line for line in out.splitlines()) == 4
    assert png.stat().st_size > 0


def test_cli_errors(capsys):
    assert main(["schedule", "--kind", "nope", "--stages", "2", "--microbatches", "4"]) == 2
    err = capsys.readouterr().err
    assert "config error" in err and all(k in err for k in ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"))
    assert main(["schedule", "--kind", "1f1b", "--stages", "2", "--microbatches", "4", "--costs", "x"]) == 2
    assert "e.g." in capsys.readouterr().err

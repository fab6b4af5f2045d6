"""plait.mesh: the geometry of the axes (global ranks, combined and hybrid groups) against
hand-written rank lists, and a live Mesh of 4 ranks in every layout: coordinates, sizes, ranks,
the process groups' own rank lists, and the errors for sizes that do not fit."""

import itertools

import pytest
import torch.distributed as dist

from plait.errors import TopologyError
from plait.mesh import WORLD, Mesh, combined_groups, derived_axis_name, global_rank_at, hybrid_dp_groups

SIZES_24 = {"pp": 2, "dp": 3, "ep": 1, "tp": 2}  # 12 ranks: rank = pp*6 + dp*2 + tp


def test_global_rank_is_row_major_with_tp_fastest():
    assert global_rank_at(SIZES_24, {"pp": 0, "dp": 0, "ep": 0, "tp": 1}) == 1
    assert global_rank_at(SIZES_24, {"pp": 0, "dp": 1, "ep": 0, "tp": 0}) == 2
    assert global_rank_at(SIZES_24, {"pp": 1, "dp": 0, "ep": 0, "tp": 0}) == 6
    assert global_rank_at(SIZES_24, {"pp": 1, "dp": 2, "ep": 0, "tp": 1}) == 11
    sizes = {"pp": 1, "dp": 2, "ep": 2, "tp": 2}  # rank = dp*4 + ep*2 + tp
    assert global_rank_at(sizes, {"pp": 0, "dp": 1, "ep": 0, "tp": 1}) == 5
    assert global_rank_at(sizes, {"pp": 0, "dp": 0, "ep": 1, "tp": 0}) == 2
    every = {
        global_rank_at(sizes, {"pp": 0, "dp": d, "ep": e, "tp": t})
        for d in range(2)
        for e in range(2)
        for t in range(2)
    }
    assert every == set(range(8))


def test_combined_groups_hold_the_ranks_sharing_every_other_coordinate():
    # pp x tp over pp2 dp3 tp2: the lines fix dp; within a line pp is outer, tp inner
    assert combined_groups(SIZES_24, ("tp", "pp")) == [[0, 1, 6, 7], [2, 3, 8, 9], [4, 5, 10, 11]]
    # dp alone: fix pp and tp
    assert combined_groups(SIZES_24, ("dp",)) == [[0, 2, 4], [1, 3, 5], [6, 8, 10], [7, 9, 11]]
    # pp x dp: everything but tp
    assert combined_groups(SIZES_24, ("dp", "pp")) == [[0, 2, 4, 6, 8, 10], [1, 3, 5, 7, 9, 11]]
    # every axis: one line of every rank in order
    assert combined_groups(SIZES_24, ("pp", "dp", "ep", "tp")) == [list(range(12))]
    assert derived_axis_name(("tp", "pp")) == "pp*tp"
    assert derived_axis_name(("ep", "tp", "dp")) == "dp*ep*tp"


@pytest.mark.parametrize("bad", [("dp", "dp"), ("dp", "xx"), ("world",)])
def test_a_combined_axis_takes_distinct_known_axes(bad):
    with pytest.raises(TopologyError, match="distinct axes"):
        derived_axis_name(bad)


def test_hybrid_groups_on_dp4_tp2():
    # rank = dp*2 + tp; shard groups: 2 consecutive dp coordinates with the same tp coordinate
    lines = hybrid_dp_groups({"pp": 1, "dp": 4, "ep": 1, "tp": 2}, 2)
    assert lines["dp_shard"] == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert lines["dp_replicate"] == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert lines["dp_shard*tp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # one shard group of everything: the replicas are single ranks
    lines = hybrid_dp_groups({"pp": 1, "dp": 4, "ep": 1, "tp": 1}, 4)
    assert lines["dp_shard"] == [[0, 1, 2, 3]] and lines["dp_replicate"] == [[0], [1], [2], [3]]
    # shards of one: nothing sharded, everything replicated
    lines = hybrid_dp_groups({"pp": 1, "dp": 4, "ep": 1, "tp": 1}, 1)
    assert lines["dp_shard"] == [[0], [1], [2], [3]] and lines["dp_replicate"] == [[0, 1, 2, 3]]


# --- a live mesh of 4 ranks --------------------------------------------------------------------

# (outer axis, inner axis) of each 2 x 2 layout, in mesh order; and the 4-rank single axes
SINGLES = ["pp", "dp", "ep", "cp", "tp"]
PAIRS = list(itertools.combinations(SINGLES, 2))
# combined axes a 2 x 2 mesh names by their axes (a combination of axes larger than 1)
COMBINED = {("pp", "dp"): "pp*dp", ("dp", "ep"): "dp*ep", ("dp", "tp"): "dp*tp", ("dp", "cp"): "dp*cp"}


def _describe(mesh: Mesh, axes) -> dict:
    """What a rank sees of `mesh` along each of `axes` (and the world)."""
    out = {"coords": dict(mesh.coords), "global_rank": mesh.global_rank}
    for a in (*axes, WORLD):
        g = mesh.group(a)
        out[a] = {
            "size": mesh.size(a),
            "rank": mesh.rank(a),
            "ranks": mesh.ranks(a),
            "group": None if g is None else dist.get_process_group_ranks(g),
        }
    return out


def _bad_mesh(kwargs) -> str:
    try:
        Mesh(watchdog=False, **kwargs).close()
    except TopologyError as exc:
        return str(exc)
    return "accepted"


def _mesh_checks() -> dict:
    out = {"singles": {}, "pairs": {}, "over": {}}
    for a in SINGLES:
        with Mesh(**{a: 4}, watchdog=False) as m:
            out["singles"][a] = _describe(m, SINGLES)
    for a, b in PAIRS:
        with Mesh(**{a: 2, b: 2}, watchdog=False) as m:
            out["pairs"][(a, b)] = _describe(m, SINGLES)
            if (a, b) in COMBINED:
                name = m.axis_over((b, a))  # given in any order
                out["over"][(a, b)] = (name, _describe(m, [name])[name] if name else None)
    with Mesh(dp=4, dp_shard=2, watchdog=False) as m:
        out["hybrid"] = _describe(m, ["dp", "dp_shard", "dp_replicate"])
    out["bad"] = {
        name: _bad_mesh(kw)
        for name, kw in {
            "product": dict(dp=2),
            "product-2": dict(dp=2, tp=4),
            "zero": dict(dp=0, tp=4),
            "negative": dict(dp=-4),
            "float": dict(dp=4.0),
            "bool": dict(dp=True, tp=4),
            "timeout": dict(dp=4, timeout_s=0),
            "dp_shard": dict(dp=4, dp_shard=3),
        }.items()
    }
    with Mesh(dp=4, watchdog=False) as m:
        try:
            m.size("xp")
            out["bad"]["axis"] = "accepted"
        except TopologyError as exc:
            out["bad"]["axis"] = str(exc)
    return out


@pytest.fixture(scope="module")
def ranks_4():
    """Every live check of 4 ranks in one spawn."""
    from plait.testing import run_ranks

    return run_ranks(_mesh_checks, 4, timeout=240)


def _expect_line(seen: dict, size: int, rank: int, ranks: list[int]) -> None:
    assert (seen["size"], seen["rank"], seen["ranks"]) == (size, rank, ranks), seen
    assert seen["group"] == (ranks if size > 1 else None), seen


def test_one_axis_of_four_holds_every_rank(ranks_4):
    for r, res in enumerate(ranks_4):
        for a, seen in res["singles"].items():
            assert seen["coords"] == {x: (r if x == a else 0) for x in SINGLES}, (a, r)
            _expect_line(seen[a], 4, r, [0, 1, 2, 3])
            for other in SINGLES:
                if other != a:
                    _expect_line(seen[other], 1, 0, [r])
            _expect_line(seen[WORLD], 4, r, [0, 1, 2, 3])


def test_two_by_two_layouts_put_the_inner_axis_on_neighbouring_ranks(ranks_4):
    for r, res in enumerate(ranks_4):
        for (outer, inner), seen in res["pairs"].items():
            want = {x: 0 for x in SINGLES} | {outer: r // 2, inner: r % 2}
            assert seen["coords"] == want and seen["global_rank"] == r, (outer, inner, r)
            _expect_line(seen[inner], 2, r % 2, [r - r % 2, r - r % 2 + 1])  # neighbours
            _expect_line(seen[outer], 2, r // 2, [r % 2, r % 2 + 2])  # 2 apart
            for other in set(SINGLES) - {outer, inner}:
                _expect_line(seen[other], 1, 0, [r])


def test_axis_over_names_one_group_over_both_axes(ranks_4):
    for r, res in enumerate(ranks_4):
        assert set(res["over"]) == set(COMBINED)
        for pair, (name, seen) in res["over"].items():
            assert name == COMBINED[pair], (pair, name)
            _expect_line(seen, 4, r, [0, 1, 2, 3])


def test_hybrid_sharding_groups_on_four_ranks(ranks_4):
    for r, res in enumerate(ranks_4):
        seen = res["hybrid"]
        _expect_line(seen["dp_shard"], 2, r % 2, [r - r % 2, r - r % 2 + 1])
        _expect_line(seen["dp_replicate"], 2, r // 2, [r % 2, r % 2 + 2])
        _expect_line(seen["dp"], 4, r, [0, 1, 2, 3])


def test_bad_sizes_are_refused_with_the_reason(ranks_4):
    bad = ranks_4[0]["bad"]
    assert "covers 2 ranks but the world size is 4" in bad["product"], bad["product"]
    assert "pp=1 x dp=2 x ep=1 x cp=1 x tp=4" in bad["product-2"] and "covers 8 ranks" in bad["product-2"]
    for name, axis, value in (
        ("zero", "dp", "0"),
        ("negative", "dp", "-4"),
        ("float", "dp", "4.0"),
        ("bool", "dp", "True"),
    ):
        assert f"mesh axis {axis} must be a positive integer, got {value}" in bad[name], bad[name]
    assert "timeout_s must be positive" in bad["timeout"], bad["timeout"]
    assert "dp_shard must be a positive divisor of dp=4, got 3" in bad["dp_shard"], bad["dp_shard"]
    assert "unknown mesh axis 'xp'" in bad["axis"], bad["axis"]
    assert all(r["bad"] == bad for r in ranks_4)

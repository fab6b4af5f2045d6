"""plait.placement: the per-parameter records (sharded, replicated, partial axes), where a shard
sits in the whole tensor, the norm's parts, the axis a gradient is averaged over, and
`gather_full` on live ranks rebuilding tensors split by hand (plain, padded, fused)."""

import pytest
import torch
from torch import nn

from plait.placement import (
    REPLICATED,
    Placement,
    Shard,
    bucket_key,
    canonical_chunks,
    chunk_map,
    copy_placement,
    norm_parts,
    placement,
    set_grad_partial,
    set_shard,
    split_axis,
    update_shard,
)


class _Sizes:
    """The part of a Mesh these functions read: the size of each axis and this rank's index."""

    def __init__(self, coords=None, **sizes):
        self.sizes, self.coords = sizes, coords or {}

    def size(self, axis):
        return self.sizes.get(axis, 1)

    def rank(self, axis):
        return self.coords.get(axis, 0)


def _param(*shape):
    return nn.Parameter(torch.zeros(*shape))


def test_records_shard_replace_and_partial():
    p = _param(4, 2)
    assert placement(p) == REPLICATED and placement(p).sharded_axes == () and placement(p).shard("tp") is None
    set_shard(p, "tp", Shard(0))
    set_shard(p, "ep", Shard(1))
    assert placement(p).sharded_axes == ("ep", "tp")  # sorted, whatever the order recorded
    assert placement(p).shard("tp") == Shard(0) and placement(p).shard("ep") == Shard(1)
    set_shard(p, "tp", Shard(1, fused=3))  # replaces the tp record, keeps ep's
    assert placement(p).shard("tp") == Shard(1, fused=3) and len(placement(p).sharded) == 2
    update_shard(p, "tp", full=10)
    assert placement(p).shard("tp") == Shard(1, fused=3, full=10)
    assert placement(p).grad_partial == ()
    set_grad_partial(p, "tp")
    set_grad_partial(p, "tp")
    set_grad_partial(p, "pp")
    assert placement(p).grad_partial == ("tp", "pp")
    q, r = _param(4, 2), _param(3)
    copy_placement(p, q)
    copy_placement(r, q)  # a source without a record leaves the target's
    assert placement(q) == placement(p)
    copy_placement(r, p)
    assert placement(p).shard("ep") == Shard(1)


def test_split_axis_is_the_one_live_model_axis():
    assert split_axis(REPLICATED) is None
    expert = Placement(sharded=(("ep", Shard(0)),))
    assert split_axis(expert) == "ep"
    both = Placement(sharded=(("tp", Shard(0)), ("ep", Shard(0))))
    with pytest.raises(ValueError, match="several model axes"):
        split_axis(both)
    assert split_axis(both, _Sizes(ep=2)) == "ep"  # tp of size 1 splits nothing
    assert split_axis(expert, _Sizes(tp=2)) is None


def test_bucket_key_holds_live_partial_and_sharded_axes():
    p = _param(4)
    set_shard(p, "tp", Shard(0))
    set_grad_partial(p, "tp")
    set_grad_partial(p, "ep")
    assert bucket_key(p, _Sizes(tp=2, ep=2)) == (("tp", "ep"), ("tp",))
    assert bucket_key(p, _Sizes(tp=2)) == (("tp",), ("tp",))
    assert bucket_key(p, _Sizes(tp=2), sharding=False) == (("tp",), ())
    assert bucket_key(p, _Sizes()) == ((), ())
    assert bucket_key(_param(2), _Sizes(tp=2)) == ((), ())


def test_chunk_map_places_plain_padded_and_fused_shards():
    plain = Placement(sharded=(("tp", Shard(1)),))
    # a (3, 8) tensor split over 4 columns-wise: rank 2 holds columns 4-5
    assert chunk_map(plain, (3, 2), _Sizes({"tp": 2}, tp=4)) == (torch.Size([3, 8]), [(1, 0, 4, 2)])
    # 10 rows padded to 12 over 4 ranks: rank 3 holds row 9 and two padding rows
    padded = Placement(sharded=(("tp", Shard(0, full=10)),))
    assert chunk_map(padded, (3, 5), _Sizes({"tp": 3}, tp=4)) == (torch.Size([10, 5]), [(0, 0, 9, 1)])
    assert chunk_map(padded, (3, 5), _Sizes({"tp": 1}, tp=4))[1] == [(0, 0, 3, 3)]
    # [q | k | v], 4 rows each, over 2 ranks: rank 1 holds rows 2-3 of each block
    fused = Placement(sharded=(("tp", Shard(0, fused=3)),))
    shape, runs = chunk_map(fused, (6, 5), _Sizes({"tp": 1}, tp=2))
    assert shape == torch.Size([12, 5]) and runs == [(0, 0, 2, 2), (0, 2, 6, 2), (0, 4, 10, 2)]
    # replicated, or a tp of 1: one run of the whole tensor
    assert chunk_map(REPLICATED, (6, 5), _Sizes(tp=2)) == (torch.Size([6, 5]), [(0, 0, 0, 6)])
    assert chunk_map(fused, (6, 5), _Sizes())[0] == torch.Size([6, 5])


def test_canonical_chunks_are_views_at_their_whole_tensor_offsets():
    local = torch.arange(30.0).view(6, 5)
    p = nn.Parameter(local.clone())
    set_shard(p, "tp", Shard(0, fused=3))
    shape, chunks = canonical_chunks(p, _Sizes({"tp": 1}, tp=2))
    assert shape == torch.Size([12, 5])
    assert [off for off, _ in chunks] == [(2, 0), (6, 0), (10, 0)]
    for i, (_, view) in enumerate(chunks):
        assert torch.equal(view, local[2 * i : 2 * i + 2]) and view.data_ptr() == p[2 * i].data_ptr()
    shape, chunks = canonical_chunks(_param(6, 5), _Sizes(tp=2))
    assert shape == torch.Size([6, 5]) and [off for off, _ in chunks] == [(0, 0)]


def test_norm_parts_count_each_gradient_once():
    rep, tp_g, ep_g = torch.ones(2), torch.ones(3), torch.ones(4)
    pl_tp = Placement(sharded=(("tp", Shard(0)),))
    pl_ep = Placement(sharded=(("ep", Shard(0)),))
    pairs = [(REPLICATED, rep), (pl_tp, tp_g), (pl_ep, ep_g)]

    def ids(parts):
        return [([id(g) for g in grads], axes) for grads, axes in parts]

    # tp and ep both split: a part per axis set, each over the axes its gradients are split on
    got = norm_parts(pairs, _Sizes(tp=2, ep=2), ("dp",))
    assert ids(got) == [([id(rep)], ("dp",)), ([id(ep_g)], ("dp", "ep")), ([id(tp_g)], ("dp", "tp"))]
    # ep of size 1: the experts are whole on every rank, summed with the replicated part
    got = norm_parts(pairs, _Sizes(tp=2), ())
    assert ids(got) == [([id(rep), id(ep_g)], ()), ([id(tp_g)], ("tp",))]
    # a rank holding no tp-split gradient still has that part (empty): the collectives match
    got = norm_parts([(REPLICATED, rep)], _Sizes(tp=2, ep=2), ("pp",))
    assert ids(got) == [([id(rep)], ("pp",)), ([], ("pp", "ep")), ([], ("pp", "tp"))]
    # `every` adds the parts of placements the model holds elsewhere
    both = Placement(sharded=(("ep", Shard(0)), ("tp", Shard(1))))
    got = norm_parts([], _Sizes(tp=2, ep=2), (), every=[both])
    assert ids(got) == [([], ()), ([], ("ep",)), ([], ("ep", "tp")), ([], ("tp",))]


# --- on live ranks -----------------------------------------------------------------------------


def _whole(rows: int, cols: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


def _fused_rows(rows: int, fused: int, t: int, r: int) -> list[int]:
    """Rank r's rows of `fused` blocks laid end to end: its slice of every block, in block order."""
    block = rows // fused
    per = block // t
    return [j * block + r * per + i for j in range(fused) for i in range(per)]


def _gather_and_reduce_axis() -> dict:
    from plait.mesh import Mesh
    from plait.placement import gather_full, reduce_axis

    out = {}
    with Mesh(tp=4, watchdog=False) as mesh:
        r = mesh.rank("tp")
        cases = {}
        w = _whole(8, 3, 1)  # rows over tp
        cases["rows"] = (w[2 * r : 2 * r + 2], Shard(0))
        w = _whole(3, 8, 2)  # columns over tp
        cases["cols"] = (w[:, 2 * r : 2 * r + 2], Shard(1))
        w = torch.cat([_whole(10, 3, 3), torch.zeros(2, 3)])  # 10 rows padded to 12
        cases["padded"] = (w[3 * r : 3 * r + 3], Shard(0, full=10))
        w = _whole(24, 2, 4)  # [q | k | v], 8 rows each
        cases["fused"] = (w[_fused_rows(24, 3, 4, r)], Shard(0, fused=3))
        for name, (local, shard) in cases.items():
            p = nn.Parameter(local.clone())
            set_shard(p, "tp", shard)
            out[name] = gather_full(p, mesh)
        out["replicated"] = gather_full(nn.Parameter(_whole(2, 2, 5) + r), mesh)  # this rank's own
        # (a parameter split over ep, gathered over the axis its placement names: ep = 1 here)
        e = nn.Parameter(torch.ones(2))
        set_shard(e, "ep", Shard(0))
        out["ep-of-1"] = gather_full(e, mesh)
    axes = {}
    for shape in (dict(dp=2, ep=2), dict(dp=2, tp=2), dict(ep=4)):
        with Mesh(**shape, watchdog=False) as mesh:
            dense, expert, tp_split = _param(2), _param(2), _param(2)
            set_shard(expert, "ep", Shard(0))
            set_shard(tp_split, "tp", Shard(0))
            key = "x".join(f"{a}{n}" for a, n in shape.items())
            for name, p in (("dense", dense), ("expert", expert), ("tp", tp_split)):
                axes[(key, name, "dp+ep")] = reduce_axis(p, mesh, ("dp", "ep"))
                axes[(key, name, "dp")] = reduce_axis(p, mesh, ("dp",))
    out["reduce_axis"] = axes
    return out


@pytest.fixture(scope="module")
def ranks_4():
    from plait.testing import run_ranks

    return run_ranks(_gather_and_reduce_axis, 4, timeout=240)


def test_gather_full_rebuilds_the_whole_tensor(ranks_4):
    want = {
        "rows": _whole(8, 3, 1),
        "cols": _whole(3, 8, 2),
        "padded": _whole(10, 3, 3),
        "fused": _whole(24, 2, 4),
        "ep-of-1": torch.ones(2),
    }
    for r, res in enumerate(ranks_4):
        for name, w in want.items():
            assert res[name].shape == w.shape and torch.equal(res[name], w), (name, r)
            assert res[name].device.type == "cpu"
        assert torch.equal(res["replicated"], _whole(2, 2, 5) + r)


def test_reduce_axis_is_the_data_axes_a_gradient_is_not_split_on(ranks_4):
    want = {
        # dense gradients average over every data axis, one combined group
        ("dp2xep2", "dense", "dp+ep"): "dp*ep",
        ("dp2xep2", "tp", "dp+ep"): "dp*ep",  # tp is not a data axis (and has size 1 here)
        # an expert's replicas are the dp ranks holding it
        ("dp2xep2", "expert", "dp+ep"): "dp",
        ("dp2xep2", "dense", "dp"): "dp",
        ("dp2xep2", "expert", "dp"): "dp",
        ("dp2xtp2", "dense", "dp+ep"): "dp",
        ("dp2xtp2", "tp", "dp+ep"): "dp",
        ("dp2xtp2", "expert", "dp+ep"): "dp",
        ("dp2xtp2", "tp", "dp"): "dp",
        ("ep4", "dense", "dp+ep"): "ep",
        ("ep4", "tp", "dp"): "dp",  # nothing to average over: the first data axis (size 1)
        ("ep4", "expert", "dp+ep"): "dp",
    }
    for r, res in enumerate(ranks_4):
        got = res["reduce_axis"]
        for key, axis in want.items():
            assert got[key] == axis, (key, got[key], r)

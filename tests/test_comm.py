"""Mesh geometry, every comm op with its ledger entry, and the watchdog."""

import time

import pytest
import torch
import torch.distributed as dist

from plait import comm
from plait.comm import WATCHDOG_EXIT_CODE, Ledger, bus_bytes
from plait.errors import TopologyError
from plait.mesh import Mesh, combined_groups, derived_axis_name, hybrid_dp_groups
from plait.testing import RankFailure, run_ranks


def test_bus_bytes_follow_the_ring_formulas():
    assert bus_bytes("all_reduce", 1000, 4) == 2 * 3 / 4 * 1000
    assert bus_bytes("all_gather", 1000, 4) == bus_bytes("reduce_scatter", 1000, 4) == 750
    assert bus_bytes("all_to_all", 800, 2) == 400 and bus_bytes("broadcast", 10, 8) == 10
    assert bus_bytes("all_reduce", 1000, 1) == 0
    ledger = Ledger()
    ledger.set_step(3)
    ledger.record("all_reduce", "dp", 100, 2)
    ledger.record("all_reduce", "dp", 50, 2, logical_bytes=200)
    row = ledger.rows(3)[("all_reduce", "dp")]
    assert (row.count, row.payload_bytes, row.bus_bytes, row.logical_bytes) == (2, 150, 150.0, 300)
    assert ledger.rows(4) == {} and ledger.total(3) == 150 and "all_reduce" in ledger.table(3)


def _mesh_and_ops():
    rank = dist.get_rank()
    for bad in (dict(dp=3), dict(dp=2, tp=3), dict(dp=0, tp=4)):
        try:
            Mesh(**bad)
            raise AssertionError(f"Mesh({bad}) accepted")
        except TopologyError as exc:
            assert "4" in str(exc) or "positive" in str(exc)
    m = Mesh(pp=2, tp=2, timeout_s=30)
    assert m.coords == {"pp": rank // 2, "dp": 0, "ep": 0, "cp": 0, "tp": rank % 2}
    assert m.group("dp") is None and m.size("ep") == 1 and m.ranks("pp") == [rank % 2, rank % 2 + 2]
    m.close()

    # Combined axes: one group over pp x dp; ep = 1 leaves pp*dp*ep the same group.
    c = Mesh(pp=2, dp=2, timeout_s=30)
    assert c.size("pp*dp") == 4 and c.ranks("pp*dp") == [0, 1, 2, 3] and c.rank("pp*dp") == rank
    assert c.group("pp*dp*ep") is c.group("pp*dp") and c.ranks("dp*ep") == c.ranks("dp")
    assert (
        c.axis_over(("dp", "pp")) == "pp*dp"
        and c.axis_over(("dp", "tp")) == "dp*tp"
        and c.axis_over(("ep", "tp")) == "ep*tp"
        and c.size("ep*tp") == 1
        and c.group("ep*tp") is None
    )
    c.ledger.set_step(5)
    assert comm.all_reduce_scalar(rank + 1, c, ("dp", "pp")) == 10.0
    rows = c.ledger.rows(5)
    assert set(rows) == {("all_reduce", "pp*dp")} and rows[("all_reduce", "pp*dp")].count == 1  # one, not 2
    c.close()

    # Hybrid sharding: shard groups are consecutive ranks (one node), replicas stride across
    # them; the process groups are the ones the geometry names.
    h = Mesh(dp=4, dp_shard=2, timeout_s=30)
    lo = rank - rank % 2
    assert h.ranks("dp_shard") == [lo, lo + 1] and h.rank("dp_shard") == rank % 2
    assert h.ranks("dp_replicate") == [rank % 2, rank % 2 + 2] and h.rank("dp_replicate") == rank // 2
    assert dist.get_process_group_ranks(h.group("dp_shard")) == [lo, lo + 1]
    assert dist.get_process_group_ranks(h.group("dp_replicate")) == [rank % 2, rank % 2 + 2]
    t = torch.tensor([float(rank)])
    comm.all_reduce(t, h, "dp_shard")
    assert float(t) == 2 * lo + 1
    h.close()

    mesh = Mesh(dp=2, tp=2, timeout_s=30)
    assert mesh.coords == {"pp": 0, "dp": rank // 2, "ep": 0, "cp": 0, "tp": rank % 2}
    assert mesh.ranks("tp") == [rank - rank % 2, rank - rank % 2 + 1]
    assert mesh.ranks("dp") == [rank % 2, rank % 2 + 2]
    mesh.ledger.set_step(1)
    t = torch.full((4,), float(rank + 1))
    comm.all_reduce(t, mesh, "dp")
    assert t.tolist() == [float(2 * (rank % 2) + 4)] * 4  # ranks r and r+2: (r+1) + (r+3)
    out = torch.empty(8)
    comm.all_gather(out, torch.full((4,), float(rank)), mesh, "tp")
    assert out.tolist() == [float(mesh.ranks("tp")[0])] * 4 + [float(mesh.ranks("tp")[1])] * 4
    rs = torch.empty(2)
    comm.reduce_scatter(rs, torch.arange(4.0) * (rank + 1), mesh, "tp")
    peers = sum(r + 1 for r in mesh.ranks("tp"))
    i = mesh.rank("tp")
    assert rs.tolist() == [2.0 * i * peers, (2.0 * i + 1) * peers]
    a2a = torch.empty(4)
    comm.all_to_all(a2a, torch.arange(4.0) + 10 * i, mesh, "tp")
    assert a2a.tolist() == [2.0 * i, 2.0 * i + 1, 10 + 2.0 * i, 10 + 2.0 * i + 1]
    b = torch.full((3,), float(rank))
    comm.broadcast(b, mesh, "dp", src=1)
    assert b.tolist() == [float(mesh.ranks("dp")[1])] * 3
    buf = torch.empty(5)
    peer = 1 - mesh.rank("tp")
    if mesh.rank("tp") == 0:
        comm.send(torch.arange(5.0) + rank, mesh, "tp", peer)
        comm.recv(buf, mesh, "tp", peer)
        assert buf.tolist() == (torch.arange(5.0) * 2 + rank + 1).tolist()
    else:
        comm.recv(buf, mesh, "tp", peer)
        comm.send(buf * 2 - rank + 2, mesh, "tp", peer)  # = 2 * arange + the sender's rank + 1
    h = comm.all_reduce(torch.ones(2), mesh, "tp", async_op=True)
    assert h.wait().tolist() == [2.0, 2.0]
    comm.barrier(mesh)
    comm.all_reduce(torch.ones(3), mesh, "ep")  # size-1 axis: a free no-op, not recorded
    rows = mesh.ledger.rows(1)
    assert rows[("all_reduce", "dp")].payload_bytes == 16 and rows[("all_reduce", "dp")].bus_bytes == 16
    assert rows[("all_gather", "tp")].payload_bytes == 32 and rows[("all_gather", "tp")].bus_bytes == 16
    assert rows[("reduce_scatter", "tp")].payload_bytes == 16
    assert rows[("all_to_all", "tp")].payload_bytes == 16 and rows[("broadcast", "dp")].payload_bytes == 12
    assert rows[("send", "tp")].count == 1 and rows[("recv", "tp")].count == 1
    assert rows[("all_reduce", "tp")].count == 1 and ("all_reduce", "ep") not in rows
    assert all(e.completed for e in mesh.recorder.entries())
    assert [e.seq for e in mesh.recorder.entries()] == list(range(1, len(mesh.recorder.entries()) + 1))
    mesh.close()
    return True


def test_mesh_and_every_op_on_four_ranks():
    assert all(run_ranks(_mesh_and_ops, 4, timeout=120))


def test_hybrid_groups_shard_over_consecutive_dp_ranks():
    """pp=2 x dp=4 x tp=2, shard groups of 2: each shard group is two neighbouring dp
    coordinates (global ranks tp apart, within a node of 8), each replicate group strides over
    the shard groups; both partition the ranks."""
    sizes = {"pp": 2, "dp": 4, "ep": 1, "tp": 2}
    lines = hybrid_dp_groups(sizes, 2)
    assert lines["dp_shard"][:4] == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert lines["dp_replicate"][:4] == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert lines["dp_shard*tp"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    for axis, groups in lines.items():
        assert sorted(r for g in groups for r in g) == list(range(16)), axis
    assert all(max(g) // 8 == min(g) // 8 for g in lines["dp_shard"])  # never across a node of 8
    assert hybrid_dp_groups({"pp": 1, "dp": 4, "ep": 1, "tp": 1}, 4)["dp_replicate"] == [[0], [1], [2], [3]]


def test_combined_axes_cover_the_named_axes_and_partition_the_ranks():
    sizes = {"pp": 2, "dp": 2, "ep": 2, "tp": 2}
    assert derived_axis_name(("ep", "dp")) == "dp*ep"
    lines = combined_groups(sizes, ("dp", "ep"))
    assert lines[0] == [0, 2, 4, 6] and lines[1] == [1, 3, 5, 7] and len(lines) == 4
    assert sorted(r for line in lines for r in line) == list(range(16))
    assert combined_groups(sizes, ("pp", "dp", "ep"))[1] == [1, 3, 5, 7, 9, 11, 13, 15]  # all but tp
    with pytest.raises(TopologyError, match="distinct axes"):
        derived_axis_name(("dp", "dp"))


def test_mesh_needs_a_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(TopologyError, match="initialised process group"):
        Mesh(dp=1)


def _skip_a_collective(then: str):
    mesh = Mesh(dp=2, timeout_s=3)
    t = torch.ones(4)
    comm.all_reduce(t, mesh, "dp")
    if mesh.rank("dp") == 0:
        comm.all_reduce(t, mesh, "dp")  # rank 1 never joins this one
    elif then == "compute":
        time.sleep(30)  # rank 1 is busy elsewhere (or lost): only rank 0 is stuck in a collective
    if then == "barrier":
        comm.barrier(mesh)  # both stuck, in different collectives
    mesh.close()


def _raise_on_rank_one():
    mesh = Mesh(dp=2, timeout_s=60)
    if mesh.rank("dp") == 1:
        raise ValueError("boom from rank 1")
    comm.all_reduce(torch.ones(2), mesh, "dp")  # would wait for rank 1 for 60 s
    mesh.close()


def test_watchdog_names_the_rank_op_and_axis_and_every_rank_exits():
    t0 = time.time()
    with pytest.raises(RankFailure) as info:
        run_ranks(_skip_a_collective, 2, args=("compute",), timeout=60, grace=3)
    assert time.time() - t0 < 20
    exc = info.value
    assert exc.exitcodes[0] == WATCHDOG_EXIT_CODE and exc.exitcodes[1] != 0, exc.exitcodes
    report = exc.failures[0]
    assert "plait watchdog: rank 0" in report and "#2 all_reduce on axis 'dp'" in report, report
    assert "rank 1: last op #1 all_reduce axis=dp" in report and "completed" in report, report

    # Both ranks stuck in different collectives: whichever watchdog fires first ends the job;
    # the other rank then fails too (its collective breaks, or its own watchdog fires).
    t0 = time.time()
    with pytest.raises(RankFailure) as info:
        run_ranks(_skip_a_collective, 2, args=("barrier",), timeout=60, grace=3)
    assert time.time() - t0 < 20
    exc = info.value
    assert all(code != 0 for code in exc.exitcodes.values()), exc.exitcodes
    reports = [text for text in exc.failures.values() if "plait watchdog: rank" in text]
    assert reports and any("all_reduce" in r and "barrier" in r for r in reports), exc.failures


def test_a_raising_rank_fails_fast_with_its_own_traceback():
    t0 = time.time()
    with pytest.raises(RankFailure) as info:
        run_ranks(_raise_on_rank_one, 2, timeout=60)
    assert time.time() - t0 < 30
    text = info.value.failures[1]
    assert "ValueError: boom from rank 1" in text and "_raise_on_rank_one" in text, text

"""The silent-corruption check: tensors that must be identical on several ranks are compared.

A parameter is replicated over every axis of dp, ep and tp it is not split on (its placement):
data-parallel replicas hold the same values, and so do tensor-parallel peers for the tensors
they do not split. A bit flip in memory or a rank that silently skipped an update breaks that,
and nothing else in training notices: the replicas just drift apart. Every
`train.replica_check_every` steps each rank hashes each such tensor it holds (exactly: the
integer view of its bits, position-weighted), the hashes are gathered over each axis, and a
mismatch stops the job naming the parameter, the axis and the ranks that disagree.

Parameters without storage between steps (ZeRO-3's gathered views, a pipeline's ZeRO-3 stage
parameters) are not compared: the shards that hold them are different on every rank by design.
"""

from __future__ import annotations

import torch

from plait import comm
from plait.errors import ReplicaMismatchError
from plait.mesh import Mesh
from plait.placement import placement

AXES = ("dp", "ep", "cp", "tp")


def held_parameters(engine) -> list[tuple[str, torch.Tensor]]:
    """(name, parameter) of every parameter whose values this rank holds between steps."""
    model = getattr(engine, "raw", None) or engine.module
    out = []
    for name, p in model.named_parameters():
        if p.numel() and p.untyped_storage().size():
            out.append((name, p))
    return out


def bit_hash(t: torch.Tensor) -> torch.Tensor:
    """Two int64 sums of the tensor's bits (plain and position-weighted): equal tensors give equal
    hashes on every rank, and a change in any bit changes them. Integer sums wrap around alike
    everywhere, so overflow does not matter."""
    flat = t.reshape(-1)
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    bits = flat.view(ints).to(torch.int64)
    weights = torch.arange(bits.numel(), device=bits.device) % 1009 + 1
    return torch.stack([bits.sum(), (bits * weights).sum()])


def check_replicas(engine, mesh: Mesh, step: int) -> int:
    """Compare every replicated parameter over each axis it is replicated on; raise
    ReplicaMismatchError naming the first mismatches. Returns how many tensors were compared."""
    params = held_parameters(engine)
    compared = 0
    for axis in AXES:
        if mesh.size(axis) == 1:
            continue
        mine = [(n, t) for n, t in params if axis not in placement(t).sharded_axes]
        if not mine:
            continue
        hashes = torch.stack([bit_hash(t.detach()) for _, t in mine]).to(mesh.device)
        n = mesh.size(axis)
        everyone = torch.empty((n * hashes.shape[0], 2), dtype=hashes.dtype, device=hashes.device)
        comm.all_gather(everyone, hashes, mesh, axis)
        everyone = everyone.view(n, -1, 2).cpu()
        ranks = mesh.ranks(axis)
        bad = []
        for i, (name, _) in enumerate(mine):
            rows = everyone[:, i]
            differ = [ranks[k] for k in range(len(ranks)) if not torch.equal(rows[k], rows[0])]
            if differ:
                bad.append(f"{name} on rank(s) {differ} differs from rank {ranks[0]}")
        if bad:
            shown = "; ".join(bad[:4]) + (f"; and {len(bad) - 4} more" if len(bad) > 4 else "")
            raise ReplicaMismatchError(
                f"step {step}: replicas over {axis} differ: {shown}. Memory or a rank's update went "
                "wrong (silent corruption); resume from the last checkpoint, ideally on other devices"
            )
        compared += len(mine)
    return compared

"""Every collective plait issues, recorded in the mesh's ledger and flight recorder.

Each function takes the `Mesh` and the name of the axis to communicate over. Over an axis of
size 1 a collective is a no-op and records nothing. Otherwise the operation is issued
asynchronously to torch.distributed, entered in the flight recorder (so the watchdog sees it
if it never completes) and in the ledger (count, payload, ring bus bytes); with
`async_op=False` the call waits for it. With `async_op=True` it returns a `Handle` whose
`wait()` completes the operation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from plait.comm.recorder import OpEntry
from plait.errors import CommError

if TYPE_CHECKING:
    from plait.mesh import Mesh

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class Handle:
    """An operation in flight; `wait()` blocks until it completes and returns its result."""

    def __init__(self, work=None, entry: OpEntry | None = None, mesh: Mesh | None = None, result=None):
        self._work = work
        self._entry = entry
        self._mesh = mesh
        self.result = result
        self.done = work is None

    def wait(self):
        if not self.done:
            self._work.wait()
            # On CUDA, wait() only orders the current stream after the collective and returns at
            # once; the watchdog marks the entry complete when the work really finishes.
            if self._mesh.device.type != "cuda" or self._mesh.watchdog is None:
                self._mesh.recorder.complete(self._entry)
            self.done = True
        return self.result

    def is_completed(self) -> bool:
        return self.done or bool(self._work.is_completed())


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _issue(
    mesh: Mesh,
    op: str,
    axis: str,
    payload: int,
    launch,
    async_op: bool,
    result,
    peer=None,
    logical_bytes: int | None = None,
    group=None,
) -> Handle:
    """Launch `launch(group)` asynchronously, record it, and wait unless `async_op`. `group`:
    a process group outside the mesh (a link between islands), recorded under `axis`."""
    group, n = (mesh.group(axis), mesh.size(axis)) if group is None else (group, group.size())
    entry = mesh.recorder.start(op, axis, payload, peer=peer)
    try:
        work = launch(group)
    except Exception as exc:
        mesh.recorder.complete(entry)
        raise CommError(f"rank {mesh.global_rank}: {op} on axis '{axis}' failed to start: {exc}") from exc
    entry.work = work
    mesh.ledger.record(op, axis, payload, n, logical_bytes=logical_bytes)
    handle = Handle(work, entry, mesh, result)
    if not async_op:
        handle.wait()
    return handle


def _reduce_op(op: str):
    try:
        return _REDUCE_OPS[op]
    except KeyError:
        raise CommError(f"unknown reduce op {op!r}; valid: {', '.join(_REDUCE_OPS)}") from None


def all_reduce(
    tensor: torch.Tensor,
    mesh: Mesh,
    axis: str,
    op: str = "sum",
    async_op: bool = False,
    logical_bytes: int | None = None,
):
    """In-place all-reduce of `tensor` over `axis`. Returns the tensor (or a Handle if async)."""
    if mesh.size(axis) == 1:
        return Handle(result=tensor) if async_op else tensor
    rop = _reduce_op(op)
    h = _issue(
        mesh,
        "all_reduce",
        axis,
        _nbytes(tensor),
        lambda g: dist.all_reduce(tensor, op=rop, group=g, async_op=True),
        async_op,
        tensor,
        logical_bytes=logical_bytes,
    )
    return h if async_op else tensor


def all_gather(
    output: torch.Tensor,
    tensor: torch.Tensor,
    mesh: Mesh,
    axis: str,
    async_op: bool = False,
    logical_bytes: int | None = None,
):
    """Gather `tensor` from every rank of `axis` into `output` (concatenated along dim 0).

    `logical_bytes`: for the ledger, the uncompressed payload this gather stands for."""
    n = mesh.size(axis)
    if output.numel() != tensor.numel() * n:
        raise CommError(f"all_gather: output has {output.numel()} elements, expected {tensor.numel()} x {n}")
    if n == 1:
        output.copy_(tensor.reshape(output.shape))
        return Handle(result=output) if async_op else output
    h = _issue(
        mesh,
        "all_gather",
        axis,
        _nbytes(output),
        lambda g: _gather_into(output, tensor, g),
        async_op,
        output,
        logical_bytes=logical_bytes,
    )
    return h if async_op else output


def _gather_into(output: torch.Tensor, tensor: torch.Tensor, group):
    """torch's gather into one tensor; on a gloo group outside torch's registry of groups (a link
    between islands, DiLoCo's replica axis), the group's own operation, which needs none."""
    if group is not None and group not in dist.distributed_c10d._world.pg_map:
        return group._allgather_base(output, tensor)
    return dist.all_gather_single(output, tensor, group=group, async_op=True)


def reduce_scatter(
    output: torch.Tensor,
    tensor: torch.Tensor,
    mesh: Mesh,
    axis: str,
    op: str = "sum",
    async_op: bool = False,
    logical_bytes: int | None = None,
):
    """Reduce `tensor` over `axis` and leave this rank's 1/N slice (along dim 0) in `output`.

    `logical_bytes`: for the ledger, the uncompressed payload this reduce-scatter stands for."""
    n = mesh.size(axis)
    if tensor.numel() != output.numel() * n:
        raise CommError(
            f"reduce_scatter: input has {tensor.numel()} elements, expected {output.numel()} x {n}"
        )
    if n == 1:
        output.copy_(tensor.reshape(output.shape))
        return Handle(result=output) if async_op else output
    rop = _reduce_op(op)
    h = _issue(
        mesh,
        "reduce_scatter",
        axis,
        _nbytes(tensor),
        lambda g: dist.reduce_scatter_single(output, tensor, op=rop, group=g, async_op=True),
        async_op,
        output,
        logical_bytes=logical_bytes,
    )
    return h if async_op else output


def all_to_all(
    output: torch.Tensor,
    tensor: torch.Tensor,
    mesh: Mesh,
    axis: str,
    output_splits: list[int] | None = None,
    input_splits: list[int] | None = None,
    async_op: bool = False,
):
    """Exchange slices of dim 0 between the ranks of `axis` (equal slices unless splits are given)."""
    if mesh.size(axis) == 1:
        output.copy_(tensor)
        return Handle(result=output) if async_op else output
    h = _issue(
        mesh,
        "all_to_all",
        axis,
        _nbytes(tensor),
        lambda g: dist.all_to_all_single(output, tensor, output_splits, input_splits, group=g, async_op=True),
        async_op,
        output,
    )
    return h if async_op else output


def broadcast(tensor: torch.Tensor, mesh: Mesh, axis: str, src: int = 0, async_op: bool = False):
    """Broadcast `tensor` from position `src` along `axis` (an axis index, not a global rank)."""
    if mesh.size(axis) == 1:
        return Handle(result=tensor) if async_op else tensor
    src_global = mesh.global_rank_of(axis, src)
    h = _issue(
        mesh,
        "broadcast",
        axis,
        _nbytes(tensor),
        lambda g: dist.broadcast(tensor, src=src_global, group=g, async_op=True),
        async_op,
        tensor,
    )
    return h if async_op else tensor


def isend(tensor: torch.Tensor, mesh: Mesh, axis: str, peer: int) -> Handle:
    """Start sending `tensor` to position `peer` along `axis`."""
    dst = mesh.global_rank_of(axis, peer)
    return _issue(
        mesh,
        "send",
        axis,
        _nbytes(tensor),
        lambda g: dist.isend(tensor, dst=dst, group=g),
        True,
        tensor,
        peer=peer,
    )


def irecv(tensor: torch.Tensor, mesh: Mesh, axis: str, peer: int) -> Handle:
    """Start receiving into `tensor` from position `peer` along `axis`."""
    src = mesh.global_rank_of(axis, peer)
    return _issue(
        mesh,
        "recv",
        axis,
        _nbytes(tensor),
        lambda g: dist.irecv(tensor, src=src, group=g),
        True,
        tensor,
        peer=peer,
    )


def link_isend(tensor: torch.Tensor, mesh: Mesh, axis: str, group, peer: int, tag: int) -> Handle:
    """Start sending `tensor` to rank `peer` of `group`, a process group of its own outside the
    mesh (plait.controller.links), recorded in this mesh's ledger and flight recorder as `axis`."""
    launch = lambda g: g.send([tensor], peer, tag)  # noqa: E731
    return _issue(mesh, "send", axis, _nbytes(tensor), launch, True, tensor, peer=peer, group=group)


def link_irecv(tensor: torch.Tensor, mesh: Mesh, axis: str, group, peer: int, tag: int) -> Handle:
    """Start receiving into `tensor` from rank `peer` of `group` (as `link_isend`)."""
    launch = lambda g: g.recv([tensor], peer, tag)  # noqa: E731
    return _issue(mesh, "recv", axis, _nbytes(tensor), launch, True, tensor, peer=peer, group=group)


def batch_isend_irecv(ops: list[tuple[str, torch.Tensor, int]], mesh: Mesh, axis: str) -> list[Handle]:
    """Post several sends and receives along `axis` together: `ops` holds ("send" | "recv",
    tensor, peer position) triples. On NCCL they form one group (`dist.batch_isend_irecv`), so a
    rank that sends to and receives from the same peer cannot block on its own send; returns one
    Handle per op, in order."""
    if not ops:
        return []
    group = mesh.group(axis)
    n = mesh.size(axis)
    p2p, entries = [], []
    for kind, tensor, peer in ops:
        if kind not in ("send", "recv"):
            raise CommError(f"batch_isend_irecv: op {kind!r} is not valid; valid: send, recv")
        fn = dist.isend if kind == "send" else dist.irecv
        p2p.append(dist.P2POp(fn, tensor, mesh.global_rank_of(axis, peer), group=group))
        entries.append(mesh.recorder.start(kind, axis, _nbytes(tensor), peer=peer))
    try:
        works = dist.batch_isend_irecv(p2p)
    except Exception as exc:
        for entry in entries:
            mesh.recorder.complete(entry)
        raise CommError(
            f"rank {mesh.global_rank}: batched send/recv on axis '{axis}' failed to start: {exc}"
        ) from exc
    handles = []
    for (kind, tensor, _), entry, work in zip(ops, entries, works, strict=True):
        entry.work = work
        mesh.ledger.record(kind, axis, _nbytes(tensor), n)
        handles.append(Handle(work, entry, mesh, tensor))
    return handles


def send(tensor: torch.Tensor, mesh: Mesh, axis: str, peer: int) -> None:
    isend(tensor, mesh, axis, peer).wait()


def recv(tensor: torch.Tensor, mesh: Mesh, axis: str, peer: int) -> torch.Tensor:
    return irecv(tensor, mesh, axis, peer).wait()


def barrier(mesh: Mesh, axis: str | None = None) -> None:
    """Wait until every rank of `axis` (default: every axis, the whole mesh) arrives."""
    axis = axis or "world"
    if mesh.size(axis) > 1:
        _issue(mesh, "barrier", axis, 0, lambda g: dist.barrier(group=g, async_op=True), False, None)


def all_reduce_scalar(value: float, mesh: Mesh, axes: tuple[str, ...], op: str = "sum") -> float:
    """All-reduce a Python number over several axes (e.g. a loss sum over dp and pp); float64 on
    the CPU. One collective over the mesh's combined axis where it has one, else one per axis."""
    t = torch.tensor(
        [float(value)], dtype=torch.float64, device=mesh.device if mesh.device.type == "cuda" else "cpu"
    )
    combined = mesh.axis_over(axes)
    for axis in (combined,) if combined is not None else axes:
        all_reduce(t, mesh, axis, op=op)
    return float(t.item())

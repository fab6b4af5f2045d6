"""Every parameter of a pipelined model on every pipeline rank: what `PipelineEngine.full_parameters`
returns ("every parameter, whole", under every layout).

Each pipeline rank gathers its own stages' parameters whole (over dp, tp and ep: the inner
engine's `full_parameters`); `share_over_axis` then completes that set with the other pipeline
ranks' through `plait.comm`: one all-reduce of the shapes and dtypes, and one all-reduce per dtype
of the values, each element the sum of one sender's value and zeros (exact: x + 0 = x).
"""

from __future__ import annotations

import torch

from plait import comm
from plait.errors import PipelineError
from plait.mesh import Mesh

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
MAX_DIMS = 8


def share_over_axis(
    mine: dict[str, torch.Tensor], owners: list[tuple[str, int]], mesh: Mesh, axis: str = "pp"
) -> dict[str, torch.Tensor]:
    """`mine` (this rank's tensors by name) completed with every other rank's of `axis`, on the CPU,
    in the order of `owners`: every name, listed alike on every rank, with the position along
    `axis` that sends it (a name this rank sends must be in `mine`). A collective over `axis`."""
    rank, device = mesh.rank(axis), mesh.device
    meta = torch.zeros((len(owners), MAX_DIMS + 2), dtype=torch.int64)
    for i, (name, owner) in enumerate(owners):
        if owner != rank:
            continue
        t = mine[name]
        if t.dim() > MAX_DIMS or t.dtype not in DTYPES:
            raise PipelineError(
                f"full_parameters: {name} is {t.dtype} with {t.dim()} dims; pipelines gather "
                f"floating-point parameters of at most {MAX_DIMS} dims"
            )
        meta[i, 0] = t.dim() + 1  # 0: no rank sends it
        meta[i, 1] = DTYPES.index(t.dtype)
        meta[i, 2 : 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    meta = comm.all_reduce(meta.to(device), mesh, axis).cpu()
    shapes = {}
    for i, (name, _) in enumerate(owners):
        dims = int(meta[i, 0]) - 1
        if dims >= 0:
            shapes[name] = (tuple(int(d) for d in meta[i, 2 : 2 + dims]), DTYPES[int(meta[i, 1])])
    out: dict[str, torch.Tensor] = {}
    for dtype in DTYPES:
        names = [(n, o) for n, o in owners if n in shapes and shapes[n][1] == dtype]
        if not names:  # every rank agrees: the dtypes came from the same all-reduce
            continue
        sizes = [torch.Size(shapes[n][0]).numel() for n, _ in names]
        flat = torch.zeros(sum(sizes), dtype=dtype, device=device)
        for (name, owner), piece in zip(names, flat.split(sizes), strict=True):
            if owner == rank:
                piece.copy_(mine[name].reshape(-1))
        flat = comm.all_reduce(flat, mesh, axis).cpu()
        for (name, _), piece in zip(names, flat.split(sizes), strict=True):
            out[name] = piece.view(shapes[name][0]).clone()
    return {n: out[n] for n, _ in owners if n in out}

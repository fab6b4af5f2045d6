"""What the planner knows of a cluster: the `Link` and `Cluster` records and the presets.

A cluster is nodes of ``gpus_per_node`` devices. Two classes of link join them, each priced by
the α-β model (Hockney 1994; the form Alpa, Zheng et al. 2022 §5, and Narayanan et al. 2021 §3
use): sending ``n`` bytes costs ``α + n / β``. ``intra`` is the link inside a node (NVLink),
``inter`` the link across nodes (InfiniBand); β is the bandwidth one device sees in one
direction (a DGX node's eight 200 Gb/s HCAs give each GPU its own 25 GB/s).

Mesh axes are laid out as plait's `Mesh` lays them, tp innermost, then ep, dp, pp outermost
(docs/ARCHITECTURE.md): an axis whose groups stay inside one node (the product of its size and
the sizes of the axes inside it is at most ``gpus_per_node``) uses ``intra``, any other ``inter``.

A cluster may also be cut into **islands** of ``island_devices`` consecutive devices (whole
nodes: two data centres, or pods joined by a slower fabric): an axis whose groups span more than
one island uses the ``island`` link, the slowest, whatever else they cross. Its β is, like the
others', what one device sees each way while all send (an island's uplink of B GB/s shared by its
D devices is B/D per device). DiLoCo's replica axis is what such a link is for
(`plait.planner.diloco`).

Presets are from the vendors' datasheets (dense bf16 peaks; NVLink per-direction bandwidth);
the α values and the compute ``efficiency`` are typical figures, not measured: a preset says so.
How a cluster file describes any other cluster is in `plait.planner.cluster_file`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math


@dataclasses.dataclass(frozen=True)
class Link:
    """One class of link in the α-β model: ``time(n) = alpha_s + n / beta_bps``."""

    alpha_s: float
    beta_bps: float

    def time(self, nbytes: float, messages: int = 1) -> float:
        """Seconds to move ``nbytes`` in ``messages`` sequential messages."""
        if nbytes <= 0:
            return 0.0
        return messages * self.alpha_s + nbytes / self.beta_bps


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Devices, their peak and memory, and the two link classes."""

    name: str
    gpus_per_node: int
    peak_tflops: float
    """Dense peak per device in the compute dtype (bf16), TFLOP/s."""
    memory_gb: float
    """Device memory, GB of 1e9 bytes."""
    intra: Link
    inter: Link
    efficiency: float = 0.6
    """Fraction of the peak a transformer layer's kernels reach (GEMMs, attention and the
    element-wise work together): a preset's figure, not a measurement."""
    usable_memory: float = 0.9
    """Fraction of the memory a run may plan for (the rest: CUDA context, allocator slack)."""
    memory_bw_gbps: float = 2000.0
    """Device memory bandwidth, GB/s: the optimizer step is bound by it."""
    pcie_gbps: float = 25.0
    """Host link per device, GB/s each way (ZeRO-Offload's transfers)."""
    host_adam_params_per_s: float = 1e9
    """Parameters per second the host's optimizer step updates for one device (offload)."""
    note: str = ""
    precision: str = "bf16"
    """The dtype plans train in: bf16 on accelerators; fp32 on a CPU (`this`), where bf16 matmuls
    are slow."""
    cores: int = 0
    """CPU cores per node that the node's ranks share (0: every device computes on its own). The
    node's memory is shared too: ``memory_gb`` is the node's, split over its ranks."""
    rank_tflops: tuple[tuple[int, float], ...] = ()
    """Measured (ranks on the node, matmul TFLOP/s each rank gets while all compute, with the
    launcher's threads per rank); empty: ``peak_tflops`` per device."""
    efficiency_curve: tuple[tuple[float, float, float], ...] = ()
    """Measured (d_model, tokens per micro-batch, efficiency) points on a grid, interpolated in
    log d_model and log tokens and held flat beyond the ends; empty: ``efficiency`` throughout."""
    tp_efficiency: tuple[tuple[float, float, float, float], ...] = ()
    """Measured (d_model, tokens per micro-batch, tp, efficiency) of one of tp tensor-parallel
    ranks: its 1/tp of the model FLOPs over its time (narrower GEMMs, the norms it still does
    whole); empty: the unsplit model's efficiency for every tp."""
    pipeline_overhead: tuple[tuple[str, float], ...] = ()
    """Measured (schedule, seconds) that plait's pipeline engine adds per micro-batch on a rank
    beyond the compute (its actions' bookkeeping and point-to-point calls); empty: none."""
    collectives: tuple[tuple[str, int, int, Link], ...] = ()
    """Measured (op, ranks, ranks on the node, α-β of the whole collective over its bus bytes):
    used instead of the link class where they cover the op."""
    island_devices: int = 0
    """Devices of one island (a multiple of ``gpus_per_node``); 0: the cluster is one island."""
    island: Link | None = None
    """The link between islands (per device, each way); None without islands."""

    def islands(self, devices: int) -> int:
        """How many islands `devices` consecutive devices fill (1 without islands)."""
        if not self.island_devices or devices <= self.island_devices:
            return 1
        return math.ceil(devices / self.island_devices)

    @property
    def peak_flops(self) -> float:
        return self.peak_tflops * 1e12

    def efficiency_at(self, d_model: float, tokens: float = 0, tp: int = 1) -> float:
        """The compute efficiency of a GPT of this width on micro-batches of `tokens` tokens (the
        measured grid, or the one figure), as one of `tp` tensor-parallel ranks computes its share
        (the measured shares interpolated in log tp, flat beyond the largest; no tp points: the
        unsplit model's)."""
        if not self.efficiency_curve:
            return self.efficiency
        whole = _grid_at(self.efficiency_curve, d_model, tokens)
        shares = sorted({t for _, _, t, _ in self.tp_efficiency})
        if tp <= 1 or not shares:
            return whole
        ys = [whole] + [
            _grid_at([(h, n, e) for h, n, t, e in self.tp_efficiency if t == share], d_model, tokens)
            for share in shares
        ]
        return _log_interp([1.0, *shares], ys, tp)

    def rank_flops(self, ranks: int, computing: float = 0.0) -> float:
        """Matmul FLOP/s one of ``ranks`` devices of a node gets. ``computing``: the ranks busy at a
        time, on average (default all). The node's total is the measured one of that many busy
        ranks (ranks x per-rank rate; between measured worlds interpolated, beyond the largest
        held at its total: the cores are full and more runnable ranks only switch more), shared
        by them, up to what a rank's own threads reach alone (the one-thread peak per thread)."""
        pts = sorted(self.rank_tflops)
        if not pts:
            return self.peak_flops
        ranks = min(ranks, self.gpus_per_node)
        active = min(max(computing or ranks, 1.0), ranks)
        total = [(w, w * t * 1e12) for w, t in pts]
        node = total[-1][1]
        if active <= total[0][0]:
            node = total[0][1] * active / total[0][0]
        for (w0, a0), (w1, a1) in itertools.pairwise(total):
            if w0 < active <= w1:
                node = a0 + (active - w0) / (w1 - w0) * (a1 - a0)
                break
        threads = max(1, self.cores // ranks) if self.cores else 1
        return min(node / active, max(node / ranks, self.peak_flops * threads))

    def pipeline_overhead_s(self, schedule: str) -> float:
        """Seconds plait's pipeline engine adds per micro-batch on a rank under `schedule`."""
        return dict(self.pipeline_overhead).get(schedule, 0.0)

    def collective_link(self, op: str, ranks: int, world: int) -> Link | None:
        """The measured α-β of `op` over `ranks` ranks while `world` ranks share the node: the
        measurement with the same op and ranks and the nearest world, else None."""
        same = [(abs(w - world), link) for o, n, w, link in self.collectives if o == op and n == ranks]
        return min(same, key=lambda x: x[0])[1] if same else None

    def link_for(self, span: int) -> Link:
        """The link of a group whose ranks span ``span`` consecutive global ranks: inside a node,
        across nodes, or (with islands) across islands."""
        if span <= self.gpus_per_node:
            return self.intra
        if self.island is not None and self.island_devices and span > self.island_devices:
            return self.island
        return self.inter


def _grid_at(points, d_model: float, tokens: float) -> float:
    """(d_model, tokens, efficiency) points on a grid, interpolated in log d_model and log tokens
    and held flat beyond the ends (`tokens` 0: the largest measured)."""
    widths = sorted({h for h, _, _ in points})
    grid = {(h, t): e for h, t, e in points}

    def along(h: float) -> float:
        pts = sorted((t, e) for (hh, t), e in grid.items() if hh == h)
        return _log_interp([t for t, _ in pts], [e for _, e in pts], tokens or pts[-1][0])

    return _log_interp(widths, [along(h) for h in widths], d_model)


def _log_interp(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise-linear in log x through sorted (xs, ys), flat beyond the ends."""
    if x <= xs[0]:
        return ys[0]
    for x0, x1, y0, y1 in zip(xs, xs[1:], ys, ys[1:], strict=False):
        if x <= x1:
            return y0 + math.log(x / x0) / math.log(x1 / x0) * (y1 - y0)
    return ys[-1]


def axis_links(cluster: Cluster, sizes: dict[str, int]) -> dict[str, Link]:
    """The link each mesh axis lives on, for sizes {"pp", "dp", "ep", "cp", "tp"}: tp innermost, so
    the span of an axis is its size times the sizes inside it (plait.mesh's mixed radix)."""
    out, inner = {}, 1
    for axis in ("tp", "cp", "ep", "dp", "pp"):
        n = sizes.get(axis, 1)
        out[axis] = cluster.link_for(inner * n)
        inner *= n
    return out


def _gbps(x: float) -> float:
    return x * 1e9


PRESETS = {
    "dgx-a100": Cluster(
        name="dgx-a100",
        gpus_per_node=8,
        peak_tflops=312.0,
        memory_gb=80.0,
        # NVLink 3: 600 GB/s per GPU both ways, 300 each way; HDR InfiniBand: 200 Gb/s = 25 GB/s.
        intra=Link(alpha_s=5e-6, beta_bps=_gbps(300.0)),
        inter=Link(alpha_s=10e-6, beta_bps=_gbps(25.0)),
        note="DGX A100 80GB: 8 GPUs, NVLink 3 (300 GB/s each way), 8 x 200 Gb/s HDR IB; "
        "alpha and efficiency are typical figures, not measured",
    ),
    "dgx-h100": Cluster(
        name="dgx-h100",
        gpus_per_node=8,
        peak_tflops=989.0,
        memory_gb=80.0,
        # NVLink 4: 900 GB/s per GPU both ways; NDR InfiniBand: 400 Gb/s = 50 GB/s.
        intra=Link(alpha_s=5e-6, beta_bps=_gbps(450.0)),
        inter=Link(alpha_s=10e-6, beta_bps=_gbps(50.0)),
        memory_bw_gbps=3350.0,
        pcie_gbps=50.0,
        note="DGX H100: 8 GPUs, NVLink 4 (450 GB/s each way), 8 x 400 Gb/s NDR IB; "
        "alpha and efficiency are typical figures, not measured",
    ),
}


PRESET_NAMES = (*PRESETS, "this")
"""Every name `--cluster` takes: the presets, and `this` (this machine, calibrated)."""

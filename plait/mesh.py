"""The device mesh: named axes pp, dp, ep, cp, tp laid over the ranks of a process group.

Axes run from outermost to innermost (pp, dp, ep, cp, tp): tp changes fastest from one global rank
to the next, so tensor-parallel peers sit on the closest devices (one node's NVLink), context-
parallel peers (a sequence split over cp, whose attention passes keys and values every layer)
next to them, and pipeline stages, which exchange the least, sit furthest apart. A `Mesh` is
built on torch's `DeviceMesh` and is passed explicitly to every function that communicates;
plait keeps no global mesh.

The mesh also owns what every collective must be recorded in (see `plait.comm`): the ledger of
bytes moved per step, the flight recorder of the last operations, and the watchdog that turns a
stuck collective into an error naming the rank, the operation and the axis.
"""

from __future__ import annotations

import datetime
import itertools
import math
import os

import torch
import torch.distributed as dist

from plait.comm.ledger import Ledger
from plait.comm.ports import is_loopback, loopback_store
from plait.comm.recorder import FlightRecorder, Watchdog
from plait.errors import TopologyError

AXES = ("pp", "dp", "ep", "cp", "tp")
WORLD = "world"  # a pseudo-axis spanning every rank of the mesh
DEFAULT_TIMEOUT_S = 300.0


def default_device() -> torch.device:
    """CUDA (one device per local rank) when available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


def backend_for(device: torch.device | str) -> str:
    """NCCL for CUDA devices, gloo for the CPU."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_distributed(device: torch.device | str | None = None, timeout_s: float = 1800.0) -> torch.device:
    """Initialise the default process group from the torchrun environment (RANK, WORLD_SIZE, ...).

    The backend follows the device: gloo on the CPU, NCCL on CUDA. Returns the device this rank
    computes on. Does nothing but return the device when a group is already initialised.
    """
    dev = torch.device(device) if device is not None else default_device()
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise TopologyError(
                f"no process group and no launcher environment ({', '.join(missing)} unset): "
                "start with `plait train` or `torchrun`, or call torch.distributed.init_process_group first"
            )
        dist.init_process_group(
            backend=backend_for(dev),
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=dev if dev.type == "cuda" else None,
            **_loopback_rendezvous(timeout_s),
        )
    return dev


def _loopback_rendezvous(timeout_s: float) -> dict:
    """Rank 0's store for a group whose rendezvous address is this machine's loopback (one
    node): hosted on 127.0.0.1 only, where torch's env:// rendezvous would listen on every
    interface (`plait.comm.ports`). The other ranks, and every rank of a multi-node job (or one
    that uses its agent's store), rendezvous as torch does."""
    if (
        os.environ["RANK"] != "0"
        or not is_loopback(os.environ["MASTER_ADDR"])
        or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    ):
        return {}
    world = int(os.environ["WORLD_SIZE"])
    store = loopback_store(
        int(os.environ["MASTER_PORT"]), timeout_s, world_size=world, multi_tenant=True, wait_for_workers=False
    )
    # env:// puts the default group's keys under this prefix; the other ranks' rendezvous does
    return {"store": dist.PrefixStore("default_pg", store), "rank": 0, "world_size": world}


def _product(sizes: dict[str, int], axes: tuple[str, ...]):
    """Every coordinate tuple over `axes`, in row-major order."""
    return itertools.product(*(range(sizes.get(a, 1)) for a in axes))


def global_rank_at(sizes: dict[str, int], coords: dict[str, int]) -> int:
    """The global rank at `coords` of a mesh of `sizes` (row-major over AXES: tp fastest; an axis
    `sizes` leaves out has size 1)."""
    rank = 0
    for axis in AXES:
        rank = rank * sizes.get(axis, 1) + coords.get(axis, 0)
    return rank


def derived_axis_name(axes) -> str:
    """The name of the combined axis over `axes`: the axes in mesh order joined by "*" (pp*dp)."""
    unknown = [a for a in axes if a not in AXES]
    if unknown or len(set(axes)) != len(axes):
        raise TopologyError(f"a combined axis takes distinct axes of {', '.join(AXES)}, got {tuple(axes)!r}")
    return "*".join(a for a in AXES if a in axes)


def combined_groups(sizes: dict[str, int], axes) -> list[list[int]]:
    """The lines of the combined axis over `axes`, as global ranks: the ranks that share every
    other coordinate, ordered row-major over `axes` (in mesh order)."""
    axes = tuple(a for a in AXES if a in axes)
    others = tuple(a for a in AXES if a not in axes)
    lines = []
    for c in _product(sizes, others):
        fixed = dict(zip(others, c, strict=True))
        lines.append(
            [
                global_rank_at(sizes, {**fixed, **dict(zip(axes, d, strict=True))})
                for d in _product(sizes, axes)
            ]
        )
    return lines


def hybrid_dp_groups(sizes: dict[str, int], f: int) -> dict[str, list[list[int]]]:
    """Hybrid sharding's derived axes, as lists of global ranks: "dp_shard" groups hold `f`
    consecutive dp coordinates (with tp innermost these are the nearest devices, so sharding's
    all-gathers and reduce-scatters stay within a node), and "dp_replicate" groups hold the ranks
    with the same position in every shard group (their all-reduce crosses nodes); "dp_shard*tp"
    groups are a shard group with its tensor-parallel peers (a tensor split over both axes)."""
    dp = sizes["dp"]
    lines: dict[str, list[list[int]]] = {"dp_shard": [], "dp_replicate": [], "dp_shard*tp": []}
    for c in _product(sizes, ("pp", "ep", "cp", "tp")):
        o = dict(zip(("pp", "ep", "cp", "tp"), c, strict=True))
        for rep in range(dp // f):
            lines["dp_shard"].append([global_rank_at(sizes, {**o, "dp": rep * f + i}) for i in range(f)])
        for i in range(f):
            lines["dp_replicate"].append(
                [global_rank_at(sizes, {**o, "dp": rep * f + i}) for rep in range(dp // f)]
            )
    for c in _product(sizes, ("pp", "ep", "cp")):  # a shard group and its tensor-parallel peers
        o = dict(zip(("pp", "ep", "cp"), c, strict=True))
        for rep in range(dp // f):
            lines["dp_shard*tp"].append(
                [
                    global_rank_at(sizes, {**o, "dp": rep * f + i, "tp": j})
                    for i in range(f)
                    for j in range(sizes["tp"])
                ]
            )
    return lines


class Mesh:
    """Named parallel axes over the ranks of the initialised default process group.

    >>> mesh = Mesh(dp=2)                 # inside an initialised group of 2 ranks
    >>> mesh.size("dp"), mesh.rank("dp"), mesh.group("dp")

    Every axis defaults to 1; the product of the sizes must equal the world size. Axes of size 1
    have no process group (`group()` returns None) and collectives over them are free no-ops.

    Args:
        pp, dp, ep, cp, tp: sizes of the pipeline, data, expert, context (sequence) and tensor
            parallel axes.
        device: the device this rank computes on; default CUDA if available, else CPU. The
            process group's backend must suit it (NCCL for CUDA, gloo for the CPU).
        timeout_s: a collective that has not completed after this many seconds is a hang: the
            watchdog reports it and ends the process (see `plait.comm.recorder.Watchdog`).
        watchdog: set False to run without the watchdog thread (e.g. for a single process).
        dp_shard: hybrid sharding (FSDP's HYBRID_SHARD): split dp into groups of `dp_shard`
            consecutive dp ranks, giving two more axes: "dp_shard" (within a group: parameters
            and optimizer state are sharded here) and "dp_replicate" (across groups, same
            coordinate: shards are replicated here). Must divide dp.

    Combined axes: any set of axes is usable by name like one axis ("pp*dp", "dp*ep*tp"), so
    that a quantity reduced over several axes takes one collective (`axis_over(("pp", "dp"))`
    names it). Their process groups follow from the degrees: the mesh builds one, once, for
    every combination of two or more axes larger than 1; a combination with at most one such
    axis is that axis's group (or none).
    """

    def __init__(
        self,
        pp: int = 1,
        dp: int = 1,
        ep: int = 1,
        tp: int = 1,
        *,
        cp: int = 1,
        device: torch.device | str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        watchdog: bool = True,
        dp_shard: int | None = None,
    ):
        sizes = {"pp": pp, "dp": dp, "ep": ep, "cp": cp, "tp": tp}
        for name, n in sizes.items():
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise TopologyError(f"mesh axis {name} must be a positive integer, got {n!r}")
        if not dist.is_initialized():
            raise TopologyError(
                "Mesh needs an initialised process group: call plait.mesh.init_distributed() "
                "(or torch.distributed.init_process_group) first"
            )
        world = dist.get_world_size()
        product = math.prod(sizes.values())
        if product != world:
            shape = " x ".join(f"{k}={v}" for k, v in sizes.items())
            raise TopologyError(
                f"mesh {shape} covers {product} ranks but the world size is {world}: "
                f"make the product of pp, dp, ep, cp and tp equal {world}"
            )
        if timeout_s <= 0:
            raise TopologyError(f"timeout_s must be positive, got {timeout_s}")
        self.sizes = sizes
        self.world_size = world
        self.global_rank = dist.get_rank()
        self.device = torch.device(device) if device is not None else default_device()
        expected = backend_for(self.device)
        actual = dist.get_backend()
        if expected not in actual:
            raise TopologyError(
                f"device {self.device} needs the {expected} backend but the process group uses {actual}"
            )
        self.coords = self._coordinates(self.global_rank)
        active = [a for a in AXES if sizes[a] > 1] or ["dp"]
        self.device_mesh = dist.init_device_mesh(
            self.device.type, tuple(sizes[a] for a in active), mesh_dim_names=tuple(active)
        )
        self._groups = {a: (self.device_mesh.get_group(a) if sizes[a] > 1 else None) for a in AXES}
        self._axis_ranks = {a: self._ranks_along(a) for a in AXES}
        self._sub: dict[str, tuple[int, int, list[int], dist.ProcessGroup | None]] = {}
        if dp_shard is not None:
            self._split_dp(dp_shard)
        self._combined: dict[tuple[str, ...], dist.ProcessGroup] = {}
        wide = [a for a in AXES if sizes[a] > 1]
        for n in range(2, len(wide) + 1):  # every rank creates every group, in the same order
            for axes in itertools.combinations(wide, n):
                self._combined[axes], _ = dist.new_subgroups_by_enumeration(combined_groups(sizes, axes))
        self.timeout_s = float(timeout_s)
        self.ledger = Ledger()
        self.recorder = FlightRecorder(rank=self.global_rank)
        self.watchdog: Watchdog | None = None
        if watchdog and world > 1:
            self.watchdog = Watchdog(self.recorder, self.global_rank, world, timeout_s=self.timeout_s)
            self.watchdog.start()

    # --- geometry ---------------------------------------------------------------------------

    def _coordinates(self, rank: int) -> dict[str, int]:
        coords = {}
        for axis in reversed(AXES):  # tp is innermost: it varies fastest with the rank
            coords[axis] = rank % self.sizes[axis]
            rank //= self.sizes[axis]
        return {a: coords[a] for a in AXES}

    def _global_rank(self, coords: dict[str, int]) -> int:
        return global_rank_at(self.sizes, coords)

    def _ranks_along(self, axis: str) -> list[int]:
        return [self._global_rank({**self.coords, axis: i}) for i in range(self.sizes[axis])]

    def _split_dp(self, f: int) -> None:
        """Create the dp_shard / dp_replicate groups, and dp_shard*tp (a shard group with its
        tensor-parallel peers), every rank every group, in order."""
        dp = self.sizes["dp"]
        if not isinstance(f, int) or isinstance(f, bool) or f < 1 or dp % f:
            raise TopologyError(f"dp_shard must be a positive divisor of dp={dp}, got {f!r}")
        for axis, groups in hybrid_dp_groups(self.sizes, f).items():
            if axis == "dp_shard*tp" and self.sizes["tp"] == 1:
                self._sub[axis] = self._sub["dp_shard"]
                continue
            size = len(groups[0])
            mine = next(g for g in groups if self.global_rank in g)
            group = None
            if size > 1:
                group, _ = dist.new_subgroups_by_enumeration(groups)
            self._sub[axis] = (size, mine.index(self.global_rank), mine, group)

    def attach_axis(self, name: str, group, index: int, size: int) -> None:
        """Add an axis over a process group outside this mesh's world (DiLoCo's replica axis:
        the same position in every replica group, each group a world of its own), so that
        plait.comm's collectives run, and are recorded, over it like over any other axis. A
        later call replaces it (a new quorum); `group` None with size 1 makes it a no-op axis."""
        if name in self.sizes or name == WORLD or "*" in name:
            raise TopologyError(f"cannot attach axis {name!r}: it is one of the mesh's own")
        self._sub[name] = (size, index, list(range(size)), group)

    def _derive(self, axes: tuple[str, ...]) -> str:
        """Register the combined axis over `axes` (its group built at construction, or the one
        axis larger than 1 among them, or none) and return its name."""
        name = derived_axis_name(axes)
        if name not in self._sub:
            lines = combined_groups(self.sizes, axes)
            mine = next(line for line in lines if self.global_rank in line)
            wide = tuple(a for a in AXES if a in axes and self.sizes[a] > 1)
            group = self._combined[wide] if len(wide) > 1 else (self._groups[wide[0]] if wide else None)
            self._sub[name] = (len(mine), mine.index(self.global_rank), mine, group)
        return name

    def axis_over(self, axes) -> str | None:
        """The one axis that covers every axis of `axes` at once: the axis itself for one, the
        combined axis for several of the base axes, or None for a combination the mesh has no
        group for (a hybrid shard axis with another, except the "dp_shard*tp" it builds)."""
        axes = tuple(a for axis in axes for a in axis.split("*"))  # combined axes flattened
        if len(axes) == 1:
            return axes[0]
        if not all(a in AXES for a in axes):
            name = "*".join(axes)
            return name if name in self._sub else None
        return self._derive(axes)

    def has_axis(self, axis: str) -> bool:
        """Whether `axis` names an axis of this mesh (a base, hybrid or combined one)."""
        if axis in self.sizes or axis == WORLD or axis in self._sub:
            return True
        parts = axis.split("*")
        return len(parts) > 1 and len(set(parts)) == len(parts) and all(a in AXES for a in parts)

    def _check_axis(self, axis: str) -> None:
        if self.has_axis(axis) and axis not in self._sub and "*" in axis:
            self._derive(tuple(axis.split("*")))
        if axis not in self.sizes and axis != WORLD and axis not in self._sub:
            extra = "".join(f", {a!r}" for a in self._sub)
            raise TopologyError(
                f"unknown mesh axis {axis!r}; the axes are {', '.join(AXES)} (and {WORLD!r}{extra})"
            )

    def size(self, axis: str) -> int:
        """Number of ranks along `axis` ("world": all of them)."""
        self._check_axis(axis)
        if axis in self._sub:
            return self._sub[axis][0]
        return self.world_size if axis == WORLD else self.sizes[axis]

    def rank(self, axis: str) -> int:
        """This rank's index along `axis` (its coordinate)."""
        self._check_axis(axis)
        if axis in self._sub:
            return self._sub[axis][1]
        return self.global_rank if axis == WORLD else self.coords[axis]

    def group(self, axis: str) -> dist.ProcessGroup | None:
        """The process group of this rank's line along `axis`; None when the axis has size 1."""
        self._check_axis(axis)
        if axis in self._sub:
            return self._sub[axis][3]
        if axis == WORLD:
            return dist.group.WORLD if self.world_size > 1 else None
        return self._groups[axis]

    def ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's line along `axis`, in axis order."""
        self._check_axis(axis)
        if axis in self._sub:
            return list(self._sub[axis][2])
        return list(range(self.world_size)) if axis == WORLD else list(self._axis_ranks[axis])

    def global_rank_of(self, axis: str, index: int) -> int:
        """Global rank of the peer at position `index` along `axis` (other coordinates as ours)."""
        return self.ranks(axis)[index]

    @property
    def is_rank0(self) -> bool:
        return self.global_rank == 0

    def shape_str(self) -> str:
        return " x ".join(f"{a}={self.sizes[a]}" for a in AXES)

    def __repr__(self) -> str:
        return (
            f"Mesh({self.shape_str()}, rank={self.global_rank}, coords={self.coords}, device={self.device})"
        )

    # --- lifetime ---------------------------------------------------------------------------

    def close(self, reason: str = "exited normally") -> None:
        """Stop the watchdog (telling the other ranks `reason`). Call before destroying the group."""
        if self.watchdog is not None:
            self.watchdog.stop(reason)
            self.watchdog = None

    def release_groups(self) -> None:
        """Forget this mesh's process groups (it cannot communicate afterwards). Call after
        `close` and before `dist.destroy_process_group()`: a group that a Python object still
        references outlives its destruction, with its gloo threads running into interpreter exit,
        where their C++ destructors may abort a finished rank ("terminate called without an
        active exception")."""
        self._groups = dict.fromkeys(self._groups)
        self._sub = {k: (*v[:3], None) for k, v in self._sub.items()}
        self._combined = {}
        self.device_mesh = None

    def __enter__(self) -> Mesh:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

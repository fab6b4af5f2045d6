"""The replica axis of DiLoCo: the same rank of every replica group, over a gloo group of its own.

Each replica group is a torch.distributed world of its own (started by
`plait.train.diloco_launch`), so a group that dies takes no other group down. The rank at
position r of each group joins one more gloo process group with the rank at position r of every
other group, rendezvousing through the launcher's store (on 127.0.0.1) under a prefix of its
own; that group is attached to the rank's mesh as the axis "replica" (`Mesh.attach_axis`), so
the outer exchange goes through plait.comm and the ledger counts it like any other axis.

* `FixedReplicas`: every group, for the whole run (diloco.fault_tolerant = false). A group
  that fails stops the job (the launcher stops the others and shows its traceback).
* `plait.train.diloco_quorum.QuorumReplicas`: the groups alive at each synchronisation.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from plait import comm
from plait.comm.ports import LOOPBACK

AXIS = "replica"
ENV_GROUP = "PLAIT_DILOCO_GROUP"  # this process's replica group, of ENV_GROUPS
ENV_GROUPS = "PLAIT_DILOCO_GROUPS"
ENV_STORE = "PLAIT_DILOCO_STORE"  # the launcher's store's port (127.0.0.1)
ENV_GENERATION = "PLAIT_DILOCO_GENERATION"  # how many times this group was started before


def replica_group() -> tuple[int, int] | None:
    """(this process's replica group, the number of groups) under the DiLoCo launcher, else None."""
    if ENV_GROUP not in os.environ:
        return None
    return int(os.environ[ENV_GROUP]), int(os.environ[ENV_GROUPS])


def rejoining_group(cfg) -> bool:
    """Whether this process belongs to a fault-tolerant DiLoCo group started again after it failed
    (it heals from a live group instead of resuming a checkpoint)."""
    return bool(cfg.diloco.fault_tolerant and replica_group() and int(os.environ.get(ENV_GENERATION, "0")))


def launcher_store(timeout_s: float):
    """The DiLoCo launcher's store, as a client."""
    return dist.TCPStore(
        LOOPBACK,
        int(os.environ[ENV_STORE]),
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
        use_libuv=True,
    )


def gloo_group(store, prefix: str, rank: int, size: int, timeout_s: float):
    """A gloo process group of `size` over `store` under `prefix` (sockets on 127.0.0.1)."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=LOOPBACK)]
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, opts)


class _Summed:
    """An outer exchange in flight; `wait()` gives the fp32 sum on the buffer's device."""

    def __init__(self, handle, wire: torch.Tensor, like: torch.Tensor):
        self.handle, self.wire, self.like = handle, wire, like

    def wait(self) -> torch.Tensor:
        self.handle.wait()
        return self.wire.to(self.like.device, torch.float32)


def on_the_wire(delta: torch.Tensor, wire_dtype: torch.dtype) -> torch.Tensor:
    """A copy of `delta` on the CPU in `wire_dtype`, which the exchange may overwrite."""
    wire = delta.detach().to("cpu", wire_dtype)
    return wire.clone() if wire.data_ptr() == delta.data_ptr() else wire


def start_sum(mesh, delta: torch.Tensor, wire_dtype: torch.dtype) -> _Summed:
    """The all-reduce (sum) of `delta` over the replica axis in `wire_dtype`, asynchronous. The
    wire is on the CPU (the replica axis is gloo: a slow link between islands), and the ledger
    records its bytes beside the fp32 bytes they stand for."""
    wire = on_the_wire(delta, wire_dtype)
    handle = comm.all_reduce(wire, mesh, AXIS, async_op=True, logical_bytes=delta.numel() * 4)
    return _Summed(handle, wire, delta)


def mean_over_replicas(mesh, value: float, contributors: int, step: int) -> float:
    """The mean of `value` over the replica axis (not part of the step's traffic in the ledger,
    as the loss report is not)."""
    mesh.ledger.set_step(-1)
    t = torch.tensor([float(value)], dtype=torch.float64)
    comm.all_reduce(t, mesh, AXIS)
    mesh.ledger.set_step(step)
    return float(t.item()) / max(1, contributors)


class FixedReplicas:
    """Every replica group, for the whole run."""

    rejoining = False

    def __init__(self, mesh, group: int, groups: int, timeout_s: float, last_step: int = 0):
        self.mesh, self.group, self.groups = mesh, group, groups
        self.store = launcher_store(timeout_s) if groups > 1 else None
        pg = None
        if groups > 1:
            pg = gloo_group(self.store, f"diloco/fixed/pos{mesh.global_rank}/", group, groups, timeout_s)
        mesh.attach_axis(AXIS, pg, group, groups)

    def all_reduce(self, delta: torch.Tensor, wire_dtype: torch.dtype, step: int, fragment: int):
        """(the exchange of `delta` in flight, how many groups it sums over)."""
        return start_sum(self.mesh, delta, wire_dtype), self.groups

    def outcome(self) -> dict:
        return {"groups": self.groups}

    def mean_loss(self, loss: float, step: int) -> float | None:
        return mean_over_replicas(self.mesh, loss, self.groups, step) if self.groups > 1 else None

    def heal_joiners(self, engine, run_state) -> None:
        pass  # a group that fails ends the job: nobody rejoins

    def close(self) -> None:
        pass

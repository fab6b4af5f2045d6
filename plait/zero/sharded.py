"""The optimizer side shared by every ZeRO stage: fp32 master shards, gradient shards, the step.

Each rank steps only its shard of each flat group (ZeRO's P_os, §5.1): the fp32 master shard,
the reduced gradient shard and the optimizer state of that shard. The wrapped torch optimizer
sees one tensor per parameter (its *segment* of the shard, see `plait.flat`), in the same
order on every rank, so any torch.optim optimizer works unchanged, parameter groups keep their
options, and LAMB/LARS get whole-layer norms with `plait.optim.allreduce_norms`.

Offload (ZeRO-Offload, Ren et al. 2021): with `offload="cpu"` the master shards, the optimizer
state and the step live on the host; on a GPU run the reduced gradient shard is copied to the
host before the step and the updated shard back after. `delayed_update=True` is the paper's
one-step delayed parameter update (DPU, §4.2): the step of iteration t runs in a background
thread while iteration t+1 computes on the parameters of t-1. `offload="disk"` (ZeRO-Infinity,
Rajbhandari et al. 2021) keeps the optimizer state in files and streams it per shard.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import torch

from plait import comm
from plait.combinations import refuse
from plait.engine import global_grad_norm
from plait.errors import ConfigError
from plait.flat import FlatLayout, storage_bytes
from plait.mesh import Mesh
from plait.placement import REPLICATED, gather_full, norm_parts, placement
from plait.zero.offload_disk import DiskStateOptimizer

OptimizerFactory = Callable[[list[dict]], torch.optim.Optimizer]
OFFLOADS = ("none", "cpu", "disk")


class ShardGroup:
    """One flat group's state on this rank: its layout, master shard and gradient shard, and the
    axis it is sharded over (under expert parallelism dense groups and experts' differ)."""

    def __init__(
        self,
        layout: FlatLayout,
        rank: int,
        master: torch.Tensor,
        grad_dtype: torch.dtype,
        grad: torch.Tensor | None = None,
        device: torch.device | None = None,
        axis: str | None = None,
    ):
        self.layout = layout
        self.rank = rank  # this rank's index along `axis`
        self.axis = axis  # the axis the group is sharded over (None: the optimizer's shard axis)
        self.master = master  # fp32, [shard_numel]; may be a view of the flat parameters themselves
        # the reduced gradient shard; ZeRO-1 passes a view of its full gradient buffer
        if grad is None:  # on the compute device: the reduce-scatter writes it there
            grad = torch.zeros(layout.shard_numel, dtype=grad_dtype, device=device or master.device)
        self.grad = grad
        self.segments = layout.segments(rank)
        self.seg_params = [master[s.shard_offset : s.shard_offset + s.length] for s in self.segments]


class ShardedOptimizer:
    """Steps this rank's shards of every group with the optimizer `factory` builds.

    Args:
        groups: the flat groups, in the same order on every rank.
        params: for each group, the original parameters in layout order (used to map the user's
            `param_groups` onto segments).
        factory: `factory(param_groups) -> torch.optim.Optimizer`.
        param_groups: torch-style groups of original parameters with per-group options; None
            for one group of everything.
        mesh, shard_axis: the axis the shards are split over (for the gradient norm), unless a
            group names its own (`ShardGroup.axis`); `axes` then lists every such axis.
        on_updated: called after every step with this object, to publish the new parameters.
        offload, offload_path, delayed_update: see the module docstring.
    """

    def __init__(
        self,
        groups: list[ShardGroup],
        params: list[list[torch.Tensor]],
        factory: OptimizerFactory,
        param_groups: list[dict] | None,
        mesh: Mesh,
        shard_axis: str,
        on_updated: Callable[[], None],
        offload: str = "none",
        offload_path: str | Path | None = None,
        delayed_update: bool = False,
        compute_device: torch.device | None = None,
        axes: tuple[str, ...] | None = None,
    ):
        if offload not in OFFLOADS:
            raise ConfigError(f"offload {offload!r} is not valid; valid: {', '.join(OFFLOADS)}")
        if delayed_update and offload == "none":
            raise refuse("delayed-no-offload")
        self.groups = groups
        self.mesh = mesh
        self.shard_axis = shard_axis
        # every axis a group may be sharded over, on any rank (a pipeline stage without experts
        # has no group over the experts' axis, but takes part in the norm's collectives)
        self.axes = tuple(axes or (shard_axis,))
        unknown = {self.axis_of(g) for g in groups} - set(self.axes)
        if unknown:
            raise ConfigError(f"flat groups sharded over {sorted(unknown)}, not among the axes {self.axes}")
        # each parameter's placement on the model axes (tensor parallelism): read by the norm,
        # full_parameters and checkpoints
        self.placements = [[placement(p) for p in ps] for ps in params]
        # the norm: more axes the model is split over besides the shard axis (a pipeline's pp),
        # and names of parameters another rank counts (a tied copy on a later pipeline stage)
        self.norm_axes: tuple[str, ...] = ()
        self.norm_skip: set[str] = set()
        self.on_updated = on_updated
        self.offload = offload
        self.delayed_update = delayed_update
        self.compute_device = compute_device or mesh.device
        where = {}
        for gi, ps in enumerate(params):
            for pi, p in enumerate(ps):
                where[id(p)] = (gi, pi)
        if param_groups is None:
            param_groups = [{"params": [p for ps in params for p in ps]}]
        torch_groups, seen = [], set()
        for g in param_groups:
            opts = {k: v for k, v in g.items() if k != "params"}
            segs = []
            for p in g["params"]:
                if id(p) not in where:
                    raise ConfigError("param_groups names a parameter that is not in the sharded model")
                seen.add(id(p))
                gi, pi = where[id(p)]
                segs.append(self.groups[gi].seg_params[pi])
            torch_groups.append({"params": segs, **opts})
        missing = [k for k in where if k not in seen]
        if missing:
            raise ConfigError(
                f"param_groups leaves out {len(missing)} trainable parameter(s); list each exactly once"
            )
        self.optimizer = factory(torch_groups)
        # An optimizer that exchanges its own state in place of reduced gradients (1-bit Adam,
        # plait.optim.onebit_adam) is given the flat layout of the shards it steps.
        if callable(bind := getattr(self.optimizer, "bind_shards", None)):
            bind(groups, shard_axis)
        self._stepper = self.optimizer
        if offload == "disk":
            if offload_path is None:
                raise ConfigError("offload = 'disk' needs an offload path ([offload] path)")
            self._stepper = DiskStateOptimizer(self.optimizer, offload_path, rank=mesh.global_rank)
        self._thread: threading.Thread | None = None
        self._thread_error: BaseException | None = None
        self._pending: tuple[list[torch.Tensor], list[float]] | None = None
        self._restore_lrs: list[float] | None = None

    # --- gradients --------------------------------------------------------------------------

    def _local_grads(self) -> list[torch.Tensor] | None:
        """The whole local gradient the optimizer holds in place of the reduced shards (1-bit
        Adam after its freeze: each rank measures and clips its own, as under DataParallel), or
        None."""
        local = getattr(self.optimizer, "local_grads", None)
        return local() if callable(local) else None

    def grad_norm(self) -> float:
        """The global 2-norm of the reduced gradient: every shard of every group, each segment
        also summed over the model axes its parameter is split on (its placement)."""
        if (local := self._local_grads()) is not None:  # this rank's own: nothing to sum
            return global_grad_norm(self.mesh, [(local, ())])
        by_axis: dict[str, tuple[list, list]] = {}  # shard axis -> (pairs, every placement)
        for g, placements in zip(self.groups, self.placements, strict=True):
            pairs, every = by_axis.setdefault(self.axis_of(g), ([], []))
            every.extend(placements)
            skip = self.norm_skip.intersection(g.layout.names)
            if not skip and not any(pl.sharded for pl in placements):  # the whole shard at once
                pairs.append((REPLICATED, g.grad))
                continue
            for seg in g.segments:
                if seg.length and seg.name not in skip:
                    part = g.grad[seg.shard_offset : seg.shard_offset + seg.length]
                    pairs.append((placements[seg.index], part))
        parts = []
        for axis in self.axes:  # the same parts, in the same order, on every rank
            pairs, every = by_axis.get(axis, ([], []))
            parts += norm_parts(pairs, self.mesh, (axis, *self.norm_axes), every)
        return global_grad_norm(self.mesh, parts)

    def axis_of(self, g: ShardGroup) -> str:
        """The axis group `g` is sharded over."""
        return g.axis or self.shard_axis

    def combined_axis(self, shard_axis: str, axis: str) -> str:
        """The combined axis of a shard axis and model axis `axis` (a tensor split both ways
        lives on it)."""
        if shard_axis == "dp_shard":
            name = f"dp_shard*{axis}"
        else:
            name = self.mesh.axis_over((shard_axis, axis))
        if name is None or not self.mesh.has_axis(name):
            raise ConfigError(f"the mesh has no combined axis over {shard_axis} and {axis}")
        return name

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale the gradient so its global norm is at most `max_norm` (as torch's
        clip_grad_norm_: factor min(1, max_norm / (norm + 1e-6))). Returns the norm before."""
        norm = self.grad_norm()
        if (local := self._local_grads()) is not None:  # this rank's own, by torch's arithmetic
            coef = torch.clamp(max_norm / (torch.tensor(norm) + 1e-6), max=1.0)  # as data parallel's
            for t in local:
                t.mul_(coef.to(t.device))
            return norm
        coef = min(1.0, max_norm / (norm + 1e-6))
        if coef < 1.0:
            for g in self.groups:
                g.grad.mul_(coef)
        return norm

    def zero_grad(self) -> None:
        if self.delayed_update:
            self._start_pending()
        for g in self.groups:
            g.grad.zero_()

    # --- the step ---------------------------------------------------------------------------

    def _host_grads(self) -> list[torch.Tensor]:
        """The gradient shard of each group as fp32 on the master's device (a copy when the
        dtype or device differs, else the shard itself)."""
        out = []
        for g in self.groups:
            if g.grad.dtype == torch.float32 and g.grad.device == g.master.device and not self.delayed_update:
                out.append(g.grad)
            else:
                out.append(g.grad.to(device=g.master.device, dtype=torch.float32, copy=True))
        return out

    def _step_with(self, grads: list[torch.Tensor]) -> None:
        for g, flat_grad in zip(self.groups, grads, strict=True):
            for seg, p in zip(g.segments, g.seg_params, strict=True):
                p.grad = flat_grad[seg.shard_offset : seg.shard_offset + seg.length]
        self._stepper.step()
        for g in self.groups:
            for p in g.seg_params:
                p.grad = None

    def step(self) -> None:
        """One optimizer step on this rank's shards, then publish the new parameters."""
        if not self.delayed_update:
            self._step_with(self._host_grads())
            self.on_updated()
            return
        # Delayed update: finish the step started last iteration, publish it, and queue this
        # iteration's gradients; their step starts in the background at zero_grad().
        self._complete_delayed()
        self._pending = (self._host_grads(), [g["lr"] for g in self.optimizer.param_groups])

    def _start_pending(self) -> None:
        if self._pending is None:
            return
        grads, lrs = self._pending
        self._pending = None
        self._restore_lrs = [g["lr"] for g in self.optimizer.param_groups]

        def work():
            try:
                for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
                    group["lr"] = lr
                self._step_with(grads)
            except BaseException as exc:  # re-raised in the training thread at the next step
                self._thread_error = exc

        self._thread = threading.Thread(target=work, name="plait-delayed-step", daemon=True)
        self._thread.start()

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._thread_error is not None:
            exc, self._thread_error = self._thread_error, None
            raise exc

    def finish(self) -> None:
        """Complete and publish an outstanding delayed step (call before evaluating or saving)."""
        if self.delayed_update and (self._pending is not None or self._thread is not None):
            self._complete_delayed()

    def _complete_delayed(self) -> None:
        """Run (if queued) and join the delayed step, give the schedule back its learning rates
        (the thread stepped with the ones of its own iteration), and publish the parameters."""
        self._start_pending()
        self._join()
        if self._restore_lrs is not None:
            for group, lr in zip(self.optimizer.param_groups, self._restore_lrs, strict=True):
                group["lr"] = lr
            self._restore_lrs = None
        self.on_updated()

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter, whole, from the fp32 master shards (an all-gather per group, then
        over the model axis of each tensor-parallel or expert shard; every rank of those axes
        must call it). Keyed by the names given to the layouts."""
        out = {}
        for g, placements in zip(self.groups, self.placements, strict=True):
            full = torch.empty(g.layout.padded, dtype=torch.float32, device=self.compute_device)
            comm.all_gather(full, g.master.to(self.compute_device), self.mesh, self.axis_of(g))
            for name, v, pl in zip(g.layout.names, g.layout.views(full), placements, strict=True):
                out[name] = gather_full(v, self.mesh, pl=pl)
        return out

    # --- accounting -------------------------------------------------------------------------

    def state_tensors(self) -> list[torch.Tensor]:
        return [t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]

    def optimizer_bytes(self, master_is_separate: bool) -> int:
        """Optimizer-state bytes held in memory, plus the fp32 master shards when they are a
        separate copy (ZeRO's K counts the master copy as optimizer state)."""
        if self.offload == "disk":
            total = self._stepper.resident_state_bytes()
        else:
            total = storage_bytes(self.state_tensors())
        if master_is_separate:
            total += storage_bytes([g.master for g in self.groups])
        return total

    def close(self) -> None:
        self._join()
        if self._stepper is not self.optimizer:
            self._stepper.close()

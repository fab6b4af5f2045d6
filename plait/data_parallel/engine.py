"""Plain data parallelism behind the engine contract (plait.engine): `DataParallel`'s bucketed
all-reduce and an unsharded optimizer. ZeRO stage 0 is this engine.

Two ways to start the gradient exchange (`trigger`): "hook", per-parameter hooks as backward
produces each gradient (one model per rank, `forward_backward` accumulating micro-batches inside
`no_sync()`); or "manual", where the owner hands over the gradients that are complete
(`grads_ready`) and waits for the rest (`finish_grads`): a pipeline, whose schedule knows when a
stage's last backward has run.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from plait.data_parallel.ddp import DataParallel
from plait.engine import AccumulatingEngine, global_grad_norm
from plait.flat import storage_bytes
from plait.mesh import Mesh
from plait.placement import gather_full, norm_parts, placement
from plait.state import plain_state


class DataParallelEngine(AccumulatingEngine):
    """Data parallelism over `axes` and an optimizer over the whole `module` on every rank.

    Args:
        module: the model (or a pipeline rank's part of it), on the mesh's device.
        factory: ``factory(param_groups) -> torch.optim.Optimizer``.
        param_groups: torch-style groups of `module`'s parameters, or None (one group).
        names: parameter id -> the name checkpoints use (a part's parameters under the whole
            model's names); default the module's own.
        norm_axes: more axes the gradient norm sums over (a pipeline's pp: each rank holds other
            parameters); `norm_skip` holds ids of parameters another rank counts (tied copies).
        trigger: "hook" or "manual" (see the module doc); under "manual" with nothing to
            exchange (one rank on every data axis, no gradient partial over another axis) no
            DataParallel is built and the gradients stay where backward put them.
        ddp: the rest of `DataParallel`'s arguments (bucket_mb, allow_unused, comm_hook, axes).
    """

    def __init__(
        self,
        module: nn.Module,
        mesh: Mesh,
        factory,
        param_groups=None,
        *,
        names: dict[int, str] | None = None,
        norm_axes: tuple[str, ...] = (),
        trigger: str = "hook",
        **ddp,
    ):
        self.raw = module
        self.mesh = mesh
        self.names = names
        self.norm_axes = norm_axes
        self.norm_skip: set[str] = set()
        self.ddp: DataParallel | None = None
        axes = ddp.get("axes") or ("dp",)
        partial = any(mesh.size(a) > 1 for q in module.parameters() for a in placement(q).grad_partial)
        if trigger == "hook" or partial or any(mesh.size(a) > 1 for a in axes):
            self.ddp = DataParallel(module, mesh, trigger=trigger, **ddp)
        self.module = self.ddp if trigger == "hook" else module
        self.optimizer = factory(param_groups if param_groups is not None else list(module.parameters()))

    # --- the gradient exchange ------------------------------------------------------------------

    def grads_ready(self, params) -> None:
        """Manual trigger: these parameters' gradients are complete (their buckets may start)."""
        if self.ddp is not None:
            self.ddp.grads_ready(params)

    def finish_grads(self) -> None:
        """Manual trigger: wait for every bucket of the step (the rest are reduced now)."""
        if self.ddp is not None:
            self.ddp.finish_grads()

    overlaps_backward = True  # reduces while backward (or a pipeline's schedule) goes on

    def gather_params(self) -> bool:
        return False  # the parameters are always whole

    def release_params(self) -> None:
        pass

    @property
    def comm_hook(self):
        return self.ddp.comm_hook if self.ddp is not None else None

    def set_lr_scale(self, scale: float) -> None:
        if self.ddp is not None:
            self.ddp.set_lr_scale(scale)

    def residual_buffers(self) -> dict[str, torch.Tensor] | None:
        return self.ddp.residual_buffers() if self.ddp is not None else None

    def no_sync(self):
        return self.ddp.no_sync() if self.ddp is not None else contextlib.nullcontext()

    # --- the step -------------------------------------------------------------------------------

    def skip_in_norm(self, names) -> None:
        """Leave these parameters out of the gradient norm (another rank counts them: a pipeline's
        tied copies)."""
        self.norm_skip.update(names)

    def grad_norm(self) -> float:
        """The global gradient norm: shards (by their placements) summed over their axes and
        `norm_axes`, replicas counted once. (Gradients partial over tp were summed by
        DataParallel's synchroniser, by their placements.)"""
        names = self.names or {}
        pairs = [
            (placement(p), p.grad)
            for n, p in self.raw.named_parameters()
            if p.grad is not None and names.get(id(p), n) not in self.norm_skip
        ]
        every = [placement(p) for p in self.raw.parameters()]
        return global_grad_norm(self.mesh, norm_parts(pairs, self.mesh, self.norm_axes, every))

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale the gradients so their global norm is at most `max_norm` (torch's rule)."""
        norm = self.grad_norm()
        params = [p for p in self.raw.parameters() if p.grad is not None]
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, torch.tensor(norm), foreach=True)
        return norm

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def memory(self) -> dict:
        """Model-state bytes: a gradient per parameter counts as allocated (the bucket buffers, or
        under the manual trigger the gradients the step holds until zero_grad)."""
        params = storage_bytes(list(self.raw.parameters()))
        if self.module is self.ddp:
            grads = storage_bytes([b.buffer for b in self.ddp.buckets])
        else:
            grads = sum(q.numel() * q.element_size() for q in self.raw.parameters() if q.requires_grad)
        state = [t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        optim = storage_bytes(state)
        return {"params": params, "grads": grads, "optimizer": optim, "total": params + grads + optim}

    def finish(self) -> None:
        pass

    def checkpoint_state(self) -> tuple[dict, dict]:
        return plain_state(self.raw, self.optimizer, self.names, mesh=self.mesh)

    def checkpoint_loaded(self) -> None:
        pass  # loaded in place into the parameters and optimizer state

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter, whole (tensor- and expert-parallel shards gathered by their placements)."""
        names = self.names or {}
        return {names.get(id(p), n): gather_full(p, self.mesh) for n, p in self.raw.named_parameters()}

    def close(self) -> None:
        if self.ddp is not None:
            self.ddp.remove_hooks()

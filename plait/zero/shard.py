"""ZeRO stage 3 / FSDP (Rajbhandari et al. 2019 §5.3; Zhao et al. 2023): parameters sharded too.

The model is cut into *units* by a wrapping policy (default: each transformer block, and the
root holding the rest: embeddings, final norm, head). A unit's parameters are one flat buffer,
right-padded to a multiple of the shard count N; each rank keeps only its 1/N shard (fp32, the
master copy) between uses. Around each use of a unit:

* forward pre-hook: all-gather the unit's flat parameters (in the compute dtype) into its leaf
  buffer and point the module's parameters at views of it (one `split`, so autograd sends the
  whole unit's gradient to the leaf at once); then start the all-gather of the next unit in
  forward order (prefetch, so communication overlaps this unit's compute);
* forward post-hook: free the gathered buffer (the views saved for backward keep the tensor
  objects, not the memory), and hook the unit's outputs so that when their gradient arrives
  the buffer is gathered again (and the previous unit's gather is prefetched);
* when the leaf's gradient is complete (post-accumulate hook): reduce-scatter it, divided by
  the data-parallel degree, into this rank's gradient shard, and free the buffer and gradient.

Per step: all-gather Ψ (forward) + all-gather Ψ (backward) + reduce-scatter Ψ = 3Ψ.
Hybrid sharding shards within `dp_shard` and all-reduces the gradient shards across
`dp_replicate`. Under tensor parallelism the parts of a shard whose parameters' gradients are
partial over tp (placements: sequence-parallel LayerNorms) are summed over tp, one all-reduce per
unit. The reduce-scatters and those sums are plait's one gradient synchroniser
(`plait.gradsync.GradSync`, one bucket per unit, launched as autograd completes each unit). The
optimizer side (master shards, step, offload) is `ShardedOptimizer`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook

from plait import comm
from plait.combinations import refuse
from plait.errors import ConfigError
from plait.flat import alloc_storage, free_storage, storage_bytes
from plait.gradsync import GradBucket, GradSync
from plait.mesh import Mesh
from plait.optim.onebit_adam import MomentumHook
from plait.zero.engine import ShardedEngine
from plait.zero.sharded import OptimizerFactory, ShardedOptimizer, ShardGroup

WrapPolicy = Callable[[str, nn.Module], bool]


def default_wrap_policy(model: nn.Module) -> WrapPolicy:
    """Each block the model declares (`plait.engine.model_blocks`: its `plait_blocks()`, torch's
    Transformer*Layer) is a unit."""
    from plait.engine import model_blocks

    ids = {id(b) for b in model_blocks(model)}
    return lambda name, module: id(module) in ids


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class _Unit:
    """One wrapping unit: its flat parameter, shard and hooks."""

    def __init__(
        self, engine: ZeroStage3, index: int, name: str, module: nn.Module, owned: list[tuple], axis: str
    ):
        self.engine = engine
        self.name = name or "<root>"
        self.module = module
        self.axis = axis  # the axis the unit is sharded over (experts': their replica group)
        # owned: (param, fqn, [(owner module, attribute), ...]) for each distinct parameter
        self.params = [p for p, _, _ in owned]
        self.slots = [slots for _, _, slots in owned]
        names = [fqn for _, fqn, _ in owned]
        dev = engine.mesh.device
        # the unit's gradient, reduced by the engine's GradSync (partial runs by placements)
        n, rank = engine.mesh.size(axis), engine.mesh.rank(axis)
        self.bucket = GradBucket(
            index, self.params, names, n, dtype=engine.compute_dtype, device=dev, axis=axis
        )
        self.layout = self.bucket.layout
        full = self.layout.flatten(self.params, dtype=torch.float32, device=dev)
        # every replica starts from rank 0's values
        comm.broadcast(full, engine.mesh, engine.replicas_of(axis), src=0)
        lo, hi = self.layout.shard_range(rank)
        master = full[lo:hi].to(device=engine.host, copy=True)
        self.group = ShardGroup(self.layout, rank, master, engine.compute_dtype, device=dev, axis=axis)
        # the compute-dtype shard that is gathered (the master itself in fp32 on the device)
        self.shard = master if not engine.master_is_separate else full[lo:hi].to(engine.compute_dtype)
        del full
        self.flat = nn.Parameter(torch.empty(self.layout.padded, dtype=engine.compute_dtype, device=dev))
        placeholders = self.layout.views(self.flat.data)  # taken while the storage exists
        free_storage(self.flat)
        self.gathered = False
        self.handle = None  # an all-gather in flight (prefetch)
        # the module's parameters become views of the (freed) buffer: usable inside the unit's
        # forward, which gathers first
        for v, slots in zip(placeholders, self.slots, strict=True):
            for owner, attr in slots:
                del owner._parameters[attr]
                setattr(owner, attr, v)
        self.hooks = [self.flat.register_post_accumulate_grad_hook(self._on_grad)]

    # --- parameters -------------------------------------------------------------------------

    def start_gather(self) -> None:
        """Launch the all-gather of this unit's parameters (no-op if gathered or in flight)."""
        if self.gathered or self.handle is not None:
            return
        alloc_storage(self.flat)
        self.handle = comm.all_gather(self.flat.data, self.shard, self.engine.mesh, self.axis, True)

    def gather(self) -> None:
        self.start_gather()
        if self.handle is not None:
            self.handle.wait()
            self.handle = None
        self.gathered = True

    def bind(self) -> None:
        """Point the module's parameters at views of the gathered buffer (recorded by autograd)."""
        views = self.layout.split(self.flat) if torch.is_grad_enabled() else self.layout.views(self.flat.data)
        for v, slots in zip(views, self.slots, strict=True):
            for owner, attr in slots:
                setattr(owner, attr, v)

    def free(self) -> None:
        if self.gathered and self.engine.reshard:
            free_storage(self.flat.data)
            self.gathered = False

    # --- hooks ------------------------------------------------------------------------------

    def pre_forward(self, module, args):
        self.engine.record_order(self)
        self.gather()
        self.bind()
        if not _in_backward():
            self.engine.prefetch_after(self)

    def post_forward(self, module, args, output):
        if _in_backward():  # recomputation (activation checkpointing): backward still needs them
            return output
        self.free()
        if torch.is_grad_enabled():
            tensors = [t for t in _tensors(output) if t.requires_grad]
            if tensors:
                register_multi_grad_hook(tensors, self._pre_backward, mode="any")
        return output

    def _pre_backward(self, grad) -> None:
        self.engine.queue_finish()
        self.gather()
        self.engine.prefetch_before(self)

    def _on_grad(self, flat: torch.Tensor) -> None:
        g = flat.grad
        flat.grad = None
        self.engine.sync.bucket_ready(self.bucket, g)  # its reduce-scatter starts
        self.free()

    def deliver(self, shard: torch.Tensor) -> None:
        """The unit's reduced gradient shard: added to the shard the optimizer steps."""
        self.group.grad.add_(shard)
        self.bucket.release()


def _tensors(obj):
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, list | tuple):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


class ZeroStage3(ShardedEngine):
    """ZeRO-3 / FSDP over any nn.Module (use `plait.zero.wrap`).

    Args:
        module: the model (on the mesh's device, fp32); its parameters are replaced in place.
        wrap_policy: `policy(name, submodule) -> bool` chooses the units; the root is always one.
        reshard_after_forward: free gathered parameters after each unit's forward (True: ZeRO-3's
            3Ψ traffic and lowest memory; False keeps them until backward, 2Ψ, like ZeRO-2).
        comm_hook: a compressor of `plait.comm.compress` in place of each unit's reduce-scatter
            (fp32 gradients; not with tensor parallelism: a unit mixes placements).
        Other arguments as `ZeroOptimizer`.
    """

    def __init__(
        self,
        module: nn.Module,
        mesh: Mesh,
        factory: OptimizerFactory,
        param_groups: list[dict] | None = None,
        shard_axis: str = "dp",
        replicate_axis: str | None = None,
        compute_dtype: torch.dtype = torch.float32,
        wrap_policy: WrapPolicy | None = None,
        reshard_after_forward: bool = True,
        offload: str = "none",
        offload_path=None,
        delayed_update: bool = False,
        comm_hook=None,
        data_axes: tuple[str, ...] = ("dp",),
    ):
        self._init_layout(
            module, mesh, shard_axis, replicate_axis, compute_dtype, offload, delayed_update, data_axes
        )
        self._check_hook(comm_hook, compute_dtype, stage=3)
        if isinstance(comm_hook, MomentumHook):
            raise refuse("1-bit-adam-zero3")
        if comm_hook is not None and mesh.size("tp") > 1:
            raise refuse("zero3-compression-tp", compression=type(comm_hook).__name__, tp=mesh.size("tp"))
        self.comm_hook = comm_hook
        self.reshard = reshard_after_forward
        for buf in module.buffers():
            comm.broadcast(buf, mesh, self.replicas_of(self.axis_of(buf)), src=0)
        policy = wrap_policy or default_wrap_policy(module)
        self.units = self._build_units(policy)
        self._order: list[_Unit] = []
        self._order_done = False
        self._queued = False
        self.shards = ShardedOptimizer(
            [u.group for u in self.units],
            [u.params for u in self.units],
            factory,
            param_groups,
            mesh,
            shard_axis,
            self._publish,
            offload=offload,
            offload_path=offload_path,
            delayed_update=delayed_update,
            axes=self.group_axes(),
        )
        self.optimizer = self.shards.optimizer
        self.sync = GradSync(
            [u.bucket for u in self.units],
            mesh,
            shard_axis,
            reduce="reduce_scatter",
            comm_hook=comm_hook,
            scale=self.scale,
            trigger="manual",  # each unit's hook hands its flat gradient over
            ordered=False,  # autograd completes units in one order on every rank
            replicate_axis=replicate_axis,
            missing="skip",  # a unit no gradient reached this backward
            deliver=lambda b, shard: self.units[b.index].deliver(shard),
        )
        for u in self.units:  # the original parameters' memory now lives in the shards
            for p in u.params:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def _build_units(self, policy: WrapPolicy) -> list[_Unit]:
        roots = [(name, m) for name, m in self.module.named_modules() if name and policy(name, m)]
        nested = [n for n, _ in roots for o, _ in roots if o != n and n.startswith(o + ".")]
        if nested:
            raise ConfigError(f"wrap policy chose nested units ({nested[0]}); choose non-overlapping modules")
        unit_of: dict[int, str] = {}  # parameter id -> unit name
        slots: dict[int, list] = {}
        fqns: dict[int, str] = {}
        order: list[nn.Parameter] = []
        for mname, m in self.module.named_modules():
            unit = next((n for n, _ in roots if mname == n or mname.startswith(n + ".")), "")
            for attr, p in list(m._parameters.items()):
                if p is None or not p.requires_grad:
                    continue
                if id(p) in unit_of and unit_of[id(p)] != unit:
                    raise ConfigError(
                        f"parameter {fqns[id(p)]} is shared by units {unit_of[id(p)] or '<root>'} and "
                        f"{unit or '<root>'}: put the modules sharing it in one unit"
                    )
                if id(p) not in unit_of:
                    unit_of[id(p)] = unit
                    fqns[id(p)] = f"{mname}.{attr}" if mname else attr
                    order.append(p)
                    slots[id(p)] = []
                slots[id(p)].append((m, attr))
        units = []
        modules = dict(roots)
        for uname in [""] + [n for n, _ in roots]:
            owned = [(p, fqns[id(p)], slots[id(p)]) for p in order if unit_of[id(p)] == uname]
            module = self.module if uname == "" else modules[uname]
            # one unit per shard axis: under expert parallelism a block's experts are sharded
            # over their replica group (dp) and its dense parameters over dp x ep; both are
            # gathered around the block's forward and backward by hooks of their own
            axes = list(dict.fromkeys(self.axis_of(p) for p, _, _ in owned))
            for axis in axes:
                mine = [o for o in owned if self.axis_of(o[0]) == axis]
                name = uname if len(axes) == 1 else f"{uname or '<root>'}[{axis}]"
                u = _Unit(self, len(units), name, module, mine, axis)
                u.hooks += [
                    module.register_forward_pre_hook(u.pre_forward),
                    module.register_forward_hook(u.post_forward),
                ]
                units.append(u)
        if not units:
            raise ConfigError("the module has no trainable parameters to shard")
        return units

    # --- ordering and prefetch --------------------------------------------------------------

    def record_order(self, unit: _Unit) -> None:
        if not self._order_done and not _in_backward() and torch.is_grad_enabled():
            if unit in self._order:
                self._order_done = True
            else:
                self._order.append(unit)

    def _neighbour(self, unit: _Unit, step: int) -> _Unit | None:
        if not self._order_done or unit not in self._order:
            return None
        i = self._order.index(unit) + step
        return self._order[i] if 0 <= i < len(self._order) else None

    def prefetch_after(self, unit: _Unit) -> None:
        nxt = self._neighbour(unit, +1)
        if nxt is not None and torch.is_grad_enabled():
            nxt.start_gather()

    def prefetch_before(self, unit: _Unit) -> None:
        prev = self._neighbour(unit, -1)
        if prev is not None:
            prev.start_gather()

    def queue_finish(self) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _finish_backward(self) -> None:
        self._queued = False
        self._order_done = self._order_done or bool(self._order)
        self.sync.finish()
        for u in self.units:
            u.free()

    # --- step -------------------------------------------------------------------------------

    @torch.no_grad()
    def _publish(self) -> None:
        """After the step: refresh the compute-dtype shards from the masters (no communication;
        the next forward gathers)."""
        for u in self.units:
            if self.master_is_separate:
                u.shard.copy_(u.group.master)

    def close(self) -> None:
        """Stop the optimizer side and remove the hooks: they and autograd's C++ references to
        the flat parameters form a cycle that Python's collector cannot see, which would keep
        the engine, the model and the mesh's process groups alive until the process exits."""
        super().close()
        for u in self.units:
            for h in u.hooks:
                h.remove()
            u.hooks = []

    def memory(self) -> dict:
        """Model-state bytes held by this rank, counted from tensor storage."""
        params = storage_bytes([u.shard for u in self.units] + [u.flat for u in self.units])
        grads = storage_bytes([u.group.grad for u in self.units])
        optim = self.shards.optimizer_bytes(self.master_is_separate)
        return {"params": params, "grads": grads, "optimizer": optim, "total": params + grads + optim}

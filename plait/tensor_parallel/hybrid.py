"""Krizhevsky's hybrid: convolutions data-parallel, fully connected layers model-parallel.

A. Krizhevsky, "One weird trick for parallelizing convolutional neural networks" (2014,
arXiv:1404.5997). Convolutional layers hold ~90-95% of a CNN's computation and ~5% of its
parameters; fully connected layers the opposite. So the K workers run the convolutional layers
data-parallel (each on its own b = B/K examples, weight gradients averaged over workers) and the
fully connected layers model-parallel (each worker owns 1/K of every FC layer's output neurons
and computes them for all B examples), and only activations cross between the two regions.

§4 lists three ways to move the last convolutional activations into the FC region:
(a) every worker sends all its b activations to every other worker, and the FC layers run once on
the big batch of B examples; (b) one worker at a time broadcasts its b examples and the FC layers
run on those while the next worker's are in flight; (c) every worker sends b/K of its examples to
all others, K times, so each round is a batch of b examples drawn evenly from all workers and every
link carries the same load. plait implements (c) (the default) and (a); (b) needs a rooted reduce
that plait.comm does not have. In round r each worker all-gathers the r-th 1/K of its examples
(all-gather along the batch, dim 0); backward reduce-scatters the gradients w.r.t. those
activations, which sums each worker's partial gradient and hands every example's sum back to the
worker that owns it. All rounds' gathers are issued at once and waited one by one, so the
transfer of round r+1 overlaps the FC computation of round r. The paper also lets the FC layers
update after each round (batch b) rather than once per step (batch B); plait updates once per step,
which is what makes the hybrid train exactly like one process.

Inside the FC region each layer is split by output neurons, and the next layer needs the whole
previous layer's output, as in the paper: the sharded activations are all-gathered along the
feature dim (dim 1) and the backward reduce-scatters along it (each worker's weight slice
contributes a partial gradient for every input neuron). A last layer (the logits) whose width is
not a multiple of K is padded with zero columns, as a vocabulary is in Megatron-LM; hidden widths
must divide (a ConfigError names the layer). The logits leave the FC region with one all-to-all:
each worker sends every other worker its neuron slice of that worker's examples, so the hybrid
returns full logits for the caller's own b examples and the loss is ordinary data-parallel code.

Gradient scaling follows DataParallel: each worker's loss is its own mean, the objective their
average. The conv gradients are averaged by DataParallel's all-reduce. The FC region receives, via
the all-to-all's backward, the gradients of all K local losses, so its weight gradients are the
sum over workers; a hook divides them by K, the same average, with no weight traffic at all.

Per step, per worker, with B global batch, s bytes per element, d the FC input width, n_i the
hidden widths, C' the padded class count and L the number of Linear layers (payload bytes, as the
ledger records them; bus bytes are (K-1)/K of those, 2(K-1)/K for the all-reduce):

    all_gather      B (d + sum n_i) s    in R·L calls (R = K rounds for (c), 1 for (a))
    reduce_scatter  B (d + sum n_i) s    in R·L calls
    all_to_all      2 B (C'/K) s         in 2 calls (forward and backward)
    all_reduce      Psi_conv s           one per DataParallel bucket
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from plait import comm
from plait.comm.autograd import all_to_all_along, gather_from_sequence
from plait.data_parallel.ddp import DataParallel
from plait.errors import ConfigError
from plait.mesh import Mesh

SCHEMES = ("a", "c")
# Per-element layers: they act on a slice of neurons exactly as on the whole layer.
ELEMENTWISE = (nn.ReLU, nn.GELU, nn.Tanh, nn.SiLU, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.Identity)


# --- differentiable exchanges (every collective through plait.comm) ---------------------------


class _GatherRows(torch.autograd.Function):
    """All-gather along dim 0 forward, reduce-scatter along dim 0 backward, as
    `plait.comm.autograd.gather_from_sequence`, but left in flight: the handle is appended to
    `pending` and the caller waits on it before reading the output, so that the scheme-(c)
    rounds can all be issued before the first one is computed."""

    @staticmethod
    def forward(ctx, x, mesh, axis, pending):
        ctx.mesh, ctx.axis = mesh, axis
        x = x.contiguous()
        out = x.new_empty((mesh.size(axis) * x.shape[0], *x.shape[1:]))
        handle = comm.all_gather(out, x, mesh, axis, async_op=True)
        pending.append((handle, x))  # keeps the input alive until the gather completes
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = grad.new_empty((grad.shape[0] // ctx.mesh.size(ctx.axis), *grad.shape[1:]))
        comm.reduce_scatter(out, grad, ctx.mesh, ctx.axis)
        return out, None, None, None


# --- the plan: which layers split how, checked without a process group ------------------------


@dataclasses.dataclass
class KrizhevskyPlan:
    """How a model's classifier is split over `n_workers`."""

    n_workers: int
    feature_dim: int
    """d: input width of the first Linear, i.e. the activations crossing into the FC region."""
    widths: list[int]
    """Output widths of the Linear layers, in order; all but the last divide n_workers."""
    linear_index: list[int]
    """Index in `classifier` of each Linear."""
    conv_params: int
    """Parameters of `features` (the data-parallel region)."""

    @property
    def padded_classes(self) -> int:
        """The last width rounded up to a multiple of n_workers."""
        return math.ceil(self.widths[-1] / self.n_workers) * self.n_workers


def _describe(name: str, layer: nn.Module) -> str:
    if isinstance(layer, nn.Linear):
        return f"{name} (Linear {layer.in_features}->{layer.out_features})"
    return f"{name} ({type(layer).__name__})"


def check_krizhevsky(model: nn.Module, n_workers: int, axis: str = "dp") -> KrizhevskyPlan:
    """Validate `model` for the hybrid over `n_workers` and return the plan; needs no processes.

    The model must have `features` (any module, run data-parallel) and `classifier` (an
    nn.Sequential of Linear layers and elementwise activations, optionally led by Flatten), and
    its forward must be `classifier(features(x))`. Hidden Linear widths must be multiples of
    `n_workers`; the last one is padded.
    """
    if isinstance(n_workers, bool) or not isinstance(n_workers, int) or n_workers < 1:
        raise ConfigError(f"n_workers must be a positive integer, got {n_workers!r}")
    features = getattr(model, "features", None)
    classifier = getattr(model, "classifier", None)
    if not isinstance(features, nn.Module) or not isinstance(classifier, nn.Sequential):
        raise ConfigError(
            f"{type(model).__name__} needs a `features` module and a `classifier` nn.Sequential "
            "(forward = classifier(features(x))) for the Krizhevsky hybrid"
        )
    linears = [(i, m) for i, m in enumerate(classifier) if isinstance(m, nn.Linear)]
    if not linears:
        raise ConfigError("classifier has no nn.Linear layer to split")
    for i, layer in enumerate(classifier):
        ok = isinstance(layer, (nn.Linear, *ELEMENTWISE)) or (
            isinstance(layer, nn.Flatten) and i < linears[0][0]
        )
        if not ok:
            kinds = ", ".join(t.__name__ for t in ELEMENTWISE)
            raise ConfigError(
                f"{_describe(f'classifier.{i}', layer)} cannot be split: the hybrid's classifier may hold "
                f"Linear layers, elementwise activations ({kinds}) and a leading Flatten"
            )
    for i, lin in linears[:-1]:
        w = lin.out_features
        if w % n_workers:
            lower, upper = (w // n_workers) * n_workers, (w // n_workers + 1) * n_workers
            hint = f"{lower} or {upper}" if lower else f"{upper}"
            raise ConfigError(
                f"{_describe(f'classifier.{i}', lin)}: {w} output neurons cannot be split evenly over "
                f"the {n_workers} workers of axis '{axis}'; make the width a multiple of {n_workers} "
                f"(e.g. {hint})"
            )
    return KrizhevskyPlan(
        n_workers=n_workers,
        feature_dim=linears[0][1].in_features,
        widths=[lin.out_features for _, lin in linears],
        linear_index=[i for i, _ in linears],
        conv_params=sum(p.numel() for p in features.parameters() if p.requires_grad),
    )


def round_sizes(local_batch: int, n_workers: int, scheme: str) -> list[int]:
    """Rows each worker contributes per round: scheme (c) K near-equal rounds, (a) one round."""
    if scheme == "a" or n_workers == 1:
        return [local_batch]
    rounds = min(n_workers, local_batch)
    q, rem = divmod(local_batch, rounds)
    return [q + 1] * rem + [q] * (rounds - rem)


def krizhevsky_comm(
    plan: KrizhevskyPlan, global_batch: int, scheme: str = "c", elem_bytes: int = 4, conv_buckets: int = 1
) -> dict[str, tuple[int, int]]:
    """The formula: {op: (calls, payload bytes)} per training step per worker, as the ledger counts.

    `conv_buckets`: DataParallel buckets of the conv gradients (one all-reduce each)."""
    k = plan.n_workers
    if global_batch % k:
        raise ConfigError(f"global batch {global_batch} does not split over {k} workers")
    if k == 1:
        return {op: (0, 0) for op in ("all_gather", "reduce_scatter", "all_to_all", "all_reduce")}
    rounds = len(round_sizes(global_batch // k, k, scheme))
    n_lin = len(plan.widths)
    gathered = global_batch * (plan.feature_dim + sum(plan.widths[:-1])) * elem_bytes
    return {
        "all_gather": (rounds * n_lin, gathered),
        "reduce_scatter": (rounds * n_lin, gathered),
        "all_to_all": (2, 2 * global_batch * (plan.padded_classes // k) * elem_bytes),
        "all_reduce": (conv_buckets if plan.conv_params else 0, plan.conv_params * elem_bytes),
    }


# --- the hybrid module --------------------------------------------------------------------------


class ShardedLinear(nn.Module):
    """Output neurons [start, stop) of a Linear, zero-padded to `width` outputs.

    Its gradients arrive summed over the workers' losses (see the module docstring); a hook
    divides them by `n_workers`, the average DataParallel takes for the conv weights."""

    def __init__(self, linear: nn.Linear, start: int, stop: int, width: int, n_workers: int):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.start, self.stop, self.width = start, stop, width
        self.weight = nn.Parameter(linear.weight.detach()[start:stop].clone())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach()[start:stop].clone())
        scale = 1.0 / n_workers
        for p in self.parameters():
            p.register_hook(lambda g: g * scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        pad = self.width - (self.stop - self.start)
        return F.pad(y, (0, pad)) if pad else y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, neurons [{self.start}, {self.stop}) of {self.out_features}"


class KrizhevskyHybrid(nn.Module):
    """`model` split as in Krizhevsky (2014): see the module docstring. Build with apply_krizhevsky.

    `forward(x)` takes this worker's b examples (every worker the same b) and returns their full
    logits (b, n_classes); compute the loss on them as with DataParallel (a mean over own examples).
    """

    def __init__(
        self, model: nn.Module, mesh: Mesh, axis: str = "dp", scheme: str = "c", bucket_mb: float = 25.0
    ):
        super().__init__()
        if scheme not in SCHEMES:
            raise ConfigError(
                f"unknown exchange scheme {scheme!r}; valid: {', '.join(SCHEMES)} (Krizhevsky §4)"
            )
        k, me = mesh.size(axis), mesh.rank(axis)
        self.plan = check_krizhevsky(model, k, axis)
        self.mesh, self.axis, self.scheme = mesh, axis, scheme
        self.features = DataParallel(model.features, mesh, axis, bucket_mb=bucket_mb)
        self._broadcast(model.classifier)
        first = self.plan.linear_index[0]
        self.pre = nn.Sequential(*list(model.classifier)[:first])
        ends = self.plan.linear_index[1:] + [len(model.classifier)]
        self.stages = nn.ModuleList()
        for i, end in zip(self.plan.linear_index, ends):
            lin = model.classifier[i]
            width = math.ceil(lin.out_features / k)
            start, stop = min(me * width, lin.out_features), min((me + 1) * width, lin.out_features)
            shard = ShardedLinear(lin, start, stop, width, k)
            self.stages.append(nn.Sequential(shard, *list(model.classifier)[i + 1 : end]))
        self.n_classes = self.plan.widths[-1]
        self._orders: dict[tuple[int, ...], torch.Tensor] = {}

    @torch.no_grad()
    def _broadcast(self, classifier: nn.Sequential) -> None:
        """Start from rank 0's FC weights, as DataParallel does for the conv weights."""
        if self.mesh.size(self.axis) == 1:
            return
        params = list(classifier.parameters())
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        comm.broadcast(flat, self.mesh, self.axis, src=0)
        offset = 0
        for p in params:
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()

    def _owner_order(self, sizes: list[int]) -> torch.Tensor:
        """Row permutation from (round, worker, row) order to (worker, round, row) order."""
        key = tuple(sizes)
        if key not in self._orders:
            k, rows, offset = self.mesh.size(self.axis), [], 0
            starts = []
            for m in sizes:
                starts.append(offset)
                offset += k * m
            for j in range(k):
                for o, m in zip(starts, sizes):
                    rows.append(torch.arange(o + j * m, o + (j + 1) * m))
            self._orders[key] = torch.cat(rows)
        return self._orders[key]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mesh, axis, k = self.mesh, self.axis, self.mesh.size(self.axis)
        a = self.pre(self.features(x))
        if a.dim() != 2:
            raise ConfigError(
                f"the activations entering the classifier have shape {tuple(a.shape)}; end `features` "
                "with nn.Flatten (or start `classifier` with it) so each example is one vector"
            )
        b = a.shape[0]
        if b == 0:
            raise ConfigError("the hybrid needs at least one example per worker")
        sizes = round_sizes(b, k, self.scheme)
        pending: list = []
        rounds = [_GatherRows.apply(part, mesh, axis, pending) for part in a.split(sizes)]
        outputs = []
        for r, h in enumerate(rounds):
            pending[r][0].wait()  # later rounds stay in flight while this one is computed
            for i, stage in enumerate(self.stages):
                if i:  # the next layer needs every neuron of this one (reduce-scatter backward)
                    h = gather_from_sequence(h, mesh, axis, dim=1)
                h = stage(h)
            outputs.append(h)
        z = torch.cat(outputs) if len(outputs) > 1 else outputs[0]
        if len(sizes) > 1:
            z = z.index_select(0, self._owner_order(sizes).to(z.device))
        # Rows now grouped by owning worker: send each worker its examples' slice of neurons
        # (block j of the rows to worker j), received slices side by side in worker order.
        logits = all_to_all_along(z, mesh, axis, split_dim=0, concat_dim=1)
        return logits[:, : self.n_classes] if logits.shape[1] != self.n_classes else logits

    def comm_per_step(self, global_batch: int, elem_bytes: int = 4) -> dict[str, tuple[int, int]]:
        """The formula for this hybrid: {op: (calls, payload bytes)} per step per worker."""
        return krizhevsky_comm(self.plan, global_batch, self.scheme, elem_bytes, len(self.features.buckets))

    @torch.no_grad()
    def gather_parameters(self) -> dict[str, torch.Tensor]:
        """The full model's parameters (names as in the original model), on every worker.

        Collective: every worker of the axis must call it."""
        out = {f"features.{n}": p.detach().clone() for n, p in self.features.module.named_parameters()}
        k = self.mesh.size(self.axis)
        for index, stage in zip(self.plan.linear_index, self.stages):
            shard = stage[0]
            for name in ("weight", "bias"):
                p = getattr(shard, name)
                if p is None:
                    continue
                local = p.new_zeros((shard.width, *p.shape[1:]))
                local[: p.shape[0]] = p
                full = p.new_empty((k * shard.width, *p.shape[1:]))
                comm.all_gather(full, local, self.mesh, self.axis)
                out[f"classifier.{index}.{name}"] = full[: shard.out_features]
        return out


def apply_krizhevsky(
    model: nn.Module, mesh: Mesh, axis: str = "dp", scheme: str = "c", bucket_mb: float = 25.0
) -> KrizhevskyHybrid:
    """Krizhevsky's hybrid of `model` over `axis`: features data-parallel, classifier split by
    output neurons. `scheme` is the paper's §4 exchange: "c" (default) or "a". Build the optimizer
    on the returned module's parameters afterwards; `model` must already be on the mesh's device."""
    return KrizhevskyHybrid(model, mesh, axis, scheme, bucket_mb)

"""`apply_tp`: split a built model over the mesh's tp axis by a plan (Megatron-LM §3).

A plan maps module names (fnmatch patterns, e.g. ``"blocks.*.mlp.fc"``) to styles, the records
of `plait.tp_plan` (a model declares its plan with them and imports nothing of this package);
`APPLY` says how each is applied:

* `Colwise(fused=1)`: an nn.Linear becomes a `ColumnParallelLinear`. ``fused=k`` says the
  output features are k blocks laid end to end (a fused qkv: ``[q | k | v]``): each rank then
  takes its slice of *each* block, so it holds whole heads of q, k and v.
* `Rowwise()`: an nn.Linear becomes a `RowParallelLinear` (its input arrives split).
* `VocabEmbedding()`: an nn.Embedding becomes a `VocabParallelEmbedding`.
* `VocabHead(tie=name)`: the output layer becomes column-parallel over the (padded) vocabulary,
  sharing the embedding's shard when the weights are tied; the model's loss becomes the
  vocab-parallel cross-entropy (the logits are never gathered) and the logits it returns without
  targets are gathered.
* `ParallelRandom()`: a parameter-free module (dropout, attention core) whose randomness must
  differ across tp ranks: it runs on the per-rank stream of `ParallelRNG`.
* `SequenceSharded()` (sequence parallelism only): a module applied to sequence shards whose
  parameters stay replicated (LayerNorm): its parameters get partial gradients, summed over tp.
* `PositionSharded()`: under sequence parallelism the embedding returns its shard's positions.
* `ExpertsReplicated()`: a mixture-of-experts MLP kept whole; under sequence parallelism forward
  hooks gather its input sequences and cut its output back to the rank's shard.
* `LocalWidths("n_head", ...)`: a module whose code reads its sizes from its own attributes
  (an attention module's ``self.n_head``) gets each divided by tp: the rank's share.

A style of any other type applies itself (``style.apply(name, module, ctx)``), as a model-specific
one may (`plait.models.hf_parallel.LocalHeads`).

Nothing here knows a particular model: a model declares its own plan (``model.tp_plan()``,
which `apply_tp` uses when given none; plait's GPT's is `plait.models.gpt_parallel.gpt_plan`),
or any model built from Linear and Embedding layers is split by a plan passed in, like torch's
``parallelize_module``.

Every split parameter gets its placement (`plait.placement`: the shard dim, fused blocks and the
canonical length, or a gradient partial over tp), which is all the rest of plait reads: gradient
sync, the norm, checkpoints (chunks of the whole canonical tensor, so DCP can reshard them to
another tp degree) and `gather_full`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import functools

import torch
from torch import nn

from plait.comm.autograd import gather_from_parallel, gather_from_sequence
from plait.errors import ConfigError
from plait.mesh import Mesh
from plait.placement import _fused_order, gather_full, set_grad_partial, update_shard
from plait.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from plait.tensor_parallel.loss import vocab_parallel_cross_entropy
from plait.tensor_parallel.rng import ParallelRNG, run_on_parallel_stream
from plait.tp_plan import (
    Colwise,
    ExpertsReplicated,
    LocalWidths,
    ParallelRandom,
    PositionSharded,
    Rowwise,
    SequenceSharded,
    VocabEmbedding,
    VocabHead,
)


@dataclasses.dataclass
class _Ctx:
    mesh: Mesh
    axis: str
    sequence_parallel: bool
    seq_dim: int
    rng: ParallelRNG
    model: nn.Module


def _colwise(style: Colwise, name: str, m: nn.Module, ctx: _Ctx) -> nn.Module:
    _expect(name, m, nn.Linear, style)
    t = ctx.mesh.size(ctx.axis)
    w, b = m.weight.detach(), None if m.bias is None else m.bias.detach()
    if m.out_features % (style.fused * t):
        raise ConfigError(
            f"{name}: {m.out_features} output features in {style.fused} block(s) do not split over "
            f"tp = {t}: each block must be divisible by tp (for attention: heads by tp)"
        )
    if style.fused > 1:  # [q | k | v] -> [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]: contiguous per rank
        order = _fused_order(m.out_features, style.fused, t)
        w, b = w[order], None if b is None else b[order]
    new = ColumnParallelLinear(
        m.in_features,
        m.out_features,
        ctx.mesh,
        ctx.axis,
        bias=b is not None,
        gather_output=style.gather_output,
        sequence_parallel=ctx.sequence_parallel,
        seq_dim=ctx.seq_dim,
        full_weight=w,
        full_bias=b,
    )
    for p in new.parameters():
        update_shard(p, ctx.axis, fused=style.fused, full=m.out_features)
    return new


def _rowwise(style: Rowwise, name: str, m: nn.Module, ctx: _Ctx) -> nn.Module:
    _expect(name, m, nn.Linear, style)
    t = ctx.mesh.size(ctx.axis)
    if m.in_features % t:
        raise ConfigError(f"{name}: in_features = {m.in_features} is not divisible by tp = {t}")
    new = RowParallelLinear.from_linear(
        m, ctx.mesh, ctx.axis, sequence_parallel=ctx.sequence_parallel, seq_dim=ctx.seq_dim
    )
    update_shard(new.weight, ctx.axis, full=m.in_features)
    return new


def _vocab_embedding(style: VocabEmbedding, name: str, m: nn.Module, ctx: _Ctx) -> nn.Module:
    _expect(name, m, nn.Embedding, style)
    new = VocabParallelEmbedding.from_embedding(
        m, ctx.mesh, ctx.axis, sequence_parallel=ctx.sequence_parallel, seq_dim=ctx.seq_dim
    )
    update_shard(new.weight, ctx.axis, full=m.num_embeddings)
    return new


def _vocab_head(style: VocabHead, name: str, m: nn.Module, ctx: _Ctx) -> nn.Module:
    _expect(name, m, nn.Linear, style)
    t = ctx.mesh.size(ctx.axis)
    vocab = m.out_features
    padded = -(-vocab // t) * t
    tied = ctx.model.get_submodule(style.tie) if style.tie else None
    full = torch.zeros(padded, m.in_features, dtype=m.weight.dtype, device=m.weight.device)
    if tied is None:
        full[:vocab] = m.weight.detach()
    new = ColumnParallelLinear(
        m.in_features,
        padded,
        ctx.mesh,
        ctx.axis,
        bias=False,
        sequence_parallel=ctx.sequence_parallel,
        seq_dim=ctx.seq_dim,
        full_weight=full,
    )
    if m.bias is not None:
        raise ConfigError(f"{name}: a vocabulary head with a bias is not supported")
    if tied is not None:
        if not isinstance(tied, VocabParallelEmbedding):
            raise ConfigError(f"{name}: tie={style.tie!r} must name a module split with VocabEmbedding()")
        new.weight = tied.weight
    else:
        update_shard(new.weight, ctx.axis, full=vocab)
    model = ctx.model
    model.loss_fn = functools.partial(_tp_loss, mesh=ctx.mesh, axis=ctx.axis, vocab=vocab)
    model.output_fn = functools.partial(_tp_logits, mesh=ctx.mesh, axis=ctx.axis, vocab=vocab)
    return new


def _parallel_random(style: ParallelRandom, name: str, m: nn.Module, ctx: _Ctx) -> nn.Module:
    if any(True for _ in m.parameters(recurse=False)):
        raise ConfigError(f"{name}: ParallelRandom is for parameter-free modules (dropout, attention)")
    run_on_parallel_stream(m, ctx.rng)
    return m


def _sequence_sharded(style: SequenceSharded, name: str, m: nn.Module, ctx: _Ctx) -> nn.Module:
    if ctx.sequence_parallel:
        for p in m.parameters():
            set_grad_partial(p, ctx.axis)
        if isinstance(m, nn.Dropout):
            run_on_parallel_stream(m, ctx.rng)
    return m


class PositionShard(nn.Module):
    """A position embedding that returns the rows of this rank's sequence slice (sequence
    parallelism: the residual stream it is added to is split along the sequence)."""

    def __init__(self, emb: nn.Embedding, mesh: Mesh, axis: str):
        super().__init__()
        self.weight = emb.weight
        set_grad_partial(self.weight, axis)
        self.mesh, self.axis = mesh, axis

    sequence_parallel = True

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        if not self.sequence_parallel:
            return nn.functional.embedding(pos, self.weight)
        t, r = self.mesh.size(self.axis), self.mesh.rank(self.axis)
        n = pos.shape[0]
        if n % t:
            raise ConfigError(f"sequence parallelism: {n} positions do not split over tp = {t}")
        return nn.functional.embedding(pos[r * n // t : (r + 1) * n // t], self.weight)


def _position_sharded(style: PositionSharded, name: str, m: nn.Module, ctx: _Ctx) -> nn.Module:
    _expect(name, m, nn.Embedding, style)
    return PositionShard(m, ctx.mesh, ctx.axis) if ctx.sequence_parallel else m


def _experts_replicated(style: ExpertsReplicated, name: str, m: nn.Module, ctx: _Ctx) -> nn.Module:
    """Under sequence parallelism: whole sequences in (gathered from the tp ranks' shards), this
    rank's shard out, cut at the input of the module's last step (its dropout, which then draws
    per-rank masks); gradients partial over tp; auxiliary losses weighted 1/tp per rank."""
    if ctx.sequence_parallel:
        mesh, axis, dim = ctx.mesh, ctx.axis, ctx.seq_dim
        for p in m.parameters():
            set_grad_partial(p, axis)
        run_on_parallel_stream(m.dropout, ctx.rng)
        m.loss_share = 1.0 / mesh.size(axis)

        def gather(module, args):
            return (gather_from_sequence(args[0], mesh, axis, dim), *args[1:])

        def cut(module, args):
            n = args[0].shape[dim] // mesh.size(axis)
            return (args[0].narrow(dim, mesh.rank(axis) * n, n), *args[1:])

        m.register_forward_pre_hook(gather)
        m.dropout.register_forward_pre_hook(cut)
    return m


def _local_widths(style: LocalWidths, name: str, m: nn.Module, ctx: _Ctx) -> nn.Module:
    """Each named size attribute becomes this rank's share, so the module's own code, reading
    ``self.n_head``, computes on the heads (or features) its split layers hold."""
    t = ctx.mesh.size(ctx.axis)
    for attr in style.attrs:
        value = getattr(m, attr, None)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(
                f"plan: {name} ({type(m).__name__}) has no integer attribute {attr!r} for LocalWidths; "
                f"its integer attributes: {sorted(k for k, v in vars(m).items() if type(v) is int)}"
            )
        if value % t:
            raise ConfigError(f"plan: {name}.{attr} = {value} does not split over tp = {t}")
        setattr(m, attr, value // t)
    return m


APPLY = {
    Colwise: _colwise,
    Rowwise: _rowwise,
    VocabEmbedding: _vocab_embedding,
    VocabHead: _vocab_head,
    ParallelRandom: _parallel_random,
    SequenceSharded: _sequence_sharded,
    PositionSharded: _position_sharded,
    ExpertsReplicated: _experts_replicated,
    LocalWidths: _local_widths,
}
"""How each style of `plait.tp_plan` is applied: ``fn(style, name, module, ctx) -> module``. A
style of another type applies itself: ``style.apply(name, module, ctx)``."""


def _expect(name: str, m: nn.Module, kind: type, style) -> None:
    if not isinstance(m, kind):
        raise ConfigError(f"plan: {name} is a {type(m).__name__}, but {style} expects an nn.{kind.__name__}")


def _tp_loss(logits, targets, reduction="mean", *, mesh, axis, vocab):
    flat = logits.reshape(-1, logits.shape[-1])
    return vocab_parallel_cross_entropy(
        flat, targets.reshape(-1), mesh, axis, vocab_size=vocab, reduction=reduction
    )


def _tp_logits(logits, *, mesh, axis, vocab):
    return gather_from_parallel(logits, mesh, axis, dim=-1)[..., :vocab]


def apply_tp(
    model: nn.Module,
    mesh: Mesh,
    plan: dict | None = None,
    axis: str = "tp",
    sequence_parallel: bool = False,
    seq_dim: int = 1,
    seed: int = 0,
    rules: dict[str, str | None] | None = None,
) -> nn.Module:
    """Split `model` (identical on every rank of `axis`) over `axis` by `plan`, in place.

    `plan` defaults to the model's own, ``model.tp_plan()`` (plait's GPT declares one, in
    `plait.models.gpt_parallel`); a model without one needs a `plan`. Modules are replaced in
    plan order (the embedding before a head tied to it). `seed` seeds the per-rank random
    stream (`ParallelRNG`) used by `ParallelRandom` and sharded dropouts. Returns `model`.

    `rules` are Mesh-TensorFlow layout rules: which named tensor dims of the plan (for plait's
    GPT "vocab", "heads", "d_ff") are split over `axis`; a dim mapped to None stays whole, and
    its styles are skipped (those layers stay replicated). Default: every named dim over `axis`
    (Megatron-LM's split). Sequence parallelism needs every named dim split.
    """
    if plan is None:
        if not callable(getattr(model, "tp_plan", None)):
            raise ConfigError(
                f"apply_tp: a {type(model).__name__} declares no tensor-parallel plan: pass plan={{module "
                "name pattern: style}} or give the model a tp_plan() method returning one"
            )
        plan = model.tp_plan()
        source = getattr(model, "tp_plan_source", f"the model's plan ({type(model).__name__}.tp_plan())")
    else:
        source = "the tp_plan passed in"
    plan = _apply_rules(plan, rules, axis, sequence_parallel)
    rng = ParallelRNG(seed, mesh.rank(axis), mesh.device)
    ctx = _Ctx(mesh, axis, sequence_parallel, seq_dim, rng, model)
    names = [n for n, _ in model.named_modules() if n]
    rules_seen = model.__dict__.setdefault("_plait_tp_rules", {})
    for pattern, style in plan.items():
        matched = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not matched:
            raise ConfigError(f"plan pattern {pattern!r} matches no module of {type(model).__name__}")
        for name in matched:
            old = model.get_submodule(name)
            fn = APPLY.get(type(style))
            new = fn(style, name, old, ctx) if fn is not None else style.apply(name, old, ctx)
            rules_seen[name] = {  # what plait verify names, and how it reassembles the outputs
                "rule": f"{style_text(style)} from {source}",
                "fused": getattr(style, "fused", 1),
                "splits_output": isinstance(style, (Colwise, VocabHead))
                and not getattr(style, "gather_output", False),
            }
            if new is not old:
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, child, new)
    model._plait_tp = (mesh, axis, rng)
    return model


def style_text(style) -> str:
    """A style as its class and the fields it sets away from their defaults: ``Colwise(fused=3)``."""
    if not dataclasses.is_dataclass(style):
        return repr(style)
    fields = [
        f"{f.name}={getattr(style, f.name)!r}"
        for f in dataclasses.fields(style)
        if f.name != "dim" and getattr(style, f.name) != f.default
    ]
    return f"{type(style).__name__}({', '.join(fields)})"


def plan_dims(plan: dict) -> list[str]:
    """The named tensor dims a plan's styles split, in plan order."""
    dims = [getattr(style, "dim", None) for style in plan.values()]
    return list(dict.fromkeys(d for d in dims if d is not None))


def _apply_rules(plan: dict, rules: dict | None, axis: str, sequence_parallel: bool) -> dict:
    """The plan restricted to the styles whose named dim `rules` maps to `axis`."""
    dims = plan_dims(plan)
    if rules is None:
        return plan
    unknown = sorted(set(rules) - set(dims))
    if unknown:
        raise ConfigError(f"layout rules name {unknown}, which the plan does not split; valid dims: {dims}")
    bad = {d: a for d, a in rules.items() if a not in (axis, None)}
    if bad:
        raise ConfigError(f"layout rules map {bad}: a dim goes to {axis!r} or None (stays whole)")
    split = {d for d in dims if rules.get(d) == axis}
    if sequence_parallel and split != set(dims):
        raise ConfigError(
            f"sequence parallelism needs every named dim split over {axis!r} ({', '.join(dims)}); "
            f"the rules leave {sorted(set(dims) - split)} whole"
        )
    return {k: st for k, st in plan.items() if getattr(st, "dim", None) is None or st.dim in split}


@contextlib.contextmanager
def without_sequence_parallel(model: nn.Module):
    """Run `model` with sequence parallelism switched off (the same function, computed on
    whole sequences): for inference on lengths not divisible by tp, e.g. sampling."""
    switched = [m for m in model.modules() if getattr(m, "sequence_parallel", False) is True]
    for m in switched:
        m.sequence_parallel = False
    try:
        yield model
    finally:
        for m in switched:
            m.sequence_parallel = True


def tp_named_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of a tp-split model, whole and in canonical order (collective)."""
    mesh, axis, _ = model._plait_tp
    return {n: gather_full(p, mesh, axis) for n, p in model.named_parameters()}

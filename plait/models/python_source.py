"""`[model] source = "python:PKG.MODULE:FUNC"`: a model the user's own Python function builds.

    # mymodels.py, in the current directory or on PYTHONPATH
    def make_net(args):                        # args: ModelArgs (vocab_size, seq_len, sizes)
        net = MyNet(args.vocab_size, args.d_model, args.n_layer)
        return net, {"blocks": list(net.layers), "tp_plan": {...}}

`FUNC(args)` returns an `nn.Module`, or `(module, extras)` where `extras` may hold `tp_plan`
({module name pattern: style}, plait.tensor_parallel), `layout_rules` ({named dim: "tp" or
None}), `blocks` (the repeated layers: ZeRO-3's units, what activation checkpointing
recomputes) and `pipeline_split` (`split(module, n_stages, split) -> stage modules`, the
contract of plait.pipeline.stage).

Two kinds of module are accepted. One that already meets the trainer's model contract
(`forward(idx, targets=None, reduction="mean")` returning the loss, or logits without targets)
is trained as it is: its own `tp_plan()`, `plait_blocks()` and `pipeline_split()` are used, and
`extras` given beside it are set on it as attributes. Any other module must map token ids
(B, T) to logits (B, T, V) (a tensor, a tuple whose first item is one, or an object with a
`.logits` tensor, as Hugging Face models return); `PythonModel` adapts it: the loss is plait's
token cross-entropy (`loss_fn`, which a vocabulary-parallel head replaces), `generate` samples
greedily or with a temperature, and the model FLOPs per token are estimated as 6 x parameters
(`train_flops_per_token`; Kaplan et al. 2020's C = 6N, attention's own FLOPs left out).

Nothing here is parallel: plait's parallelize path applies the plan, the blocks and the split.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import re
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from plait.errors import ConfigError
from plait.models.gpt import GPT
from plait.models.resolve import model_config
from plait.pipeline.stage import split_sequential

PREFIX = "python:"
_SPEC = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")
EXTRAS = ("tp_plan", "layout_rules", "blocks", "pipeline_split")
KEY = "model.source"


@dataclasses.dataclass(frozen=True)
class ModelArgs:
    """What a factory receives: the [model] keys, resolved (the named size's value where a key is
    not set). Only vocab_size and seq_len bind the model to the data; the sizes are offered."""

    vocab_size: int
    seq_len: int
    n_layer: int
    n_head: int
    d_model: int
    d_ff: int
    dropout: float
    seed: int


def model_args(cfg) -> ModelArgs:
    """The ModelArgs of a plait Config (its [model] keys over the named size)."""
    m = model_config(cfg)
    return ModelArgs(
        vocab_size=m.vocab_size,
        seq_len=m.seq_len,
        n_layer=m.n_layer,
        n_head=m.n_head,
        d_model=m.d_model,
        d_ff=m.ff_dim,
        dropout=m.dropout,
        seed=cfg.train.seed,
    )


def parse_spec(spec: str) -> tuple[str, str]:
    """'python:pkg.module:func' -> ('pkg.module', 'func'), or a ConfigError naming the key."""
    rest = spec[len(PREFIX) :] if spec.startswith(PREFIX) else spec
    if not spec.startswith(PREFIX) or not _SPEC.match(rest):
        raise ConfigError(
            f"{KEY} = {spec!r} is malformed: expected 'python:PKG.MODULE:FUNC' (a module importable from "
            "the current directory or PYTHONPATH, and the function in it that builds the model)"
        )
    module, _, func = rest.partition(":")
    return module, func


def load_factory(spec: str) -> Callable:
    """The function `spec` names, imported from the current directory or PYTHONPATH."""
    module_name, func = parse_spec(spec)
    cwd = os.getcwd()
    if cwd not in sys.path:  # `plait train` is a console script: its own dir is on sys.path, not this one
        sys.path.append(cwd)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if (
            exc.name
            and module_name.startswith(exc.name)
            and module_name.split(".")[0] == exc.name.split(".")[0]
        ):
            raise ConfigError(
                f"{KEY} = {spec!r}: module {module_name!r} not found in the current directory ({cwd}) or on "
                "PYTHONPATH; put the file there or add its directory to PYTHONPATH"
            ) from None
        raise ConfigError(f"{KEY} = {spec!r}: importing {module_name!r} failed: {exc}") from None
    except Exception as exc:  # the user's module itself failed to import
        raise ConfigError(
            f"{KEY} = {spec!r}: importing {module_name!r} raised {type(exc).__name__}: {exc}"
        ) from None
    fn = getattr(module, func, None)
    if not callable(fn):
        names = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
        what = "is not callable" if hasattr(module, func) else "not found"
        raise ConfigError(
            f"{KEY} = {spec!r}: function {func!r} {what} in {module_name} ({module.__file__}); "
            f"its functions: {', '.join(sorted(names)) or 'none'}"
        )
    return fn


def meets_contract(module: nn.Module) -> bool:
    """Whether `module` is a plait trainer model already: forward(idx, targets, reduction)."""
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    return "targets" in params and "reduction" in params


def call_factory(spec: str, args: ModelArgs) -> tuple[nn.Module, dict]:
    """Call the factory; returns (module, extras), checked (a ConfigError naming the key)."""
    fn = load_factory(spec)
    try:
        out = fn(args)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"{KEY} = {spec!r}: calling it raised {type(exc).__name__}: {exc}") from None
    extras: dict = {}
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):
        out, extras = out
    if not isinstance(out, nn.Module):
        raise ConfigError(
            f"{KEY} = {spec!r} returned {type(out).__name__}, not a torch nn.Module: return the model, or "
            "(model, {'tp_plan': ..., 'layout_rules': ..., 'blocks': [...], 'pipeline_split': ...})"
        )
    unknown = sorted(set(extras) - set(EXTRAS))
    if unknown:
        raise ConfigError(f"{KEY} = {spec!r}: unknown extras {unknown}; valid: {', '.join(EXTRAS)}")
    if extras.get("pipeline_split") is not None and not callable(extras["pipeline_split"]):
        raise ConfigError(
            f"{KEY} = {spec!r}: extras['pipeline_split'] must be split(module, n_stages, split)"
        )
    return out, extras


def build_python_model(spec: str, args: ModelArgs) -> nn.Module:
    """The trainer's model from the factory: the module as it is when it meets the contract
    (extras set on it), else wrapped in `PythonModel`."""
    module, extras = call_factory(spec, args)
    if not meets_contract(module):
        return PythonModel(module, args, **extras)
    if extras.get("tp_plan") is not None:
        module.tp_plan = lambda plan=extras["tp_plan"]: plan
        module.tp_plan_source = PythonModel.tp_plan_source
    if extras.get("blocks") is not None:
        module.plait_blocks = lambda blocks=list(extras["blocks"]): blocks
    if extras.get("pipeline_split") is not None:
        split_fn = extras["pipeline_split"]
        module.pipeline_split = lambda n, split="uniform": split_fn(module, n, split)
    if extras.get("layout_rules") is not None:
        module.layout_rules = extras["layout_rules"]
    return module


def _logits(out) -> torch.Tensor:
    if isinstance(out, (tuple, list)):
        out = out[0]
    if not torch.is_tensor(out) and torch.is_tensor(getattr(out, "logits", None)):
        out = out.logits
    if not torch.is_tensor(out) or out.dim() != 3:
        what = tuple(out.shape) if torch.is_tensor(out) else type(out).__name__
        raise ConfigError(
            f"{KEY}: the model returned {what} for token ids of shape (B, T); it must return logits "
            "(B, T, V), or meet plait's contract: forward(idx, targets=None, reduction='mean') -> loss"
        )
    return out


def _sum_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The summed token loss a pipeline's last stage returns (plait.pipeline.stage)."""
    return cross_entropy(logits, targets, "sum")


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), reduction=reduction
    )


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


class PythonModel(nn.Module):
    """A module mapping ids (B, T) to logits (B, T, V), given the trainer's model contract.

    The user's module is `self.net`, so its parameters are named `net.<its names>` in
    checkpoints, and its plan's patterns (and a `VocabHead`'s `tie`) are prefixed the same way.
    """

    tp_plan_source = "the factory's tp_plan"  # how plait verify names where a rule came from

    def __init__(
        self,
        net: nn.Module,
        args: ModelArgs,
        tp_plan: dict | None = None,
        layout_rules: dict | None = None,
        blocks: list[nn.Module] | None = None,
        pipeline_split: Callable | None = None,
    ) -> None:
        super().__init__()
        self.net = net
        self.cfg = args
        self._plan = tp_plan
        self.layout_rules = layout_rules
        self._blocks = list(blocks) if blocks is not None else None
        self._split = pipeline_split
        # the hooks plait.tensor_parallel.apply_tp replaces for a vocabulary-parallel head
        self.loss_fn = cross_entropy
        self.output_fn = _identity
        if pipeline_split is None and not isinstance(net, nn.Sequential):
            self.pipeline_split = None  # no way to cut it: plait.pipeline.stage refuses it

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, reduction: str = "mean"):
        logits = _logits(self.net(idx))
        if targets is None:
            return self.output_fn(logits)
        return self.loss_fn(logits, targets, reduction)

    def plait_blocks(self) -> list[nn.Module]:
        """The blocks the factory named (none: ZeRO-3 gathers the model as one unit)."""
        return list(self._blocks or [])

    def tp_plan(self) -> dict:
        if self._plan is None:
            raise ConfigError(
                f"{KEY}: tensor parallelism needs a plan: return (model, {{'tp_plan': {{pattern: style}}}}) "
                "from the factory, or set parallel.tp = 1"
            )
        out = {}
        for pattern, style in self._plan.items():
            if dataclasses.is_dataclass(style) and getattr(style, "tie", None):
                style = dataclasses.replace(style, tie=f"net.{style.tie}")
            out[f"net.{pattern}"] = style
        return out

    def pipeline_split(self, n_stages: int, split="uniform") -> list[nn.Module]:
        """The factory's split of its module, or an nn.Sequential's by its layers; the last
        stage returns the summed token loss."""
        if self._split is not None:
            return self._split(self.net, n_stages, split)
        return split_sequential(self.net, n_stages, _sum_cross_entropy, split)

    generate = GPT.generate  # plait's sampling loop: it only calls forward and reads cfg.seq_len


def train_flops_per_token(model: nn.Module) -> float:
    """6 x parameters (Kaplan et al. 2020: forward 2N, backward 4N per token; attention's
    sequence-dependent FLOPs are left out), each shared tensor counted once."""
    return 6.0 * sum(p.numel() for p in model.parameters())


def check_source(cfg, n_stages: int) -> None:
    """`model.source = "python:..."` before any process starts: the spec, the import, the call
    (on the meta device, so no memory is spent; on the CPU if the factory needs real tensors),
    the module's output on (1, seq_len) ids, a plan for tp > 1 and a split into `n_stages`
    pipeline stages for pp > 1. Each problem is one ConfigError naming the key. (The features of
    plait's GPT a factory's model cannot take are rules of the combination table:
    `plait.combinations.SOURCE_LIMITS`, read by plait.layout.)"""
    spec, p = cfg.model.source, cfg.parallel
    args = model_args(cfg)
    try:
        with torch.device("meta"):
            model = build_python_model(spec, args)
    except ConfigError:
        raise
    except Exception:  # something in it needs real tensors: build it for real once
        model = build_python_model(spec, args)
    if p.tp > 1:
        if isinstance(model, PythonModel):
            has_plan = model._plan is not None
        else:
            has_plan = callable(getattr(model, "tp_plan", None))
        if not has_plan:
            raise ConfigError(
                f"{KEY} = {spec!r} with parallel.tp = {p.tp} needs a tensor-parallel plan: return (model, "
                "{'tp_plan': {module name pattern: Colwise() / Rowwise() ...}}) from the factory "
                "(plait.tensor_parallel), or set parallel.tp = 1"
            )
    if p.pp > 1 and not callable(getattr(model, "pipeline_split", None)):
        raise ConfigError(
            f"{KEY} = {spec!r} with parallel.pp = {p.pp} needs a way to cut the model into stages: return "
            "(model, {'pipeline_split': split(module, n_stages, split) -> stages}) from the factory, make "
            "the module an nn.Sequential, or set parallel.pp = 1"
        )
    if p.pp > 1 and isinstance(model, PythonModel) and model._split is None and len(model.net) % n_stages:
        raise ConfigError(
            f"{KEY} = {spec!r} is an nn.Sequential of {len(model.net)} layers, not divisible into "
            f"parallel.pp x virtual_stages = {n_stages} pipeline stages of equal size: use a pp x "
            "virtual_stages that divides it, or return (model, {'pipeline_split': ...})"
        )
    out = _run_forward(model, args, spec)
    if isinstance(model, PythonModel) and out is not None:
        _check_output(out, args, spec)


def _run_forward(model: nn.Module, args: ModelArgs, spec: str):
    """The module's output for ids (1, seq_len) (the adapted module's, or the contract's loss),
    checked against the data it will train on: an embedding that takes the token ids has at least
    vocab_size rows, and the forward does not fail (a sequence longer than the model's context, a
    shape that does not fit). On the meta device this costs nothing; a forward the meta device
    cannot run (data-dependent steps) is not checked here and gives None."""
    device = next(iter(model.parameters()), torch.empty(0)).device
    idx = torch.zeros(1, args.seq_len, dtype=torch.long, device=device)
    short = []  # (name, rows, what they index) of embeddings too small for the data

    def takes_ids(name):
        def hook(module, inputs):
            if not inputs or not torch.is_tensor(inputs[0]):
                return
            rows, x = module.num_embeddings, inputs[0]
            if x is idx and rows < args.vocab_size:
                short.append(
                    (name, rows, f"the token ids go up to model.vocab_size - 1 = {args.vocab_size - 1}")
                )
            elif _POSITIONS.search(name) and x.shape[-1:] == (args.seq_len,) and rows < args.seq_len:
                short.append((name, rows, f"the positions go up to model.seq_len - 1 = {args.seq_len - 1}"))

        return hook

    root = model.net if isinstance(model, PythonModel) else model  # the user's own names
    embeddings = [(n, m) for n, m in root.named_modules() if isinstance(m, nn.Embedding)]
    handles = [m.register_forward_pre_hook(takes_ids(n)) for n, m in embeddings]
    try:
        with torch.no_grad():
            out = model.net(idx) if isinstance(model, PythonModel) else model(idx, idx, reduction="sum")
    except Exception as exc:
        if not (short or _does_not_fit(exc)):
            return None
        out = exc
    finally:
        for h in handles:
            h.remove()
    if short:
        name, rows, what = short[0]
        raise ConfigError(
            f"{KEY} = {spec!r}: its embedding {name} has {rows} rows but {what}: build it from the "
            "sizes the factory is called with (args.vocab_size, args.seq_len)"
        )
    if isinstance(out, Exception):
        what = " ".join(str(out).split())[:300]
        raise ConfigError(
            f"{KEY} = {spec!r}: the model fails on token ids of shape (1, {args.seq_len}) (model.seq_len) "
            f"and model.vocab_size = {args.vocab_size}: {type(out).__name__}: {what}; build it from the "
            "sizes the factory is called with (args.seq_len, args.vocab_size)"
        )
    return out


# a learned position table (GPT-2's wpe, position_embeddings, pos_emb, ...), fed positions 0..T-1
_POSITIONS = re.compile(r"(^|\.)(wpe|pos\w*|position\w*)$")


def _does_not_fit(exc: Exception) -> bool:
    """Whether `exc` says that the model does not fit the data (a bad value, index or shape), not
    that the meta device cannot run its forward (a step that needs the tensors' data)."""
    text = str(exc).lower()
    if isinstance(exc, NotImplementedError) or "meta" in text:
        return False
    if isinstance(exc, ValueError | IndexError | AssertionError):
        return True
    words = ("shape", "size", "broadcast", "dimension")
    return isinstance(exc, RuntimeError) and any(w in text for w in words)


def _check_output(out, args: ModelArgs, spec: str) -> None:
    """The adapted module must give logits (1, T, V >= vocab_size) for ids (1, T)."""
    logits = _logits(out)
    if tuple(logits.shape[:2]) != (1, args.seq_len) or logits.shape[2] < args.vocab_size:
        raise ConfigError(
            f"{KEY} = {spec!r}: the model gives {tuple(logits.shape)} for token ids of shape "
            f"(1, {args.seq_len}); it must give logits (1, {args.seq_len}, V) with V >= "
            f"model.vocab_size = {args.vocab_size}"
        )

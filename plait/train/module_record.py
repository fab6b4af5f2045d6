"""What each module of the model computed in one step, on this rank: the record `plait verify`
localises a fault with (`plait.parity.localise`), and the module a failing step was in.

`ModuleRecorder(model, where)` hooks every module of the model (after `plait.apply.parallelize`:
the split layers are in place, under their own names) and records, for each call until `stop()`:

* ``in``: its first tensor argument (the input), and ``gin``: the gradient that flows back into
  that input *through this module only* (the input is passed on as a view of itself, whose hook
  sees this module's share of the gradient, not the sum over every consumer of the tensor);
* ``out``: its first tensor output, and ``gout``: the gradient with respect to that output;
* which modules produced its input (the autograd graph walked back from the input to the nearest
  recorded outputs): the data flow through the code between modules, so a wrong input can be
  traced to the layer whose output it was made from.

Calls during a backward pass (activation checkpointing's recomputation) are not recorded again,
nor calls without gradients (a pipeline's shape probe, an evaluation).
While recording it also keeps the modules whose forward (a stack of the entered, not yet left)
or backward (the output gradient arrived, the input gradient not yet) is running, so that an
exception raised in a step names its module: `failure(exc)`.

`where` places the rank on the mesh for reassembling whole tensors: its index and the number of
ranks over the data axes (the batch's rows), over tp (split features or sequence) and its
pipeline stage. `state()` is the record as plain data and tensors; `write(dir, rank)` stores it
as ``rank_R.json`` and ``rank_R.safetensors`` (read back with `read`, without unpickling).
"""

from __future__ import annotations

import collections
import contextlib
import json
import time
from pathlib import Path

import torch
from torch import nn

from plait.mesh import Mesh
from plait.train.run_state import data_axis

PHASES = ("in", "out", "gin", "gout")
MAX_NODES = 200_000  # autograd nodes one input's walk may visit (a guard, never met by a model)


def first_tensor(value):
    """The first tensor in a module's arguments or outputs (tensors, tuples, lists, dicts and
    transformers' ModelOutput), or None."""
    if torch.is_tensor(value):
        return value
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        for v in value:
            t = first_tensor(v)
            if t is not None:
                return t
    return None


def _in_backward() -> bool:
    """Whether autograd is running a backward pass now (recomputation happens there)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def where_on(mesh: Mesh) -> dict:
    """This rank's place for reassembling whole tensors: [index, size] over the data axes (the
    batch's rows) and over tp, its pipeline stage and the ep degree."""
    axis = data_axis(mesh)
    return {
        "data": [mesh.rank(axis), mesh.size(axis)],
        "tp": [mesh.rank("tp"), mesh.size("tp")],
        "pp": mesh.rank("pp"),
        "ep": mesh.size("ep"),
    }


def tp_rules(model: nn.Module) -> dict[str, dict]:
    """{module name: {"rule": its tensor-parallel style and where it came from, "fused": blocks of
    its output, "splits_output": whether its output is split over tp}}, as
    `plait.tensor_parallel.apply_tp` recorded them on the model ({} without tp)."""
    return dict(getattr(model, "_plait_tp_rules", {}))


class ModuleRecorder:
    def __init__(
        self, model: nn.Module, where: dict, *, max_bytes: int = 2**30, tensors: bool = True
    ) -> None:
        self.where = dict(where)
        self.events: list[tuple[str, str, int]] = []  # (phase, module, call) in the order they happen
        self.tensors: dict[str, torch.Tensor] = {}  # "phase/module/call"
        self.producers: dict[str, list[str]] = {}  # module -> the modules its first input came from
        self.rules = tp_rules(model)
        self.kinds = {name: type(m).__name__ for name, m in model.named_modules()}
        self.calls: collections.Counter = collections.Counter()
        self.forward_stack: list[str] = []
        self.backward_stack: list[str] = []
        self.bytes, self.max_bytes, self.truncated = 0, max_bytes, False
        self.recording = True
        self.keeps_tensors = tensors  # False: only which module is running (every run's first step)
        self._owner: dict = {}  # autograd node of a recorded output -> its module
        self._handles = []
        for name, module in model.named_modules():
            self._handles.append(
                module.register_forward_pre_hook(self._pre(name or "(model)"), with_kwargs=True)
            )
            self._handles.append(
                module.register_forward_hook(self._post(name or "(model)"), with_kwargs=True)
            )

    # --- hooks ----------------------------------------------------------------------------------

    def _keep(self, phase: str, name: str, call: int, t: torch.Tensor) -> None:
        if not (self.recording and self.keeps_tensors) or not t.is_floating_point():
            return
        size = t.numel() * t.element_size()
        if self.bytes + size > self.max_bytes:
            self.truncated = True
            return
        self.bytes += size
        self.tensors[f"{phase}/{name}/{call}"] = t.detach().to("cpu", copy=True).contiguous()
        self.events.append((phase, name, call))

    def _records_now(self) -> bool:
        """Not a recomputation (inside a backward pass), nor a forward without gradients (a
        pipeline's shape probe, an evaluation): those are not the step's computation."""
        return self.recording and torch.is_grad_enabled() and not _in_backward()

    def _pre(self, name: str):
        def hook(module, args, kwargs):
            self.forward_stack.append(name)
            if not self._records_now():
                return None
            call = self.calls[name]
            self.calls[name] += 1
            key = next((i for i, a in enumerate(args) if torch.is_tensor(a)), None)
            if key is None:
                key = next((k for k, v in kwargs.items() if torch.is_tensor(v)), None)
            if key is None:
                return None
            x = args[key] if isinstance(key, int) else kwargs[key]
            if not self.keeps_tensors:
                return None
            self._keep("in", name, call, x)
            if call == 0:
                self.producers[name] = self._walk(x)
            if not (x.requires_grad and x.is_floating_point()):
                return None
            view = x.view_as(x)  # this module's own edge: its hook sees this module's gradient only
            view.register_hook(self._grad("gin", name, call))
            if isinstance(key, int):
                return (*args[:key], view, *args[key + 1 :]), kwargs
            return args, {**kwargs, key: view}

        return hook

    def _post(self, name: str):
        def hook(module, args, kwargs, output):
            while self.forward_stack and self.forward_stack.pop() != name:
                pass
            if not self._records_now():
                return None
            y = first_tensor(output)
            if y is None:
                return None
            call = self.calls[name] - 1
            self._keep("out", name, call, y)
            if y.grad_fn is not None and self.keeps_tensors:
                self._owner[y.grad_fn] = name
            if y.requires_grad and y.is_floating_point():
                y.register_hook(self._grad("gout", name, call))
            return None

        return hook

    def _grad(self, phase: str, name: str, call: int):
        def hook(grad):
            if phase == "gout":
                self.backward_stack.append(name)
            elif name in self.backward_stack:
                while self.backward_stack and self.backward_stack.pop() != name:
                    pass
            self._keep(phase, name, call, grad)
            return None

        return hook

    def _walk(self, x: torch.Tensor) -> list[str]:
        """The recorded modules whose outputs `x` was computed from, nearest first (through code
        that is no module's: a split, a reshape, attention written as a function)."""
        found: list[str] = []
        todo, seen = collections.deque([x.grad_fn]), set()
        while todo and len(seen) < MAX_NODES:
            node = todo.popleft()
            if node is None or node in seen:
                continue
            seen.add(node)
            owner = self._owner.get(node)
            if owner is not None:
                if owner not in found:
                    found.append(owner)
                continue
            todo.extend(n for n, _ in node.next_functions)
        return found

    # --- after the step -------------------------------------------------------------------------

    def failure(self, exc: BaseException) -> dict:
        """The module whose forward or backward raised `exc` (the innermost one running), its rule
        and the exception, as data; the exception gains a note naming them."""
        phase, stack = (
            ("backward", self.backward_stack) if self.backward_stack else ("forward", self.forward_stack)
        )
        module = stack[-1] if stack else None
        out = {
            "phase": phase,
            "module": module,
            "kind": self.kinds.get(module or "", ""),
            "rule": self.rules.get(module or "", {}).get("rule", ""),
            "exception": f"{type(exc).__name__}: {exc}",
            "where": self.where,
        }
        if module is not None and hasattr(exc, "add_note"):
            rule = f"; rule: {out['rule']}" if out["rule"] else ""
            exc.add_note(f"plait: raised in the {phase} of {module} ({out['kind']}{rule})")
            tp = int(self.where.get("tp", [0, 1])[1])
            if tp > 1 and phase == "forward" and isinstance(exc, (ValueError, RuntimeError)):
                out["hint"] = local_widths_hint(module, tp)
                exc.add_note(f"plait: {out['hint']}")
        return out

    def stop(self) -> None:
        """Stop recording and remove every hook (the record stays)."""
        self.recording = False
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._owner.clear()

    def state(self) -> dict:
        return {
            "where": self.where,
            "events": [list(e) for e in self.events],
            "producers": self.producers,
            "rules": self.rules,
            "kinds": self.kinds,
            "truncated": self.truncated,
            "tensors": self.tensors,
        }

    def write(self, directory: Path, rank: int) -> None:
        from safetensors.torch import save_file

        directory.mkdir(parents=True, exist_ok=True)
        meta = {k: v for k, v in self.state().items() if k != "tensors"}
        save_file(self.tensors, str(directory / f"rank_{rank}.safetensors"))
        (directory / f"rank_{rank}.json").write_text(json.dumps(meta))


def local_widths_hint(module: str, tp: int) -> str:
    """What to change when a module's own code fails on the local shapes of tensor parallelism."""
    return (
        f"under tp = {tp} the split layers inside {module} hold 1/{tp} of their output features (of "
        "the heads): code that takes a width or a head count from its config (n_head, n_embd) sees the "
        "whole model's. Read them from attributes and give the module LocalWidths('n_head', 'n_embd') "
        "in the tp plan (each becomes the rank's share), or take them from the tensors' shapes"
    )


def write_failure(directory: Path, rank: int, failure: dict) -> None:
    """`failure` (from `ModuleRecorder.failure`) as ``failure_rank_R.json``, with the rank and the
    time: the rank that failed first is the one whose fault it was (its peers fail after it)."""
    directory.mkdir(parents=True, exist_ok=True)
    record = {**failure, "rank": rank, "time": time.time()}
    (directory / f"failure_rank_{rank}.json").write_text(json.dumps(record))


def read(directory: Path) -> tuple[list[dict], list[dict]]:
    """(every rank's record, every rank's failure) written under `directory`."""
    from safetensors.torch import load_file

    records, failures = [], []
    for path in sorted(directory.glob("rank_*.json")):
        meta = json.loads(path.read_text())
        meta["tensors"] = load_file(str(path.with_suffix(".safetensors")))
        meta["events"] = [tuple(e) for e in meta["events"]]
        records.append(meta)
    for path in sorted(directory.glob("failure_rank_*.json")):
        failures.append(json.loads(path.read_text()))
    return records, failures


@contextlib.contextmanager
def first_step(model: nn.Module, where: dict, directory: Path | None, rank: int):
    """Around a run's first step: which module a failure was in (a note on the exception, and
    ``failure_rank_R.json`` under `directory`), and with a `directory` (``log.modules``) the
    step's module record written there for `plait verify`."""
    rec = ModuleRecorder(model, where, tensors=directory is not None)
    try:
        yield rec
    except Exception as exc:
        failure = rec.failure(exc)
        if directory is not None:
            write_failure(directory, rank, failure)
        raise
    finally:
        rec.stop()
    if directory is not None:
        rec.write(directory, rank)

"""Which module a layout's fault is in: step 1's module records (`plait.train.module_record`) of
the layout against the one-process reference's.

Each recorded tensor of the layout is reassembled whole from the ranks that hold it: the rows of
the batch in data-parallel rank order and micro-batch order, and over tp by its shape against the
reference's (a dim that is 1/tp of the reference's is split along it: concatenated, a fused
output's blocks put back in order, a padded vocabulary cut to length; a tensor of the reference's
shape is replicated, and each tp rank's copy is compared). Gradients of a layout are those of
its ranks' mean losses over their own rows: they are divided by the data-parallel degree.

The comparison walks the reference's order of events, the forward first:

1. the first module whose output differs, its input agreeing: the fault is in that module (its
   rule, or its own code);
2. the first module whose *input* differs while every output before it agrees: the code between
   modules computed it wrongly from outputs that are right as wholes. When one of the modules it
   was computed from has its output split over tp, that module's rule splits it differently from
   how the code reads it (a fused projection split the wrong way): that module is named. Else
   the enclosing module's code is;
3. then the loss of step 1; then, in the backward, the first module whose input gradient differs
   (the fault is in its backward), or whose output gradient differs while the input gradients
   after it agree (the code between, or the loss's gradient for the last module).

A module that runs more or fewer times per micro-batch than most, or whose tensors do not
reassemble to the reference's shape (routed experts' tokens), is not compared.
"""

from __future__ import annotations

import collections
import math

import torch

from plait.placement import _fused_order

FORWARD, BACKWARD = ("in", "out"), ("gin", "gout")


def _calls(rec: dict) -> dict[tuple[str, str], list[int]]:
    out: dict[tuple[str, str], list[int]] = collections.defaultdict(list)
    for phase, name, call in rec["events"]:
        out[(phase, name)].append(int(call))
    return out


def _per_micro(calls: dict) -> int:
    """Calls per step of a module that runs once per micro-batch: the most common count."""
    counts = collections.Counter(len(set(c)) for (phase, _), c in calls.items() if phase == "out")
    return counts.most_common(1)[0][0] if counts else 1


class Records:
    """One run's records (one per rank), indexed for reassembly."""

    def __init__(self, records: list[dict]) -> None:
        self.records = records
        self.calls = [_calls(r) for r in records]
        self.micro = [_per_micro(c) for c in self.calls]
        self.rules: dict[str, dict] = {}
        self.kinds: dict[str, str] = {}
        for r in records:
            self.rules.update(r.get("rules", {}))
            self.kinds.update(r.get("kinds", {}))
        first = records[0]["where"] if records else {}
        self.data = int(first.get("data", [0, 1])[1])
        self.tp = int(first.get("tp", [0, 1])[1])

    def local(self, i: int, phase: str, name: str) -> torch.Tensor | None:
        """Rank i's tensor of (phase, name), its calls concatenated, or None."""
        calls = sorted(set(self.calls[i].get((phase, name), [])))
        if len(calls) != self.micro[i]:
            return None
        parts = [self.records[i]["tensors"][f"{phase}/{name}/{c}"] for c in calls]
        if any(p.shape[1:] != parts[0].shape[1:] or p.dim() == 0 for p in parts):
            return None
        return torch.cat(parts, 0)


def _unfuse(full: torch.Tensor, fused: int, tp: int) -> torch.Tensor:
    """Put a fused output's blocks back in order: rank r holds its slice of each block, as
    `plait.tensor_parallel` splits a fused weight's rows."""
    out = torch.empty_like(full)
    out[..., _fused_order(full.shape[-1], fused, tp)] = full
    return out


def _held(run: Records, phase: str, name: str) -> dict[int, dict[int, torch.Tensor]] | None:
    """{data index: {tp index: local tensor}} of (phase, name), or None when a rank lacks it."""
    held: dict[int, dict[int, torch.Tensor]] = collections.defaultdict(dict)
    for i, rec in enumerate(run.records):
        t = run.local(i, phase, name)
        if t is not None:
            held[int(rec["where"]["data"][0])].setdefault(int(rec["where"]["tp"][0]), t)
    if len(held) != run.data or any(len(v) != run.tp for v in held.values()):
        return None
    return held


def has_batch(run: Records, name: str, phase: str) -> bool:
    """Whether the module's tensors are split by the batch's rows: they differ between data ranks
    in the forward. A tensor every data rank computes alike (a position embedding's output)
    has no batch dim; its gradient is then the mean of the data ranks'."""
    if run.data == 1:
        return True
    held = _held(run, "out" if phase in ("out", "gout") else "in", name)
    if held is None:
        return True
    return not all(
        held[d][j].shape == held[0][j].shape and torch.equal(held[d][j], held[0][j])
        for d in range(run.data)
        for j in range(run.tp)
    )


def _over_tp(
    tps: list[torch.Tensor], want: tuple, rule: dict, phase: str, tp: int
) -> list[torch.Tensor] | None:
    """The tp ranks' tensors as whole ones of shape `want`: one, concatenated along the dim that
    is split (a fused output's blocks back in order, padding cut), or each copy of a replicated one."""
    got = tps[0].shape
    if len(got) != len(want) or any(t.shape != got for t in tps):
        return None
    split = [i for i in range(len(want)) if got[i] != want[i]]
    if not split:
        return tps
    dim = split[0]
    if len(split) > 1 or tp == 1 or -(-want[dim] // tp) != got[dim]:
        return None
    full = torch.cat(tps, dim)
    fused = int(rule.get("fused", 1))
    if fused > 1 and phase in ("out", "gout") and dim == len(want) - 1 and full.shape[dim] == want[dim]:
        full = _unfuse(full, fused, tp)
    return [full.narrow(dim, 0, want[dim])]


def assemble(ref: torch.Tensor, run: Records, phase: str, name: str) -> list[torch.Tensor] | None:
    """The layout's whole tensor(s) of (phase, name) in the units of the reference (gradients
    of the mean loss over the whole batch): one, or one per tp rank for a replicated one; None
    when they cannot be put together in the reference's shape."""
    held = _held(run, phase, name)
    if held is None or ref.dim() == 0:
        return None
    D, T = run.data, run.tp
    rule = run.rules.get(name, {})
    grad = phase in BACKWARD
    if not has_batch(run, name, phase):  # every data rank holds all of it
        wholes = [
            _over_tp([held[d][j] for j in range(T)], tuple(ref.shape), rule, phase, T) for d in range(D)
        ]
        if any(w is None for w in wholes):
            return None
        if grad:  # each data rank's gradient is of its own rows' mean loss: their mean is the whole's
            return [sum(w[k] for w in wholes) / D for k in range(len(wholes[0]))]
        return [t for w in wholes for t in w]
    if ref.shape[0] % D:
        return None
    want = (ref.shape[0] // D, *ref.shape[1:])
    per_data = [_over_tp([held[d][j] for j in range(T)], want, rule, phase, T) for d in range(D)]
    if any(c is None or c[0].shape[0] != want[0] for c in per_data):
        return None
    copies = max(len(c) for c in per_data)
    scale = D if grad else 1  # each rank's gradient is of the mean loss over its own rows
    return [torch.cat([c[min(k, len(c) - 1)] for c in per_data], 0) / scale for k in range(copies)]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    size = float(want.norm())
    diff = float((got - want).norm())
    if not math.isfinite(diff):
        return math.inf
    return diff / size if size > 0 else (0.0 if diff == 0 else math.inf)


def _inside_experts(name: str, kinds: dict[str, str]) -> bool:
    parts = name.split(".")
    for k in range(1, len(parts) + 1):
        kind = kinds.get(".".join(parts[:k]), "")
        if kind.startswith("MoE") or "Expert" in kind:
            return True
    return False


def _order(ref: Records, phases: tuple[str, ...]) -> list[tuple[str, str]]:
    seen: dict[tuple[str, str], None] = {}
    for phase, name, _ in ref.records[0]["events"]:
        if phase in phases:
            seen.setdefault((phase, name), None)
    return list(seen)


def _rule_words(run: Records, name: str) -> str:
    rule = run.rules.get(name, {}).get("rule")
    if rule:
        return f"rule: {rule}"
    return "rule: none, replicated over tp" if run.tp > 1 else ""


def _finding(run: Records, module: str, what: str, error: float, **extra) -> dict:
    return {"module": module, "what": what, "error": error, "rule": _rule_words(run, module), **extra}


def _errors(ref: Records, run: Records):
    """error(phase, name): the layout's relative error against the reference, None when the
    tensor is not compared."""
    ep = any(int(r["where"].get("ep", 1)) > 1 for r in run.records)

    def error(phase: str, name: str) -> float | None:
        if ep and _inside_experts(name, run.kinds):
            return None
        want = ref.local(0, phase, name)
        if want is None:
            return None
        wholes = assemble(want, run, phase, name)
        if wholes is None:
            return None
        return max(_rel(w, want) for w in wholes)

    return error


def survey(ref_records: list[dict], run_records: list[dict]) -> dict[tuple[str, str], float | None]:
    """Every tensor of the reference's step 1, (phase, module) -> the layout's relative error
    (None: not compared)."""
    ref, run = Records(ref_records), Records(run_records)
    error = _errors(ref, run)
    return {key: error(*key) for key in _order(ref, (*FORWARD, *BACKWARD))}


def localise(ref_records: list[dict], run_records: list[dict], tol: float, loss_rel: float) -> dict | None:
    """The module to blame for the first difference at step 1 (see the module docstring), or
    None when every compared module and the loss agree."""
    if not ref_records or not run_records:
        return None
    ref, run = Records(ref_records), Records(run_records)
    error = _errors(ref, run)

    for phase, name in _order(ref, FORWARD):
        e = error(phase, name)
        if e is None or e <= tol:
            continue
        if phase == "out":
            return _finding(run, name, "forward output", e)
        producers = ref.records[0]["producers"].get(name, [])
        split = [p for p in producers if run.rules.get(p, {}).get("splits_output")]
        if split:
            return _finding(
                run, split[0], f"forward: its split output is read wrongly on the way to {name}", e,
                note=f"{split[0]}'s output agrees whole, but {name}'s input, computed from it by the code "
                f"between them, differs: the rule splits {split[0]}'s output differently from how that code "
                "reads it (a fused projection needs its blocks in the rule: Colwise(fused=k), or the "
                "per-head order)",
            )  # fmt: skip
        parent = name.rpartition(".")[0] or "(model)"
        return _finding(
            run, parent, f"forward code before {name}", e,
            note=f"{name}'s input differs while {', '.join(producers) or 'the modules before it'} agree: the "
            f"fault is in {parent}'s own code between them",
        )  # fmt: skip
    if loss_rel > tol:
        return {
            "module": "the loss", "what": "forward", "error": loss_rel, "rule": "",
            "note": "every module's forward output agrees but the loss of step 1 differs: the fault is in "
            "the forward, in the loss computed from the model's output (its normalisation: the mean over "
            "the rows given)",
        }  # fmt: skip
    order = _order(ref, BACKWARD)
    last = _order(ref, ("out",))[-1][1] if _order(ref, ("out",)) else None
    for phase, name in order:
        e = error(phase, name)
        if e is None or e <= tol:
            continue
        if phase == "gin":
            return _finding(run, name, "backward: its input gradient", e)
        if name == last or name == "(model)":
            return _finding(run, name, "backward: the loss's gradient into its output", e)
        parent = name.rpartition(".")[0] or "(model)"
        return _finding(
            run, parent, f"backward code after {name}", e,
            note=f"the gradient into {name}'s output differs while the modules after it agree: the fault "
            f"is in the backward of {parent}'s code after {name}",
        )  # fmt: skip
    return None


def finding_line(f: dict, step: int = 1) -> str:
    """`blocks.0.attn.qkv (forward output, step 1; rule: Colwise(fused=3) from ...)`."""
    rule = f"; {f['rule']}" if f.get("rule") else ""
    return f"{f['module']} ({f['what']}, step {step}{rule})"

"""Compare a run with the one-process reference, step by step: the loss, the global gradient norm,
each parameter's gradient and each parameter.

A run is read as a `Trace`: per step its loss and gradient norm, and its parameters, whole and by
the model's own names, before the first step and after each. The optimizer is SGD without
momentum, weight decay or clipping, so step k moves every parameter by exactly -lr x its
gradient: the gradient of step k is compared as the update p_k - p_(k-1), in float64, against
the reference's. That comparison is exact up to the rounding of the fp32 parameters themselves,
eps x |p| / |update| (`floor`), which `plait verify` reports beside each error: a gradient
differs when its relative error is above max(tolerance, FLOOR_MARGIN x floor).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from plait.parity.localise import finding_line, localise

EPS32 = float(torch.finfo(torch.float32).eps)
FLOOR_MARGIN = 4.0  # a gradient's error must clear its rounding floor by this factor to differ
SHOW = 5  # differing parameters listed per layout


@dataclasses.dataclass
class Trace:
    """One run: `losses[k-1]`, `grad_norms[k-1]` of step k (1..K); `params[k]` the parameters
    after step k (`params[0]`: before the first step); `placements`: {name: where the layout put
    it}, when the run recorded them."""

    name: str
    losses: list[float]
    grad_norms: list[float]
    params: list[dict[str, torch.Tensor]]
    placements: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def steps(self) -> int:
        return len(self.losses)


def relative(got: float, want: float) -> float:
    """|got - want| / |want| (inf when one is not finite and they differ)."""
    if got == want:
        return 0.0
    if not (math.isfinite(got) and math.isfinite(want)):
        return math.inf
    return abs(got - want) / max(abs(want), 1e-30)


def gradient_errors(ref: Trace, run: Trace, step: int) -> dict[str, tuple[float, float]]:
    """{name: (relative error of step `step`'s gradient, its rounding floor)}, in the model's order."""
    out = {}
    for name, after in ref.params[step].items():
        want = after.double() - ref.params[step - 1][name].double()
        got = run.params[step][name].double() - run.params[step - 1][name].double()
        size = float(want.norm())
        diff = float((got - want).norm())
        if size == 0.0:
            out[name] = (0.0 if diff == 0.0 else math.inf, 0.0)
            continue
        floor = (
            EPS32 * max(float(after.double().norm()), float(run.params[step][name].double().norm())) / size
        )
        out[name] = (diff / size, floor)
    return out


def parameter_error(ref: Trace, run: Trace, step: int) -> float:
    """The largest ||p - p_ref|| / ||p_ref|| over the parameters after step `step`."""
    worst = 0.0
    for name, want in ref.params[step].items():
        got, want = run.params[step][name].double(), want.double()
        worst = max(worst, float((got - want).norm()) / max(float(want.norm()), 1e-30))
    return worst


def compare(ref: Trace, run: Trace, tol: float) -> dict:
    """The verdict of `run` against `ref`: ``{"holds": bool, "where": str, "steps": [...],
    "differing": [...]}``; `where` names the first thing that differs (a parameter whose gradient
    differs at the first step where one does, else the loss or the gradient norm)."""
    if run.steps != ref.steps or set(run.params[0]) != set(ref.params[0]):
        missing = sorted(set(ref.params[0]) - set(run.params[0]))[:3]
        raise ValueError(f"{run.name}: not the reference's steps or parameters (missing {missing})")
    steps, differing, where = [], [], ""
    for k in range(1, ref.steps + 1):
        grads = gradient_errors(ref, run, k)
        bad = [
            (name, err, floor) for name, (err, floor) in grads.items() if err > max(tol, FLOOR_MARGIN * floor)
        ]
        row = {
            "step": k,
            "loss": run.losses[k - 1],
            "loss_ref": ref.losses[k - 1],
            "loss_rel": relative(run.losses[k - 1], ref.losses[k - 1]),
            "grad_norm": run.grad_norms[k - 1],
            "grad_norm_ref": ref.grad_norms[k - 1],
            "grad_norm_rel": relative(run.grad_norms[k - 1], ref.grad_norms[k - 1]),
            "grad_rel_max": max((e for e, _ in grads.values()), default=0.0),
            "grad_floor_max": max((f for _, f in grads.values()), default=0.0),
            "param_rel_max": parameter_error(ref, run, k),
            "grads_differing": len(bad),
        }
        steps.append(row)
        if bad and not differing:
            # the first step with a wrong gradient: its parameters, worst first
            for name, err, floor in sorted(bad, key=lambda b: -b[1])[:SHOW]:
                differing.append(
                    {
                        "step": k,
                        "name": name,
                        "rel": err,
                        "floor": floor,
                        "placement": run.placements.get(name, "not recorded"),
                    }
                )
        if not where:
            if bad:
                where = differing[0]["name"]
            elif row["loss_rel"] > tol:
                where = f"the loss of step {k}"
            elif row["grad_norm_rel"] > tol:
                where = f"the gradient norm of step {k}"
            elif row["param_rel_max"] > tol:
                where = f"the parameters after step {k}"
    result = {"holds": not where, "where": where, "steps": steps, "differing": differing}
    ref_modules, run_modules = getattr(ref, "modules", None), getattr(run, "modules", None)
    if where and ref_modules and run_modules:
        found = localise(ref_modules, run_modules, tol, steps[0]["loss_rel"])
        if found is not None:
            result["localised"] = found
            result["where"] = finding_line(found)
        for d in differing:  # the module each differing parameter belongs to, and its rule
            d["module"] = owner(d["name"], run_modules)
    return result


def owner(param: str, records: list[dict]) -> str:
    """`blocks.1.ln_2: rule none, replicated over tp` for `blocks.1.ln_2.weight`."""
    rules: dict = {}
    for r in records:
        rules.update(r.get("rules", {}))
    module = param.rpartition(".")[0]
    tp = max(int(r["where"]["tp"][1]) for r in records)
    rule = rules.get(module, {}).get("rule") or ("none, replicated over tp" if tp > 1 else "")
    return f"{module}: rule {rule}" if rule else module


def failed_result(exc, failures: list[dict]) -> dict:
    """The verdict of a layout whose run failed: the rank that failed first, its exception, and
    the module whose forward or backward raised it with its rule (`failures`: the ranks'
    `plait.train.module_record.write_failure` records; `exc` a RankFailure, or a message)."""
    texts = getattr(exc, "failures", {}) or {}
    first = min(failures, key=lambda f: f.get("time", 0.0)) if failures else {}
    rank = first.get("rank", min(texts) if texts else None)
    failed = {
        "rank": rank,
        "exception": first.get("exception") or _last_line(texts.get(rank, str(exc))),
        "module": first.get("module"),
        "phase": first.get("phase"),
        "kind": first.get("kind", ""),
        "rule": first.get("rule", ""),
        "traceback": texts.get(rank, str(exc)),
    }
    where = f"rank {rank} failed" if rank is not None else "the run failed"
    if failed["module"]:
        rule = f"; rule: {failed['rule']}" if failed["rule"] else ""
        where += f" in the {failed['phase']} of {failed['module']} ({failed['kind']}{rule})"
    where += f": {failed['exception']}"
    return {"holds": False, "where": where, "steps": [], "differing": [], "failed": failed}


def _last_line(text: str) -> str:
    lines = [line for line in str(text).strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def verdict_line(name: str, result: dict) -> str:
    """`<layout>: holds (max error ...)` or `<layout>: differs at <param> (step k: ...)`."""
    worst = (
        max(max(r["loss_rel"], r["grad_norm_rel"], r["param_rel_max"]) for r in result["steps"])
        if result["steps"]
        else 0.0
    )
    if result["holds"]:
        return f"{name}: holds (largest relative error {worst:.1e}; gradients within tolerance at every step)"
    if result.get("failed"):
        return f"{name}: fails: {result['where']}"
    if result.get("localised"):
        return f"{name}: differs at {result['where']}"
    if result["differing"]:
        d = result["differing"][0]
        more = len([x for x in result["differing"] if x["step"] == d["step"]]) - 1
        others = f", and {more} more" if more else ""
        module = f"; module {d['module']}" if d.get("module") and ":" in d["module"] else ""
        return (
            f"{name}: differs at {d['name']} (step {d['step']}: gradient relative error {d['rel']:.2e}"
            f"{others}; placement: {d['placement']}{module})"
        )
    return f"{name}: differs at {result['where']} (largest relative error {worst:.1e})"

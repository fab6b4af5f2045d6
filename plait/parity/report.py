"""What `plait verify` writes: report.json (every figure), report.md (the same for a reader) and
errors.png (per step, each layout's largest relative error against one process, log scale)."""

from __future__ import annotations

import dataclasses
import json
import math
import threading
from pathlib import Path

from plait.parity.compare import verdict_line

_PLOT = threading.Lock()


@dataclasses.dataclass
class Report:
    tol: float
    lr: float
    steps: int
    reference: str
    layouts: list[dict] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    def add(self, name: str, keys: dict, result: dict, measured: dict | None = None) -> None:
        self.layouts.append({"name": name, "keys": keys, **result, "measured": measured or {}})

    @property
    def holds(self) -> bool:
        return all(lay["holds"] for lay in self.layouts)

    def lines(self) -> list[str]:
        return [verdict_line(lay["name"], lay) for lay in self.layouts]

    def to_json(self) -> dict:
        return {
            "holds": self.holds,
            "tolerance": self.tol,
            "optimizer": f"SGD, lr {self.lr}, no momentum, weight decay or clipping",
            "steps": self.steps,
            "reference": self.reference,
            "notes": self.notes,
            "layouts": self.layouts,
        }

    def write(self, out: str | Path) -> Path:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps(_finite(self.to_json()), indent=1) + "\n")
        plot_errors(self, out / "errors.png")
        (out / "report.md").write_text(self.markdown())
        return out

    def markdown(self) -> str:
        lines = [
            "# plait verify",
            "",
            f"Each layout against {self.reference}, {self.steps} steps of SGD (lr {self.lr}, no momentum, "
            f"weight decay or clipping); tolerance {self.tol:g} relative.",
            "",
            "| layout | verdict | loss | grad norm | gradients | parameters |",
            "|---|---|---|---|---|---|",
        ]
        for lay in self.layouts:
            s = lay["steps"]
            worst = {
                k: max((r[k] for r in s), default=0.0) for k in ("loss_rel", "grad_norm_rel", "param_rel_max")
            }
            grads = max((r["grad_rel_max"] for r in s), default=0.0)
            if lay.get("failed") or not s:  # no step to compare: no error figures
                lines.append(f"| {code(lay['name'])} | fails: {cell(lay['where'])} | - | - | - | - |")
                continue
            verdict = "holds" if lay["holds"] else f"differs at {code(lay['where'])}"
            lines.append(
                f"| {code(lay['name'])} | {verdict} | {worst['loss_rel']:.1e} | "
                f"{worst['grad_norm_rel']:.1e} | {grads:.1e} | {worst['param_rel_max']:.1e} |"
            )
        lines += [
            "",
            "Largest relative error over the steps; gradients per parameter, as the SGD update.",
            "",
        ]
        for lay in self.layouts:
            lines += _layout_section(lay)
        if self.notes:
            lines += ["## Notes", ""] + [f"- {cell(n)}" for n in self.notes] + [""]
        lines += ["![per-step relative error](errors.png)", ""]
        return "\n".join(lines)


def cell(text) -> str:
    """`text` safe in a markdown table cell: one line, its pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def code(text) -> str:
    """`text` as inline code in a table cell (a backtick in it: plain, escaped)."""
    text = cell(text)
    return f"`{text}`" if "`" not in text else text


def _failure_section(lay: dict) -> list[str]:
    f = lay["failed"]
    lines = [f"## {code(lay['name'])}", "", verdict_line(lay["name"], lay), ""]
    if f.get("module"):
        lines += [
            f"The {f['phase']} of `{f['module']}` ({f['kind']}) raised it on rank {f['rank']}"
            + (f"; its rule: {f['rule']}." if f.get("rule") else "; it has no tensor-parallel rule."),
            "",
        ]
    fence = "````" if "```" in f.get("traceback", "") else "```"
    return lines + [f"Rank {f['rank']}'s traceback:", "", fence, f.get("traceback", "").rstrip(), fence, ""]


def _layout_section(lay: dict) -> list[str]:
    if lay.get("failed"):
        return _failure_section(lay)
    lines = [f"## {code(lay['name'])}", "", verdict_line(lay["name"], lay), ""]
    found = lay.get("localised")
    if found:
        lines += [
            f"Step 1, module by module: the first difference is in `{found['module']}` ({found['what']}; "
            f"relative error {found['error']:.2e}){'; ' + found['rule'] if found.get('rule') else ''}."
            + (f" {found['note']}." if found.get("note") else ""),
            "",
        ]
    lines += [
        "| step | loss | loss (1 process) | rel | grad norm rel | worst gradient rel (floor) "
        "| parameters rel |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in lay["steps"]:
        lines.append(
            f"| {r['step']} | {r['loss']:.6f} | {r['loss_ref']:.6f} | {r['loss_rel']:.1e} | "
            f"{r['grad_norm_rel']:.1e} | {r['grad_rel_max']:.1e} ({r['grad_floor_max']:.0e}) | "
            f"{r['param_rel_max']:.1e} |"
        )
    if lay["differing"]:
        lines += ["", f"First step whose gradients differ: {lay['differing'][0]['step']}.", ""]
        lines += ["| parameter | gradient rel | placement | module |", "|---|---|---|---|"]
        lines += [
            f"| {code(d['name'])} | {d['rel']:.2e} | {cell(d['placement'])} | {cell(d.get('module', ''))} |"
            for d in lay["differing"]
        ]
    measured = lay.get("measured") or {}
    if measured:
        lines += ["", "| measured | this run | expected | ratio |", "|---|---|---|---|"]
        for row in measured.get("rows", []):
            ratio = f"{row['ratio']:.2f}" if row.get("ratio") is not None else "-"
            lines.append(f"| {cell(row['what'])} | {cell(row['got'])} | {cell(row['want'])} | {ratio} |")
    return lines + [""]


def _finite(x):
    """JSON has no inf or nan: write them as strings."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def plot_errors(report: Report, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with _PLOT:  # pyplot's state is global: two reports written from two threads would mix
        _plot(report, path, plt)


def _plot(report: Report, path: Path, plt) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    for lay in report.layouts:
        steps = [r["step"] for r in lay["steps"]]
        worst = [
            max(r["loss_rel"], r["grad_norm_rel"], r["grad_rel_max"], r["param_rel_max"], 1e-16)
            for r in lay["steps"]
        ]
        worst = [min(w, 1e3) for w in worst]
        ax.plot(steps, worst, marker="o", label=lay["name"])
    ax.axhline(report.tol, color="k", linestyle="--", linewidth=1, label=f"tolerance {report.tol:g}")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("largest relative error vs one process")
    ax.set_title("plait verify: loss, gradient norm, gradients, parameters")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

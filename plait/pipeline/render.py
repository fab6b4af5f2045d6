"""Pipeline timelines drawn as a terminal grid or a PNG, in the style of the schedule figures of
Huang et al. 2018 (GPipe, fig. 2), Narayanan et al. 2021 (fig. 3-4) and Qi et al. 2023 (fig. 3):
one row per pipeline rank, time to the right, a cell or bar per compute action."""

from __future__ import annotations

import statistics
from pathlib import Path

from plait.pipeline.simulate import Event, SimResult, summarize

# One letter per compute kind in the text grid; BW is X so it is never mistaken for a split B.
LETTERS = {"F": "F", "B": "B", "W": "W", "BW": "X"}
COLOURS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868", "BW": "#C44E52"}
NAMES = {"F": "forward", "B": "input grad", "W": "weight grad", "BW": "full backward"}


def _as_result(timeline: SimResult | list[Event], p: int) -> SimResult:
    return timeline if isinstance(timeline, SimResult) else summarize(list(timeline), p)


def render_text(result: SimResult | list[Event], p: int, width: int = 100) -> str:
    """A time-scaled grid: one row per rank, `width` columns each covering makespan/width of time.

    A column shows the action running at its middle: F, B, W or X (BW), and '.' where the rank is
    idle. Where an action spans enough columns, its first cells spell the micro-batch number
    (``F12`` then lower-case fill, ``X3xx``), so the order of micro-batches can be read off."""
    res = _as_result(result, p)
    width = max(int(width), 1)
    t0 = min((e.start for e in res.events), default=0.0)
    span = res.makespan or 1.0
    dt = span / width
    # Unit costs give integer times: then use a whole number of columns per time unit, so every action
    # is drawn exactly as wide as it lasts.
    times = [x - t0 for e in res.events for x in (e.start, e.end)]
    if span <= width and all(abs(x - round(x)) < 1e-9 for x in times):
        per_unit = width // round(span)
        width, dt = per_unit * round(span), 1.0 / per_unit
    by_rank: dict[int, list[Event]] = {}  # one pass over the events, not one per rank
    for e in res.events:
        by_rank.setdefault(e.rank, []).append(e)
    rows = []
    for rank in range(p):
        cells = ["."] * width
        for e in by_rank.get(rank, ()):
            # Columns whose midpoint falls inside [start, end): an action is never drawn twice as wide
            # as it is, and a short one may vanish at a coarse width (the legend gives the scale).
            first = max(int(round((e.start - t0) / dt)), 0)
            last = min(int(round((e.end - t0) / dt)), width)
            if last <= first:
                continue
            letter = LETTERS.get(e.kind, "?")
            label = letter + str(e.mb)
            n = last - first
            text = label if n >= len(label) else letter
            cells[first:last] = list(text + letter.lower() * (n - len(text)))
        rows.append(f"rank {rank:>{len(str(p - 1))}} |{''.join(cells)}|")
    kinds = sorted({e.kind for e in res.events}, key=list(LETTERS).index)
    legend = ", ".join(f"{LETTERS[k]} {NAMES[k]}" for k in kinds)
    rows.append(f"legend: {legend}, . idle; digits: micro-batch; 1 column = {dt:.3g} time units")
    return "\n".join(rows)


def _title(title: str, res: SimResult, unit: str) -> str:
    bubble = statistics.fmean(res.bubble_fraction) if res.bubble_fraction else 0.0
    makespan = f"{res.makespan:.4g} s" if unit == "seconds" else f"{res.makespan:.4g}"
    return f"{title}: makespan {makespan}, mean bubble {bubble:.1%}"


def render_png(panels: list[tuple[str, SimResult | list[Event], int]], path: str | Path) -> Path:
    """Draw each (title, timeline, p) panel as a Gantt chart, stacked vertically, into `path`.

    Simulated timelines (SimResult) are in cost units, measured ones (a list of Events) in seconds
    from their first start; panels share the x axis when all are in the same unit. Bars are coloured
    by kind; a rank's later chunks (interleaved, ZB-V) are drawn lighter."""
    # Here, not at the top: the Agg backend must be chosen before pyplot loads, and only plots
    # pay matplotlib's import.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not panels:
        raise ValueError("render_png needs at least one panel")
    units = ["time" if isinstance(t, SimResult) else "seconds" for _, t, _ in panels]
    share = len(set(units)) == 1
    height = sum(0.45 * p + 1.1 for _, _, p in panels)
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, max(height, 2.5)), sharex=share, squeeze=False)
    kinds_seen: set[str] = set()
    for ax, (title, timeline, p), unit in zip(axes[:, 0], panels, units, strict=True):
        res = _as_result(timeline, p)
        t0 = min((e.start for e in res.events), default=0.0)
        stages: dict[int, set[int]] = {}
        for e in res.events:
            stages.setdefault(e.rank, set()).add(e.stage)
        # (rank, stage) -> the chunk's order on its rank, for shading
        chunk = {(rank, s): i for rank, held in stages.items() for i, s in enumerate(sorted(held))}
        for e in res.events:
            kinds_seen.add(e.kind)
            y = p - 1 - e.rank  # rank 0 on top
            alpha = 1.0 if chunk[(e.rank, e.stage)] == 0 else 0.55
            ax.barh(
                y,
                e.duration,
                left=e.start - t0,
                height=0.8,
                color=COLOURS.get(e.kind, "grey"),
                alpha=alpha,
                edgecolor="white",
                linewidth=0.5,
            )
            # Write the micro-batch number where the bar is wide enough for it (about 1.5% of the axis
            # per character at this figure width).
            if res.makespan > 0 and e.duration / res.makespan >= 0.012 * len(str(e.mb)) + 0.004:
                ax.text(e.start - t0 + e.duration / 2, y, str(e.mb), ha="center", va="center", fontsize=7)
        ax.set_yticks(range(p))
        ax.set_yticklabels([f"rank {r}" for r in reversed(range(p))])
        ax.set_ylim(-0.6, p - 0.4)
        ax.set_title(_title(title, res, unit), fontsize=10)
        if not share or ax is axes[-1, 0]:
            ax.set_xlabel("seconds" if unit == "seconds" else "time")
        ax.set_xlim(left=0)
    handles = [
        Patch(color=COLOURS[k], label=f"{k} ({NAMES[k]})") for k in ("F", "B", "W", "BW") if k in kinds_seen
    ]
    # Below the panels, where it hides no bar.
    if handles:
        fig.legend(handles=handles, loc="lower center", fontsize=8, ncol=len(handles), frameon=False)
    fig.tight_layout(rect=(0, 0.45 / fig.get_figheight(), 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

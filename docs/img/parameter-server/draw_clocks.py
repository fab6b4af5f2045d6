"""Draw docs/img/parameter-server/clocks.png: three workers (worker 2 twice as slow) under bsp,
ssp with staleness 1, and async. Each box is one clock (pull, compute, push), numbered; a grey
line is time spent waiting for a pull. Under bsp and ssp clock c is applied when every worker has
pushed it; a worker at clock c may read once every clock <= c - τ - 1 is applied.

    .venv/bin/python docs/img/parameter-server/draw_clocks.py
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DURATION = [1.0, 1.0, 2.0]  # worker 2 is twice as slow
CLOCKS = 6
HORIZON = 12.5


def schedule(tau):
    """{worker: [(start, end, clock)]} with waits; tau None = async (never waits)."""
    w_n = len(DURATION)
    ends = {w: [0.0] for w in range(w_n)}  # ends[w][c] = when its push of clock c landed
    applied = [0.0]  # applied[c] = when clock c was applied (all workers pushed)
    boxes = {w: [] for w in range(w_n)}
    for c in range(1, CLOCKS + 1):
        for w in range(w_n):
            ready = ends[w][c - 1]
            if tau is not None and c - 1 - tau >= 1:
                ready = max(ready, applied[c - 1 - tau])
            boxes[w].append((ends[w][c - 1], ready, c))
            ends[w].append(ready + DURATION[w])
        applied.append(max(ends[w][c] for w in range(w_n)))
    return boxes


def main():
    modes = [("bsp (τ = 0)", 0), ("ssp, τ = 1", 1), ("async (Downpour)", None)]
    fig, axes = plt.subplots(len(modes), 1, figsize=(8, 5.6), sharex=True)
    colours = ["#4c72b0", "#55a868", "#c44e52"]
    for ax, (title, tau) in zip(axes, modes):
        for w, rows in schedule(tau).items():
            for prev_end, start, c in rows:
                if start > prev_end:
                    ax.plot([prev_end, start], [w, w], color="grey", lw=2, alpha=0.6)
                if start < HORIZON:
                    ax.barh(
                        w, DURATION[w], left=start, height=0.6, color=colours[w], edgecolor="black", lw=0.5
                    )
                    ax.text(
                        start + DURATION[w] / 2,
                        w,
                        str(c),
                        ha="center",
                        va="center",
                        color="white",
                        fontsize=8,
                    )
        ax.set_yticks(range(len(DURATION)), [f"worker {w}" for w in range(len(DURATION))])
        ax.invert_yaxis()
        ax.set_title(title, fontsize=9, loc="left")
        ax.set_xlim(0, HORIZON)
    axes[-1].set_xlabel("time (worker 0's clock = 1); grey: waiting for a pull")
    fig.tight_layout()
    fig.savefig(Path(__file__).with_name("clocks.png"), dpi=110)


if __name__ == "__main__":
    main()

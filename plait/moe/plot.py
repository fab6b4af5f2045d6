"""The expert-load picture of a run: for each MoE layer, experts x logged steps, each cell the
share of that step window's claims (tokens x top_k, before capacity) that chose the expert. A
balanced router shows a flat colour at 1/E; a collapsing one shows a bright row."""

from __future__ import annotations

from pathlib import Path


def plot_expert_load(records: list[dict], out: Path, title: str = "") -> Path | None:
    """expert_load.png from metrics.jsonl records carrying "moe" (see plait.train.loop); None
    when no record does."""
    # Here, not at the top: the Agg backend must be chosen before pyplot loads, and only plots
    # pay matplotlib's import.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = [(r["step"], r["moe"]) for r in records if "moe" in r]
    if not rows:
        return None
    steps = [s for s, _ in rows]
    layers = len(rows[0][1]["tokens_per_expert"])
    fig, axes = plt.subplots(layers, 1, figsize=(7, 1.2 + 1.6 * layers), dpi=110, squeeze=False)
    for i, ax in enumerate(axes[:, 0]):
        load = np.array([m["tokens_per_expert"][i] for _, m in rows], dtype=float).T  # experts x steps
        share = load / np.maximum(load.sum(0, keepdims=True), 1.0)
        im = ax.imshow(share, aspect="auto", interpolation="nearest", cmap="viridis", vmin=0.0)
        ax.set_ylabel(f"MoE layer {i}\nexpert")
        ticks = np.linspace(0, len(steps) - 1, min(len(steps), 8)).round().astype(int)
        ax.set_xticks(ticks, [str(steps[t]) for t in ticks])
        fig.colorbar(im, ax=ax, label="share of claims")
    axes[-1, 0].set_xlabel("step (logged)")
    axes[0, 0].set_title(title)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out

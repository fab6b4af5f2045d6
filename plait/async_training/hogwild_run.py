"""`plait hogwild`: one Hogwild run with its output directory (curve, summary, loss plot)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from plait.async_training.hogwild import HogwildConfig, HogwildResult, describe, train_hogwild
from plait.errors import ConfigError

CURVE_FILE, SUMMARY_FILE, PLOT_FILE = "loss.jsonl", "summary.json", "loss.png"


def prepare_out_dir(out: str | None) -> Path:
    """The output directory: `out`, or runs/hogwild-<timestamp>; created now, and refused (before
    any work) if it already holds a run or cannot be written."""
    path = Path(out) if out else Path("runs") / time.strftime("hogwild-%Y%m%d-%H%M%S")
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--out {str(path)!r} is a file; give a directory")
    if (path / SUMMARY_FILE).exists() or (path / CURVE_FILE).exists():
        raise ConfigError(f"--out {str(path)!r} already holds a hogwild run; give a new directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".plait-probe"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"--out {str(path)!r}: cannot write there ({exc.strerror or exc})") from None
    return path


def plot_curve(result: HogwildResult, out: Path) -> Path:
    """Held-out loss of the live weights and the workers' progressive training loss against the
    update count, to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    held = [(p["updates"], p["val_loss"]) for p in result.curve]
    train = [(p["updates"], p["train_loss"]) for p in result.curve if p["train_loss"] is not None]
    cfg = result.config
    kind = describe(HogwildConfig(**cfg))
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(*zip(*held), "o-", ms=3, lw=1.5, label="held-out loss (live weights)")
    if train:
        ax.plot(*zip(*train), lw=1.0, alpha=0.8, label="training loss (progressive, per interval)")
    ax.set_xlabel("updates (all workers)")
    ax.set_ylabel("logistic loss (nats)")
    ax.set_title(
        f"{kind}, {cfg['optimizer']} lr {cfg['lr']:g}: {result.updates_per_s:,.0f} updates/s", fontsize=10
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def run_to_dir(cfg: HogwildConfig, out_dir: Path) -> tuple[HogwildResult, dict[str, Path]]:
    """Train, writing each curve point to loss.jsonl as it comes, then summary.json and loss.png."""
    cfg.validate()
    files = {"curve": out_dir / CURVE_FILE, "summary": out_dir / SUMMARY_FILE, "plot": out_dir / PLOT_FILE}
    with open(files["curve"], "w", buffering=1) as fh:
        result = train_hogwild(cfg, on_point=lambda point: fh.write(json.dumps(point) + "\n"))
    files["summary"].write_text(json.dumps(result.summary(), indent=1) + "\n")
    plot_curve(result, files["plot"])
    return result, files

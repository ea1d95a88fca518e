"""The plot of ``noria bench learn``: held-out accuracy against training minutes (left) and against
trained tokens (right), one line per system, the thresholds dotted. Written with matplotlib (Agg)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot(systems: dict[str, dict[str, Any]], path: Path, settings: dict[str, Any], thresholds=()) -> Path:
    """Write the PNG of ``systems``' curves to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2))
    by_time, by_tokens = fig.subplots(1, 2)
    for name, r in systems.items():
        curve = sorted(r["curve"], key=lambda p: p["step"])
        accuracy = [100 * (p["accuracy"] or 0.0) for p in curve]
        label = r.get("label", name) + (" (interrupted)" if r.get("interrupted") else "")
        by_time.plot([p["train_seconds"] / 60 for p in curve], accuracy, marker="o", label=label)
        by_tokens.plot([p["trained_tokens"] / 1000 for p in curve], accuracy, marker="o", label=label)
    for ax, xlabel in ((by_time, "training minutes (evaluations excluded)"), (by_tokens, "trained response tokens (thousands)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out accuracy (%)")
        ax.grid(alpha=0.3)
        for t in thresholds:
            ax.axhline(100 * t, color="grey", linestyle=":", linewidth=1)
    by_time.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"{Path(settings['model']).name}: greedy held-out accuracy, every {settings['eval_every']} steps", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    return path

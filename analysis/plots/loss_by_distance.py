"""Loss by distance: the mean next-token loss at each distance from the document's start (train/run/loss_by_distance.py),
one curve per model or milestone, on a log distance axis."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from posfreq.analysis.plots.frequency import plt, save_figure


def plot_loss_by_distance(
    curves: dict[str, tuple[np.ndarray, np.ndarray]], stem: str | Path, title: str = ""
) -> list[Path]:
    """Mean loss (y) per distance bucket (x: its first distance + 1, log2), a line per label; `curves[label]` is
    (edges, mean loss per bucket), empty buckets (NaN) left out."""
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for label, (edges, mean) in curves.items():
        held = ~np.isnan(mean)
        ax.plot(np.asarray(edges[:-1])[held] + 1, np.asarray(mean)[held], marker=".", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("distance from the document's first token + 1 (tokens)")
    ax.set_ylabel("mean next-token loss (nats)")
    ax.set_title(title or "Loss by distance")
    ax.grid(alpha=0.3)
    if len(curves) > 1:
        ax.legend(fontsize=8)
    return save_figure(fig, stem)

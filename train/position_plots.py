"""Pictures of position schemes: the relative-position matrix as a heatmap (the STRING paper's Fig. 5 / Fig. 8)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from posfreq.train.positions import PositionScheme

ANNOTATE_UP_TO = 24
"""Matrices up to this size get their distance written in every cell."""


def draw_distances(scheme: PositionScheme, length: int, ax: Axes | None = None, title: str | None = None) -> Axes:
    """Heatmap of `scheme.distances(length)` on `ax` (queries m down, keys n across; upper triangle blank)."""
    if ax is None:
        ax = Figure(figsize=(0.4 * min(length, 40) + 1.5, 0.4 * min(length, 40) + 1)).subplots()
    matrix = scheme.distances(length).astype(float)
    shown = np.ma.masked_less(matrix, 0)
    image = ax.imshow(shown, cmap="viridis_r", vmin=0, vmax=max(length - 1, 1), interpolation="nearest")
    if length <= ANNOTATE_UP_TO:
        for m, n in zip(*np.nonzero(matrix >= 0)):
            value = matrix[m, n]
            ax.text(n, m, f"{value:.0f}", ha="center", va="center", fontsize=7,
                    color="black" if value < 0.5 * (length - 1) else "white")
    options = ", ".join(f"{k}={v}" for k, v in scheme.options.items() if k != "protocol")
    ax.set_title(title or f"{scheme.name}" + (f" ({options})" if options else ""), fontsize=9)
    ax.set_xlabel("key position n")
    ax.set_ylabel("query position m")
    ax.figure.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label="relative distance seen")
    return ax


def save_distance_figure(schemes: list[PositionScheme], length: int, path: str | Path) -> Path:
    """One panel per scheme, side by side, written to `path` (PNG/PDF/SVG by suffix)."""
    size = 0.3 * min(length, 40) + 2
    fig = Figure(figsize=(size * len(schemes), size))
    axes = fig.subplots(1, len(schemes), squeeze=False)
    for scheme, ax in zip(schemes, axes[0]):
        draw_distances(scheme, length, ax)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150)
    return path

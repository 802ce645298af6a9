"""The position schemes' figure (train/positions/schemes.py): the relative distance each scheme's rotary sees per
(query, key) pair (the STRING paper's Fig. 5 / Fig. 8), one panel per scheme. Saved by `plots.save_figure`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from posfreq.analysis.plots.frequency import plt, save_figure

if TYPE_CHECKING:
    from posfreq.train.positions.scheme import PositionScheme

ANNOTATE_UP_TO = 24
"""Distance matrices up to this size get their distance written in every cell."""


def _draw_distances(scheme: PositionScheme, length: int, ax: plt.Axes) -> None:
    """Heatmap of `scheme.distances(length)` on `ax` (queries m down, keys n across; the masked upper triangle blank)."""
    matrix = scheme.distances(length).astype(float)
    image = ax.imshow(
        np.ma.masked_less(matrix, 0),
        cmap="viridis_r",
        vmin=0,
        vmax=max(length - 1, 1),
        interpolation="nearest",
    )
    if length <= ANNOTATE_UP_TO:
        for m, n in zip(*np.nonzero(matrix >= 0)):
            value = matrix[m, n]
            ax.text(
                n,
                m,
                f"{value:.0f}",
                ha="center",
                va="center",
                fontsize=7,
                color="black" if value < 0.5 * (length - 1) else "white",
            )
    options = ", ".join(f"{k}={v}" for k, v in scheme.options.items() if k != "protocol")
    ax.set_title(scheme.name + (f" ({options})" if options else ""), fontsize=9)
    ax.set_xlabel("key position n")
    ax.set_ylabel("query position m")
    ax.figure.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label="relative distance seen")


def plot_position_distances(
    schemes: Sequence[PositionScheme], length: int, stem: str | Path
) -> list[Path]:
    """Fig. 5 of the STRING paper: for each scheme, the relative distance its rotary sees per (query, key) pair."""
    size = 0.3 * min(length, 40) + 2
    fig, axes = plt.subplots(1, len(schemes), figsize=(size * len(schemes), size), squeeze=False)
    for scheme, ax in zip(schemes, axes[0]):
        _draw_distances(scheme, length, ax)
    return save_figure(fig, stem)

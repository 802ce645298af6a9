"""One probed model's figures (drawn by analysis/plots/derived.py): needle recall by context length and depth (Fig. 4), and
missed needles per third of the document (Table 4 as bars). Saved by `plots.save_figure`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import matplotlib
import numpy as np

from posfreq.analysis.plots.frequency import plt, save_figure


def plot_niah_heatmap(
    lengths: Sequence[int],
    depth_edges: np.ndarray,
    recall: np.ndarray,
    stem: str | Path,
    title: str = "",
) -> list[Path]:
    """Fig. 4: needle recall per context length (x) and needle depth (y, 0% at the top); NaN cells blank."""
    fig, ax = plt.subplots(figsize=(max(5.0, 0.45 * len(lengths) + 2.5), 4.5))
    cmap = matplotlib.colormaps["RdYlGn"].with_extremes(bad="white")
    image = ax.imshow(
        np.ma.masked_invalid(recall),
        aspect="auto",
        cmap=cmap,
        vmin=0.0,
        vmax=1.0,
        interpolation="nearest",
    )
    ax.set_xticks(
        range(len(lengths)), [str(n) for n in lengths], rotation=90 if len(lengths) > 8 else 0
    )
    centres = 100 * (depth_edges[:-1] + depth_edges[1:]) / 2
    ax.set_yticks(range(len(centres)), [f"{c:.0f}" for c in centres])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth (%)")
    ax.set_title(f"4-needle NIAH recall{': ' + title if title else ''}")
    fig.colorbar(image, ax=ax, label="needles retrieved (share)")
    return save_figure(fig, stem)


def plot_failure_by_thirds(
    rows: Sequence[Mapping], stem: str | Path, title: str = ""
) -> list[Path]:
    """Table 4 as bars: share of missed needles in each third of the document, per length and overall."""
    thirds = (
        [k.removeprefix("miss_rate_") for k in rows[0] if k.startswith("miss_rate_")]
        if rows
        else []
    )
    fig, ax = plt.subplots(figsize=(max(6.0, 0.5 * len(rows) + 3), 4.2))
    width = 0.8 / max(len(thirds), 1)
    x = np.arange(len(rows))
    for k, third in enumerate(thirds):
        ax.bar(
            x + (k - (len(thirds) - 1) / 2) * width,
            [r[f"miss_rate_{third}"] for r in rows],
            width,
            label=f"depth {third}",
        )
    ax.set_xticks(x, [str(r["length"]) for r in rows], rotation=90 if len(rows) > 10 else 0)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("share of needles missed")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"Failures by document depth{': ' + title if title else ''}")
    ax.legend()
    return save_figure(fig, stem)


def plot_scheme_pass_rates(rows: Sequence[Mapping], stem: str | Path) -> list[Path]:
    """Table 1 as a figure: pass rate vs length, a line per position scheme, with its 95% (Wilson) interval as bars."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    schemes = list(dict.fromkeys(r["scheme"] for r in rows))
    for k, scheme in enumerate(schemes):
        mine = sorted((r for r in rows if r["scheme"] == scheme), key=lambda r: r["length"])
        x = np.array([r["length"] for r in mine], dtype=float) * (1 + 0.01 * (k - len(schemes) / 2))
        y = np.array([r["pass_rate"] for r in mine])
        err = np.abs(np.array([[r["pass_lo"], r["pass_hi"]] for r in mine]).T - y)
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=scheme)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("test length (tokens)")
    ax.set_ylabel("pass rate (95% Wilson interval)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("4-needle NIAH by position scheme")
    ax.legend()
    return save_figure(fig, stem)

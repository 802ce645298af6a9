"""Effective-length figures: Fig. 2a (effective length vs tokens) and Fig. 2b (f(effective length) vs effective
length) of runs (analysis/tables/run_table.py) and across seeds (scripts/commands/compare.py; rows of checkpoints.csv), and the
pass rate vs test length of every milestone. Saved by `plots.save_figure`.

- `plot_fig2a_effective_length_vs_tokens`, `plot_fig2b_frequency_vs_effective_length`: several runs.
- `plot_fig2a_seed_bands`: effective length vs tokens per training length, median and seed band.
- `plot_fig2b_seeds`: f(effective length) vs effective length, every seed's checkpoints.
- `plot_pass_rate_curves`: pass rate vs test length of every milestone, one panel per training length.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from posfreq.analysis.plots.frequency import plt, save_figure
from posfreq.analysis.tables.pass_curve import STATUS_ALL_PASSED, STATUS_OK


def _censored_markers(
    ax: plt.Axes, xs: Sequence, ys: Sequence, statuses: Sequence[str], color: str
) -> None:
    """Hollow markers on points whose effective length is a lower bound (every probed length passed)."""
    pts = [(x, y) for x, y, s in zip(xs, ys, statuses) if s == STATUS_ALL_PASSED]
    if pts:
        ax.scatter(*zip(*pts), s=70, facecolors="none", edgecolors=color, zorder=3)


def _interval_bars(
    ax,
    centers: Sequence,
    values: Sequence,
    lo: Sequence | None,
    hi: Sequence | None,
    color: str,
    horizontal: bool = False,
) -> None:
    """Error bars from per-point (lo, hi) intervals of the value (empty cells skipped)."""
    if lo is None or hi is None:
        return
    pts = [
        (c, v, a, b)
        for c, v, a, b in zip(centers, values, lo, hi)
        if a not in (None, "") and b not in (None, "")
    ]
    if not pts:
        return
    c, v, a, b = (np.asarray(x, dtype=float) for x in zip(*pts))
    err = np.vstack([np.maximum(v - a, 0), np.maximum(b - v, 0)])
    if horizontal:
        ax.errorbar(v, c, xerr=err, fmt="none", ecolor=color, alpha=0.5, capsize=3)
    else:
        ax.errorbar(c, v, yerr=err, fmt="none", ecolor=color, alpha=0.5, capsize=3)


def _save_fig2a(
    fig: plt.Figure, ax: plt.Axes, stem: str | Path, xlabel: str, title: str
) -> list[Path]:
    """Fig. 2a's axes (effective length from 0 against tokens), legend and files."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel("effective context length (tokens)")
    ax.set_title(title)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend()
    return save_figure(fig, stem)


def _save_fig2b(
    fig: plt.Figure, ax: plt.Axes, stem: str | Path, xlabel: str, title: str
) -> list[Path]:
    """Fig. 2b's axes (log f against effective length), legend and files."""
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("position frequency f(effective length)")
    ax.set_title(title)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend()
    return save_figure(fig, stem)


def plot_fig2a_effective_length_vs_tokens(
    runs: Mapping[str, tuple[Sequence[int], Sequence[int], Sequence[str]]],
    stem: str | Path,
    intervals: Mapping[str, tuple[Sequence, Sequence]] | None = None,
) -> list[Path]:
    """Fig. 2a: effective length vs tokens seen; runs[label] = (tokens_trained, effective_length, status).

    `intervals[label]` = (lo, hi) per point draws each effective length's bootstrap interval.
    """
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, (tokens, eff, status) in runs.items():
        (line,) = ax.plot(tokens, eff, marker="o", label=label)
        _censored_markers(ax, tokens, eff, status, line.get_color())
        _interval_bars(
            ax, tokens, eff, *(intervals or {}).get(label, (None, None)), line.get_color()
        )
    return _save_fig2a(
        fig,
        ax,
        stem,
        "training tokens seen",
        "Effective length vs training tokens (bars: 95% bootstrap interval; hollow: all passed)",
    )


def plot_fig2b_frequency_vs_effective_length(
    runs: Mapping[str, tuple[Sequence[int], Sequence, Sequence[str]]],
    stem: str | Path,
    intervals: Mapping[str, tuple[Sequence, Sequence]] | None = None,
) -> list[Path]:
    """Fig. 2b: f(effective length) (log y) vs effective length; runs[label] = (effective_length, f, status).

    Points (in checkpoint order) with an undefined or zero f (no length passed, or effective length = L)
    are left out; `intervals[label]` = (lo, hi) of the effective length draws horizontal bars.
    """
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, (eff, freq, status) in runs.items():
        lo, hi = (intervals or {}).get(label, ([None] * len(eff), [None] * len(eff)))
        pts = [
            (e, f, s, a, b)
            for e, f, s, a, b in zip(eff, freq, status, lo, hi)
            if f not in (None, "") and float(f) > 0
        ]
        if not pts:
            ax.plot([], [], marker="o", label=f"{label} (no defined point)")
            continue
        xs, ys, ss, los, his = zip(*pts)
        (line,) = ax.plot(xs, [float(y) for y in ys], marker="o", label=label)
        _censored_markers(ax, xs, [float(y) for y in ys], ss, line.get_color())
        _interval_bars(ax, [float(y) for y in ys], xs, los, his, line.get_color(), horizontal=True)
    return _save_fig2b(
        fig,
        ax,
        stem,
        "effective context length (tokens)",
        "Position frequency at the effective length",
    )


def _by_group(rows: Sequence[Mapping]) -> dict[str, list[Mapping]]:
    """Rows per run group, labelled `L = 512`, or `L = 512, best_fit` when the rows hold several data variants."""
    variants = {r.get("variant") for r in rows}
    out: dict[tuple, list[Mapping]] = {}
    for r in rows:
        out.setdefault((int(r["train_len"]), str(r.get("variant") or "")), []).append(r)
    return {
        (f"L = {L}, {v}" if len(variants) > 1 else f"L = {L}"): mine
        for (L, v), mine in sorted(out.items())
    }


def plot_fig2a_seed_bands(rows: Sequence[Mapping], stem: str | Path) -> list[Path]:
    """Fig. 2a across seeds: per training length, each seed's curve (thin), the median and the min-max band."""
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for k, (label, mine) in enumerate(_by_group(rows).items()):
        color = f"C{k}"
        seeds = sorted({r["seed"] for r in mine}, key=str)
        tokens = sorted({r["tokens_trained"] for r in mine})
        table = np.full((len(seeds), len(tokens)), np.nan)
        for r in mine:
            table[seeds.index(r["seed"]), tokens.index(r["tokens_trained"])] = float(
                r["effective_length"]
            )
        for row in table:
            ax.plot(tokens, row, color=color, alpha=0.3, linewidth=0.8)
        ax.fill_between(tokens, np.nanmin(table, 0), np.nanmax(table, 0), color=color, alpha=0.15)
        ax.plot(
            tokens,
            np.nanmedian(table, 0),
            color=color,
            marker="o",
            label=f"{label} (median of {len(seeds)} seeds; band: min-max)",
        )
    return _save_fig2a(
        fig,
        ax,
        stem,
        "training tokens seen (warm-up included)",
        "Effective length vs training tokens, across seeds",
    )


def plot_fig2b_seeds(rows: Sequence[Mapping], stem: str | Path) -> list[Path]:
    """Fig. 2b across seeds: f(effective length) (log) vs effective length, with bootstrap intervals in x."""
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for k, (label, mine) in enumerate(_by_group(rows).items()):
        pts = [
            r
            for r in mine
            if r["effective_length_status"] == STATUS_OK
            and r["f_effective_length"] not in (None, "")
            and float(r["f_effective_length"]) > 0
        ]
        color = f"C{k}"
        if not pts:
            ax.plot([], [], marker="o", color=color, label=f"{label} (no defined point)")
            continue
        xs = np.array([float(r["effective_length"]) for r in pts])
        ys = np.array([float(r["f_effective_length"]) for r in pts])
        ax.scatter(
            xs, ys, color=color, label=f"{label} ({len(pts)} checkpoints, all seeds)", zorder=3
        )
        _interval_bars(
            ax,
            ys,
            xs,
            [r["effective_length_lo"] for r in pts],
            [r["effective_length_hi"] for r in pts],
            color,
            horizontal=True,
        )
    return _save_fig2b(
        fig,
        ax,
        stem,
        "effective context length (tokens; bars: 95% bootstrap interval)",
        "Position frequency at the effective length, across seeds",
    )


def plot_pass_rate_curves(
    rows: Sequence[Mapping], stem: str | Path, threshold: float = 0.5
) -> list[Path]:
    """Pass rate vs test length of every milestone (mean over seeds), one panel per training length (and variant)."""
    groups = _by_group(rows)
    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 4.2), squeeze=False)
    for ax, (label, mine) in zip(axes[0], groups.items()):
        tokens = sorted({r["tokens_trained"] for r in mine})
        cmap = plt.get_cmap("viridis")
        for i, t in enumerate(tokens):
            at = [r for r in mine if r["tokens_trained"] == t]
            cols = sorted(
                {k for r in at for k in r if k.startswith("pass_rate_") and r[k] not in (None, "")},
                key=lambda k: int(k.split("_")[-1]),
            )
            lengths = [int(c.split("_")[-1]) for c in cols]
            rates = [np.mean([float(r[c]) for r in at if r.get(c) not in (None, "")]) for c in cols]
            ax.plot(
                lengths,
                rates,
                marker=".",
                color=cmap(i / max(len(tokens) - 1, 1)),
                label=f"{t / 1e6:.2f}M tokens",
            )
        ax.axhline(threshold, color="grey", linestyle="--", linewidth=0.8)
        ax.set_title(f"{label}: pass rate by test length (mean over seeds)")
        ax.set_xlabel("test length (tokens)")
        ax.set_ylabel("pass rate")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    return save_figure(fig, stem)

"""Matplotlib figures, one function per figure; each saves `<stem>.png` and `<stem>.pdf`.

Position frequency (analysis/position_freq.py; the maths from analysis/frequency.py, the only analysis module
imported here):
- `plot_fig1a_length_and_frequency`: f(i) and the document-length distribution (bars) on twin axes.
- `plot_fig1b_uniform_lengths`: f(i) when document lengths are uniform on 1..L (quadratic).
- `plot_fig1c_concatenated`: f(i) when everything is concatenated into full rows (linear).
- `plot_fig3_budget_comparison`: f(i) for several training lengths at the same token budget.
- `plot_fig3_by_packing`: Fig. 3 once per panel (the corpus's Eq. 2, each packing strategy's trained f).
- `plot_packing_frequency`: f(i) at one training length, one curve per packing strategy.

Position schemes (train/positions.py):
- `plot_position_distances`: the relative distance each scheme's rotary sees, per (query, key) pair
  (the STRING paper's Fig. 5 / Fig. 8), one panel per scheme.

NIAH probe and effective length (analysis/probe.py, analysis/effective_length.py):
- `plot_niah_heatmap`: needle recall by context length and needle depth (Fig. 4).
- `plot_failure_by_thirds`: missed needles per third of the document (Table 4 as bars).
- `plot_fig2a_effective_length_vs_tokens`: effective length vs training tokens, several runs.
- `plot_fig2b_frequency_vs_effective_length`: f(effective length) vs effective length, several runs.

Across seeds (analysis/compare.py; rows of checkpoints.csv):
- `plot_fig2a_seed_bands`: effective length vs tokens per training length, median and seed band.
- `plot_fig2b_seeds`: f(effective length) vs effective length, every seed's checkpoints.
- `plot_pass_rate_curves`: pass rate vs test length of every milestone, one panel per training length.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Sequence

import matplotlib
import matplotlib.patches

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the non-interactive backend)
import numpy as np  # noqa: E402

from posfreq.analysis.frequency import length_buckets, position_shares  # noqa: E402
from posfreq.train.atomic import atomic_open  # noqa: E402
from posfreq.train.run_log import human  # noqa: E402

if TYPE_CHECKING:
    from posfreq.train.positions import PositionScheme


def save_figure(fig: plt.Figure, stem: str | Path) -> list[Path]:
    """Save a figure as PNG and PDF next to each other, close it, and return the two paths."""
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = [stem.with_suffix(".png"), stem.with_suffix(".pdf")]
    fig.tight_layout()
    for path in paths:
        with atomic_open(path, "wb") as fh:
            fig.savefig(fh, format=path.suffix[1:], dpi=150)
    plt.close(fig)
    return paths


def plot_fig1a_length_and_frequency(
    pieces: np.ndarray, f: np.ndarray, train_len: int, stem: str | Path
) -> list[Path]:
    """Fig. 1a with the paper's axes: x = document length / relative position i (log2, tokens); left y = f(i)
    (blue); right y = documents per length bin (orange bars, log-spaced bins of equal width, each labelled with its
    share of documents); the shares of position occurrences at i <= L/2 and i >= 3L/4 written on the plot.

    `pieces[n]` counts pieces of length n (0..L, from `piece_histogram`); `f` is Eq. 2 for this L. f(0) (every
    token) has no place on a log axis, so the line starts at i = 1.
    """
    total = max(int(pieces.sum()), 1)
    fig, ax = plt.subplots(figsize=(8.5, 5))
    ax.set_xscale("log", base=2)
    (line,) = ax.plot(np.arange(1, train_len), f[1:], color="tab:blue", linewidth=2)
    ax.set_ylim(0, 1.45 * max(float(f[1:].max(initial=0)), 1.0))  # headroom for the legend
    ax.set_ylabel("frequency of relative position i, f(i)", color="tab:blue")
    ax.set_xlabel("document length (bars) / relative position i (line), tokens, log scale")
    twin = ax.twinx()
    for lo, hi in length_buckets(train_len):
        count = int(pieces[lo:hi].sum())
        right = (
            hi if hi > lo + 1 else lo * np.sqrt(2)
        )  # exactly L: a bar half an octave wide, right of L
        twin.bar(
            lo,
            count,
            width=right - lo,
            align="edge",
            color="tab:orange",
            alpha=0.6,
            edgecolor="white",
        )
        if count:
            share = count / total
            twin.annotate(
                f"{share:.1%}" if share >= 0.001 else "<0.1%",
                (np.sqrt(lo * right), count),
                ha="center",
                va="bottom",
                fontsize=7,
                color="saddlebrown",
            )
    twin.set_ylabel("number of documents per length bin", color="tab:orange")
    twin.set_ylim(0, 1.45 * max(int(pieces[1:].max(initial=0)), 1))
    ax.set_zorder(twin.get_zorder() + 1)  # the line over the bars
    ax.patch.set_visible(False)
    ax.set_xlim(1, train_len * np.sqrt(2) * 1.05)
    ticks = [2**k for k in range(int(np.log2(train_len)) + 1)]
    ax.set_xticks(ticks, [str(t) for t in ticks], fontsize=7)
    for at in (train_len // 2, (3 * train_len) // 4):
        ax.axvline(at, color="grey", linestyle=":", linewidth=1)
    bars = matplotlib.patches.Patch(color="tab:orange", alpha=0.6)
    ax.legend(
        [line, bars],
        [
            "position frequency f(i), Eq. 2 (left axis)",
            "documents per length bin after cutting at L (right axis; % of documents)",
        ],
        loc="upper left",
        fontsize=7,
        title=_shares_text(f, train_len),
        title_fontsize=8,
        alignment="left",
    )
    ax.set_title(
        f"Fig. 1a: document lengths and position frequency, L = {train_len} (dotted: i = L/2, 3L/4)"
    )
    return save_figure(fig, stem)


def _shares_text(f: np.ndarray, train_len: int) -> str:
    """The two shares of position occurrences the paper quotes, as two lines for a figure."""
    shares = position_shares(f)
    return (
        f"i <= L/2 = {train_len // 2}: {shares['share_positions_le_half_L']:.1%} of position occurrences\n"
        f"i >= 3L/4 = {(3 * train_len) // 4}: {shares['share_positions_ge_three_quarter_L']:.1%}"
    )


def _plot_frequency_curve(
    f: np.ndarray, train_len: int, stem: str | Path, title: str, color: str
) -> list[Path]:
    """f(i) over 0..L-1 on linear axes from 0 (the Fig. 1b / 1c layout)."""
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(np.arange(train_len), f, color=color)
    ax.set_xlabel("relative position i (tokens)")
    ax.set_ylabel("position frequency f(i)")
    ax.set_title(title)
    ax.set_xlim(0, train_len)
    ax.set_ylim(bottom=0)
    return save_figure(fig, stem)


def plot_fig1b_uniform_lengths(f: np.ndarray, train_len: int, stem: str | Path) -> list[Path]:
    """Fig. 1b: f(i) when document lengths are uniform on 1..L: a quadratic decline."""
    return _plot_frequency_curve(
        f,
        train_len,
        stem,
        f"Uniform document lengths (1..{train_len}): f declines quadratically",
        "tab:green",
    )


def plot_fig1c_concatenated(f: np.ndarray, train_len: int, stem: str | Path) -> list[Path]:
    """Fig. 1c: f(i) when all text is concatenated into full L-token rows: linear, L - i."""
    return _plot_frequency_curve(
        f,
        train_len,
        stem,
        f"Concatenated into rows of {train_len}: f declines linearly",
        "tab:purple",
    )


def _draw_budget_comparison(
    ax: plt.Axes, curves: Mapping[int, np.ndarray], title: str, note: str | None
) -> None:
    """Fig. 3's panel on `ax`: f(i) (log y) of each training length L (key), and `note` in its lower left corner."""
    for train_len, f in sorted(curves.items()):
        ax.plot(np.arange(len(f)), f, label=f"L = {train_len}")
    ax.set_yscale("log")
    ax.set_xlabel("relative position i (tokens)")
    ax.set_ylabel("position frequency f(i) (log)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="upper right")
    if note:
        ax.text(
            0.02,
            0.03,
            "\n".join(textwrap.wrap(note, 62)),
            transform=ax.transAxes,
            fontsize=7,
            va="bottom",
            bbox={"facecolor": "white", "edgecolor": "grey", "alpha": 0.9},
        )


def plot_fig3_budget_comparison(
    curves: Mapping[int, np.ndarray],
    budget_tokens: float,
    stem: str | Path,
    note: str | None = None,
) -> list[Path]:
    """Fig. 3: f(i) for each training length L (key) after the same number of training tokens; `note` (e.g. why
    the curves part early) is written on the plot."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    _draw_budget_comparison(
        ax,
        curves,
        f"Fig. 3: f(i) after {human(budget_tokens)} training tokens, per training length",
        note,
    )
    return save_figure(fig, stem)


def plot_fig3_by_packing(
    panels: Mapping[str, tuple[Mapping[int, np.ndarray], str | None]],
    budget_tokens: float,
    stem: str | Path,
) -> list[Path]:
    """Fig. 3 once per panel (e.g. the corpus's Eq. 2 and each packing strategy's trained f): panels[title] =
    ({L: f after the budget}, note)."""
    columns = min(len(panels), 2)
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(6.5 * columns, 4.6 * rows), squeeze=False)
    for ax, (title, (curves, note)) in zip(axes.flat, panels.items()):
        _draw_budget_comparison(ax, curves, title, note)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(
        f"Fig. 3 per packing: f(i) after {human(budget_tokens)} training tokens (steps x tokens per step, "
        "padding included), per training length"
    )
    return save_figure(fig, stem)


def plot_packing_frequency(
    curves: Mapping[str, np.ndarray],
    labels: Mapping[str, str],
    train_len: int,
    budget_tokens: float,
    stem: str | Path,
) -> list[Path]:
    """f(i) at one L after the same budget, one curve per packing strategy (and the corpus's Eq. 2, key 'corpus',
    dashed); `labels[key]` is its legend entry (e.g. with its shares and padding)."""
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for key, f in curves.items():
        corpus = {
            "color": "black",
            "linestyle": (0, (4, 4)),
            "linewidth": 1.2,
            "zorder": 3,
        }  # on top, seen through
        ax.plot(
            np.arange(len(f)),
            f,
            label=labels[key],
            **(corpus if key == "corpus" else {"linewidth": 2}),
        )
    for at in (train_len // 2, (3 * train_len) // 4):
        ax.axvline(at, color="grey", linestyle=":", linewidth=1)
    ax.set_xlim(0, train_len)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("relative position i (tokens; dotted: L/2 and 3L/4)")
    ax.set_ylabel("position frequency f(i) (occurrences)")
    ax.set_title(
        f"f(i) per packing strategy, L = {train_len}, after {human(budget_tokens)} training tokens"
    )
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, title="shares of position occurrences", title_fontsize=7)
    return save_figure(fig, stem)


# Position schemes (train/positions.py).

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


# NIAH probe and effective length (analysis/probe.py, analysis/effective_length.py).


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


def _censored_markers(
    ax: plt.Axes, xs: Sequence, ys: Sequence, statuses: Sequence[str], color: str
) -> None:
    """Hollow markers on points whose effective length is a lower bound (every probed length passed)."""
    pts = [(x, y) for x, y, s in zip(xs, ys, statuses) if s == "all_passed"]
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
    """Fig. 2a: effective length vs tokens seen; runs[label] = (tokens_seen, effective_length, status).

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
        tokens = sorted({r["tokens_seen"] for r in mine})
        table = np.full((len(seeds), len(tokens)), np.nan)
        for r in mine:
            table[seeds.index(r["seed"]), tokens.index(r["tokens_seen"])] = float(
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
            if r["effective_length_status"] == "ok"
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
        tokens = sorted({r["tokens_seen"] for r in mine})
        cmap = plt.get_cmap("viridis")
        for i, t in enumerate(tokens):
            at = [r for r in mine if r["tokens_seen"] == t]
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

"""Matplotlib figures of the position frequency, one function per figure, and `save_figure`, which every figure
module (plots_*.py) saves with: `<stem>.png` and `<stem>.pdf`.

Position frequency (analysis/plots/corpus.py; the maths from analysis/corpus/frequency.py, the only analysis module
imported here):
- `plot_fig1a_length_and_frequency`: f(i) and the document-length distribution (bars) on twin axes.
- `plot_fig1b_uniform_lengths`: f(i) when document lengths are uniform on 1..L (quadratic).
- `plot_fig1c_concatenated`: f(i) when everything is concatenated into full rows (linear).
- `plot_fig3_budget_comparison`: f(i) for several training lengths at the same token budget.
- `plot_fig3_by_packing`: Fig. 3 once per panel (the corpus's Eq. 2, each packing strategy's trained f).
- `plot_packing_frequency`: f(i) at one training length, one curve per packing strategy.

The other families: analysis/plots/positions.py (position schemes' distances), analysis/plots/niah.py (one
probed model: Fig. 4, Table 4), analysis/plots/effective_length.py (Fig. 2a / 2b of runs and across seeds).
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Mapping

import matplotlib
import matplotlib.patches

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the non-interactive backend)
import numpy as np  # noqa: E402

from posfreq.analysis.corpus.frequency import length_buckets, position_shares  # noqa: E402
from posfreq.train.atomic import atomic_open  # noqa: E402
from posfreq.train.run.log import human  # noqa: E402


def save_figure(fig: plt.Figure, stem: str | Path) -> list[Path]:
    """Save a figure as PNG and PDF next to each other, close it, and return the two paths. The PDF carries no
    creation date, so the same figure is the same bytes on a rerun."""
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = [stem.with_suffix(".png"), stem.with_suffix(".pdf")]
    fig.tight_layout()
    for path in paths:
        with atomic_open(path, "wb") as fh:
            pdf = path.suffix == ".pdf"
            fig.savefig(
                fh,
                format=path.suffix[1:],
                dpi=150,
                metadata={"CreationDate": None} if pdf else None,
            )
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
    total_tokens: float,
    stem: str | Path,
    note: str | None = None,
) -> list[Path]:
    """Fig. 3: f(i) for each training length L (key) after the same number of training tokens; `note` (e.g. why
    the curves part early) is written on the plot."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    _draw_budget_comparison(
        ax,
        curves,
        f"Fig. 3: f(i) after {human(total_tokens)} training tokens, per training length",
        note,
    )
    return save_figure(fig, stem)


def plot_fig3_by_packing(
    panels: Mapping[str, tuple[Mapping[int, np.ndarray], str | None]],
    total_tokens: float,
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
        f"Fig. 3 per packing: f(i) after {human(total_tokens)} training tokens (steps x tokens per step, "
        "padding included), per training length"
    )
    return save_figure(fig, stem)


def plot_packing_frequency(
    curves: Mapping[str, np.ndarray],
    labels: Mapping[str, str],
    train_len: int,
    total_tokens: float,
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
        f"f(i) per packing strategy, L = {train_len}, after {human(total_tokens)} training tokens"
    )
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, title="shares of position occurrences", title_fontsize=7)
    return save_figure(fig, stem)

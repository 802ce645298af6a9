"""Matplotlib figures, one function per figure; each saves `<stem>.png` and `<stem>.pdf`.

Position frequency (analysis/position_freq.py):
- `plot_fig1a_length_and_frequency`: document-length distribution (bars) and f(i) on twin axes.
- `plot_fig1b_uniform_lengths`: f(i) when document lengths are uniform on 1..L (quadratic).
- `plot_fig1c_concatenated`: f(i) when everything is concatenated into full rows (linear).
- `plot_fig3_budget_comparison`: f(i) for several training lengths at the same token budget.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the non-interactive backend)
import numpy as np  # noqa: E402


def save_figure(fig: plt.Figure, stem: str | Path) -> list[Path]:
    """Save a figure as PNG and PDF next to each other, close it, and return the two paths."""
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = [stem.with_suffix(".png"), stem.with_suffix(".pdf")]
    fig.tight_layout()
    for path in paths:
        fig.savefig(path, dpi=150)
    plt.close(fig)
    return paths


def _bucket_label(lo: int, hi: int) -> str:
    """'256-511' for a range bar, '2048' for the single-length bar."""
    return f"{lo}" if hi == lo + 1 else f"{lo}-{hi - 1}"


def plot_fig1a_length_and_frequency(
    pieces: np.ndarray, f: np.ndarray, train_len: int, stem: str | Path
) -> list[Path]:
    """Fig. 1a: share of documents (after truncation to L) per length bucket, and f(i) on a twin axis.

    `pieces[n]` counts pieces of length n (0..L, from `piece_histogram`); `f` is Eq. 2 for this L.
    """
    from analysis.position_freq import length_buckets

    buckets = length_buckets(train_len)
    total = max(int(pieces.sum()), 1)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    # Bars span their length range on a linear token axis; the single-length bar (exactly L) gets
    # a visible width of L/32 just right of L.
    for lo, hi in buckets:
        share = 100 * pieces[lo:hi].sum() / total
        left, width = (lo, hi - lo) if hi > lo + 1 else (lo, train_len / 32)
        ax.bar(left, share, width=width, align="edge", color="tab:blue", alpha=0.6, edgecolor="white")
        ax.annotate(_bucket_label(lo, hi), (left + width / 2, share), ha="center", va="bottom", fontsize=7)
    ax.set_xlim(0, train_len * 1.04)
    ax.set_xlabel("document length after truncation (bars) / relative position i (line), tokens")
    ax.set_ylabel("share of documents (%)", color="tab:blue")
    twin = ax.twinx()
    twin.plot(np.arange(train_len), f, color="tab:red", label="f(i), Eq. 2")
    twin.set_ylim(bottom=0)
    twin.set_ylabel("position frequency f(i)", color="tab:red")
    ax.set_title(f"Document lengths and position frequency, L = {train_len}")
    twin.legend(loc="upper center")
    return save_figure(fig, stem)


def plot_fig1b_uniform_lengths(f: np.ndarray, train_len: int, stem: str | Path) -> list[Path]:
    """Fig. 1b: f(i) when document lengths are uniform on 1..L: a quadratic decline."""
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(np.arange(train_len), f, color="tab:green")
    ax.set_xlabel("relative position i")
    ax.set_ylabel("position frequency f(i)")
    ax.set_title(f"Uniform document lengths (1..{train_len}): f declines quadratically")
    ax.set_xlim(0, train_len)
    ax.set_ylim(bottom=0)
    return save_figure(fig, stem)


def plot_fig1c_concatenated(f: np.ndarray, train_len: int, stem: str | Path) -> list[Path]:
    """Fig. 1c: f(i) when all text is concatenated into full L-token rows: linear, L - i."""
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(np.arange(train_len), f, color="tab:purple")
    ax.set_xlabel("relative position i")
    ax.set_ylabel("position frequency f(i)")
    ax.set_title(f"Concatenated into rows of {train_len}: f declines linearly")
    ax.set_xlim(0, train_len)
    ax.set_ylim(bottom=0)
    return save_figure(fig, stem)


def plot_fig3_budget_comparison(
    curves: Mapping[int, np.ndarray], budget_tokens: float, stem: str | Path
) -> list[Path]:
    """Fig. 3: f(i) for each training length L (key) after the same number of training tokens."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for train_len, f in sorted(curves.items()):
        ax.plot(np.arange(len(f)), f, label=f"L = {train_len}")
    ax.set_yscale("log")
    ax.set_xlabel("relative position i")
    ax.set_ylabel("position frequency f(i) (log)")
    ax.set_title(f"Same token budget ({budget_tokens:.3g} tokens), different training lengths")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend()
    return save_figure(fig, stem)

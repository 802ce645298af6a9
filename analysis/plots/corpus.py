"""`posfreq analyze`'s figures (analysis/corpus/outputs.py lists them in summary.json): Fig. 1a/1b/1c and f per packing strategy for every L, and Fig. 3 across L (the
corpus f and each strategy's trained f at the same token budget) with a note on where and why the curves part.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import numpy as np

from posfreq.analysis.corpus.frequency import (
    concatenated_histogram,
    first_split,
    piece_histogram,
    position_frequency,
    scale_to_budget,
    uniform_length_histogram,
)
from posfreq.analysis.corpus.packing_prediction import Predictions, trained_at_budget
from posfreq.analysis.plots import frequency as plots

SPLIT_TOLERANCE = 0.05
"""Fig. 3's notes: two curves are apart where they differ by more than this share of the larger."""


def fig3_note(
    curves: Mapping[int, np.ndarray],
    corpus_stats: Mapping[int, dict],
    padding: Mapping[int, float] | None = None,
    strategy: str | None = None,
) -> str:
    """Fig. 3's note on one panel: are the shortest and the longest L's curves apart at i = 0 (padding), from which
    i do their shapes f/f(0) part, and why, when that is before i = L/2 (the paper, SlimPajama at 2K vs 4K: close up
    to i = 1024). `corpus_stats[L]` is `frequency_stats` of the corpus; `strategy` the packing of a trained f's
    panel (None: the corpus f)."""
    short, long = min(curves), max(curves)
    a, b = curves[short], curves[long]
    tolerance = f"{SPLIT_TOLERANCE:.0%}"
    parts = []
    if padding and first_split(a[:1], b[:1], SPLIT_TOLERANCE) == 0:
        parts.append(
            f"Apart from i = 0: padding fills {padding[short]:.1%} of the L = {short} rows and "
            f"{padding[long]:.1%} of the L = {long} rows, and padding counts in the budget but trains no "
            "position."
        )
    split = first_split(a / a[0], b / b[0], SPLIT_TOLERANCE)
    if split is None:
        parts.append(f"f/f(0) within {tolerance} at every i < {short}.")
    elif split >= short // 2:
        parts.append(f"f/f(0) within {tolerance} up to i = {split - 1}.")
    else:
        share = corpus_stats[short]["share_tokens_in_documents_longer_than_L"]
        parts.append(
            f"f/f(0) more than {tolerance} apart from i = {split} (the paper, SlimPajama at 2K vs 4K: close up to "
            f"i = 1024): {share:.0%} of the tokens are in documents longer than {short}, cut every {short} "
            f"tokens at L = {short} but every {long} at L = {long}"
            + (" (where rows end)" if strategy == "stream" else "")
            + (", and concat cuts again at every row boundary" if strategy == "concat" else "")
            + "; a cut removes every relative position "
            "across it."
        )
    return " ".join(parts)


def write_figures(
    directory: Path,
    hist: np.ndarray,
    stats: Mapping[str, dict],
    predictions: Predictions,
    total_tokens: float,
) -> list[Path]:
    """Fig. 1a/1b/1c and f per packing strategy for every L, and Fig. 3 (corpus f and each strategy's trained f)
    comparing all L at the same token budget; `stats` is summary.json's ``all.by_train_len``. Returns the files."""
    paths = []
    corpus = {L: scale_to_budget(position_frequency(hist, L), total_tokens) for L in predictions}
    for L, by_strategy in predictions.items():
        f = position_frequency(hist, L)
        paths += plots.plot_fig1a_length_and_frequency(
            piece_histogram(hist, L), f, L, directory / f"fig1a_L{L}"
        )
        tokens = int(f[0])
        uniform = position_frequency(uniform_length_histogram(L), L)
        paths += plots.plot_fig1b_uniform_lengths(
            scale_to_budget(uniform, tokens), L, directory / f"fig1b_L{L}"
        )
        full = position_frequency(concatenated_histogram(1, L), L)
        paths += plots.plot_fig1c_concatenated(
            scale_to_budget(full, tokens), L, directory / f"fig1c_L{L}"
        )
        fs = stats[str(L)]
        curves = {"corpus": corpus[L]}
        labels = {"corpus": f"corpus f, Eq. 2 over the pieces: {_shares_label(fs)}"}
        for strategy, prediction in by_strategy.items():
            ps = fs["packing"][strategy]
            curves[strategy] = trained_at_budget(prediction, L, total_tokens)
            labels[strategy] = (
                f"{strategy}, trained: {_shares_label(ps)}, padding {ps['padding_share']:.1%}"
            )
        paths += plots.plot_packing_frequency(
            curves, labels, L, total_tokens, directory / f"fig_packing_L{L}"
        )
    if len(predictions) > 1:
        corpus_stats = {L: stats[str(L)] for L in predictions}
        panels = {
            "corpus f: Eq. 2 over the pieces (the paper's Fig. 3)": (
                corpus,
                fig3_note(corpus, corpus_stats),
            )
        }
        for strategy in next(iter(predictions.values())):
            curves = {
                L: trained_at_budget(by_strategy[strategy], L, total_tokens)
                for L, by_strategy in predictions.items()
            }
            padding = {
                L: by_strategy[strategy].padding_share for L, by_strategy in predictions.items()
            }
            panels[f"{strategy}: trained f"] = (
                curves,
                fig3_note(curves, corpus_stats, padding, strategy=strategy),
            )
        name = "fig3_" + "_vs_".join(f"L{L}" for L in predictions)
        paths += plots.plot_fig3_by_packing(panels, total_tokens, directory / name)
    return paths


def _shares_label(stats: Mapping) -> str:
    """'i<=L/2 75.4%, i>=3L/4 6.3%' from a stats dict holding the two shares."""
    return (
        f"i<=L/2 {stats['share_positions_le_half_L']:.1%}, "
        f"i>=3L/4 {stats['share_positions_ge_three_quarter_L']:.1%}"
    )

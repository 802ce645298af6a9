"""Position frequency f(i), the paper's Eq. 2, from a document-length histogram; its analytic cases and statistics.

Eq. 2 lives in `position_frequency` only: documents are cut into pieces of at most L tokens (the
paper's truncation), then f(i) = sum over pieces s of max(|s| - i, 0) for 0 <= i < L. The same
function serves a corpus histogram, the analytic cases of Fig. 1b/1c, and a trainer checkpoint's
histogram of trained segment lengths or its prediction by the packing plan (train/data/packing_schedule.py;
segments are already <= L, so truncation is a no-op).

Numpy only (no matplotlib, no torch), so every job and figure that needs f imports it from here.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

PERCENTILES = (10, 25, 50, 75, 90, 99)


def as_histogram(length_hist: Sequence[int] | np.ndarray) -> np.ndarray:
    """Validate a length histogram (index = length, value = count) and return it as int64."""
    hist = np.asarray(length_hist)
    if hist.ndim != 1:
        raise ValueError(f"length histogram must be 1-D (index = length), got shape {hist.shape}")
    if hist.size and not np.issubdtype(hist.dtype, np.integer):
        raise ValueError(f"length histogram must hold integer counts, got dtype {hist.dtype}")
    hist = hist.astype(np.int64, copy=False)
    if (hist < 0).any():
        raise ValueError("length histogram has negative counts")
    return hist


def piece_histogram(length_hist: Sequence[int] | np.ndarray, train_len: int) -> np.ndarray:
    """Counts of pieces by length (0..L) after cutting every document into pieces of at most L.

    A document of length n gives n // L pieces of length L and one piece of length n % L when that
    is non-zero. O(max length), exact in int64.
    """
    if train_len < 1:
        raise ValueError(f"train_len must be >= 1, got {train_len}")
    hist = as_histogram(length_hist)
    n_rows = -(-hist.size // train_len)
    padded = np.zeros(n_rows * train_len, dtype=np.int64)
    padded[: hist.size] = hist
    by_remainder = padded.reshape(n_rows, train_len)  # row q, column r: documents of length qL + r
    pieces = np.zeros(train_len + 1, dtype=np.int64)
    pieces[1:train_len] = by_remainder[:, 1:].sum(axis=0)
    pieces[train_len] = int(by_remainder.sum(axis=1) @ np.arange(n_rows, dtype=np.int64))
    return pieces


def position_frequency(length_hist: Sequence[int] | np.ndarray, train_len: int) -> np.ndarray:
    """Eq. 2: f(i) = sum over pieces s (documents cut to <= L) of max(|s| - i, 0), for 0 <= i < L.

    `length_hist[n]` is the number of documents of length n: a corpus histogram, or a trainer
    checkpoint's bincount of trained segment lengths. O(L + max length) with cumulative sums,
    exact in int64.
    """
    pieces = piece_histogram(length_hist, train_len)
    lengths = np.arange(train_len + 1, dtype=np.int64)
    # f(i) = sum_{l > i} c_l * l  -  i * sum_{l > i} c_l, both suffix sums over l = i+1 .. L.
    count_above = np.cumsum(pieces[::-1])[::-1][1:]
    tokens_above = np.cumsum((pieces * lengths)[::-1])[::-1][1:]
    return tokens_above - lengths[:train_len] * count_above


def uniform_length_histogram(train_len: int, docs_per_length: int = 1) -> np.ndarray:
    """Fig. 1b's corpus: the same number of documents at every length 1..L."""
    hist = np.full(train_len + 1, docs_per_length, dtype=np.int64)
    hist[0] = 0
    return hist


def concatenated_histogram(n_rows: int, train_len: int) -> np.ndarray:
    """Fig. 1c's corpus: everything concatenated into `n_rows` full rows of L tokens."""
    hist = np.zeros(train_len + 1, dtype=np.int64)
    hist[train_len] = n_rows
    return hist


def scale_to_budget(f: np.ndarray, total_tokens: float, positions: int | None = None) -> np.ndarray:
    """f(i) after training on `total_tokens` tokens drawn like the rows that gave `f`.

    `positions`: the row positions those rows hold, padding included (a trainer counts its tokens as steps x
    tokens per step, so padding takes its share of the budget); None: f(0), the document tokens (no padding).
    """
    if f.size == 0 or f[0] == 0:
        raise ValueError("cannot scale an empty position frequency (no tokens)")
    return f.astype(np.float64) * (
        float(total_tokens) / float(f[0] if positions is None else positions)
    )


def first_split(f_a: np.ndarray, f_b: np.ndarray, tolerance: float = 0.05) -> int | None:
    """The smallest i (over both curves' common range) at which f_a and f_b differ by more than `tolerance` of the
    larger; None if they never do."""
    n = min(len(f_a), len(f_b))
    a, b = np.asarray(f_a[:n], dtype=np.float64), np.asarray(f_b[:n], dtype=np.float64)
    apart = np.flatnonzero(np.abs(a - b) > tolerance * np.maximum(np.abs(a), np.abs(b)))
    return int(apart[0]) if apart.size else None


def length_buckets(train_len: int) -> list[tuple[int, int]]:
    """Fig. 1a's bars as [lo, hi) ranges, log-spaced: [1, 2), [2, 4), [4, 8), ... doubling up to L, then exactly L.

    Equal widths on a log length axis, so no bar looks heavier for being wide.
    """
    edges = [2**k for k in range(64) if 2**k < train_len] + [train_len]
    return [(a, b) for a, b in zip(edges[:-1], edges[1:])] + [(train_len, train_len + 1)]


def bucket_label(lo: int, hi: int) -> str:
    """'256-511' for a range bucket [lo, hi), '2048' for the single-length bucket."""
    return f"{lo}" if hi == lo + 1 else f"{lo}-{hi - 1}"


def bucket_shares(pieces: np.ndarray, train_len: int) -> dict[str, float]:
    """Share of pieces (documents after truncation) in each of Fig. 1a's length buckets."""
    total = pieces.sum()
    return {
        bucket_label(lo, hi): float(pieces[lo:hi].sum() / total) if total else 0.0
        for lo, hi in length_buckets(train_len)
    }


def length_stats(length_hist: Sequence[int] | np.ndarray) -> dict:
    """Documents, tokens, mean/median/percentile/max lengths of a length histogram."""
    hist = as_histogram(length_hist)
    docs = int(hist.sum())
    if docs == 0:
        return {"documents": 0, "tokens": 0}
    tokens = int((hist * np.arange(hist.size)).sum())
    cumulative = np.cumsum(hist)

    def percentile(p: int) -> int:
        """Nearest-rank percentile: the smallest length with at least ceil(p% of documents) at or below it."""
        return int(np.searchsorted(cumulative, max(1, -(-p * docs // 100))))

    return {
        "documents": docs,
        "tokens": tokens,
        "mean_length": tokens / docs,
        "median_length": percentile(50),
        "percentiles": {f"p{p}": percentile(p) for p in PERCENTILES},
        "max_length": int(np.flatnonzero(hist).max()),
    }


def frequency_stats(
    length_hist: Sequence[int] | np.ndarray, train_len: int, total_tokens: float
) -> dict:
    """The paper's numbers for one L: pieces at exactly L and where the position occurrences sit.

    The shares at i <= L/2 and i >= 3L/4 are `position_shares` of Eq. 2; ``share_tokens_in_documents_longer_than_L``
    is the share of tokens in documents that this L cuts into pieces (the tokens whose f depends on L).
    """
    hist = as_histogram(length_hist)
    pieces = piece_histogram(hist, train_len)
    f = position_frequency(hist, train_len)
    if not f.any():
        return {"train_len": train_len, "pieces": 0}
    lengths = np.arange(hist.size, dtype=np.int64)
    return {
        "train_len": train_len,
        "pieces": int(pieces.sum()),
        "share_pieces_at_L": float(pieces[train_len] / pieces.sum()),
        "share_documents_longer_than_L": float(hist[train_len + 1 :].sum() / hist.sum()),
        "share_tokens_in_documents_longer_than_L": float(
            hist[train_len + 1 :] @ lengths[train_len + 1 :] / f[0]
        ),
        **position_shares(f),
        "piece_length_shares": bucket_shares(pieces, train_len),
        "total_tokens": total_tokens,
        "f_at_half_L_after_budget": float(scale_to_budget(f, total_tokens)[train_len // 2]),
    }


def position_shares(f: np.ndarray) -> dict:
    """Where the position occurrences of f (Eq. 2 for L = len(f)) sit: their total, and the shares at i <= L/2 and
    at i >= 3L/4 (the paper, L = 2048, SlimPajama: over 80% at i <= 1024, under 5% at i >= 1536)."""
    train_len, occurrences = len(f), int(np.sum(f))
    if occurrences == 0:
        raise ValueError("no position occurrences (no tokens)")
    return {
        "position_occurrences": occurrences,
        "share_positions_le_half_L": float(f[: train_len // 2 + 1].sum() / occurrences),
        "share_positions_ge_three_quarter_L": float(f[(3 * train_len) // 4 :].sum() / occurrences),
    }

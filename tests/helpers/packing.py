"""Independent references for the packing tests: pieces, best-fit fills and Eq. 2, each by a plain loop."""

from __future__ import annotations

import numpy as np

PIECE_RULES = ("best_fit", "padded")  # the strategies that place whole pieces (and pad)


def naive_pieces(lengths, L: int) -> list[int]:
    """Piece lengths of documents cut every L tokens, by a loop."""
    pieces = []
    for n in lengths:
        while n > 0:
            pieces.append(min(L, n))
            n -= L
    return pieces


def naive_best_fit_fills(sizes, L: int) -> list[int]:
    """Sorted row fills of best-fit decreasing, by scanning every open row for each item."""
    free: list[int] = []
    for s in sorted(sizes, reverse=True):
        fits = [i for i, f in enumerate(free) if f >= s]
        if fits:
            free[min(fits, key=lambda i: free[i])] -= s
        else:
            free.append(L - s)
    return sorted(L - f for f in free)


def naive_f(pieces, L: int) -> np.ndarray:
    """Eq. 2 by brute force: f(i) = sum over pieces s of max(|s| - i, 0)."""
    return np.array([sum(max(s - i, 0) for s in pieces) for i in range(L)], dtype=np.int64)

"""Paired tests of Table 1's comparisons: the exact McNemar test of one scheme against the baseline over the same
tests, and Holm's correction over the comparisons a table makes."""

from __future__ import annotations

from typing import Sequence

import numpy as np
from scipy import stats


def mcnemar_exact(baseline: Sequence[float], scheme: Sequence[float]) -> tuple[int, int, float]:
    """(tests only the scheme passed, tests only the baseline passed, the exact two-sided McNemar p-value): the
    binomial test of the discordant pairs at one half, 1 when there are none."""
    a, b = np.asarray(baseline, dtype=bool), np.asarray(scheme, dtype=bool)
    better, worse = int((b & ~a).sum()), int((a & ~b).sum())
    if better + worse == 0:
        return better, worse, 1.0
    return better, worse, float(stats.binomtest(better, better + worse, 0.5).pvalue)


def holm_adjust(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the given order: the k-th smallest of m is multiplied by m - k + 1,
    then made non-decreasing in that order and capped at 1. A comparison is significant at level a when its
    adjusted p is at most a, which holds the chance of any false finding among the m at a."""
    p = np.asarray(pvalues, dtype=float)
    order = np.argsort(p, kind="stable")
    scaled = np.minimum(1.0, (len(p) - np.arange(len(p))) * p[order])
    adjusted = np.empty_like(p)
    adjusted[order] = np.maximum.accumulate(scaled)
    return adjusted.tolist()

"""Table 1's paired tests (analysis/tables/paired_tests.py) against hand computations: the exact McNemar test from
binomial coefficients, and Holm's step-down adjustment worked through by hand."""

from __future__ import annotations

import pytest


def test_mcnemar_is_the_exact_binomial_test_of_the_discordant_tests() -> None:
    """By hand from math.comb: 7 tests only the scheme passed, 1 only rope: p = 2 P(X <= 1), X ~ Bin(8, 1/2)."""
    from math import comb

    from posfreq.analysis.tables.paired_tests import mcnemar_exact

    rope = [0] * 7 + [1] + [1] * 5 + [0] * 7
    scheme = [1] * 7 + [0] + [1] * 5 + [0] * 7
    better, worse, p = mcnemar_exact(rope, scheme)
    assert (better, worse) == (7, 1)
    assert p == pytest.approx(2 * (comb(8, 0) + comb(8, 1)) / 2**8, abs=1e-12)
    assert mcnemar_exact([1, 0], [1, 0]) == (0, 0, 1.0)  # no discordant test
    assert mcnemar_exact([0] * 4, [1] * 4)[2] == pytest.approx(2 / 16)


def test_holm_multiplies_the_kth_smallest_p_by_m_minus_k_plus_1_and_keeps_the_order() -> None:
    from posfreq.analysis.tables.paired_tests import holm_adjust

    # by hand: sorted 0.01, 0.02, 0.03, 0.5 -> 0.04, 0.06, 0.06 (max with the previous 0.06), 0.5
    assert holm_adjust([0.03, 0.5, 0.01, 0.02]) == pytest.approx([0.06, 0.5, 0.04, 0.06])
    assert holm_adjust([0.4, 0.9]) == pytest.approx([0.8, 0.9])
    assert holm_adjust([0.6, 0.7]) == pytest.approx([1.0, 1.0])

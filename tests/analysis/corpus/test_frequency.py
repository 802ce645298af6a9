"""Eq. 2 (analysis/corpus/frequency.py) against a naive reference and analytic cases, its statistics and helpers."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.corpus import naive_frequency

from posfreq.analysis.corpus import frequency as fq


@pytest.mark.parametrize("seed", range(5))
def test_fast_path_matches_naive_double_loop(seed):
    rng = np.random.default_rng(seed)
    train_len = int(rng.integers(2, 40))
    hist = rng.integers(0, 5, size=int(rng.integers(1, 4 * train_len)))
    hist[min(train_len, hist.size - 1)] += 3  # documents of exactly L (or the longest there is)
    f = fq.position_frequency(hist, train_len)
    assert f.dtype == np.int64 and f.shape == (train_len,)
    np.testing.assert_array_equal(f, naive_frequency(hist, train_len))


def test_one_document_of_length_L():
    L = 64
    np.testing.assert_array_equal(
        fq.position_frequency(fq.concatenated_histogram(1, L), L), L - np.arange(L)
    )


def test_concatenated_rows_are_linear():
    L, rows = 128, 1000
    f = fq.position_frequency(fq.concatenated_histogram(rows, L), L)
    np.testing.assert_array_equal(f, rows * (L - np.arange(L)))


def test_uniform_lengths_are_quadratic():
    L = 100
    f = fq.position_frequency(fq.uniform_length_histogram(L, docs_per_length=3), L)
    k = L - np.arange(L)
    np.testing.assert_array_equal(f, 3 * k * (k + 1) // 2)


def test_truncation_before_eq2():
    L = 10
    hist = np.zeros(2 * L + 4, dtype=np.int64)
    hist[2 * L + 3] = 1  # one document of 23 tokens -> pieces 10, 10, 3
    np.testing.assert_array_equal(fq.piece_histogram(hist, L)[[3, L]], [1, 2])
    expected = 2 * (L - np.arange(L)) + np.maximum(3 - np.arange(L), 0)
    np.testing.assert_array_equal(fq.position_frequency(hist, L), expected)


def test_trained_segment_histogram_needs_no_truncation():
    L = 16
    segments = np.bincount([16, 16, 5, 1, 9, 16], minlength=L + 1)  # as a checkpoint stores it
    expected = sum(np.maximum(n - np.arange(L), 0) for n in [16, 16, 5, 1, 9, 16])
    np.testing.assert_array_equal(fq.position_frequency(segments, L), expected)


def test_exact_in_int64_at_trillion_scale():
    L = 2048
    f = fq.position_frequency(fq.concatenated_histogram(10**12 // L, L), L)
    assert int(f[0]) == (10**12 // L) * L and f.dtype == np.int64


def test_scale_to_budget_and_bad_inputs():
    f = fq.position_frequency(np.bincount([4, 8], minlength=9), 8)
    scaled = fq.scale_to_budget(f, 1200)
    assert scaled[0] == pytest.approx(1200) and scaled[1] == pytest.approx(1200 * f[1] / f[0])
    with pytest.raises(ValueError, match="integer"):
        fq.position_frequency(np.array([0.0, 1.0]), 4)
    with pytest.raises(ValueError, match="negative"):
        fq.position_frequency(np.array([0, -1]), 4)
    with pytest.raises(ValueError, match="1-D"):
        fq.position_frequency(np.zeros((2, 2), dtype=int), 4)


def test_frequency_stats_shares():
    L = 8
    hist = fq.concatenated_histogram(1, L)
    stats = fq.frequency_stats(hist, L, total_tokens=80)
    f = L - np.arange(L)  # 8..1, sum 36; i <= 4: 8+7+6+5+4 = 30; i >= 6: 2+1 = 3
    assert stats["share_pieces_at_L"] == 1.0
    assert stats["share_positions_le_half_L"] == pytest.approx(30 / f.sum())
    assert stats["share_positions_ge_three_quarter_L"] == pytest.approx(3 / f.sum())
    assert fq.length_stats(np.bincount([2, 2, 3, 10]))["median_length"] == 2


def test_first_split_and_log_spaced_buckets():
    rng = np.random.default_rng(0)
    for _ in range(20):
        a = rng.uniform(1, 2, size=30)
        b = a * np.where(rng.random(30) < 0.1, 1.2, 1.0)
        apart = [i for i in range(30) if abs(a[i] - b[i]) > 0.05 * max(a[i], b[i])]
        assert fq.first_split(a, b) == (apart[0] if apart else None)
    for L in (2, 16, 100, 2048):
        buckets = fq.length_buckets(L)
        assert [n for lo, hi in buckets for n in range(lo, hi)] == list(
            range(1, L + 1)
        )  # each length once
        assert all(hi == 2 * lo for lo, hi in buckets[:-2]) and buckets[-1] == (L, L + 1)

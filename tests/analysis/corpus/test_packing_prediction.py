"""Each packing strategy's predicted trained f (analysis/corpus/packing_prediction.py), as `write_outputs` writes it,
against brute-force packings."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.corpus import naive_frequency

from posfreq.analysis.corpus import histogram as hg
from posfreq.analysis.corpus.outputs import write_outputs
from posfreq.analysis.corpus.packing_prediction import PackingSettings


def naive_pieces(length_hist, train_len):
    """Every piece length, by cutting each document every L tokens in a loop."""
    pieces = []
    for length, count in enumerate(length_hist):
        for _ in range(int(count)):
            pieces += [train_len] * (length // train_len) + (
                [length % train_len] if length % train_len else []
            )
    return pieces


def naive_best_fit_rows(sizes, capacity):
    """Rows best-fit decreasing needs: each piece, longest first, into the fullest open row that holds it."""
    free = []
    for size in sorted(sizes, reverse=True):
        fits = [k for k, space in enumerate(free) if space >= size]
        if fits:
            k = min(fits, key=lambda j: free[j])
            free[k] -= size
        else:
            free.append(capacity - size)
    return len(free)


def concat_segments(doc_len, docs, train_len):
    """Brute force for a corpus of `docs` documents of one length (any order is the same order): lay the epoch's
    documents end to end (and the next epoch's after them), cut rows of L from its start until a row starts past
    the epoch, and cut each row's tokens wherever a document, a piece (every L tokens of a document) or a row
    ends; returns the segment lengths."""
    rows = -(-doc_len * docs // train_len)
    end = rows * train_len
    cuts = set(range(0, end + 1, train_len))
    for start in range(0, end, doc_len):
        cuts |= set(range(start, min(start + doc_len, end), train_len)) | {
            min(start + doc_len, end)
        }
    cuts = sorted(cuts)
    return [b - a for a, b in zip(cuts, cuts[1:])]


def write(histogram, tmp_path, train_lens, **settings):
    """write_outputs without figures into tmp_path/out; returns (summary, npz arrays)."""
    out = tmp_path / "out"
    summary = write_outputs(
        out,
        histogram,
        {"corpus": "test"},
        train_lens,
        1e12,
        PackingSettings(**settings),
    )
    with np.load(out / "position_frequency.npz") as arrays:
        return summary, dict(arrays)


def test_best_fit_and_padded_train_exactly_eq2_over_the_pieces(tmp_path):
    rng = np.random.default_rng(7)
    histogram = hg.LengthHistogram()
    histogram.add("a", rng.integers(1, 90, size=60))
    histogram.add("b", rng.integers(1, 40, size=40))
    train_lens = [16, 24, 64]
    summary, arrays = write(
        histogram, tmp_path, train_lens, seed=3, shuffle_block=1000, global_batch_tokens=1000
    )
    hist = histogram.counts()
    for L in train_lens:
        expected = naive_frequency(hist, L)
        pieces = naive_pieces(hist, L)
        tokens = sum(pieces)
        np.testing.assert_array_equal(arrays[f"L{L}/f_trained_best_fit"], expected)
        np.testing.assert_array_equal(arrays[f"L{L}/f_trained_padded"], expected)
        packing = summary["all"]["by_train_len"][str(L)]["packing"]
        assert packing["padded"]["rows_per_epoch"] == len(pieces)
        assert packing["padded"]["padding_share"] == pytest.approx(1 - tokens / (len(pieces) * L))
        assert packing["padded"]["tokens_lost_per_step"] == pytest.approx(
            1000 * (1 - tokens / (len(pieces) * L))
        )
        rows = naive_best_fit_rows(pieces, L)  # one shuffle block holds the whole corpus
        assert packing["best_fit"]["rows_per_epoch"] == rows
        assert packing["best_fit"]["padding_share"] == pytest.approx(1 - tokens / (rows * L))
        for strategy in ("best_fit", "padded"):
            stats = packing[strategy]
            assert stats["position_occurrences"] == expected.sum()
            assert stats["share_positions_le_half_L"] == pytest.approx(
                expected[: L // 2 + 1].sum() / expected.sum()
            )
            assert stats["share_positions_ge_three_quarter_L"] == pytest.approx(
                expected[3 * L // 4 :].sum() / expected.sum()
            )
            assert stats["share_segments_at_L"] == pytest.approx(pieces.count(L) / len(pieces))


@pytest.mark.parametrize(
    "doc_len, docs, train_len", [(37, 11, 16), (16, 5, 16), (5, 40, 16), (100, 3, 64)]
)
@pytest.mark.parametrize("copies", [1, 2])
def test_concat_prediction_equals_a_brute_force_stream(tmp_path, doc_len, docs, train_len, copies):
    histogram = hg.LengthHistogram()
    histogram.add("only", np.full(docs, doc_len))
    upsample = {"0-": float(copies)} if copies > 1 else {}
    summary, arrays = write(histogram, tmp_path, [train_len], seed=1, length_upsample=upsample)
    segments = concat_segments(doc_len, copies * docs, train_len)
    expected = naive_frequency(np.bincount(segments), train_len)
    np.testing.assert_array_equal(arrays[f"L{train_len}/f_trained_concat"], expected)
    stats = summary["all"]["by_train_len"][str(train_len)]["packing"]["concat"]
    assert stats["rows_per_epoch"] == -(-copies * docs * doc_len // train_len)
    assert stats["padding_share"] == 0 and stats["tokens_lost_per_step"] == 0
    assert stats["share_segments_at_L"] == pytest.approx(segments.count(train_len) / len(segments))
    np.testing.assert_array_equal(
        arrays[f"L{train_len}/f"], naive_frequency(histogram.counts(), train_len)
    )


def test_length_upsample_weights_the_trained_f_not_the_corpus_f(tmp_path):
    histogram = hg.LengthHistogram()
    histogram.add("arxiv", np.array([50, 70, 70, 9]))
    histogram.add("c4", np.array([3, 12, 30, 30]))
    _, arrays = write(histogram, tmp_path, [32], length_upsample={"arxiv:0-": 3.0, "0-20": 2.0})
    weighted = 3 * histogram.counts("arxiv")
    c4 = histogram.counts("c4")
    weighted[: c4.size] += np.where(np.arange(c4.size) < 20, 2, 1) * c4
    np.testing.assert_array_equal(arrays["L32/f_trained_best_fit"], naive_frequency(weighted, 32))
    np.testing.assert_array_equal(arrays["L32/f"], naive_frequency(histogram.counts(), 32))

"""The histogram job (analysis/corpus/histogram.py): npz round trip, counting against tokenizing one by one, source
filters, workers and shards."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.corpus import write_slimpajama

from posfreq.analysis.corpus import histogram as hg
from posfreq.train.data.corpora import resolve_corpus
from posfreq.train.data.tokenizer import get_tokenizer


def test_histogram_npz_round_trip(tmp_path):
    h = hg.LengthHistogram()
    h.add("a", np.array([3, 3, 70000]))
    h.add("b", np.array([5]))
    hg.save_histogram(tmp_path / "h.npz", h, {"x": 1})
    back, meta = hg.load_histogram(tmp_path / "h.npz")
    assert meta == {"x": 1} and back.sources == ["a", "b"]
    np.testing.assert_array_equal(back.counts(), h.counts())


@pytest.fixture
def slimpajama(tmp_path):
    return write_slimpajama(tmp_path)


def one_by_one(records, tokenizer, keep=lambda source: True):
    """Reference: tokenize each document alone, length = tokens + EOS, counted per source."""
    out = {}
    for r in records:
        source = r["meta"]["redpajama_set_name"]
        if keep(source):
            out.setdefault(source, []).append(len(tokenizer.encode(r["text"])) + 1)
    return {s: np.bincount(v) for s, v in out.items()}


def assert_histograms_equal(histogram, expected):
    assert histogram.sources == sorted(expected)
    for source, hist in expected.items():
        np.testing.assert_array_equal(histogram.counts(source), np.trim_zeros(hist, "b"))


@pytest.mark.parametrize("tokenizer", ["bytes", "llama3"])
def test_corpus_histogram_equals_tokenizing_one_by_one(slimpajama, tokenizer):
    root, records = slimpajama
    corpus = resolve_corpus("slimpajama", data_dir=root)
    settings = hg.CountSettings(tokenizer=tokenizer, default_source=corpus.default_source)
    histogram, stats = hg.count_lengths(corpus.files, settings, workers=1, progress=False)
    assert stats.documents == len(records)
    assert_histograms_equal(histogram, one_by_one(records, get_tokenizer(tokenizer)))


def test_source_filter_and_worker_shard_independence(slimpajama):
    root, records = slimpajama
    corpus = resolve_corpus("slimpajama", data_dir=root, sources=["-github"])
    settings = hg.CountSettings(tokenizer="bytes", sources=corpus.sources)
    serial, _ = hg.count_lengths(corpus.files, settings, workers=1, progress=False)
    expected = one_by_one(records, get_tokenizer("bytes"), keep=lambda s: s != "RedPajamaGithub")
    assert_histograms_equal(serial, expected)
    parallel, _ = hg.count_lengths(corpus.files, settings, workers=2, progress=False)
    merged = hg.LengthHistogram()
    for i in range(4):
        part, _ = hg.count_lengths(corpus.shard(i, 4).files, settings, workers=1, progress=False)
        merged.merge(part)
    for other in (parallel, merged):
        assert other.sources == serial.sources
        for s in serial.sources:
            np.testing.assert_array_equal(other.counts(s), serial.counts(s))

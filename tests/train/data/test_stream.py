"""Corpora streamed with `datasets` (train/data/stream.py): the same histograms as a local copy, cache keys
that follow the content, and the hub tried only when asked."""

from __future__ import annotations

import pytest
from helpers.corpus import make_slimpajama, record

from posfreq.train.data.corpora import resolve_corpus
from posfreq.train.data.formats import write_jsonl
from posfreq.train.data.records import CorpusError

# --------------------------------------------------------------- streaming with `datasets`
# `datasets.load_dataset` reads a local directory in SlimPajama's layout through the same streaming
# code path as a hub id, so these tests stream for real without a network.


def length_counts(docs, tokenizer) -> dict:
    """Reference: {source: sorted lengths (tokens + EOS)} by tokenizing documents one by one."""
    out: dict = {}
    for doc in docs:
        out.setdefault(doc.source, []).append(len(tokenizer.encode(doc.text)) + 1)
    return {source: sorted(lengths) for source, lengths in out.items()}


def histogram_counts(histogram) -> dict:
    """{source: sorted lengths} of a LengthHistogram, comparable with `length_counts`."""
    import numpy as np

    return {
        s: np.repeat(np.arange(histogram.counts(s).size), histogram.counts(s)).tolist()
        for s in histogram.sources
    }


def test_stream_histogram_equals_local_copy_and_one_by_one(tmp_path, monkeypatch):
    from posfreq.analysis.corpus import histogram as hg
    from posfreq.train.data.stream import StreamShard
    from posfreq.train.data.tokenizer import get_tokenizer

    monkeypatch.delenv("SLIMPAJAMA_HF", raising=False)
    written = make_slimpajama(tmp_path / "sp")
    make_slimpajama(tmp_path / "sp", split="validation", chunks=(1,), files_per_chunk=1)
    local = resolve_corpus("slimpajama", data_dir=tmp_path / "sp")
    stream = resolve_corpus(
        "slimpajama", data_dir=tmp_path / "missing", hf_dataset=str(tmp_path / "sp")
    )
    assert len(stream.files) == len(local.files) == 6 and all(
        isinstance(f, StreamShard) for f in stream.files
    )
    docs = list(stream.documents())
    assert sorted(docs, key=str) == sorted(
        local.documents(), key=str
    )  # train split only, every document
    assert len(docs) == len(written)

    settings = hg.CountSettings(tokenizer="bytes", default_source=stream.default_source)
    from_stream, stats = hg.count_lengths(stream.files, settings, workers=1, progress=False)
    from_local, _ = hg.count_lengths(local.files, settings, workers=1, progress=False)
    expected = length_counts(docs, get_tokenizer("bytes"))
    assert histogram_counts(from_stream) == histogram_counts(from_local) == expected
    assert stats.documents == len(written)

    kept = resolve_corpus(
        "slimpajama",
        data_dir=tmp_path / "missing",
        hf_dataset=str(tmp_path / "sp"),
        sources=["-github"],
    )
    settings = hg.CountSettings(tokenizer="bytes", sources=kept.sources)
    serial, stats = hg.count_lengths(kept.files, settings, workers=1, progress=False)
    assert histogram_counts(serial) == length_counts(
        [d for d in docs if d.source != "RedPajamaGithub"], get_tokenizer("bytes")
    )
    assert stats.filtered == sum(d.source == "RedPajamaGithub" for d in docs)
    parallel, _ = hg.count_lengths(kept.files, settings, workers=2, progress=False)
    merged = hg.LengthHistogram()
    for i in range(4):
        merged.merge(
            hg.count_lengths(kept.shard(i, 4).files, settings, workers=1, progress=False)[0]
        )
    assert histogram_counts(parallel) == histogram_counts(merged) == histogram_counts(serial)


def test_stream_cache_key_follows_dataset_split_and_content(tmp_path):
    from posfreq.analysis.corpus import histogram as hg

    make_slimpajama(tmp_path / "sp", chunks=(1,))
    make_slimpajama(tmp_path / "sp", split="validation", chunks=(1,))
    settings = hg.CountSettings(tokenizer="bytes")

    def key(split="train"):
        return hg.cache_key(
            resolve_corpus(
                "slimpajama", data_dir=tmp_path / "no", split=split, hf_dataset=str(tmp_path / "sp")
            ),
            settings,
        )

    first = key()
    assert key() == first and key("validation") != first
    write_jsonl(
        tmp_path / "sp" / "train" / "chunk1" / "example_train_0.jsonl.zst", [record("changed")]
    )
    assert key() != first


def test_stream_env_var_and_prepare_data(tmp_path, monkeypatch):
    from posfreq.train.data.tokens.shards import TokenDataset

    written = make_slimpajama(tmp_path / "sp", chunks=(1, 2), files_per_chunk=1)
    monkeypatch.setenv("SLIMPAJAMA_DIR", str(tmp_path / "missing"))
    monkeypatch.setenv("SLIMPAJAMA_HF", str(tmp_path / "sp"))
    corpus = resolve_corpus("slimpajama")
    from posfreq.train.data.tokens import prepare as prep

    totals = prep.prepare(corpus, tmp_path / "tokens", "bytes", progress=False)
    assert totals.docs == len(written)
    data = TokenDataset(tmp_path / "tokens", tokenizer="bytes")
    assert [s.name for s in data.shards] == ["train__shard_0_of_2", "train__shard_1_of_2"]
    texts = sorted(bytes(data.document(i)[:-1].tolist()).decode() for i in range(data.num_docs))
    assert texts == sorted(r["text"] for r in written)
    assert prep.prepare(corpus, tmp_path / "tokens", "bytes", progress=False).skipped_complete == 2


def test_stream_not_tried_unless_asked_and_errors_list_every_place(tmp_path, monkeypatch):
    monkeypatch.delenv("SLIMPAJAMA_DIR", raising=False)
    monkeypatch.delenv("SLIMPAJAMA_HF", raising=False)
    monkeypatch.setenv("POSFREQ_CACHE", str(tmp_path / "cache"))
    with pytest.raises(CorpusError, match=r"dataset hub: not tried") as err:
        resolve_corpus("slimpajama")
    assert "--hf-dataset cerebras/SlimPajama-627B" in str(err.value)
    missing = tmp_path / "no_such_dataset"
    with pytest.raises(CorpusError) as err:
        resolve_corpus("slimpajama", data_dir=tmp_path / "dir", hf_dataset=str(missing))
    message = str(err.value)
    assert str(tmp_path / "dir" / "train") in message  # --data-dir
    assert f"dataset '{missing}', split 'train'" in message and "FileNotFoundError" in message
    assert "chunk1..chunk10" in message and "--corpus pg-essays" in message
    monkeypatch.setenv("SLIMPAJAMA_HF", str(missing))
    with pytest.raises(CorpusError) as err:
        resolve_corpus("slimpajama")
    message = str(err.value)
    assert (
        "$SLIMPAJAMA_DIR: unset" in message
        and str(tmp_path / "cache" / "SlimPajama-627B" / "train") in message
    )
    assert "($SLIMPAJAMA_HF)" in message and "FileNotFoundError" in message


@pytest.mark.slow  # a child process, a notebook kernel or a deliberate timeout
def test_cli_hub_dataset_offline_fails_fast_with_where_it_looked(tmp_path):
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k not in ("SLIMPAJAMA_DIR", "SLIMPAJAMA_HF")}
    env.update(HF_HUB_OFFLINE="1", POSFREQ_CACHE=str(tmp_path / "cache"))
    start = time.perf_counter()
    result = subprocess.run(
        [
            sys.executable,
            "analysis/position_freq.py",
            "--corpus",
            "slimpajama",
            "--hf-dataset",
            "no-such-org/fake",
            "--out",
            str(tmp_path / "out"),
            "--quiet",
        ],
        cwd=Path(__file__).resolve().parents[3],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0 and time.perf_counter() - start < 60
    assert (
        "dataset 'no-such-org/fake', split 'train', streamed with `datasets` (--hf-dataset)"
        in result.stderr
    )
    assert (
        "Offline" in result.stderr
        and str(tmp_path / "cache" / "SlimPajama-627B" / "train") in result.stderr
    )
    assert "--corpus pg-essays" in result.stderr

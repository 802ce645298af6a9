"""Corpus registry: SlimPajama layout, local formats, source filters, and bad-input errors."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from helpers.corpus import make_slimpajama

from posfreq.train.data.corpora import Corpus, SourceFilter, iter_documents, resolve_corpus
from posfreq.train.data.formats import write_jsonl
from posfreq.train.data.records import CorpusError, Document, ReadStats


def test_slimpajama_layout_natural_order_and_documents(tmp_path):
    written = make_slimpajama(tmp_path)
    corpus = resolve_corpus("slimpajama", data_dir=tmp_path)
    names = [f"{p.parent.name}/{p.name}" for p in corpus.files]
    assert names == [f"chunk{c}/example_train_{n}.jsonl.zst" for c in (1, 2, 10) for n in (0, 1)]
    docs = list(corpus.documents())
    assert docs == [Document(r["text"], r["meta"]["redpajama_set_name"]) for r in written]


def test_slimpajama_env_var_and_split(tmp_path, monkeypatch):
    make_slimpajama(tmp_path, split="validation", chunks=(1,), files_per_chunk=1)
    monkeypatch.setenv("SLIMPAJAMA_DIR", str(tmp_path))
    corpus = resolve_corpus("slimpajama", split="validation")
    assert len(corpus.files) == 1 and "validation" in str(corpus.files[0])


def test_slimpajama_missing_says_where_and_layout(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIMPAJAMA_DIR", str(tmp_path / "nowhere"))
    monkeypatch.setenv("POSFREQ_CACHE", str(tmp_path / "cache"))
    with pytest.raises(CorpusError) as err:
        resolve_corpus("slimpajama")
    message = str(err.value)
    assert str(tmp_path / "nowhere" / "train") in message
    assert str(tmp_path / "cache" / "SlimPajama-627B" / "train") in message
    assert "chunk1..chunk10" in message and "--corpus pg-essays" in message


def test_source_filter_includes_excludes_and_aliases():
    drop_github = SourceFilter(["-github"])
    assert not drop_github("RedPajamaGithub") and drop_github("RedPajamaC4")
    only = SourceFilter(["ArXiv", "redpajamabook"])
    assert only("RedPajamaArXiv") and only("RedPajamaBook") and not only("RedPajamaC4")
    assert not SourceFilter(None) and SourceFilter(None)("anything")


def test_source_filter_counts_filtered(tmp_path):
    make_slimpajama(tmp_path, chunks=(1,), files_per_chunk=1)
    corpus = resolve_corpus("slimpajama", data_dir=tmp_path, sources=["-github"])
    stats = ReadStats()
    docs = list(corpus.iter_documents(corpus.files[0], stats=stats))
    assert {d.source for d in docs} == {"RedPajamaC4"}
    assert (stats.documents, stats.filtered) == (2, 1)


def test_local_formats_and_text_field(tmp_path):
    recs = [{"body": "first", "source": "a"}, {"body": "second"}]
    write_jsonl(tmp_path / "d" / "x.jsonl", recs)
    (tmp_path / "d" / "y.json").write_text(json.dumps(recs))
    pq.write_table(pa.table({"body": ["third"], "other": [1]}), tmp_path / "d" / "z.parquet")
    (tmp_path / "d" / "w.txt").write_text("fourth")
    corpus = resolve_corpus(tmp_path / "d", text_field="body")
    assert [p.name for p in corpus.files] == ["w.txt", "x.jsonl", "y.json", "z.parquet"]
    docs = list(corpus.documents())
    assert [d.text for d in docs] == ["fourth", "first", "second", "first", "second", "third"]
    assert [d.source for d in docs] == ["d", "a", "d", "a", "d", "d"]


def test_json_extension_holding_json_lines(tmp_path):
    path = write_jsonl(tmp_path / "lines.json", [{"text": "a"}, {"text": "b"}])
    assert [d.text for d in iter_documents(path)] == ["a", "b"]


def test_malformed_json_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n\n{"text": broken\n{"text": "fine"}\n')
    with pytest.raises(CorpusError, match=r"bad\.jsonl:line 3: malformed JSON"):
        list(iter_documents(path))
    stats = ReadStats()
    assert [d.text for d in iter_documents(path, on_error="skip", stats=stats)] == ["ok", "fine"]
    assert stats.skipped == 1 and "line 3" in stats.errors[0]


def test_missing_text_field_names_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "f.jsonl", [{"text": "a"}, {"content": "b"}])
    with pytest.raises(CorpusError, match=r"f\.jsonl:line 2: text field 'text' is missing"):
        list(iter_documents(path))


def test_corrupt_zst_names_file_and_line(tmp_path):
    lines = b"".join(json.dumps({"text": "x" * 50 + str(k)}).encode() + b"\n" for k in range(2000))
    frame = bytearray(zstandard.ZstdCompressor().compress(lines))
    frame[len(frame) // 2 : len(frame) // 2 + 64] = b"\xff" * 64
    path = tmp_path / "example_train_0.jsonl.zst"
    path.write_bytes(bytes(frame))
    with pytest.raises(CorpusError, match=r"example_train_0\.jsonl\.zst:line \d+: corrupt zstd"):
        list(iter_documents(path))
    stats = ReadStats()
    list(iter_documents(path, on_error="skip", stats=stats))
    assert stats.skipped == 1


def test_not_zstd_at_all(tmp_path):
    path = tmp_path / "plain.jsonl.zst"
    path.write_text('{"text": "not compressed"}\n')
    with pytest.raises(CorpusError, match=r"plain\.jsonl\.zst:line 1: corrupt zstd"):
        list(iter_documents(path))


def test_empty_and_unknown_corpora(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CorpusError, match="no corpus files"):
        resolve_corpus(tmp_path / "empty")
    with pytest.raises(CorpusError, match="unknown corpus 'nope'"):
        resolve_corpus("nope")


def test_shards_and_samples_partition_files():
    corpus = Corpus("c", tuple(__import__("pathlib").Path(f"f{k}") for k in range(10)))
    shards = [corpus.shard(i, 3).files for i in range(3)]
    assert sorted(sum(shards, ())) == sorted(corpus.files)
    assert len(corpus.sample_files(4).files) == 4
    assert corpus.sample_files(4).files == corpus.sample_files(4).files


def test_pg_essays_corpus_one_document_per_file():
    corpus = resolve_corpus("pg-essays")
    assert len(corpus.files) == 49
    docs = list(corpus.iter_documents(corpus.files[0]))
    assert len(docs) == 1 and docs[0].source == "pg-essays" and len(docs[0].text) > 1000

"""Corpus registry: SlimPajama layout, local formats, source filters, and bad-input errors."""

from __future__ import annotations

import hashlib
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from posfreq.train.corpora import Corpus, SourceFilter, iter_documents, resolve_corpus
from posfreq.train.corpus_formats import write_jsonl
from posfreq.train.corpus_records import CorpusError, Document, ReadStats


def record(text: str, source: str = "RedPajamaC4") -> dict:
    return {"text": text, "meta": {"redpajama_set_name": source}}


def make_slimpajama(root, split="train", chunks=(1, 2, 10), files_per_chunk=2):
    """A tiny corpus in SlimPajama's published layout; returns every record in natural file order."""
    written = []
    for chunk in chunks:
        for n in (0, 1, 10)[:files_per_chunk]:
            recs = [
                record(
                    f"{split} chunk {chunk} file {n} doc {k}",
                    ("RedPajamaC4", "RedPajamaGithub")[k % 2],
                )
                for k in range(3)
            ]
            write_jsonl(root / split / f"chunk{chunk}" / f"example_{split}_{n}.jsonl.zst", recs)
            written.extend(recs)
    return written


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
    from posfreq.analysis import histogram as hg
    from posfreq.train.corpus_stream import StreamShard
    from posfreq.train.tokenizer import get_tokenizer

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
    from posfreq.analysis import histogram as hg

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
    from posfreq.train.shards import TokenDataset

    written = make_slimpajama(tmp_path / "sp", chunks=(1, 2), files_per_chunk=1)
    monkeypatch.setenv("SLIMPAJAMA_DIR", str(tmp_path / "missing"))
    monkeypatch.setenv("SLIMPAJAMA_HF", str(tmp_path / "sp"))
    corpus = resolve_corpus("slimpajama")
    from posfreq.scripts import prepare_data as prep

    totals = prep.prepare(corpus, tmp_path / "tokens", "bytes", progress=False)
    assert totals["docs"] == len(written)
    data = TokenDataset(tmp_path / "tokens", tokenizer="bytes")
    assert [s.name for s in data.shards] == ["train__shard_0_of_2", "train__shard_1_of_2"]
    texts = sorted(bytes(data.document(i)[:-1].tolist()).decode() for i in range(data.num_docs))
    assert texts == sorted(r["text"] for r in written)
    assert (
        prep.prepare(corpus, tmp_path / "tokens", "bytes", progress=False)["skipped_complete"] == 2
    )


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
        cwd=Path(__file__).resolve().parents[1],
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


def test_source_options_are_comma_or_yaml_lists_with_one_way_to_exclude(tmp_path):
    from posfreq.train.cli import command_parser, parse
    from posfreq.train.corpus_cli import (
        add_corpus_arguments,
        corpus_from_args,
        shard_from_args,
        source_names,
    )

    assert source_names("arxiv, book,") == source_names(["arxiv", "book"]) == ["arxiv", "book"]
    assert source_names(None) == source_names("") == source_names([]) == []
    with pytest.raises(
        CorpusError, match="Fix: list sources to drop with --exclude-sources github"
    ):
        source_names(["-github"])
    written = make_slimpajama(tmp_path)
    parser = command_parser("test", "corpus options", config_file=True)
    add_corpus_arguments(parser, default_corpus="slimpajama", default_workers=1)
    base = ["--data-dir", str(tmp_path)]
    for flags in (
        ["--exclude-sources", "github"],
        ["--sources", "[c4]"],
        ["--sources", "C4,RedPajamaC4"],
    ):
        docs = list(corpus_from_args(parse(parser, base + flags)).documents())
        assert docs == [
            Document(r["text"], "RedPajamaC4")
            for r in written
            if r["meta"]["redpajama_set_name"] != "RedPajamaGithub"
        ]
    assert shard_from_args(parse(parser, base)) is None and shard_from_args(
        parse(parser, ["--shard", "2/3"])
    ) == (2, 3)
    with pytest.raises(CorpusError, match="need 0 <= i < n"):
        shard_from_args(parse(parser, ["--shard", "3/3"]))


def test_prepare_cli_takes_the_shared_corpus_options(tmp_path, capsys):
    from posfreq.scripts import prepare_data

    written = make_slimpajama(tmp_path / "sp")
    config = tmp_path / "prepare.yaml"
    config.write_text(
        f"corpus: slimpajama\ndata_dir: {tmp_path / 'sp'}\ntokenizer: bytes\nexclude_sources: [github]\n"
    )
    out = tmp_path / "tokens"
    for shard in ("0/2", "1/2"):
        assert (
            prepare_data.main(
                ["--config", str(config), "--shard", shard, "--out", str(out), "--quiet"]
            )
            == 0
        )
    assert "3 files in shard 1/2" in capsys.readouterr().out
    kept = [r["text"] for r in written if r["meta"]["redpajama_set_name"] == "RedPajamaC4"]
    metas = [json.loads(p.read_text()) for p in out.glob("*.json")]
    assert len(metas) == 6 and {m["sources"][0] for m in metas} == {"-github"}
    assert sum(m["num_docs"] for m in metas) == len(kept)
    assert sum(m["num_tokens"] for m in metas) == sum(
        len(text.encode()) + 1 for text in kept
    )  # bytes + EOS


def test_prepare_val_fraction_holds_out_documents_by_content(tmp_path) -> None:
    """--val-fraction: every document lands in exactly one of OUT and OUT/val, chosen by its text's hash (the same
    split whatever the file layout or worker count), near the asked fraction; a changed fraction redoes shards."""
    from posfreq.scripts import prepare_data as prep
    from posfreq.train.shards import TokenDataset
    from posfreq.train.tokenizer import get_tokenizer

    texts = [f"document number {i} " * (1 + i % 7) for i in range(400)]
    for layout, chunks in (("one", [texts]), ("four", [texts[i::4] for i in range(4)])):
        root = tmp_path / layout
        root.mkdir()
        for k, chunk in enumerate(chunks):
            (root / f"part{k}.jsonl").write_text(
                "".join(json.dumps({"text": t}) + "\n" for t in chunk)
            )
    tok = get_tokenizer("bytes")
    split = {}
    for layout, workers in (("one", 1), ("four", 2)):
        out = tmp_path / f"tokens-{layout}"
        totals = prep.prepare(
            resolve_corpus(tmp_path / layout),
            out,
            "bytes",
            workers=workers,
            progress=False,
            val_fraction=0.25,
        )
        train, val = (
            TokenDataset(out, tokenizer="bytes"),
            TokenDataset(out / "val", tokenizer="bytes"),
        )
        decode = lambda ds: {tok.decode(ds.document(i)[:-1].tolist()) for i in range(ds.num_docs)}  # noqa: E731
        train_texts, val_texts = decode(train), decode(val)
        assert train_texts.isdisjoint(val_texts) and train_texts | val_texts == set(texts)
        assert totals["val_docs"] == len(val_texts) and totals["docs"] == len(train_texts)
        expected = {
            t
            for t in texts
            if int.from_bytes(hashlib.sha256(t.encode()).digest()[:8], "big") < 2**62
        }
        assert val_texts == expected  # by content: an independent recomputation of the rule
        split[layout] = val_texts
    assert split["one"] == split["four"] and 60 <= len(split["one"]) <= 140  # 25% of 400, loosely
    again = prep.prepare(
        resolve_corpus(tmp_path / "one"),
        tmp_path / "tokens-one",
        "bytes",
        progress=False,
        val_fraction=0.1,
    )
    assert again["skipped_complete"] == 0 and again["val_docs"] < len(split["one"])
    # Back to no held-out documents: every document trains, and no stale validation shard still holds some of them.
    (tmp_path / "tokens-one" / ".part0.tokens.bin.0123abcd.tmp").write_bytes(
        b"torn"
    )  # an interrupted write
    none = prep.prepare(
        resolve_corpus(tmp_path / "one"), tmp_path / "tokens-one", "bytes", progress=False
    )
    assert none["docs"] == len(texts) and none["val_docs"] == 0
    assert not list((tmp_path / "tokens-one" / "val").iterdir())
    assert not list((tmp_path / "tokens-one").glob(".*.tmp"))


@pytest.mark.parametrize(
    "fraction, message",
    [
        ("-0.1", "--val-fraction must be in [0, 1)"),
        ("1", "--val-fraction must be in [0, 1)"),
        ("nan", 'Parser key "val_fraction"'),
    ],
)
def test_prepare_refuses_a_val_fraction_outside_0_1(tmp_path, fraction, message, capsys):
    from posfreq.scripts import prepare_data as prep

    (tmp_path / "c.jsonl").write_text('{"text": "a"}\n')
    with pytest.raises(SystemExit) as refused:
        prep.main(
            [
                "--corpus",
                str(tmp_path / "c.jsonl"),
                "--tokenizer",
                "bytes",
                "--out",
                str(tmp_path / "t"),
                "--val-fraction",
                fraction,
            ]
        )
    assert refused.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "t").exists()

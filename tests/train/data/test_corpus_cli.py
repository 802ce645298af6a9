"""The shared corpus options (train/data/corpus_cli.py) and prepare_data's use of them: source lists, validation
hold-out by content, and the errors for bad fractions."""

from __future__ import annotations

import hashlib
import json

import pytest
from helpers.corpus import make_slimpajama

from posfreq.train.data.corpora import resolve_corpus
from posfreq.train.data.records import CorpusError, Document


def test_source_options_are_comma_or_yaml_lists_with_one_way_to_exclude(tmp_path):
    from posfreq.train.command_line import command_parser, parse
    from posfreq.train.data.corpus_cli import (
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
    from posfreq.scripts.commands import prepare as prepare_data

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
    metas = [json.loads(p.read_text()) for p in out.glob("[!.]*.json") if p.name != "manifest.json"]
    assert len(metas) == 6 and {m["sources"][0] for m in metas} == {"-github"}
    assert sum(m["num_docs"] for m in metas) == len(kept)
    assert sum(m["num_tokens"] for m in metas) == sum(
        len(text.encode()) + 1 for text in kept
    )  # bytes + EOS


def test_prepare_val_fraction_holds_out_documents_by_content(tmp_path) -> None:
    """--val-fraction: every document lands in exactly one of OUT and OUT/val, chosen by its text's hash (the same
    split whatever the file layout or worker count), near the asked fraction; a changed fraction redoes shards."""
    from posfreq.train.data.tokenizer import get_tokenizer
    from posfreq.train.data.tokens import prepare as prep
    from posfreq.train.data.tokens.shards import TokenDataset

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
        assert totals.val_docs == len(val_texts) and totals.docs == len(train_texts)
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
    assert again.skipped_complete == 0 and again.val_docs < len(split["one"])
    # Back to no held-out documents: every document trains, and no stale validation shard still holds some of them.
    (tmp_path / "tokens-one" / ".part0.tokens.bin.0123abcd.tmp").write_bytes(
        b"torn"
    )  # an interrupted write
    none = prep.prepare(
        resolve_corpus(tmp_path / "one"), tmp_path / "tokens-one", "bytes", progress=False
    )
    assert none.docs == len(texts) and none.val_docs == 0
    assert not list((tmp_path / "tokens-one" / "val").glob("[!.]*"))  # the owner record stays
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
    from posfreq.scripts.commands import prepare as prep

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


@pytest.mark.parametrize("command", ["prepare", "analyze"])
def test_an_out_inside_the_corpus_folder_or_holding_it_is_refused_untouched(
    tmp_path, command, monkeypatch, capsys
):
    """prepare --out inside its --corpus folder: the first run worked, a rerun read its own .posfreq-output.json
    and shards as corpus files. Both directions are refused before anything is written."""
    from posfreq.scripts.cli import main as posfreq

    monkeypatch.setenv("POSFREQ_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    corpus = tmp_path / "top" / "corpus"
    corpus.mkdir(parents=True)
    (corpus / "data.jsonl").write_text('{"text": "hello"}\n{"text": "world"}\n')
    extra = ["--no-figures", "--train-len", "8", "--workers", "1"] if command == "analyze" else []
    base = [command, "--corpus", "top/corpus", "--tokenizer", "bytes", "--quiet", *extra]
    for out, message in (
        ("top/corpus/tokens", f"--out top/corpus/tokens lies inside the corpus folder {corpus}: "),
        ("top", f"the corpus folder {corpus} lies inside --out top: "),
    ):
        with pytest.raises(SystemExit) as refused:  # the one `error:` line a command words itself
            posfreq([*base, "--out", out])
        err = str(refused.value.code)
        assert (
            err.startswith(f"error: {message}a rerun would read") and "Fix: choose an --out" in err
        )
        assert sorted(p.name for p in (tmp_path / "top").rglob("*")) == ["corpus", "data.jsonl"]
    assert posfreq([*base, "--out", "elsewhere"]) == 0  # beside it is fine
    assert (
        posfreq(
            [
                command,
                "--corpus",
                "top/corpus/data.jsonl",
                "--tokenizer",
                "bytes",
                "--quiet",
                *extra,
                "--out",
                "top/corpus/out",
            ]
        )
        == 0
    )  # one file given alone: its folder is not read


def test_prepare_refuses_to_write_no_documents_and_reports_a_filter_name_that_matches_none(
    tmp_path, capsys, monkeypatch
):
    """prepare exited 0 after writing 0 documents (--sources nosuch, a file of blank lines) where analyze refused,
    and a misspelt --exclude-sources kept what it meant to drop without a word."""
    from posfreq.scripts.commands import analyze
    from posfreq.scripts.commands import prepare as prepare_cli
    from posfreq.train.data.tokens.shards import TokenDataset

    make_slimpajama(tmp_path / "sp")  # 18 documents, 12 RedPajamaC4 and 6 RedPajamaGithub
    out = tmp_path / "tokens"
    base = ["--corpus", "slimpajama", "--data-dir", str(tmp_path / "sp"), "--tokenizer", "bytes"]
    base += ["--out", str(out), "--quiet"]
    with pytest.raises(SystemExit) as refused:
        prepare_cli.main([*base, "--sources", "nosuch"])
    assert str(refused.value.code) == (
        "error: corpus slimpajama: no documents to write (6 files, 18 records read, 18 removed by the source "
        "filter (--sources nosuch) (documents by source: RedPajamaC4 (12), RedPajamaGithub (6)), 0 bad records "
        "skipped). Fix: check --sources/--exclude-sources, --text-field and --split, or that the files hold "
        "records; no shard was kept"
    )
    assert not list(out.glob("[!.]*"))  # no empty shard left to look complete
    assert prepare_cli.main([*base, "--sources", "c4"]) == 0  # the typo fixed, into the same --out
    assert TokenDataset(out).num_docs == 12
    capsys.readouterr()
    assert (
        prepare_cli.main([*base, "--exclude-sources", "githb"]) == 0
    )  # another filter: every shard redone
    captured = capsys.readouterr()
    assert "6 files in shard 0/1 (0 already complete); wrote 18 documents" in captured.out
    assert captured.err == (
        "warning: --exclude-sources githb: matched no document read (documents by source: RedPajamaC4 (12), "
        "RedPajamaGithub (6)); check the spelling\n"
    )
    assert TokenDataset(out).num_docs == 18
    assert (
        prepare_cli.main([*base, "--exclude-sources", "githb"]) == 0
    )  # complete shards keep their counts
    assert "check the spelling" in capsys.readouterr().err

    blank = tmp_path / "blank"
    blank.mkdir()
    (blank / "x.jsonl").write_text("\n\n\n")
    with pytest.raises(SystemExit) as refused:
        prepare_cli.main(
            ["--corpus", str(blank), "--tokenizer", "bytes", "--out", str(tmp_path / "b")]
        )
    assert str(refused.value.code).startswith(
        f"error: corpus {blank}: no documents to write (1 files, 0 records read, 0 bad records skipped). Fix:"
    )
    part = tmp_path / "part"  # one --shard task without documents: its partners may have some
    assert (
        prepare_cli.main([*base[:-3], "--out", str(part), "--sources", "nosuch", "--shard", "0/2"])
        == 0
    )
    assert "warning: shard 0/2 has no documents (9 removed" in capsys.readouterr().err

    monkeypatch.setenv("POSFREQ_CACHE", str(tmp_path / "cache"))
    analyzed = [
        "--corpus",
        "slimpajama",
        "--data-dir",
        str(tmp_path / "sp"),
        "--tokenizer",
        "bytes",
    ]
    analyzed += ["--quiet", "--no-figures", "--train-len", "8", "--workers", "1"]
    assert (
        analyze.main([*analyzed, "--out", str(tmp_path / "pf"), "--exclude-sources", "githb"]) == 0
    )
    assert "warning: --exclude-sources githb: matched no document read" in capsys.readouterr().err

"""Bad corpus files, planted one at a time: both corpus CLIs (position_freq, prepare_data) stop with an
`error:` line naming the file and where, or, with --on-error skip, count what they lost and say where
it is recorded. Never a traceback, never a file read as shorter (or empty) without a word."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import zstandard

from posfreq.scripts.commands import analyze as pf
from posfreq.scripts.commands import prepare as prepare_data
from posfreq.train.data.corpora import iter_documents
from posfreq.train.data.formats import write_jsonl
from posfreq.train.data.records import CorpusError, ReadStats

REPO = Path(__file__).resolve().parents[3]
RECORDS = [{"text": f"document {k}: " + "lorem ipsum " * (k % 40)} for k in range(3000)]


def jsonl_bytes(records: list[dict]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in records)


def zst(path: Path, data: bytes) -> Path:
    """Write `data` to PATH.zst; returns that path."""
    target = path.with_name(path.name + ".zst")
    target.write_bytes(data)
    return target


def truncated(path: Path) -> Path:
    """A .jsonl.zst missing only its last 3 bytes (a cut download)."""
    return zst(path, zstandard.ZstdCompressor().compress(jsonl_bytes(RECORDS))[:-3])


def corrupt(path: Path) -> Path:
    """A .jsonl.zst with 64 garbage bytes in the middle of its frame."""
    data = bytearray(zstandard.ZstdCompressor().compress(jsonl_bytes(RECORDS)))
    data[len(data) // 2 : len(data) // 2 + 64] = b"\xff" * 64
    return zst(path, bytes(data))


def empty(path: Path) -> Path:
    """A 0-byte .jsonl.zst (an interrupted download)."""
    return zst(path, b"")


def not_utf8(path: Path) -> Path:
    path.write_bytes(
        jsonl_bytes(RECORDS[:5]) + b'{"text": "caf\xe9"}\n' + jsonl_bytes(RECORDS[5:10])
    )
    return path


def missing_text(path: Path) -> Path:
    path.write_bytes(
        jsonl_bytes(RECORDS[:5]) + b'{"content": "no text field"}\n' + jsonl_bytes(RECORDS[5:10])
    )
    return path


def lone_surrogate(path: Path) -> Path:
    """A JSON line whose text escapes half of a UTF-16 pair: valid JSON, a str that UTF-8 cannot encode."""
    path.write_bytes(
        jsonl_bytes(RECORDS[:5]) + b'{"text": "bad \\ud800 x"}\n' + jsonl_bytes(RECORDS[5:10])
    )
    return path


def corrupt_parquet(path: Path) -> Path:
    """A snappy Parquet file (row groups of 500 rows) with 2,000 bytes of 0xff over its middle."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    target = path.with_name(path.name.replace(".jsonl", ".parquet"))
    pq.write_table(
        pa.table({"text": [r["text"] for r in RECORDS]}),
        target,
        row_group_size=500,
        compression="snappy",
    )
    data = bytearray(target.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 2000] = b"\xff" * 2000
    target.write_bytes(bytes(data))
    return target


# (make the file, what the error says after "FILE:WHERE: ", whether the rest of the file is lost)
FAULTS = {
    "truncated-zst": (
        truncated,
        r"line \d+: truncated zstd file: it ends at byte \d+, inside the frame",
        True,
    ),
    "corrupt-zst": (corrupt, r"line \d+: corrupt zstd data in compressed bytes \d+\.\.\d+", True),
    "empty-file": (empty, r"byte 0: empty file \(0 bytes\)", True),
    "non-utf8": (not_utf8, r"line 6: not UTF-8 text", False),
    "missing-text-field": (missing_text, r"line 6: text field 'text' is missing", False),
    "corrupt-parquet": (
        corrupt_parquet,
        r"row (\d+): corrupt Parquet data in row group \d+ \(0-based, of 6; rows \1\.\.\d+\): ",
        True,
    ),
    "lone-surrogate": (
        lone_surrogate,
        r"line 6: text is not valid Unicode \(lone surrogate \\ud800 at character 4",
        False,
    ),
}


@pytest.fixture(params=sorted(FAULTS))
def corpus(request, tmp_path) -> tuple[Path, Path, str, bool]:
    """(corpus directory with one good and one planted bad file, the bad file, expected message, rest lost)."""
    make, message, lost = FAULTS[request.param]
    root = tmp_path / "corpus"
    write_jsonl(root / "a_good.jsonl", RECORDS[:20])
    bad = make(root / "b_bad.jsonl")
    return root, bad, message, lost


def test_reader_reports_the_file_and_never_reads_it_short(corpus):
    root, bad, message, lost = corpus
    with pytest.raises(CorpusError, match=rf"^{re.escape(str(bad))}:{message}"):
        list(iter_documents(bad))
    stats = ReadStats()
    docs = list(iter_documents(bad, on_error="skip", stats=stats))
    assert stats.skipped == 1 and stats.documents == len(docs)
    assert stats.lost_files == (stats.errors if lost else [])


def test_truncation_is_never_reported_as_malformed_json(tmp_path):
    data = zstandard.ZstdCompressor().compress(jsonl_bytes(RECORDS))
    for cut in (1, 2, 5, len(data) // 3, len(data) - 20):  # a 1-byte cut loses only the frame's end
        path = tmp_path / f"cut{cut}.jsonl.zst"
        path.write_bytes(data[:-cut])
        with pytest.raises(
            CorpusError,
            match=rf"{path.name}:line \d+: truncated zstd file: it ends at byte "
            rf"{len(data) - cut},",
        ):
            list(iter_documents(path))
    plain = tmp_path / "cut.jsonl"
    plain.write_bytes(jsonl_bytes(RECORDS)[:-7])
    with pytest.raises(
        CorpusError, match=rf"cut\.jsonl:line {len(RECORDS)}: truncated file: its last line is cut"
    ):
        list(iter_documents(plain))


def test_every_frame_of_a_multi_frame_zst_is_read(tmp_path):
    compress = zstandard.ZstdCompressor().compress
    path = tmp_path / "frames.jsonl.zst"
    path.write_bytes(
        b"".join(compress(jsonl_bytes(RECORDS[k : k + 700])) for k in range(0, len(RECORDS), 700))
    )
    assert [d.text for d in iter_documents(path)] == [r["text"] for r in RECORDS]
    path.write_bytes(
        path.read_bytes()[:-4]
    )  # the last frame cut: the earlier frames' documents, then an error
    stats = ReadStats()
    assert len(list(iter_documents(path, on_error="skip", stats=stats))) >= 2100
    assert len(stats.lost_files) == 1 and "truncated zstd file" in stats.lost_files[0]


# ------------------------------------------------------------------------- analysis/position_freq.py


def position_freq(root: Path, out: Path, *extra: str) -> int:
    return pf.main(
        [
            "--corpus",
            str(root),
            "--tokenizer",
            "bytes",
            "--workers",
            "1",
            "--quiet",
            "--no-figures",
            "--train-len",
            "64",
            "--out",
            str(out),
            *extra,
        ]
    )


def test_position_freq_stops_with_an_error_line_naming_the_file(corpus, tmp_path, monkeypatch):
    root, bad, message, _ = corpus
    monkeypatch.setenv("POSFREQ_CACHE", str(tmp_path / "cache"))
    with pytest.raises(SystemExit, match=rf"^error: {re.escape(str(bad))}:{message}"):
        position_freq(root, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_position_freq_skip_reports_what_was_lost(corpus, tmp_path, monkeypatch, capsys):
    root, bad, message, lost = corpus
    monkeypatch.setenv("POSFREQ_CACHE", str(tmp_path / "cache"))
    assert position_freq(root, tmp_path / "out", "--on-error", "skip") == 0
    printed = capsys.readouterr().out
    read = json.loads((tmp_path / "out" / "summary.json").read_text())["meta"]["read"]
    assert read["skipped"] == 1 and re.match(rf"{re.escape(str(bad))}:{message}", read["errors"][0])
    assert "skipped bad items: 1 (the first 20 in summary.json meta.read.errors)" in printed
    assert read["lost_files"] == (read["errors"] if lost else [])
    if lost:
        assert (
            "files cut short: 1; their documents after the point named were NOT read (all listed in "
            "summary.json meta.read.lost_files):" in printed
        )
        assert f"    {read['lost_files'][0]}" in printed


# -------------------------------------------------------------------------- scripts/prepare_data.py


def prepare(root: Path, out: Path, *extra: str) -> None:
    prepare_data.main(["--corpus", str(root), "--tokenizer", "bytes", "--out", str(out), *extra])


def test_prepare_data_stops_with_an_error_line_naming_the_file(corpus, tmp_path):
    root, bad, message, _ = corpus
    with pytest.raises(SystemExit, match=rf"^error: {re.escape(str(bad))}:{message}"):
        prepare(root, tmp_path / "tokens")
    assert not list(
        (tmp_path / "tokens").glob("b_bad*")
    )  # no shard of the bad file, not even a partial one


def test_prepare_data_skip_reports_and_records_what_was_lost(corpus, tmp_path, capsys):
    root, bad, message, lost = corpus
    out = tmp_path / "tokens"
    prepare(root, out, "--on-error", "skip")
    printed = capsys.readouterr().out
    meta = json.loads((out / "b_bad.json").read_text())
    assert meta["skipped_items"] == 1 and re.match(
        rf"{re.escape(str(bad))}:{message}", meta["skipped_errors"][0]
    )
    assert (
        f"skipped 1 bad records (--on-error skip); recorded per shard as skipped_items and skipped_errors "
        f"in {out}/NAME.json" in printed
    )
    assert meta["lost_files"] == (meta["skipped_errors"] if lost else [])
    if lost:
        assert (
            f"files cut short: 1; their documents after the point named were NOT read (all listed in "
            f"lost_files in {out}/NAME.json; a rerun redoes these shards):\n    {meta['lost_files'][0]}"
            in printed
        )
        prepare(
            root, out, "--on-error", "skip"
        )  # the shard that lost data is redone, the good one kept
        assert "(1 already complete)" in capsys.readouterr().out


def test_prepare_data_cli_error_is_one_line_and_exit_status_1(tmp_path):
    bad = truncated(tmp_path / "x.jsonl")
    result = subprocess.run(
        [
            sys.executable,
            "scripts/prepare_data.py",
            "--corpus",
            str(bad),
            "--tokenizer",
            "bytes",
            "--out",
            str(tmp_path / "tokens"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert re.search(
        rf"^error: {re.escape(str(bad))}:line \d+: truncated zstd file", result.stderr, re.M
    )


def test_a_line_nested_too_deeply_is_one_bad_line_named_and_skippable(tmp_path):
    """A JSONL line nested 100k deep raised a bare RecursionError (no file, no line) that skip did not skip."""
    path = tmp_path / "deep.jsonl"
    good = json.dumps({"text": "fine"}) + "\n"
    path.write_text(good + "[" * 100_000 + "]" * 100_000 + "\n" + good)
    with pytest.raises(CorpusError, match=r"deep\.jsonl:line 2: JSON nested too deeply"):
        list(iter_documents(path))
    stats = ReadStats()
    texts = [d.text for d in iter_documents(path, on_error="skip", stats=stats)]
    assert texts == ["fine", "fine"] and stats.skipped == 1


@pytest.mark.parametrize("tokenizer", ["bytes", "llama3"])
def test_a_lone_surrogate_is_one_bad_record_for_every_tokenizer(tmp_path, tokenizer, capsys):
    """A JSON \\ud800 escape without its pair crashed both commands inside the tokenizer, even with --on-error skip:
    a UnicodeEncodeError (bytes) or a TypeError from encode_batch (llama3), naming no file or line."""
    bad = lone_surrogate(tmp_path / "s.jsonl")
    with pytest.raises(
        SystemExit, match=rf"^error: {re.escape(str(bad))}:line 6: text is not valid Unicode"
    ):
        prepare_data.main(
            ["--corpus", str(bad), "--tokenizer", tokenizer, "--out", str(tmp_path / "t")]
        )
    out = tmp_path / "skip"
    prepare_data.main(
        [
            "--corpus",
            str(bad),
            "--tokenizer",
            tokenizer,
            "--out",
            str(out),
            "--on-error",
            "skip",
            "--quiet",
        ]
    )
    meta = json.loads((out / "s.json").read_text())
    assert meta["num_docs"] == 10 and meta["skipped_items"] == 1
    assert "skipped 1 bad records" in capsys.readouterr().out

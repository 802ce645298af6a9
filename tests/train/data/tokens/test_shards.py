"""Shards (train/data/tokens/shards.py) and tokenization into them, against independent references.

Most tests use a "unique-token" dataset: token values are the global token positions
(0, 1, 2, ...), so each token identifies its document and offset. The packing tests
(tests/train/data/test_packing.py) use it too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from helpers.records import as_older_posfreq
from helpers.shards import LENGTHS, unique_dataset

from posfreq.train.data.tokenizer import get_tokenizer
from posfreq.train.data.tokens.shard_files import ShardWriter
from posfreq.train.data.tokens.shards import TokenDataset, concat_ranges
from posfreq.train.outdir import OutputDirError

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def unique(tmp_path: Path) -> tuple[TokenDataset, np.ndarray]:
    offsets = unique_dataset(tmp_path / "u", LENGTHS)
    return TokenDataset(tmp_path / "u"), offsets


def test_dataset_reads_documents(unique) -> None:
    ds, offsets = unique
    assert ds.num_docs == len(offsets) - 1 and ds.num_tokens == offsets[-1]
    assert np.array_equal(ds.doc_lengths(), np.diff(offsets))
    assert np.array_equal(ds.doc_lengths(3, 12), np.diff(offsets)[3:12])
    for i in (0, 4, 5, 9, ds.num_docs - 1):
        assert np.array_equal(ds.document(i), np.arange(offsets[i], offsets[i + 1]))


def test_concat_ranges_against_a_loop() -> None:
    starts, lengths = np.array([5, 0, 9, 3]), np.array([2, 0, 3, 1])
    expected = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lengths)])
    assert concat_ranges(starts, lengths).tolist() == expected.tolist() == [5, 6, 9, 10, 11, 3]
    assert concat_ranges(np.array([4]), np.array([0])).size == 0


def test_shard_validation_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist.*prepare_data"):
        TokenDataset(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no token shards.*prepare_data"):
        TokenDataset(tmp_path / "empty")

    unique_dataset(tmp_path / "a", [[3, 4], [5]])
    (tmp_path / "a" / "shard01.offsets.npy").unlink()
    with pytest.raises(FileNotFoundError, match="shard01.offsets.npy is missing.*prepare_data"):
        TokenDataset(tmp_path / "a")

    unique_dataset(tmp_path / "b", [[3, 4]])
    with open(tmp_path / "b" / "shard00.tokens.bin", "ab") as f:
        f.write(b"\0" * 4)
    with pytest.raises(ValueError, match="shard00.offsets.npy: offsets inconsistent.*prepare_data"):
        TokenDataset(tmp_path / "b")

    unique_dataset(tmp_path / "c", [[3, 4]])
    with ShardWriter(tmp_path / "c", "zz", tokenizer="bytes", vocab_size=258, eos_id=257) as w:
        w.add([1, 257])
    with pytest.raises(ValueError, match="shard zz has tokenizer='bytes'.*single --tokenizer"):
        TokenDataset(tmp_path / "c")

    unique_dataset(tmp_path / "d", [[3]])
    with pytest.raises(ValueError, match="tokenized with 'unique', not 'llama3'"):
        TokenDataset(tmp_path / "d", tokenizer="llama3")


def test_prepare_data_matches_one_by_one_tokenization_and_restarts(tmp_path: Path) -> None:
    from posfreq.train.data.corpora import resolve_corpus
    from posfreq.train.data.tokens import prepare as prep

    corpus_dir = tmp_path / "corpus"
    (corpus_dir / "part").mkdir(parents=True)
    texts = {
        "part/a.jsonl": ["hello world", "naïve café ☕", ""],
        "part/b.jsonl": ["x" * 50],
        "c.txt": ["one text file\nwith two lines"],
    }
    for name, docs in texts.items():
        path = corpus_dir / name
        if name.endswith(".txt"):
            path.write_text(docs[0], encoding="utf-8")
        else:
            path.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs), encoding="utf-8")
    corpus = resolve_corpus(corpus_dir)
    out = tmp_path / "tokens"
    totals = prep.prepare(corpus, out, "bytes", progress=False)
    assert totals.files == 3 and totals.skipped_complete == 0

    tok = get_tokenizer("bytes")
    ds = TokenDataset(out, tokenizer="bytes")
    assert [s.name for s in ds.shards] == ["c", "part__a", "part__b"]
    expected = [
        tok.encode(t) + [tok.eos_id]
        for name in ("c.txt", "part/a.jsonl", "part/b.jsonl")
        for t in texts[name]
    ]
    assert [ds.document(i).tolist() for i in range(ds.num_docs)] == expected

    meta = json.loads((out / "part__a.json").read_text())
    assert (
        meta["source_size"] == (corpus_dir / "part/a.jsonl").stat().st_size
        and len(meta["source_sha256"]) == 64
    )
    mtime = (out / "part__b.tokens.bin").stat().st_mtime_ns
    (out / "c.json").unlink()  # as if killed before this shard completed
    again = prep.prepare(corpus, out, "bytes", progress=False)
    assert again.skipped_complete == 2 and again.docs == 1
    assert (out / "part__b.tokens.bin").stat().st_mtime_ns == mtime
    assert [TokenDataset(out).document(i).tolist() for i in range(ds.num_docs)] == expected

    split = tmp_path / "split"  # two array tasks, one with worker processes, give the same shards
    prep.prepare(corpus, split, "bytes", shard=(0, 2), progress=False)
    prep.prepare(corpus, split, "bytes", shard=(1, 2), workers=2, progress=False)
    for name in ("c", "part__a", "part__b"):
        assert (split / f"{name}.tokens.bin").read_bytes() == (
            out / f"{name}.tokens.bin"
        ).read_bytes()
    with pytest.raises(OutputDirError, match="tokenized with 'bytes', not 'llama3'"):
        prep.prepare(corpus, out, "llama3", progress=False)


def test_prepare_writes_only_into_its_own_folder(tmp_path: Path) -> None:
    """A user's folder is refused untouched; an older prepare's shards (no owner record) are resumed."""
    from posfreq.scripts.commands import prepare as prep
    from posfreq.train.data.corpora import resolve_corpus

    corpus_dir = tmp_path / "corpus"
    corpus_dir.mkdir()
    (corpus_dir / "notes.txt").write_text("a document")
    corpus = resolve_corpus(corpus_dir)
    mine = tmp_path / "mine"
    (mine / "val").mkdir(parents=True)
    (mine / "val" / "notes.json").write_text(
        "my own"
    )  # the name a held-out shard of notes.txt takes
    with pytest.raises(
        SystemExit, match=r"--out .*mine holds files `posfreq prepare` did not write"
    ):
        prep.main(
            ["--corpus", str(corpus_dir), "--tokenizer", "bytes", "--out", str(mine), "--quiet"]
        )
    assert (mine / "val" / "notes.json").read_text() == "my own"
    assert sorted(p.name for p in mine.rglob("*")) == ["notes.json", "val"]

    older = tmp_path / "older"
    prep.prepare(corpus, older, "bytes", progress=False, val_fraction=0.5)
    as_older_posfreq(older)
    as_older_posfreq(older / "val")
    again = prep.prepare(corpus, older, "bytes", progress=False, val_fraction=0.5)
    assert again.skipped_complete == 1
    (older / "README").write_text("a user's note")
    as_older_posfreq(older)
    with pytest.raises(OutputDirError, match=r"did not write \(README, manifest.json, notes.json"):
        prep.prepare(corpus, older, "bytes", progress=False, val_fraction=0.5)


def test_damaged_shards_are_refused_naming_the_file(tmp_path: Path) -> None:
    """Offsets that go backwards (refused on opening) and token ids >= vocab_size (refused when read)."""
    unique_dataset(tmp_path / "back", [[3, 4, 5]])
    offsets_file = tmp_path / "back" / "shard00.offsets.npy"
    offsets = np.load(offsets_file)
    offsets[1], offsets[2] = (
        offsets[2],
        offsets[1],
    )  # 0, 7, 3, 12: same ends, a document of negative length
    np.save(offsets_file, offsets)
    with pytest.raises(
        ValueError, match="shard00.offsets.npy: document offsets go backwards at document 1"
    ):
        TokenDataset(tmp_path / "back")

    unique_dataset(tmp_path / "ids", [[3, 4]])
    tokens_file = tmp_path / "ids" / "shard00.tokens.bin"
    tokens = np.fromfile(tokens_file, dtype=np.uint32)
    tokens[5] = 10**6
    tokens.tofile(tokens_file)
    data = TokenDataset(tmp_path / "ids")
    assert data.document(0).tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="shard00.tokens.bin: token id 1000000 >= vocab_size 8"):
        data.document(1)
    with pytest.raises(ValueError, match="token id 1000000 >= vocab_size"):
        data.read_runs(np.array([3]), np.array([4]))


def _drop(key: str):
    return lambda meta: {k: v for k, v in meta.items() if k != key}


@pytest.mark.parametrize(
    "file, damage, message",
    [
        ("json", _drop("num_docs"), "damaged shard metadata: num_docs is missing"),
        ("json", _drop("vocab_size"), "damaged shard metadata: vocab_size is missing"),
        ("json", lambda m: m | {"num_docs": str(m["num_docs"])}, "num_docs is '3', not an integer"),
        ("json", lambda m: m | {"eos_id": 300}, "eos_id 300 is outside the vocabulary [0, 258)"),
        ("npy", lambda data: b"garbage" * 10, "not a readable .npy array of document offsets"),
        ("npy", lambda data: data[:-16], "not a readable .npy array of document offsets"),
    ],
    ids=["no-num_docs", "no-vocab_size", "str-num_docs", "eos-outside", "garbage-npy", "cut-npy"],
)
def test_damaged_shard_metadata_names_the_file_and_a_rerun_redoes_it(
    tmp_path, file, damage, message
):
    """A shard .json without num_docs or vocab_size (KeyError), with "num_docs": "3" (TypeError), a garbage or cut
    offsets .npy (numpy's message) named no file; an eos_id outside the vocabulary was accepted, then crashed
    padded packing (IndexError; a device-side assert on a GPU). Each names the file and the fix, and that fix (a
    rerun of prepare into the same --out) redoes the shard."""
    from posfreq.train.data.corpora import resolve_corpus
    from posfreq.train.data.tokens import prepare as prep
    from posfreq.train.data.tokens.shard_files import DamagedShard

    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.jsonl").write_text(
        "".join(json.dumps({"text": t}) + "\n" for t in ("one", "two", "three"))
    )
    corpus, out = resolve_corpus(tmp_path / "corpus"), tmp_path / "tokens"
    prep.prepare(corpus, out, "bytes", progress=False)
    path = out / ("a.json" if file == "json" else "a.offsets.npy")
    if file == "json":
        path.write_text(json.dumps(damage(json.loads(path.read_text()))))
    else:
        path.write_bytes(damage(path.read_bytes()))
    trusting = TokenDataset(
        out
    )  # the manifest is trusted at start: the shard is checked when first read
    with pytest.raises(DamagedShard) as refused:
        trusting.document(0)
    assert str(refused.value).startswith(f"{path}: ") and message in str(refused.value)
    (out / "manifest.json").unlink()  # without it, every shard is checked at start
    with pytest.raises(DamagedShard) as refused:
        TokenDataset(out)
    assert str(refused.value).startswith(f"{path}: ") and message in str(refused.value)
    assert "Fix: rerun scripts/prepare_data.py (posfreq prepare) with the same --out" in str(
        refused.value
    )
    assert prep.prepare(corpus, out, "bytes", progress=False).skipped_complete == 0
    assert TokenDataset(out).num_docs == 3


@pytest.mark.skipif(
    not Path("/proc/self/fd").is_dir(), reason="counts open files through Linux's /proc"
)
def test_cached_shards_hold_one_file_each_and_the_open_file_limit_allows_them(
    tmp_path: Path,
) -> None:
    """Each cached shard keeps one open file (its tokens' memory map; offsets are read whole): a memory-mapped
    offsets file was a second one, so 256 cached shards of a run and of its validation set passed the 1,024 open
    files a cluster job often starts with. The soft limit is raised where it is lower than the cache needs."""
    import resource

    for s in range(12):
        with ShardWriter(
            tmp_path, f"shard-{s:03d}", tokenizer="bytes", vocab_size=258, eos_id=257
        ) as w:
            for d in range(3):
                w.add([d + 1] * (s + 2) + [257])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))
        before = len(os.listdir("/proc/self/fd"))
        data = TokenDataset(tmp_path, max_open=8)
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= min(8 + 1024, hard)
        for i in range(len(data)):
            assert data.document(i)[-1] == 257
        assert len(os.listdir("/proc/self/fd")) - before <= 8
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.slow
def test_a_manifest_makes_start_up_one_read_for_a_thousand_shards(
    tmp_path: Path, monkeypatch
) -> None:
    """Every rank read each shard's JSON, stat its tokens and loaded its offsets at every start, and rank 0 read every
    offsets file again for the fingerprint: about 3 million metadata operations for SlimPajama's ~59k shards on a
    shared file system. With the manifest `posfreq prepare` writes, a start (the dataset and its fingerprint) reads
    one file, whatever the number of shards, and gives the same fingerprint and counts."""
    import builtins
    import os

    from posfreq.train.data.tokens.shard_files import ShardWriter
    from posfreq.train.data.tokens.shards import write_manifest

    for s in range(1000):
        with ShardWriter(
            tmp_path, f"s{s:04d}", tokenizer="bytes", vocab_size=258, eos_id=257
        ) as writer:
            writer.add(np.array([5, 6, 257], dtype=np.int64))
    scanned = TokenDataset(tmp_path)
    expected = (scanned.num_docs, scanned.num_tokens, scanned.fingerprint())

    def counted() -> tuple[int, tuple]:
        calls = {"n": 0}
        real = {"stat": os.stat, "open": builtins.open, "load": np.load}

        def count(name):
            def wrapper(*args, **kwargs):
                calls["n"] += 1
                return real[name](*args, **kwargs)

            return wrapper

        with monkeypatch.context() as patch:
            patch.setattr(os, "stat", count("stat"))
            patch.setattr(builtins, "open", count("open"))
            patch.setattr(np, "load", count("load"))
            dataset = TokenDataset(tmp_path)
            found = (dataset.num_docs, dataset.num_tokens, dataset.fingerprint())
        return calls["n"], found

    without, found = counted()
    assert found == expected and without >= 3000
    write_manifest(tmp_path)
    with_manifest, found = counted()
    assert found == expected and with_manifest <= 5, with_manifest
    assert TokenDataset(tmp_path).document(999).tolist() == [
        5,
        6,
        257,
    ]  # read lazily, checked when opened


def test_the_tokenizer_setting_names_the_shards_folder_by_path_not_by_spelling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relative hf:DIR setting for the folder the shards recorded absolutely is the same tokenizer; another
    folder is refused, with the rerun that relabels shards whose data and tokenizer moved."""
    recorded = f"hf:{tmp_path / 'tok'}"
    with ShardWriter(tmp_path / "d", "a", tokenizer=recorded, vocab_size=258, eos_id=257) as w:
        w.add([1, 257])
    monkeypatch.chdir(tmp_path)
    assert TokenDataset(tmp_path / "d", tokenizer="hf:tok").tokenizer == recorded
    with pytest.raises(ValueError, match="rerun posfreq prepare.*--tokenizer hf:/moved/tok"):
        TokenDataset(tmp_path / "d", tokenizer="hf:/moved/tok")
    with pytest.raises(ValueError, match=r"not 'bytes'\. Fix: point to data.*setting\.$"):
        TokenDataset(tmp_path / "d", tokenizer="bytes")

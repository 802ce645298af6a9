"""Shards (train/shards.py), packing and the resumable sampler (train/packing.py), against independent references.

Most tests use a "unique-token" dataset: token values are the global token positions
(0, 1, 2, ...), so each token identifies its document and offset, and "every token exactly
once" is a plain sort-and-compare.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

from posfreq.train.packing import IGNORE_INDEX, PackedBatch, PackedSampler
from posfreq.train.shards import ShardWriter, TokenDataset, concat_ranges
from posfreq.train.tokenizer import get_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def unique_dataset(directory: Path, lengths_per_shard: list[list[int]], tokenizer: str = "unique") -> np.ndarray:
    """Write shards whose tokens are their global positions; returns global doc offsets."""
    total = sum(map(sum, lengths_per_shard))
    start, offsets = 0, [0]
    for s, lengths in enumerate(lengths_per_shard):
        with ShardWriter(directory, f"shard{s:02d}", tokenizer=tokenizer, vocab_size=total + 1, eos_id=total) as w:
            for n in lengths:
                w.add(np.arange(start, start + n))
                start += n
                offsets.append(start)
    return np.array(offsets)


LENGTHS = [[1, 5, 40, 3, 17], [2, 33, 9, 11], [], [64, 1, 1, 7, 25, 8]]  # some > L, some 1 token, an empty shard


@pytest.fixture
def unique(tmp_path: Path) -> tuple[TokenDataset, np.ndarray]:
    offsets = unique_dataset(tmp_path / "u", LENGTHS)
    return TokenDataset(tmp_path / "u"), offsets


def epoch_stream(sampler: PackedSampler, pad_id: int | None = None) -> np.ndarray:
    """The first epoch's input tokens, in stream order, read through the iterator."""
    units = sampler.units_per_epoch
    tokens: list[np.ndarray] = []
    rows = 0
    while rows * (sampler.seq_len if sampler.mix_documents else 1) < units:
        batch = next(sampler)
        ids = batch.input_ids.numpy()
        tokens.append(ids if pad_id is None else ids[ids != pad_id])
        rows += batch.rows
    stream = np.concatenate(tokens)
    return stream[: sampler.dataset.num_tokens]


def check_segments(batch: PackedBatch, offsets: np.ndarray | None, attention: str = "document",
                   pad_id: int | None = None) -> None:
    """Invariants of one batch, checked segment by segment with plain Python."""
    L, T = batch.seq_len, batch.rows * batch.seq_len
    cu = batch.cu_seqlens.numpy().astype(np.int64)
    ids, tgt, pos = batch.input_ids.numpy(), batch.targets.numpy(), batch.position_ids.numpy()
    assert batch.cu_seqlens.dtype == torch.int32 and batch.input_ids.dtype == torch.int64
    assert ids.shape == tgt.shape == pos.shape == (T,)
    assert cu[0] == 0 and cu[-1] == T and np.all(np.diff(cu) > 0)
    assert set(range(0, T + 1, L)) <= set(cu.tolist()), "a segment crosses a row boundary"
    assert batch.max_seqlen == np.diff(cu).max() <= L
    assert np.all(batch.segment_lengths <= L)
    for a, b in zip(cu[:-1], cu[1:]):
        assert list(pos[a:b]) == list(range(b - a))
        if pad_id is not None and np.all(ids[a:b] == pad_id):
            assert np.all(tgt[a:b] == IGNORE_INDEX)
            continue
        assert list(tgt[a: b - 1]) == list(ids[a + 1: b]) and tgt[b - 1] == IGNORE_INDEX
        if attention == "row":
            assert b - a == L
        elif offsets is not None:  # a document segment lies inside one piece of one document
            doc = np.searchsorted(offsets, ids[a:b], side="right") - 1
            assert len(set(doc)) == 1 and np.all(np.diff(ids[a:b]) == 1)
            local = ids[a:b] - offsets[doc[0]]
            assert local[0] // L == local[-1] // L, "a segment crosses a piece cut"


@pytest.mark.parametrize("seq_len,rows,world,block", [(8, 3, 1, 1 << 20), (16, 2, 1, 3), (5, 4, 2, 4)])
def test_mixed_epoch_covers_every_token_once(unique, seq_len, rows, world, block) -> None:
    ds, offsets = unique
    samplers = [PackedSampler(ds, seq_len, rows, seed=3, rank=r, world_size=world, shuffle_block=block)
                for r in range(world)]
    per_step = []
    while sum(len(x) for x in per_step) < ds.num_tokens:
        for s in samplers:
            batch = next(s)
            check_segments(batch, offsets)
            assert np.array_equal(np.diff(batch.cu_seqlens.numpy()), batch.segment_lengths)
            per_step.append(batch.input_ids.numpy())
    stream = np.concatenate(per_step)[: ds.num_tokens]
    assert np.array_equal(np.sort(stream), np.arange(ds.num_tokens))
    starts = set(offsets[:-1].tolist())
    inside = np.array([t not in starts for t in stream[1:]])
    assert np.all(np.diff(stream)[inside] == 1), "documents are not contiguous in the stream"


def test_row_attention_is_one_causal_segment_per_row(unique) -> None:
    ds, _ = unique
    sampler = PackedSampler(ds, 8, 3, seed=1, attention="row")
    reference = PackedSampler(ds, 8, 3, seed=1)
    for _ in range(10):
        batch, ref = next(sampler), next(reference)
        check_segments(batch, None, attention="row")
        assert torch.equal(batch.input_ids, ref.input_ids)
        assert np.array_equal(batch.segment_lengths, np.full(3, 8))


def test_one_piece_per_row_with_padding(unique) -> None:
    ds, offsets = unique
    L, pad = 8, ds.eos_id
    sampler = PackedSampler(ds, L, 3, seed=5, mix_documents=False)
    pieces = sum(-(-n // L) for n in ds.doc_lengths())
    assert sampler.units_per_epoch == pieces
    real = []
    for _ in range(-(-pieces // 3)):
        batch = next(sampler)
        check_segments(batch, offsets, pad_id=pad)
        ids, tgt, pos = (t.numpy().reshape(3, L) for t in (batch.input_ids, batch.targets, batch.position_ids))
        lengths = (ids != pad).sum(1)
        for r in range(3):
            n = lengths[r]
            assert np.all(ids[r, n:] == pad) and np.all(tgt[r, n - 1:] == IGNORE_INDEX)
            doc = np.searchsorted(offsets, ids[r, 0], side="right") - 1
            assert (ids[r, 0] - offsets[doc]) % L == 0, "a row does not start a piece"
            assert pos[r, 0] == 0
        assert np.array_equal(batch.segment_lengths, lengths)
        real.append(ids[ids != pad])
    stream = np.concatenate(real)[: ds.num_tokens]
    assert np.array_equal(np.sort(stream), np.arange(ds.num_tokens))


@pytest.mark.parametrize("mix", [True, False])
def test_resume_mid_epoch_reproduces_the_stream(unique, mix) -> None:
    ds, _ = unique
    make = lambda: PackedSampler(ds, 7, 2, seed=11, mix_documents=mix, shuffle_block=5)  # noqa: E731
    original = make()
    for _ in range(23):  # past the first epoch, stopping mid-epoch
        next(original)
    state = json.loads(json.dumps(original.state_dict()))
    assert 0 < state["position_in_epoch"] and state["epoch"] >= 1
    expected = [next(original) for _ in range(20)]
    resumed = make()
    resumed.load_state_dict(state)
    for want, got in zip(expected, (next(resumed) for _ in range(20))):
        for field in ("input_ids", "targets", "position_ids", "cu_seqlens"):
            assert torch.equal(getattr(want, field), getattr(got, field))
        assert np.array_equal(want.segment_lengths, got.segment_lengths)


def test_state_from_other_stream_is_refused(unique) -> None:
    ds, _ = unique
    state = PackedSampler(ds, 8, 2, seed=1).state_dict()
    with pytest.raises(ValueError, match="seq_len: saved 8 vs now 16"):
        PackedSampler(ds, 16, 2, seed=1).load_state_dict(state)


def test_deterministic_for_a_seed(unique) -> None:
    ds, _ = unique
    a, b, c = (PackedSampler(ds, 8, 2, seed=s) for s in (4, 4, 5))
    first = [next(a).input_ids for _ in range(5)]
    assert all(torch.equal(x, next(b).input_ids) for x in first)
    assert not all(torch.equal(x, next(c).input_ids) for x in first)


def test_ranks_are_disjoint_and_union_is_single_stream(unique) -> None:
    ds, _ = unique
    world, rows = 3, 2
    single = PackedSampler(ds, 6, rows, seed=2)
    ranks = [PackedSampler(ds, 6, rows, seed=2, rank=r, world_size=world) for r in range(world)]
    seen = []
    for _ in range(4):
        for sampler in ranks:
            got = next(sampler)
            assert torch.equal(got.input_ids, next(single).input_ids)
            seen.append(got.input_ids.numpy())
    assert all(s.state_dict() == single.state_dict() for s in ranks)
    first_epoch = np.concatenate(seen)[: ds.num_tokens]
    assert len(np.unique(first_epoch)) == len(first_epoch)


def test_dataset_reads_documents(unique) -> None:
    ds, offsets = unique
    assert ds.num_docs == len(offsets) - 1 and ds.num_tokens == offsets[-1]
    assert np.array_equal(ds.doc_lengths(), np.diff(offsets))
    assert np.array_equal(ds.doc_lengths(3, 12), np.diff(offsets)[3:12])
    for i in (0, 4, 5, 9, ds.num_docs - 1):
        assert np.array_equal(ds.document(i), np.arange(offsets[i], offsets[i + 1]))
    batch = next(PackedSampler(ds, 8, 2, seed=0)).to("cpu")
    assert isinstance(batch, PackedBatch) and batch.num_tokens == 16


def test_concat_ranges_against_a_loop() -> None:
    starts, lengths = np.array([5, 0, 9, 3]), np.array([2, 0, 3, 1])
    expected = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lengths)])
    assert concat_ranges(starts, lengths).tolist() == expected.tolist() == [5, 6, 9, 10, 11, 3]
    assert concat_ranges(np.array([4]), np.array([0])).size == 0


def test_shard_files_are_world_readable(tmp_path: Path) -> None:
    """Data directories are shared between users: every shard file is 0644 under the usual umask 022."""
    old = os.umask(0o022)
    try:
        unique_dataset(tmp_path, [[2, 3]])
    finally:
        os.umask(old)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["shard00.json", "shard00.offsets.npy", "shard00.tokens.bin"]
    assert {stat.S_IMODE((tmp_path / n).stat().st_mode) for n in names} == {0o644}


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


def test_interrupted_writer_leaves_no_shard(tmp_path: Path) -> None:
    unique_dataset(tmp_path, [[2]])
    with pytest.raises(RuntimeError):
        with ShardWriter(tmp_path, "broken", tokenizer="unique", vocab_size=3, eos_id=2) as w:
            w.add([0, 1])
            raise RuntimeError("killed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard00.json", "shard00.offsets.npy", "shard00.tokens.bin"]


def test_prepare_data_matches_one_by_one_tokenization_and_restarts(tmp_path: Path) -> None:
    from posfreq.train.corpora import resolve_corpus

    from posfreq.scripts import prepare_data as prep

    corpus_dir = tmp_path / "corpus"
    (corpus_dir / "part").mkdir(parents=True)
    texts = {"part/a.jsonl": ["hello world", "naïve café ☕", ""], "part/b.jsonl": ["x" * 50],
             "c.txt": ["one text file\nwith two lines"]}
    for name, docs in texts.items():
        path = corpus_dir / name
        if name.endswith(".txt"):
            path.write_text(docs[0], encoding="utf-8")
        else:
            path.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs), encoding="utf-8")
    corpus = resolve_corpus(corpus_dir)
    out = tmp_path / "tokens"
    totals = prep.prepare(corpus, out, "bytes", progress=False)
    assert totals["files"] == 3 and totals["skipped_complete"] == 0

    tok = get_tokenizer("bytes")
    ds = TokenDataset(out, tokenizer="bytes")
    assert [s.name for s in ds.shards] == ["c", "part__a", "part__b"]
    expected = [tok.encode(t) + [tok.eos_id] for name in ("c.txt", "part/a.jsonl", "part/b.jsonl") for t in texts[name]]
    assert [ds.document(i).tolist() for i in range(ds.num_docs)] == expected

    meta = json.loads((out / "part__a.json").read_text())
    assert meta["source_size"] == (corpus_dir / "part/a.jsonl").stat().st_size and len(meta["source_sha256"]) == 64
    mtime = (out / "part__b.tokens.bin").stat().st_mtime_ns
    (out / "c.json").unlink()  # as if killed before this shard completed
    again = prep.prepare(corpus, out, "bytes", progress=False)
    assert again["skipped_complete"] == 2 and again["docs"] == 1
    assert (out / "part__b.tokens.bin").stat().st_mtime_ns == mtime
    assert [TokenDataset(out).document(i).tolist() for i in range(ds.num_docs)] == expected

    split = tmp_path / "split"  # two array tasks, one with worker processes, give the same shards
    prep.prepare(corpus, split, "bytes", shard=(0, 2), progress=False)
    prep.prepare(corpus, split, "bytes", shard=(1, 2), workers=2, progress=False)
    for name in ("c", "part__a", "part__b"):
        assert (split / f"{name}.tokens.bin").read_bytes() == (out / f"{name}.tokens.bin").read_bytes()
    with pytest.raises(SystemExit, match="tokenized with 'bytes', not 'llama3'"):
        prep.prepare(corpus, out, "llama3", progress=False)

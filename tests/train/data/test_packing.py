"""Packing strategies, length upsampling, the sampler and the trained-histogram prediction, against independent
references: token-by-token scans of the rows (a "unique-token" dataset, where every token is its global position,
so it names its document and offset), a naive best-fit and brute-force Eq. 2. Tiny trained models:
tests/train/run/test_trainer_packing.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.packing import PIECE_RULES, naive_best_fit_fills, naive_f, naive_pieces
from helpers.shards import LENGTHS, unique_dataset

from posfreq.analysis.corpus.frequency import position_frequency
from posfreq.train.data.packing import IGNORE_INDEX, PackedBatch, PackedSampler
from posfreq.train.data.packing_schedule import (
    PackingSchedule,
    RowPacking,
    predict_trained_histogram,
)
from posfreq.train.data.packing_strategies import (
    STRATEGIES,
    TOKEN_STREAMS,
    Documents,
    best_fit_decreasing,
)
from posfreq.train.data.tokens.shards import TokenDataset
from posfreq.train.data.upsample import LengthUpsample
from posfreq.train.run.config import ConfigError, DataSection, config_from_dict

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture
def unique(tmp_path: Path) -> tuple[TokenDataset, np.ndarray]:
    """The unique-token dataset of tests/train/data/tokens/test_shards.py (documents of 1..64 tokens, an empty shard) and its offsets."""
    offsets = unique_dataset(tmp_path / "u", LENGTHS)
    return TokenDataset(tmp_path / "u"), offsets


def scan_segments(
    batch: PackedBatch, offsets: np.ndarray, pad_id: int, pieces: bool = True
) -> list[list[int]]:
    """Per row, the lengths of its document segments, found token by token: a segment ends at a row end, at padding,
    where tokens stop being consecutive, or (with `pieces`, every strategy but stream) before a token at a
    document-local multiple of L (a piece start)."""
    L, ids = batch.train_len, batch.input_ids.numpy()
    out = []
    for r in range(batch.rows):
        row, lengths, run = ids[r * L : (r + 1) * L].tolist(), [], 0
        for k, t in enumerate(row):
            if t == pad_id:
                if run:
                    lengths.append(run)
                run = 0
                continue
            local = t - offsets[np.searchsorted(offsets, t, side="right") - 1]
            starts_piece = local == 0 or (pieces and local % L == 0)  # a document starts a piece
            if run and (starts_piece or t != row[k - 1] + 1):
                lengths.append(run)
                run = 0
            run += 1
        if run:
            lengths.append(run)
        out.append(lengths)
    return out


def real_tokens(batch: PackedBatch, pad_id: int) -> np.ndarray:
    """The batch's document tokens in row order (the unique dataset's pad id is no document token)."""
    ids = batch.input_ids.numpy()
    return ids[ids != pad_id]


def check_batch(batch: PackedBatch, offsets: np.ndarray, pad_id: int, packing: str) -> None:
    """Invariants of one batch, segment by segment with plain Python: row boundaries cut, targets inside segments,
    position ids, padding never a target; a document segment inside one piece (the whole piece under the piece
    rules; stream has no pieces: a segment is cut only at its document's ends and at row ends)."""
    L, T = batch.train_len, batch.rows * batch.train_len
    cu = batch.cu_seqlens.numpy().astype(np.int64)
    ids, tgt, pos = batch.input_ids.numpy(), batch.targets.numpy(), batch.position_ids.numpy()
    assert batch.cu_seqlens.dtype == torch.int32 and batch.input_ids.dtype == torch.int64
    assert ids.shape == tgt.shape == pos.shape == (T,)
    assert cu[0] == 0 and cu[-1] == T and np.all(np.diff(cu) > 0)
    assert set(range(0, T + 1, L)) <= set(cu.tolist()), "a segment crosses a row boundary"
    assert batch.max_seqlen == np.diff(cu).max() <= L
    real = []
    for a, b in zip(cu[:-1], cu[1:]):
        assert list(pos[a:b]) == list(range(b - a))
        if np.all(ids[a:b] == pad_id):
            assert np.all(tgt[a:b] == IGNORE_INDEX)
            continue
        real.append(b - a)
        assert list(tgt[a : b - 1]) == list(ids[a + 1 : b]) and tgt[b - 1] == IGNORE_INDEX
        doc = np.searchsorted(offsets, ids[a:b], side="right") - 1
        assert len(set(doc)) == 1 and np.all(np.diff(ids[a:b]) == 1)
        local = ids[a:b] - offsets[doc[0]]
        if (
            packing == "stream"
        ):  # a segment starts at its document's start or at a row start, ends likewise
            doc_len = offsets[doc[0] + 1] - offsets[doc[0]]
            assert local[0] == 0 or a % L == 0, "a document was cut inside a row"
            assert local[-1] == doc_len - 1 or b % L == 0, "a document was cut inside a row"
            continue
        assert local[0] // L == local[-1] // L, "a segment crosses a piece cut"
        if packing in PIECE_RULES:
            doc_len = offsets[doc[0] + 1] - offsets[doc[0]]
            assert local[0] % L == 0 and b - a == min(L, doc_len - local[0]), "a piece was split"
    assert batch.segment_lengths.tolist() == real


# --------------------------------------------------------------------------------------------
# Strategies: every token once, whole pieces, the segments a token scan finds
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("packing", STRATEGIES)
@pytest.mark.parametrize("train_len,block", [(8, 1 << 20), (5, 3), (16, 4)])
def test_an_epoch_holds_every_token_once(unique, packing, train_len, block) -> None:
    ds, offsets = unique
    sampler = PackedSampler(
        ds, train_len, 3, seed=3, packing=RowPacking(strategy=packing, shuffle_block=block)
    )
    rows = sampler.schedule.epoch_rows(0)
    assert rows.start == 0
    batch = sampler.make_batch(0, len(rows))
    check_batch(batch, offsets, ds.eos_id, packing)
    stream = real_tokens(batch, ds.eos_id)
    if packing in TOKEN_STREAMS:
        assert len(rows) == -(-ds.num_tokens // train_len)
        stream = stream[: ds.num_tokens]  # the last row runs on into the next epoch
        starts = set(offsets[:-1].tolist())
        inside = np.array([t not in starts for t in stream[1:]])
        assert np.all(np.diff(stream)[inside] == 1), "documents are not contiguous in the stream"
    assert np.array_equal(np.sort(stream), np.arange(ds.num_tokens))
    scan = scan_segments(batch, offsets, ds.eos_id, pieces=packing != "stream")
    found = [n for row in scan for n in row]
    assert sorted(found) == sorted(batch.segment_lengths.tolist())
    if packing == "padded":
        assert len(rows) == len(naive_pieces(ds.doc_lengths(), train_len))
        assert all(len(row) == 1 for row in scan_segments(batch, offsets, ds.eos_id))


def test_best_fit_rows_match_a_naive_best_fit(unique) -> None:
    ds, offsets = unique
    L = 16
    sampler = PackedSampler(
        ds, L, 2, seed=1, packing=RowPacking(strategy="best_fit")
    )  # one block: the whole corpus is the buffer
    rows = sampler.schedule.epoch_rows(0)
    batch = sampler.make_batch(0, len(rows))
    fills = (batch.input_ids.numpy().reshape(len(rows), L) != ds.eos_id).sum(1)
    assert sorted(fills.tolist()) == naive_best_fit_fills(naive_pieces(ds.doc_lengths(), L), L)
    padding = 1 - fills.sum() / (len(rows) * L)
    assert padding == pytest.approx(sampler.schedule.predict_epoch(0).padding_share)


@pytest.mark.parametrize("seed", range(5))
def test_best_fit_decreasing_against_a_naive_scan(seed) -> None:
    rng = np.random.default_rng(seed)
    L = int(rng.integers(1, 40))
    sizes = rng.integers(1, L + 1, size=int(rng.integers(0, 300)))
    rows = best_fit_decreasing(sizes, L)
    fills = np.bincount(rows, weights=sizes, minlength=int(rows.max(initial=-1)) + 1)
    assert sorted(fills.astype(int).tolist()) == naive_best_fit_fills(sizes.tolist(), L)
    assert fills.max(initial=0) <= L
    with pytest.raises(ValueError, match=r"lengths in \[1, 4\]"):
        best_fit_decreasing(np.array([5]), 4)


def test_row_attention_is_one_causal_segment_per_row(unique) -> None:
    ds, _ = unique
    sampler = PackedSampler(ds, 8, 3, seed=1, packing=RowPacking(attention="row"))
    reference = PackedSampler(ds, 8, 3, seed=1)
    for _ in range(10):
        batch, ref = next(sampler), next(reference)
        assert torch.equal(batch.input_ids, ref.input_ids)
        assert np.array_equal(batch.cu_seqlens.numpy(), np.arange(0, 25, 8))
        assert np.array_equal(batch.segment_lengths, np.full(3, 8))
    with pytest.raises(ValueError, match="attention='row'.*needs packing='concat'"):
        PackedSampler(ds, 8, 3, packing=RowPacking(strategy="best_fit", attention="row"))
    # stream's rows are concat's rows (the same token stream): under row attention the two are one thing
    streamed = PackedSampler(
        ds, 8, 3, seed=1, packing=RowPacking(strategy="stream", attention="row")
    )
    again = PackedSampler(ds, 8, 3, seed=1, packing=RowPacking(attention="row"))
    for _ in range(10):
        a, b = next(streamed), next(again)
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.cu_seqlens, b.cu_seqlens)


# --------------------------------------------------------------------------------------------
# Determinism, ranks, resume
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("packing", STRATEGIES)
def test_deterministic_for_a_seed(unique, packing) -> None:
    ds, _ = unique
    a, b, c = (
        PackedSampler(ds, 8, 2, seed=s, packing=RowPacking(strategy=packing, shuffle_block=4))
        for s in (4, 4, 5)
    )
    first = [next(a).input_ids for _ in range(12)]
    assert all(torch.equal(x, next(b).input_ids) for x in first)
    assert not all(torch.equal(x, next(c).input_ids) for x in first)


@pytest.mark.parametrize("packing", STRATEGIES)
def test_ranks_are_disjoint_and_union_is_single_stream(unique, packing) -> None:
    ds, _ = unique
    world, rows = 3, 2
    single = PackedSampler(
        ds, 6, rows, seed=2, packing=RowPacking(strategy=packing, shuffle_block=5)
    )
    ranks = [
        PackedSampler(
            ds,
            6,
            rows,
            seed=2,
            rank=r,
            world_size=world,
            packing=RowPacking(strategy=packing, shuffle_block=5),
        )
        for r in range(world)
    ]
    seen = []
    for _ in range(8):  # past the first epoch
        for sampler in ranks:
            got = next(sampler)
            assert torch.equal(got.input_ids, next(single).input_ids)
            seen.append(got)
        assert all(s.state_dict() == single.state_dict() for s in ranks)
    tokens = np.concatenate([real_tokens(b, ds.eos_id) for b in seen])
    first_epoch = tokens[: ds.num_tokens]
    assert len(np.unique(first_epoch)) == len(first_epoch)


UPSAMPLE = {"1-2": 0.5, "30-": 2.0}


@pytest.mark.parametrize("packing", STRATEGIES)
@pytest.mark.parametrize("upsample", [{}, UPSAMPLE])
def test_resume_mid_epoch_reproduces_the_stream(unique, packing, upsample) -> None:
    ds, _ = unique

    def make(world: int = 1, rank: int = 0) -> PackedSampler:
        return PackedSampler(
            ds,
            7,
            2,
            seed=11,
            world_size=world,
            rank=rank,
            packing=RowPacking(strategy=packing, shuffle_block=5, upsample=upsample),
        )

    original = make()
    epoch_rows = original.schedule.epoch_rows(0)
    for _ in range(len(epoch_rows) // 2 + 3):  # past the first epoch, stopping mid-epoch
        next(original)
    state = json.loads(json.dumps(original.state_dict()))
    assert state["epoch"] >= 1 and state["position_in_epoch"] > 0
    assert state["length_upsample"] == LengthUpsample.parse(upsample).as_dict()
    expected = [next(original) for _ in range(20)]
    resumed = make()
    resumed.load_state_dict(state)
    for want, got in zip(expected, (next(resumed) for _ in range(20))):
        for field in ("input_ids", "targets", "position_ids", "cu_seqlens"):
            assert torch.equal(getattr(want, field), getattr(got, field))
        assert np.array_equal(want.segment_lengths, got.segment_lengths)
    cursor = tuple(state["cursor"])
    assert all(tuple(c) <= (0, 0, 0, 0) or tuple(c) >= cursor for c in resumed.schedule._walked), (
        "resuming planned blocks before the saved one (a replay of the epoch)"
    )
    halves = [make(2, r) for r in range(2)]  # another world size continues the same global stream
    for sampler in halves:
        sampler.load_state_dict(state)
    for k in range(0, 20, 2):
        assert torch.equal(next(halves[0]).input_ids, expected[k].input_ids)
        assert torch.equal(next(halves[1]).input_ids, expected[k + 1].input_ids)


def test_state_from_other_stream_is_refused(unique) -> None:
    ds, _ = unique
    state = PackedSampler(ds, 8, 2, seed=1).state_dict()
    with pytest.raises(ValueError, match="train_len: saved 8 vs now 16"):
        PackedSampler(ds, 16, 2, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="packing: saved 'concat' vs now 'best_fit'"):
        PackedSampler(ds, 8, 2, seed=1, packing=RowPacking(strategy="best_fit")).load_state_dict(
            state
        )
    with pytest.raises(ValueError, match=r"length_upsample: saved \{\} vs now \{'30-': 2.0\}"):
        PackedSampler(ds, 8, 2, seed=1, packing=RowPacking(upsample={"30-": 2.0})).load_state_dict(
            state
        )


# --------------------------------------------------------------------------------------------
# Length upsampling
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("packing", STRATEGIES)
def test_integer_weights_repeat_each_document_exactly(unique, packing) -> None:
    ds, offsets = unique
    lengths = ds.doc_lengths()
    weights = {"1-3": 0.0, "3-20": 1.0, "30-": 3.0}
    copies = np.where(lengths < 3, 0, np.where(lengths >= 30, 3, 1))
    sampler = PackedSampler(
        ds, 8, 2, seed=7, packing=RowPacking(strategy=packing, shuffle_block=4, upsample=weights)
    )
    rows = sampler.schedule.epoch_rows(0)
    batch = sampler.make_batch(0, len(rows))
    check_batch(batch, offsets, ds.eos_id, packing)
    tokens = real_tokens(batch, ds.eos_id)
    expected = np.repeat(copies, lengths)
    if packing in TOKEN_STREAMS:
        tokens = tokens[: int(expected.sum())]
    assert np.array_equal(np.bincount(tokens, minlength=ds.num_tokens), expected)


def test_fractional_weights_keep_floor_or_ceil_copies_drawn_per_epoch(unique) -> None:
    ds, offsets = unique
    sampler = PackedSampler(
        ds,
        8,
        1,
        seed=2,
        packing=RowPacking(strategy="padded", shuffle_block=4, upsample={"1-": 1.5}),
    )
    per_epoch = []
    for epoch in range(40):
        rows = sampler.schedule.epoch_rows(epoch)
        tokens = real_tokens(sampler.make_batch(rows.start, len(rows)), ds.eos_id)
        counts = np.bincount(tokens, minlength=ds.num_tokens)[
            offsets[:-1]
        ]  # copies of each document's first token
        assert set(counts.tolist()) <= {1, 2}
        per_epoch.append(counts)
    per_epoch = np.array(per_epoch)
    assert len({tuple(c) for c in per_epoch}) > 1, "every epoch drew the same copies"
    assert abs(per_epoch.mean() - 1.5) < 0.1


def test_upsample_weights_by_source_override_the_general_bucket() -> None:
    lengths = np.array([5, 50, 500, 5, 50, 500])
    docs = Documents(lengths, np.array([0, 0, 0, 1, 1, 1]), ("arxiv", "web"))
    upsample = LengthUpsample.parse({"0-100": 0.5, "arxiv:40-": 4.0})
    assert upsample.weights(docs.lengths, docs.sources, docs.source_names).tolist() == [
        0.5,
        4,
        4,
        0.5,
        0.5,
        1,
    ]
    with pytest.raises(ValueError, match="no documents of source 'books'"):
        LengthUpsample.parse({"books:0-": 2}).weights(docs.lengths, docs.sources, docs.source_names)
    with pytest.raises(ValueError, match="per-source buckets.*carry no source"):
        PackingSchedule(Documents(lengths), 8, packing=RowPacking(upsample={"arxiv:0-": 2.0}))


@pytest.mark.parametrize(
    "weights,message",
    [
        ({"abc": 1.0}, r"\['abc'\]: a key is LO-HI"),
        ({"10-5": 1.0}, r"\['10-5'\]: empty range"),
        ({"0-10": -1.0}, r"\['0-10'\]=-1.0: a weight is a finite number >= 0"),
        ({"0-10": float("nan")}, r"\['0-10'\]=nan"),
        ({"0-100": 1.0, "50-": 2.0}, r"\['50-'\] overlaps .*\['0-100'\]"),
        ({"0-100": 0.0, "100-": 0}, r": every document length has weight 0"),
    ],
)
def test_bad_upsample_weights_are_named(weights, message) -> None:
    with pytest.raises(ValueError, match=message):
        LengthUpsample.parse(weights)
    with pytest.raises(ConfigError, match=r"data\.length_upsample" + message):
        DataSection(length_upsample=weights)


def test_data_section_checks_packing_settings() -> None:
    with pytest.raises(ConfigError, match="data.attention=row needs data.packing=concat"):
        DataSection(packing="padded", attention="row")
    with pytest.raises(ConfigError, match="per-source keys.*token shards do not record"):
        DataSection(length_upsample={"arxiv:0-": 2.0})
    with pytest.raises(ConfigError, match="packing"):
        config_from_dict({"data": {"packing": "greedy"}})
    assert DataSection(
        packing="best_fit", length_upsample={"0-1024": 0.5, "4096-": 2}
    ).length_upsample == {"0-1024": 0.5, "4096-": 2.0}


# --------------------------------------------------------------------------------------------
# Prediction
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("packing", STRATEGIES)
@pytest.mark.parametrize("upsample", [{}, UPSAMPLE])
def test_prediction_equals_the_segments_a_token_scan_finds(unique, packing, upsample) -> None:
    ds, offsets = unique
    L = 8
    sampler = PackedSampler(
        ds, L, 3, seed=5, packing=RowPacking(strategy=packing, shuffle_block=4, upsample=upsample)
    )
    prediction = predict_trained_histogram(
        ds, L, seed=5, packing=RowPacking(strategy=packing, shuffle_block=4, upsample=upsample)
    )
    found = np.zeros(L + 1, dtype=np.int64)
    for first in range(0, prediction.rows, 3):  # the batches a one-epoch run trains on
        batch = sampler.make_batch(first, min(3, prediction.rows - first))
        for row in scan_segments(batch, offsets, ds.eos_id, pieces=packing != "stream"):
            found += np.bincount(row, minlength=L + 1)
    assert np.array_equal(prediction.histogram, found)
    if (
        packing in PIECE_RULES and not upsample
    ):  # one epoch trains exactly Eq. 2 over the corpus's pieces
        pieces = naive_pieces(ds.doc_lengths(), L)
        assert np.array_equal(prediction.histogram, np.bincount(pieces, minlength=L + 1))
        assert np.array_equal(position_frequency(prediction.histogram, L), naive_f(pieces, L))
    assert prediction.padding_share == pytest.approx(
        1 - found @ np.arange(L + 1) / (prediction.rows * L)
    )


def test_stream_keeps_a_long_documents_whole_rows_that_concat_cuts_at_its_pieces() -> None:
    """Documents of 3L + 5 tokens: stream cuts them only where rows end, so each has two whole L-token rows;
    concat also cuts at every document-local multiple of L, so a piece whole in a row needs the document to
    start on a row boundary. Both fill every token of the epoch's rows."""
    L, n = 16, 40
    lengths = np.full(n, 3 * L + 5)
    stream = predict_trained_histogram(
        lengths, L, seed=1, packing=RowPacking(strategy="stream")
    ).histogram
    concat = predict_trained_histogram(
        lengths, L, seed=1, packing=RowPacking(strategy="concat")
    ).histogram
    pieces = np.bincount(naive_pieces(lengths, L), minlength=L + 1)
    rows = -(-lengths.sum() // L)  # the epoch's rows, the last running on into the next epoch
    assert stream @ np.arange(L + 1) == concat @ np.arange(L + 1) == rows * L
    assert stream[L] >= 2 * n - 1  # two whole rows inside each document (the stream's end aside)
    assert concat[L] < stream[L] / 4 and pieces[L] == 3 * n
    f_stream, f_concat = position_frequency(stream, L), position_frequency(concat, L)
    assert np.all(f_stream[L // 2 :] > f_concat[L // 2 :])


def test_prediction_from_a_histogram_or_an_array() -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 300, size=500)
    counts = np.bincount(lengths)
    for packing in PIECE_RULES:  # order-free: one epoch is the corpus's pieces, whatever the order
        a = predict_trained_histogram(
            lengths, 64, packing=RowPacking(strategy=packing, shuffle_block=50)
        )
        b = predict_trained_histogram(
            Documents.from_histogram(counts, seed=3),
            64,
            packing=RowPacking(strategy=packing, shuffle_block=50),
        )
        assert np.array_equal(a.histogram, b.histogram)
        assert np.array_equal(a.histogram, np.bincount(naive_pieces(lengths, 64), minlength=65))
    by_source = Documents.from_histogram({"web": counts, "arxiv": np.bincount(lengths[:7])}, seed=1)
    assert by_source.source_names == ("arxiv", "web") and by_source.num_docs == 507
    assert sorted(by_source.lengths[by_source.sources == 0].tolist()) == sorted(
        lengths[:7].tolist()
    )
    weighted = predict_trained_histogram(
        by_source, 64, packing=RowPacking(strategy="padded", upsample={"arxiv:0-": 2.0})
    )
    assert weighted.histogram.sum() == len(naive_pieces(lengths, 64)) + 2 * len(
        naive_pieces(lengths[:7], 64)
    )
    with pytest.raises(ValueError, match="1-D integer array"):
        Documents(np.array([1.5, 2.0]))


# --------------------------------------------------------------------------------------------
# The trainer: one epoch trains the predicted histogram; steps without targets
# --------------------------------------------------------------------------------------------


def test_the_config_hands_its_packing_settings_to_the_sampler_as_one_object() -> None:
    """DataSection.row_packing carries every packing key of the config (strategy, attention, shuffle, block,
    upsampling) into the RowPacking the trainer's sampler and the schedule take, upsampling parsed."""
    data = DataSection(
        packing="best_fit", shuffle=False, shuffle_block=7, length_upsample={"0-10": 2.0}
    )
    rows = data.row_packing()
    assert (rows.strategy, rows.attention, rows.shuffle, rows.shuffle_block) == (
        "best_fit",
        "document",
        False,
        7,
    )
    assert rows.upsample == LengthUpsample.parse({"0-10": 2.0})
    assert RowPacking(upsample=None).upsample == LengthUpsample()
    with pytest.raises(ValueError, match="attention='row'"):
        RowPacking("best_fit", "row")

"""Packing documents into rows of L tokens with cu_seqlens, and the resumable, rank-aware sampler.

Packing rule (exact)
--------------------
Each epoch orders the documents by a seeded permutation (blocked for scale: the blocks of
``shuffle_block`` consecutive documents are permuted, then the documents inside each block).
Every document is cut into pieces of at most L tokens (document-local cuts at 0, L, 2L, ...:
the paper's truncation of long documents).

- ``mix_documents=True`` (default): the epochs' documents are concatenated into one endless
  token stream and row k is the stream's tokens ``[k*L, (k+1)*L)``. A piece that does not fit
  the rest of a row continues in the next row; no padding, no token lost, each token of an
  epoch is an input exactly once. The attention segments of a row are the pieces cut at the
  row boundaries (``attention="document"``), or the whole row (``attention="row"``: plain
  causal attention over the row, the paper's Fig. 1c).
- ``mix_documents=False``: the pieces form the stream and each row holds one piece, padded to
  L with ``pad_id``; the padding is its own segment and is never a target. Every row starts
  a piece, and ``attention`` makes no difference.

Targets are the next token inside the same attention segment; the last position of every
segment (and every padding position) gets -100, so no target lies across a boundary the
attention cannot see. Rotary position ids restart at 0 at every segment start.

Ranks: the global row stream is cut into global batches of ``rows_per_batch * world_size``
rows; rank r takes the r-th contiguous block of ``rows_per_batch`` rows of each. The sampler's
state is the index of the next global row; any row is computed directly from it (cumulative
lengths + binary search), so resuming never replays data.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Literal

import numpy as np
import torch

from posfreq.train.shards import PREPARE_HINT, TokenDataset, concat_ranges

IGNORE_INDEX = -100
"""Target of positions that have none (a segment's last token, padding): skipped by the loss."""


# --------------------------------------------------------------------------------------------
# Packed batches
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PackedBatch:
    """`rows` rows of `seq_len` tokens, flattened, with the attention segments of each row.

    `segment_lengths` are the lengths of the segments that hold real tokens (what the
    trainer bincounts into the trained-length histogram); padding segments are in
    `cu_seqlens` but not in `segment_lengths`, so the two agree exactly when there is no
    padding (always with ``mix_documents=True``).
    """

    input_ids: torch.Tensor  # (rows * seq_len,) int64
    targets: torch.Tensor  # (rows * seq_len,) int64, IGNORE_INDEX where there is no target
    position_ids: torch.Tensor  # (rows * seq_len,) int64, 0 at every segment start
    cu_seqlens: torch.Tensor  # (n_segments + 1,) int32 over the flattened batch
    max_seqlen: int
    segment_lengths: np.ndarray  # int64 lengths of the non-padding segments
    rows: int
    seq_len: int

    @property
    def num_tokens(self) -> int:
        """Tokens in the batch (rows * seq_len), padding included."""
        return self.rows * self.seq_len

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "PackedBatch":
        """The same batch with its tensors on `device`."""
        move = lambda t: t.to(device, non_blocking=non_blocking)  # noqa: E731
        return replace(self, input_ids=move(self.input_ids), targets=move(self.targets),
                       position_ids=move(self.position_ids), cu_seqlens=move(self.cu_seqlens))


def _assemble(tokens: np.ndarray, cuts: np.ndarray, pad: np.ndarray | None, rows: int, seq_len: int) -> PackedBatch:
    """Targets, position ids and segment lengths of flattened rows, given segment boundaries."""
    total = len(tokens)
    lengths = np.diff(cuts)
    targets = np.empty(total, dtype=np.int64)
    targets[:-1] = tokens[1:]
    targets[cuts[1:] - 1] = IGNORE_INDEX
    positions = np.arange(total, dtype=np.int64) - np.repeat(cuts[:-1], lengths)
    real = lengths
    if pad is not None:
        targets[pad] = IGNORE_INDEX
        real = lengths[~pad[cuts[:-1]]]
    return PackedBatch(
        input_ids=torch.from_numpy(tokens),
        targets=torch.from_numpy(targets),
        position_ids=torch.from_numpy(positions),
        cu_seqlens=torch.from_numpy(cuts.astype(np.int32)),
        max_seqlen=int(lengths.max()),
        segment_lengths=real.astype(np.int64),
        rows=rows,
        seq_len=seq_len,
    )


# --------------------------------------------------------------------------------------------
# Packing strategies: how rows are formed from the ordered stream of documents
# --------------------------------------------------------------------------------------------


Runs = Callable[[int, int], tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]
"""`runs(start, count)`: the documents covering stream units [start, start + count) in stream order:
global ids, lengths, first unit taken inside each document, units taken (`PackedSampler._runs`)."""


class Packing(ABC):
    """One packing rule: what a stream unit is, and how rows of `seq_len` tokens are formed from units.

    The sampler orders the documents (seeded epochs and blocks) and lays their units end to end;
    a strategy says how many units each document has, how many units a row takes, and turns the
    units of consecutive rows into a `PackedBatch`. A new rule is a new subclass, picked in
    `PackedSampler.__init__`; row k must depend only on k, so any row is computed directly.
    """

    seq_len: int

    @property
    @abstractmethod
    def units_per_row(self) -> int:
        """Stream units that one row consumes."""

    @abstractmethod
    def units(self, lengths: np.ndarray) -> np.ndarray:
        """Stream units of documents with these lengths (EOS included)."""

    @abstractmethod
    def rows(self, dataset: TokenDataset, runs: Runs, first_row: int, rows: int) -> PackedBatch:
        """Rows [first_row, first_row + rows) of the global stream, as one batch."""


@dataclass(frozen=True)
class MixedRows(Packing):
    """``mix_documents=True``: rows cut from the concatenated token stream, no padding; a unit is a token."""

    seq_len: int
    attention: Literal["document", "row"] = "document"

    @property
    def units_per_row(self) -> int:
        """A row takes L tokens of the stream."""
        return self.seq_len

    def units(self, lengths: np.ndarray) -> np.ndarray:
        """Every token is a unit."""
        return lengths

    def rows(self, dataset: TokenDataset, runs: Runs, first_row: int, rows: int) -> PackedBatch:
        """Rows [first_row, first_row + rows): segments are pieces cut at row boundaries, or whole rows."""
        L, total = self.seq_len, rows * self.seq_len
        docs, _, starts, counts = runs(first_row * L, total)
        tokens = dataset.read_runs(dataset.token_offsets(docs) + starts, counts)
        row_cuts = np.arange(0, total + 1, L, dtype=np.int64)
        if self.attention == "row":
            return _assemble(tokens, row_cuts, None, rows, L)
        where = np.cumsum(counts) - counts  # batch position of each run
        first_piece = -(-starts // L)  # piece cuts are at document-local multiples of L
        n_cuts = -(-(starts + counts) // L) - first_piece
        piece = concat_ranges(first_piece, n_cuts)
        cuts = np.repeat(where - starts, n_cuts) + piece * L
        return _assemble(tokens, np.union1d(cuts, row_cuts), None, rows, L)


@dataclass(frozen=True)
class PaddedRows(Packing):
    """``mix_documents=False``: one piece per row, padded to L with `pad_id`; a unit is a piece."""

    seq_len: int
    pad_id: int

    @property
    def units_per_row(self) -> int:
        """A row takes one piece."""
        return 1

    def units(self, lengths: np.ndarray) -> np.ndarray:
        """Pieces of at most L tokens per document."""
        return -(-lengths // self.seq_len)

    def rows(self, dataset: TokenDataset, runs: Runs, first_row: int, rows: int) -> PackedBatch:
        """Rows [first_row, first_row + rows): each its piece, then padding as its own, never-trained segment."""
        L, total = self.seq_len, rows * self.seq_len
        docs, lengths, firsts, counts = runs(first_row, rows)
        doc = np.repeat(docs, counts)
        piece = concat_ranges(firsts, counts)
        piece_len = np.minimum(L, np.repeat(lengths, counts) - piece * L)
        row_start = np.arange(rows, dtype=np.int64) * L
        dest = concat_ranges(row_start, piece_len)
        tokens = np.full(total, self.pad_id, dtype=np.int64)
        tokens[dest] = dataset.read_runs(dataset.token_offsets(doc) + piece * L, piece_len)
        pad = np.ones(total, dtype=bool)
        pad[dest] = False
        cuts = np.union1d(np.append(row_start, total), row_start + piece_len)
        return _assemble(tokens, cuts, pad, rows, L)


# --------------------------------------------------------------------------------------------
# The sampler
# --------------------------------------------------------------------------------------------


class PackedSampler:
    """Endless, deterministic, rank-aware stream of `PackedBatch`es with exact mid-epoch resume.

    Each `next()` returns this rank's `rows_per_batch` rows of the next global batch (see the
    module docstring for the packing rule). `state_dict()` is the same on every rank and can be
    loaded into a sampler with another world size or batch size: the stream continues at the
    next global row.
    """

    def __init__(self, dataset: TokenDataset, seq_len: int, rows_per_batch: int, seed: int = 0,
                 rank: int = 0, world_size: int = 1, *, mix_documents: bool = True,
                 attention: Literal["document", "row"] = "document", pad_id: int | None = None,
                 shuffle: bool = True, shuffle_block: int = 1 << 20) -> None:
        if seq_len < 1 or rows_per_batch < 1 or shuffle_block < 1:
            raise ValueError(f"need seq_len, rows_per_batch, shuffle_block >= 1; got {seq_len}, "
                             f"{rows_per_batch}, {shuffle_block}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        if attention not in ("document", "row"):
            raise ValueError(f"attention must be 'document' or 'row', not {attention!r}")
        if dataset.num_tokens == 0:
            raise ValueError(f"{dataset.directory} holds no tokens. {PREPARE_HINT}")
        self.dataset = dataset
        self.seq_len, self.rows_per_batch, self.seed = seq_len, rows_per_batch, seed
        self.rank, self.world_size = rank, world_size
        self.mix_documents, self.attention, self.shuffle = mix_documents, attention, shuffle
        self.shuffle_block = shuffle_block
        self.pad_id = dataset.eos_id if pad_id is None else pad_id
        self.packing: Packing = MixedRows(seq_len, attention) if mix_documents else PaddedRows(seq_len, self.pad_id)
        self._block_bounds = np.append(np.arange(0, dataset.num_docs, shuffle_block), dataset.num_docs)
        self._block_units = np.array([self.packing.units(dataset.doc_lengths(a, b)).sum() for a, b in
                                      zip(self._block_bounds[:-1], self._block_bounds[1:])], dtype=np.int64)
        self.units_per_epoch = int(self._block_units.sum())  # tokens (mixed) or pieces (one per row)
        self.next_row = 0  # index of the first row of the next global batch
        self._epoch_order = lru_cache(maxsize=2)(self._make_epoch_order)
        self._block_plan = lru_cache(maxsize=4)(self._make_block_plan)

    # -- stream layout -------------------------------------------------------------------------

    def _make_epoch_order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """Block order of an epoch and the cumulative units before each block in that order."""
        n = len(self._block_units)
        order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
        return order, np.concatenate([[0], np.cumsum(self._block_units[order])])

    def _make_block_plan(self, epoch: int, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Documents of one block in epoch order: global ids, lengths, cumulative units."""
        a, b = int(self._block_bounds[block]), int(self._block_bounds[block + 1])
        perm = (np.random.default_rng([self.seed, epoch, block]).permutation(b - a)
                if self.shuffle else np.arange(b - a))
        lengths = self.dataset.doc_lengths(a, b)[perm]
        return a + perm, lengths, np.concatenate([[0], np.cumsum(self.packing.units(lengths))])

    def _runs(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Documents covering stream units [start, start + count): ids, lengths, first unit, units."""
        ids, lengths, firsts, counts = [], [], [], []
        unit, end = start, start + count
        while unit < end:
            epoch, offset = divmod(unit, self.units_per_epoch)
            order, cum = self._epoch_order(epoch)
            j = int(np.searchsorted(cum, offset, side="right") - 1)
            block_ids, block_lengths, block_cum = self._block_plan(epoch, int(order[j]))
            lo = offset - int(cum[j])
            hi = min(lo + end - unit, int(block_cum[-1]))
            k0 = int(np.searchsorted(block_cum, lo, side="right") - 1)
            k1 = int(np.searchsorted(block_cum, hi, side="left"))
            first = np.maximum(lo - block_cum[k0:k1], 0)
            ids.append(block_ids[k0:k1])
            lengths.append(block_lengths[k0:k1])
            firsts.append(first)
            counts.append(np.minimum(hi - block_cum[k0:k1], block_cum[k0 + 1: k1 + 1] - block_cum[k0:k1]) - first)
            unit += hi - lo
        return tuple(np.concatenate(x).astype(np.int64) for x in (ids, lengths, firsts, counts))

    # -- batches -------------------------------------------------------------------------------

    def make_batch(self, first_row: int, rows: int) -> PackedBatch:
        """Rows [first_row, first_row + rows) of the global stream, as one batch (formed by `self.packing`)."""
        return self.packing.rows(self.dataset, self._runs, first_row, rows)

    # -- iteration and state -------------------------------------------------------------------

    @property
    def rows_per_global_batch(self) -> int:
        """Rows that one step consumes over all ranks."""
        return self.rows_per_batch * self.world_size

    @property
    def epoch(self) -> int:
        """The epoch that the next batch starts in."""
        return self.next_row * self.packing.units_per_row // self.units_per_epoch

    def __iter__(self) -> Iterator[PackedBatch]:
        """The sampler is its own (endless) iterator."""
        return self

    def __next__(self) -> PackedBatch:
        """This rank's rows of the next global batch; advances the stream by one global batch."""
        batch = self.make_batch(self.next_row + self.rank * self.rows_per_batch, self.rows_per_batch)
        self.next_row += self.rows_per_global_batch
        return batch

    def _stream_identity(self) -> dict:
        """Settings that define the row stream; a saved state is only valid for the same ones."""
        return {"seed": self.seed, "seq_len": self.seq_len, "mix_documents": self.mix_documents,
                "attention": self.attention, "shuffle": self.shuffle, "shuffle_block": self.shuffle_block,
                "num_docs": self.dataset.num_docs, "num_tokens": self.dataset.num_tokens,
                "pad_id": self.pad_id}

    def state_dict(self) -> dict:
        """Where the stream stands (identical on every rank), plus the settings that define it."""
        units = self.next_row * self.packing.units_per_row
        return {"next_row": self.next_row, "epoch": units // self.units_per_epoch,
                "position_in_epoch": units % self.units_per_epoch, **self._stream_identity()}

    def load_state_dict(self, state: dict) -> None:
        """Continue the stream where `state` left it; refuses a state from another stream."""
        mine = self._stream_identity()
        diff = {k: (state.get(k), v) for k, v in mine.items() if state.get(k) != v}
        if diff:
            detail = ", ".join(f"{k}: saved {a!r} vs now {b!r}" for k, (a, b) in diff.items())
            raise ValueError(f"sampler state belongs to a different data stream ({detail}). Fix: resume "
                             "with the data directory and data settings of the saved run.")
        self.next_row = int(state["next_row"])

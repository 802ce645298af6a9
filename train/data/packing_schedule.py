"""The packing schedule: every row of the endless, seeded stream of epochs, from document lengths alone.

The trainer's sampler (train/data/packing.py) reads the tokens of exactly the rows this schedule lays out,
and `predict_trained_histogram` counts the same rows' attention segments without reading a token,
so the predicted and the trained length histograms cannot diverge: one implementation serves both.

Epochs and blocks
-----------------
Documents (in corpus order) are grouped into shuffle blocks of ``shuffle_block`` consecutive
documents. Epoch e visits the blocks in a seeded order and, inside each block, its documents in a
seeded order (with ``shuffle=False``: corpus order). With length upsampling
(train/data/upsample.py) a block's documents are first repeated (0, 1, 2, ... copies, drawn per epoch)
and the copies are then shuffled together. Every document is cut into pieces of at most L tokens
at document-local offsets 0, L, 2L, ... (the paper's truncation of long documents), and a
strategy (train/data/packing_strategies.py) packs each block's pieces into rows.

Stream units and resume
-----------------------
Each strategy measures the stream in units: tokens (``concat``, ``stream``, L per row) or rows
(``best_fit``, ``padded``). A `Cursor` marks where a block starts in the unit stream; the schedule walks blocks
forward from the cursors it knows (always the stream's start), so any row is computed directly
once the cursor of its block is known. A sampler state carries the cursor of its next row's
block, so resuming costs one block plan, not a replay of the epoch.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from posfreq.train.data.packing_strategies import (
    TOKEN_STREAMS,
    Attention,
    Block,
    DocumentLengths,
    Documents,
    RowLayout,
    Strategy,
    make_packing,
)
from posfreq.train.data.upsample import LengthUpsample


class Cursor(NamedTuple):
    """Where block `position` of `epoch`'s block order starts in the unit stream (and where its epoch starts)."""

    first_unit: int
    epoch: int
    position: int
    epoch_first_unit: int


@dataclass(frozen=True)
class EpochPrediction:
    """The trained-length histogram of one epoch's rows, as the trainer counts it, and how full the rows are."""

    histogram: np.ndarray
    """Index = attention segment length (0..L), value = segments of that length: the trainer's trained_lengths."""
    rows: int
    """Rows of L tokens the epoch takes."""
    train_len: int
    """L."""

    @property
    def tokens(self) -> int:
        """Document tokens in those rows."""
        return int(self.histogram @ np.arange(len(self.histogram), dtype=np.int64))

    @property
    def padding_share(self) -> float:
        """Share of the rows' positions that are padding."""
        return 1.0 - self.tokens / (self.rows * self.train_len) if self.rows else 0.0


def some_document_has_weight(
    corpus: DocumentLengths, upsample: LengthUpsample, block: int = 1 << 22
) -> bool:
    """Whether any document of `corpus` has a positive expected number of copies under `upsample` (else every
    epoch would be empty); reads `block` documents' lengths at a time and stops at the first with weight."""
    with_sources = isinstance(corpus, Documents) and corpus.sources is not None
    names = corpus.source_names if with_sources else ()
    for a in range(0, corpus.num_docs, block):
        b = min(a + block, corpus.num_docs)
        sources = corpus.doc_sources(a, b) if with_sources else None
        if upsample.weights(corpus.doc_lengths(a, b), sources, names).any():
            return True
    return False


@dataclass(frozen=True)
class RowPacking:
    """How documents become rows: the trainer's data.packing, data.attention, data.shuffle, data.shuffle_block and
    data.length_upsample, carried as one object from the config to the schedule (`DataSection.row_packing`)."""

    strategy: Strategy = "concat"
    """train/data/packing_strategies.py's strategy."""
    attention: Attention = "document"
    """document: attend within documents; row: one causal segment per row (token streams only)."""
    shuffle: bool = True
    """Seeded block and document order (False: corpus order)."""
    shuffle_block: int = 1 << 20
    """Documents per shuffle block."""
    upsample: LengthUpsample | Mapping[str, float] | None = LengthUpsample()
    """Length upsampling (train/data/upsample.py; a mapping is parsed into one)."""

    def __post_init__(self) -> None:
        if not isinstance(
            self.upsample, LengthUpsample
        ):  # {bucket: weight} or None, as a config writes it
            object.__setattr__(self, "upsample", LengthUpsample.parse(self.upsample))
        if self.shuffle_block < 1:
            raise ValueError(f"need shuffle_block >= 1; got {self.shuffle_block}")
        if self.attention not in ("document", "row"):
            raise ValueError(f"attention must be 'document' or 'row', not {self.attention!r}")
        if self.attention == "row" and self.strategy not in TOKEN_STREAMS:
            raise ValueError(
                f"attention='row' (one causal segment per row) needs packing='concat' (or 'stream', the same "
                f"rows), not {self.strategy!r}: padding must stay its own segment"
            )


class PackingSchedule:
    """Every row of the endless, seeded stream of epochs (module docstring), from document lengths alone."""

    def __init__(
        self,
        corpus: DocumentLengths,
        train_len: int,
        packing: RowPacking = RowPacking(),
        *,
        seed: int = 0,
    ) -> None:
        if train_len < 1:
            raise ValueError(f"need train_len >= 1; got {train_len}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        if corpus.num_docs == 0:
            raise ValueError("the corpus holds no documents")
        self.corpus, self.train_len, self.seed, self.row_packing = corpus, train_len, seed, packing
        self.packing = make_packing(packing.strategy, train_len, packing.attention)
        self._sources = (
            corpus if isinstance(corpus, Documents) and corpus.sources is not None else None
        )
        if self.row_packing.upsample.sources and self._sources is None:
            raise ValueError(
                f"length_upsample has per-source buckets ({list(self.row_packing.upsample.sources)}) but these "
                "documents carry no source (token shards do not record one)"
            )
        self._bounds = np.append(
            np.arange(0, corpus.num_docs, self.row_packing.shuffle_block), corpus.num_docs
        )
        self._walked: list[Cursor] = [
            Cursor(0, 0, 0, 0)
        ]  # block starts known so far, in stream order
        self._order = lru_cache(maxsize=2)(self._make_order)
        self._block = lru_cache(maxsize=4)(self._make_block)

    @property
    def units_per_row(self) -> int:
        """Stream units per row (L for concat and stream, else 1)."""
        return self.packing.units_per_row

    # -- blocks --------------------------------------------------------------------------------

    def _make_order(self, epoch: int) -> np.ndarray:
        """The blocks in `epoch`'s order."""
        n = len(self._bounds) - 1
        return (
            np.random.default_rng([self.seed, epoch]).permutation(n)
            if self.row_packing.shuffle
            else np.arange(n)
        )

    def _make_block(self, epoch: int, position: int) -> Block:
        """The plan of the block at `position` in `epoch`'s order: its document copies shuffled, then packed."""
        block = int(self._order(epoch)[position])
        a, b = int(self._bounds[block]), int(self._bounds[block + 1])
        lengths = self.corpus.doc_lengths(a, b)
        ids = np.arange(b - a)
        if self.row_packing.upsample:
            sources = None if self._sources is None else self._sources.doc_sources(a, b)
            names = () if self._sources is None else self._sources.source_names
            ids = np.repeat(
                ids,
                self.row_packing.upsample.copies(
                    lengths, np.random.default_rng([self.seed, epoch, block, 1]), sources, names
                ),
            )
        if self.row_packing.shuffle:
            ids = ids[np.random.default_rng([self.seed, epoch, block]).permutation(len(ids))]
        rng = (
            np.random.default_rng([self.seed, epoch, block, 2])
            if self.row_packing.shuffle
            else None
        )
        return self.packing.plan_block(a + ids, lengths[ids], rng)

    def _next(self, cursor: Cursor) -> Cursor:
        """The cursor of the block after `cursor`'s (remembered)."""
        first = cursor.first_unit + self._block(cursor.epoch, cursor.position).units
        if cursor.position + 1 < len(self._bounds) - 1:
            after = Cursor(first, cursor.epoch, cursor.position + 1, cursor.epoch_first_unit)
        elif first == cursor.epoch_first_unit and not some_document_has_weight(
            self.corpus, self.row_packing.upsample
        ):
            raise ValueError(
                f"epoch {cursor.epoch} holds no tokens: length_upsample {self.row_packing.upsample.as_dict()} "
                "gives every document weight 0"
            )
        else:  # an epoch whose random draws kept no document (fractional weights, tiny corpus) is simply passed
            after = Cursor(first, cursor.epoch + 1, 0, first)
        self.remember(after)
        return after

    def remember(self, cursor: Cursor) -> None:
        """Record where a block starts (e.g. from a sampler state), so rows from there on need no walk to it."""
        cursor = Cursor(*(int(x) for x in cursor))
        i = bisect_left(self._walked, cursor)
        if i == len(self._walked) or self._walked[i] != cursor:
            self._walked.insert(i, cursor)

    def locate(self, unit: int) -> tuple[Cursor, Block]:
        """The block that holds stream unit `unit`, and its cursor."""
        cursor = self._walked[bisect_right(self._walked, (unit, np.inf, np.inf, np.inf)) - 1]
        while unit >= cursor.first_unit + self._block(cursor.epoch, cursor.position).units:
            cursor = self._next(cursor)
        return cursor, self._block(cursor.epoch, cursor.position)

    def epoch_start(self, epoch: int) -> int:
        """The stream unit at which `epoch` starts."""
        cursor = self._walked[bisect_right(self._walked, epoch, key=lambda c: c.epoch) - 1]
        while cursor.epoch < epoch:
            cursor = self._next(cursor)
        return cursor.epoch_first_unit

    def epoch_rows(self, epoch: int) -> range:
        """The rows whose first unit lies in `epoch` (under concat and stream the last may end in the next epoch)."""
        upr = self.units_per_row
        return range(-(-self.epoch_start(epoch) // upr), -(-self.epoch_start(epoch + 1) // upr))

    # -- rows ----------------------------------------------------------------------------------

    def layout(self, first_row: int, rows: int) -> RowLayout:
        """Rows [first_row, first_row + rows) of the stream: their token runs and attention segments."""
        if first_row < 0 or rows < 1:
            raise ValueError(f"need first_row >= 0 and rows >= 1; got {first_row}, {rows}")
        upr = self.units_per_row
        unit, end = first_row * upr, (first_row + rows) * upr
        parts = []
        while unit < end:
            cursor, block = self.locate(unit)
            lo = unit - cursor.first_unit
            hi = min(block.units, end - cursor.first_unit)
            parts.append((block, lo, hi))
            unit += hi - lo
        return self.packing.layout(parts, rows)

    def histogram(self, rows: range, chunk_rows: int = 4096) -> np.ndarray:
        """Bincount (0..L) of the non-padding attention segment lengths of `rows`, as the trainer counts them."""
        counts = np.zeros(self.train_len + 1, dtype=np.int64)
        for first in range(rows.start, rows.stop, chunk_rows):
            layout = self.layout(first, min(chunk_rows, rows.stop - first))
            counts += np.bincount(layout.segment_lengths(), minlength=self.train_len + 1)
        return counts

    def predict_epoch(self, epoch: int = 0) -> EpochPrediction:
        """The trained-length histogram of training exactly the rows of `epoch`."""
        rows = self.epoch_rows(epoch)
        return EpochPrediction(self.histogram(rows), len(rows), self.train_len)


def predict_trained_histogram(
    corpus: DocumentLengths | np.ndarray,
    train_len: int,
    packing: RowPacking = RowPacking(),
    *,
    seed: int = 0,
    epoch: int = 0,
) -> EpochPrediction:
    """The trained-length histogram of one epoch of a run with these data settings (the trainer's `data.*` and
    `seed`), from document lengths alone; Eq. 2 over it (analysis/corpus/frequency.py) is the epoch's trained f(i).

    `corpus`: a TokenDataset (exact, row by row), `Documents` (e.g. `Documents.from_histogram` of a corpus
    histogram, with sources for per-source weights), or an array of document lengths in corpus order.
    """
    documents = Documents(corpus) if isinstance(corpus, np.ndarray) else corpus
    return PackingSchedule(documents, train_len, packing, seed=seed).predict_epoch(epoch)

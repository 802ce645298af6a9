"""The packing plan: which pieces of which documents fill each row of L tokens, from document lengths alone.

The trainer's sampler (train/packing.py) reads the tokens of exactly the rows this plan lays out,
and `predict_trained_histogram` counts the same rows' attention segments without reading a token,
so the predicted and the trained length histograms cannot diverge: one implementation serves both.

Epochs and blocks
-----------------
Documents (in corpus order) are grouped into shuffle blocks of ``shuffle_block`` consecutive
documents. Epoch e visits the blocks in a seeded order and, inside each block, its documents in a
seeded order (with ``shuffle=False``: corpus order). With length upsampling
(train/upsample.py) a block's documents are first repeated (0, 1, 2, ... copies, drawn per epoch)
and the copies are then shuffled together. Every document is cut into pieces of at most L tokens
at document-local offsets 0, L, 2L, ... (the paper's truncation of long documents).

Strategies (``packing``)
------------------------
- ``concat``: the documents of all epochs form one endless token stream and row k is its tokens
  [kL, (k+1)L). No padding, no token lost. Attention segments are the pieces cut at row
  boundaries (``attention="document"``), or whole rows (``attention="row"``, the paper's Fig. 1c).
- ``best_fit``: within each block (the buffer, many rows), pieces are packed whole into rows by
  best-fit decreasing (Ding et al. 2024, 'Fewer Truncations Improve Language Modeling'): longest
  first, each into the open row with the least free space that holds it, else a new row; the rows
  are then shuffled (seeded). A piece is never split below L; the rest of a row is padding.
- ``padded``: one piece per row, in stream order, the rest of the row padding.

Padding is its own attention segment and never a target; it is not in the trained-length
histogram. Rows never cross epochs under ``best_fit`` and ``padded``, so one epoch of those trains
exactly Eq. 2 over the epoch's pieces.

Stream units and resume
-----------------------
Each strategy measures the stream in units: tokens (``concat``, L per row) or rows (``best_fit``,
``padded``). A `Cursor` marks where a block starts in the unit stream; the plan walks blocks
forward from the cursors it knows (always the stream's start), so any row is computed directly
once the cursor of its block is known. A sampler state carries the cursor of its next row's
block, so resuming costs one block plan, not a replay of the epoch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from bisect import bisect_left, bisect_right, insort
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal, NamedTuple, Protocol

import numpy as np

from posfreq.train.shards import concat_ranges
from posfreq.train.upsample import LengthUpsample

Strategy = Literal["concat", "best_fit", "padded"]
STRATEGIES: tuple[str, ...] = ("concat", "best_fit", "padded")
Attention = Literal["document", "row"]


# --------------------------------------------------------------------------------------------
# Corpora as document lengths
# --------------------------------------------------------------------------------------------


class DocumentLengths(Protocol):
    """What a plan reads from a corpus: how many documents, and the lengths of a range of them (TokenDataset)."""

    @property
    def num_docs(self) -> int:
        """Documents in the corpus."""

    def doc_lengths(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Lengths (EOS included) of documents [start, stop), int64."""


@dataclass(frozen=True)
class Documents:
    """Document lengths (EOS included) in corpus order, with optional sources: a corpus held as arrays."""

    lengths: np.ndarray
    """int64 length of each document."""
    sources: np.ndarray | None = None
    """Each document's source as an index into `source_names`; None: the documents carry no source."""
    source_names: tuple[str, ...] = ()
    """Source names, indexed by `sources`."""

    def __post_init__(self) -> None:
        lengths = np.asarray(self.lengths)
        if lengths.ndim != 1 or (lengths.size and not np.issubdtype(lengths.dtype, np.integer)):
            raise ValueError(
                f"document lengths must be a 1-D integer array, got {lengths.dtype} of shape "
                f"{lengths.shape}"
            )
        if lengths.size and lengths.min() < 0:
            raise ValueError("document lengths must be >= 0")
        object.__setattr__(self, "lengths", lengths.astype(np.int64, copy=False))
        if self.sources is not None:
            sources = np.asarray(self.sources)
            if sources.shape != lengths.shape or (
                sources.size and not 0 <= sources.min() <= sources.max() < len(self.source_names)
            ):
                raise ValueError(
                    f"sources must give one index into source_names ({len(self.source_names)} "
                    f"names) per document ({lengths.size} documents)"
                )

    @classmethod
    def from_histogram(
        cls, counts: np.ndarray | Mapping[str, np.ndarray], seed: int = 0
    ) -> "Documents":
        """A corpus with these length counts (index = length; a mapping gives them per source, e.g. a
        LengthHistogram's `by_source`), its documents in a seeded random corpus order. A histogram has no order,
        so a plan over it is exact in distribution, not row by row, for the corpus it was counted from."""
        by_source = isinstance(counts, Mapping)
        per_source = counts if by_source else {"": counts}
        names = tuple(sorted(per_source))
        n = max(len(names), 1)
        coded = [
            np.repeat(
                np.arange(len(per_source[name]), dtype=np.int64) * n + code,
                np.asarray(per_source[name], dtype=np.int64),
            )
            for code, name in enumerate(names)
        ]
        packed = np.concatenate(
            coded or [np.zeros(0, dtype=np.int64)]
        )  # length * n + source, in one array
        np.random.default_rng(seed).shuffle(
            packed
        )  # in place: no permutation array of the corpus's size
        sources = packed % n if by_source else None
        packed //= n  # in place: the lengths
        return cls(packed, sources, names if by_source else ())

    @property
    def num_docs(self) -> int:
        """Documents in the corpus."""
        return len(self.lengths)

    def doc_lengths(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Lengths of documents [start, stop)."""
        return self.lengths[start:stop]

    def doc_sources(self, start: int = 0, stop: int | None = None) -> np.ndarray | None:
        """Sources of documents [start, stop), or None."""
        return None if self.sources is None else self.sources[start:stop]


def cut_pieces(
    docs: np.ndarray, lengths: np.ndarray, train_len: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The pieces of documents cut at local offsets 0, L, 2L, ...: (document, first token, length) of each."""
    n_pieces = -(-lengths // train_len)
    starts = concat_ranges(np.zeros(len(lengths), dtype=np.int64), n_pieces) * train_len
    return (
        np.repeat(docs, n_pieces),
        starts,
        np.minimum(train_len, np.repeat(lengths, n_pieces) - starts),
    )


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """Row of each item (in the given order) under best-fit decreasing into rows of `capacity`.

    Items are placed longest first (equal lengths in the given order), each into the open row whose
    free space is the smallest that still holds it, else into a new row; rows are numbered in the
    order they open. O(n log capacity) with a sorted list of the free spaces that have open rows.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size and (lengths.min() < 1 or lengths.max() > capacity):
        raise ValueError(f"items must have lengths in [1, {capacity}]")
    order = np.argsort(-lengths, kind="stable")
    rows = np.empty(len(lengths), dtype=np.int64)
    full = int(np.count_nonzero(lengths == capacity))  # placed first, a row each
    rows[order[:full]] = np.arange(full)
    free_spaces: list[int] = []  # sorted; each has at least one open row
    open_rows: list[list[int]] = [[] for _ in range(capacity)]  # open rows by free space
    placed: list[int] = []
    n_rows = full
    for size in lengths[order[full:]].tolist():
        i = bisect_left(free_spaces, size)
        if i == len(free_spaces):
            row, free = n_rows, capacity - size
            n_rows += 1
        else:
            space = free_spaces[i]
            stack = open_rows[space]
            row, free = stack.pop(), space - size
            if not stack:
                del free_spaces[i]
        if free:
            stack = open_rows[free]
            if not stack:
                insort(free_spaces, free)
            stack.append(row)
        placed.append(row)
    rows[order[full:]] = placed
    return rows


# --------------------------------------------------------------------------------------------
# Row layouts: what the rows hold, without their tokens
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RowLayout:
    """Consecutive rows of L tokens, flattened: the token runs that fill them and their attention segments.

    Token run k is tokens [starts[k], starts[k] + lengths[k]) of document docs[k], placed at
    dest[k] of the flattened rows; positions no run covers are padding. The attention segments are
    [cuts[j], cuts[j+1]); real[j] says whether segment j holds document tokens (False: padding).
    """

    rows: int
    """Rows laid out."""
    train_len: int
    """Tokens per row (L)."""
    docs: np.ndarray
    """Global document id of each token run."""
    starts: np.ndarray
    """First token of each run inside its document."""
    lengths: np.ndarray
    """Tokens in each run."""
    dest: np.ndarray
    """Position of each run's first token in the flattened rows (increasing)."""
    cuts: np.ndarray
    """Attention segment boundaries over the flattened rows: 0, ..., rows * train_len (int64)."""
    real: np.ndarray
    """Per segment: True if it holds document tokens, False if it is padding."""

    def segment_lengths(self) -> np.ndarray:
        """Lengths of the non-padding attention segments: what the trainer bincounts into its histogram."""
        return np.diff(self.cuts)[self.real]

    @property
    def padding_tokens(self) -> int:
        """Positions that hold no document token."""
        return self.rows * self.train_len - int(self.lengths.sum())


def _piece_layout(
    row: np.ndarray,
    docs: np.ndarray,
    starts: np.ndarray,
    lengths: np.ndarray,
    rows: int,
    train_len: int,
) -> RowLayout:
    """Rows filled with whole pieces back to back from each row's start (pieces grouped by `row`, in order), then
    padding: a segment per piece, and one padding segment per row that is not full."""
    before = np.cumsum(lengths) - lengths
    first_of_row = np.searchsorted(row, np.arange(rows, dtype=np.int64))
    dest = row * train_len + before - before[first_of_row][row]
    fill = np.bincount(row, weights=lengths, minlength=rows).astype(np.int64)
    short = np.flatnonzero(fill < train_len)
    segment_starts = np.concatenate([dest, short * train_len + fill[short]])
    real = np.concatenate([np.ones(len(dest), dtype=bool), np.zeros(len(short), dtype=bool)])
    order = np.argsort(segment_starts, kind="stable")
    cuts = np.append(segment_starts[order], rows * train_len)
    return RowLayout(rows, train_len, docs, starts, lengths, dest, cuts, real[order])


# --------------------------------------------------------------------------------------------
# Strategies: a block's plan, and the layout of rows from the blocks that cover them
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StreamBlock:
    """A block's document copies in stream order, for a strategy whose rows are cut from the token stream."""

    docs: np.ndarray
    """Global id of each document copy, in stream order."""
    lengths: np.ndarray
    """Its length."""
    cum: np.ndarray
    """Tokens before each copy (len(docs) + 1 entries, the last the block's total)."""

    @property
    def units(self) -> int:
        """Tokens in the block."""
        return int(self.cum[-1])


@dataclass(frozen=True)
class RowBlock:
    """A block's rows, each a list of whole pieces: row r holds pieces row_ptr[r]:row_ptr[r + 1]."""

    docs: np.ndarray
    """Global document id of each piece, pieces in row order."""
    starts: np.ndarray
    """First token of each piece inside its document (a multiple of L)."""
    lengths: np.ndarray
    """Tokens in each piece (1..L)."""
    row_ptr: np.ndarray
    """Index of each row's first piece (rows + 1 entries)."""

    @property
    def units(self) -> int:
        """Rows in the block."""
        return len(self.row_ptr) - 1


Block = StreamBlock | RowBlock
Parts = Sequence[tuple[Block, int, int]]
"""The blocks covering some rows, each with the local unit range [lo, hi) of it that they take, in stream order."""


class Packing(ABC):
    """One packing rule: how a block's ordered documents become units, and rows of L tokens from units."""

    train_len: int

    @property
    @abstractmethod
    def units_per_row(self) -> int:
        """Stream units that one row consumes."""

    @abstractmethod
    def plan_block(
        self, docs: np.ndarray, lengths: np.ndarray, rng: np.random.Generator | None
    ) -> Block:
        """A block's plan from its document copies in stream order; `rng` (None: no shuffling) orders its rows."""

    @abstractmethod
    def layout(self, parts: Parts, rows: int) -> RowLayout:
        """The layout of `rows` consecutive rows from the blocks (and unit ranges) that cover them."""


@dataclass(frozen=True)
class ConcatRows(Packing):
    """``concat``: rows of L tokens cut from the endless token stream; a unit is a token."""

    train_len: int
    attention: Attention = "document"

    @property
    def units_per_row(self) -> int:
        """A row takes L tokens of the stream."""
        return self.train_len

    def plan_block(
        self, docs: np.ndarray, lengths: np.ndarray, rng: np.random.Generator | None
    ) -> StreamBlock:
        """The document copies as they are, with their cumulative token counts."""
        return StreamBlock(
            docs, lengths, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        )

    def layout(self, parts: Parts, rows: int) -> RowLayout:
        """Runs of documents over the rows' tokens; segments are the pieces cut at row boundaries, or whole rows."""
        L, total = self.train_len, rows * self.train_len
        docs, starts, counts = [], [], []
        for block, lo, hi in parts:
            cum = block.cum
            k0 = int(np.searchsorted(cum, lo, side="right") - 1)
            k1 = int(np.searchsorted(cum, hi, side="left"))
            first = np.maximum(lo - cum[k0:k1], 0)
            docs.append(block.docs[k0:k1])
            starts.append(first)
            counts.append(np.minimum(hi - cum[k0:k1], cum[k0 + 1 : k1 + 1] - cum[k0:k1]) - first)
        docs_, starts_, counts_ = (
            np.concatenate(x).astype(np.int64) for x in (docs, starts, counts)
        )
        dest = np.cumsum(counts_) - counts_
        row_cuts = np.arange(0, total + 1, L, dtype=np.int64)
        if self.attention == "row":
            cuts = row_cuts
        else:
            first_piece = -(-starts_ // L)  # piece cuts are at document-local multiples of L
            n_cuts = -(-(starts_ + counts_) // L) - first_piece
            piece_cuts = np.repeat(dest - starts_, n_cuts) + concat_ranges(first_piece, n_cuts) * L
            cuts = np.union1d(piece_cuts, row_cuts)
        return RowLayout(
            rows, L, docs_, starts_, counts_, dest, cuts, np.ones(len(cuts) - 1, dtype=bool)
        )


class PieceRows(Packing):
    """Rows that hold whole pieces, then padding; a unit is a row."""

    train_len: int

    @property
    def units_per_row(self) -> int:
        """A row is one unit."""
        return 1

    def layout(self, parts: Parts, rows: int) -> RowLayout:
        """The pieces of the rows, placed back to back from each row's start, then padding."""
        row, docs, starts, lengths, offset = [], [], [], [], 0
        for block, lo, hi in parts:
            a, b = int(block.row_ptr[lo]), int(block.row_ptr[hi])
            row.append(
                np.repeat(np.arange(offset, offset + hi - lo), np.diff(block.row_ptr[lo : hi + 1]))
            )
            docs.append(block.docs[a:b])
            starts.append(block.starts[a:b])
            lengths.append(block.lengths[a:b])
            offset += hi - lo
        return _piece_layout(
            *(np.concatenate(x).astype(np.int64) for x in (row, docs, starts, lengths)),
            rows,
            self.train_len,
        )


@dataclass(frozen=True)
class PaddedRows(PieceRows):
    """``padded``: one piece per row, in stream order, padded to L."""

    train_len: int

    def plan_block(
        self, docs: np.ndarray, lengths: np.ndarray, rng: np.random.Generator | None
    ) -> RowBlock:
        """Each piece its own row."""
        pieces = cut_pieces(docs, lengths, self.train_len)
        return RowBlock(*pieces, np.arange(len(pieces[0]) + 1, dtype=np.int64))


@dataclass(frozen=True)
class BestFitRows(PieceRows):
    """``best_fit``: a block's pieces packed whole into rows by best-fit decreasing; rows shuffled by `rng`."""

    train_len: int

    def plan_block(
        self, docs: np.ndarray, lengths: np.ndarray, rng: np.random.Generator | None
    ) -> RowBlock:
        """Best-fit decreasing over the block's pieces; in a row, pieces in the order they were placed."""
        docs, starts, sizes = cut_pieces(docs, lengths, self.train_len)
        row = best_fit_decreasing(sizes, self.train_len)
        placed = np.argsort(
            -sizes, kind="stable"
        )  # placement order; sorting by row keeps it within a row
        order = placed[np.argsort(row[placed], kind="stable")]
        counts = np.bincount(row, minlength=int(row.max(initial=-1)) + 1)
        if rng is not None:
            shuffled = rng.permutation(len(counts))
            row_ptr = np.concatenate([[0], np.cumsum(counts)])
            order = order[concat_ranges(row_ptr[shuffled], counts[shuffled])]
            counts = counts[shuffled]
        return RowBlock(
            docs[order], starts[order], sizes[order], np.concatenate([[0], np.cumsum(counts)])
        )


def make_packing(packing: Strategy, train_len: int, attention: Attention = "document") -> Packing:
    """The strategy object for a `data.packing` name."""
    if packing == "concat":
        return ConcatRows(train_len, attention)
    if packing == "best_fit":
        return BestFitRows(train_len)
    if packing == "padded":
        return PaddedRows(train_len)
    raise ValueError(f"packing must be one of {list(STRATEGIES)}, not {packing!r}")


# --------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------


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


class PackingPlan:
    """Every row of the endless, seeded stream of epochs (module docstring), from document lengths alone."""

    def __init__(
        self,
        corpus: DocumentLengths,
        train_len: int,
        packing: Strategy = "concat",
        *,
        attention: Attention = "document",
        seed: int = 0,
        shuffle: bool = True,
        shuffle_block: int = 1 << 20,
        upsample: LengthUpsample | Mapping[str, float] | None = None,
    ) -> None:
        if train_len < 1 or shuffle_block < 1:
            raise ValueError(
                f"need train_len and shuffle_block >= 1; got {train_len}, {shuffle_block}"
            )
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        if attention not in ("document", "row"):
            raise ValueError(f"attention must be 'document' or 'row', not {attention!r}")
        if attention == "row" and packing != "concat":
            raise ValueError(
                f"attention='row' (one causal segment per row) needs packing='concat', not {packing!r}: "
                "padding must stay its own segment"
            )
        if corpus.num_docs == 0:
            raise ValueError("the corpus holds no documents")
        self.corpus, self.train_len, self.packing_name = corpus, train_len, packing
        self.packing = make_packing(packing, train_len, attention)
        self.attention, self.seed, self.shuffle, self.shuffle_block = (
            attention,
            seed,
            shuffle,
            shuffle_block,
        )
        self.upsample = (
            upsample if isinstance(upsample, LengthUpsample) else LengthUpsample.parse(upsample)
        )
        self._sources = (
            corpus if isinstance(corpus, Documents) and corpus.sources is not None else None
        )
        if self.upsample.sources and self._sources is None:
            raise ValueError(
                f"length_upsample has per-source buckets ({list(self.upsample.sources)}) but these "
                "documents carry no source (token shards do not record one)"
            )
        self._bounds = np.append(np.arange(0, corpus.num_docs, shuffle_block), corpus.num_docs)
        self._walked: list[Cursor] = [
            Cursor(0, 0, 0, 0)
        ]  # block starts known so far, in stream order
        self._order = lru_cache(maxsize=2)(self._make_order)
        self._block = lru_cache(maxsize=4)(self._make_block)

    @property
    def units_per_row(self) -> int:
        """Stream units per row (L for concat, else 1)."""
        return self.packing.units_per_row

    # -- blocks --------------------------------------------------------------------------------

    def _make_order(self, epoch: int) -> np.ndarray:
        """The blocks in `epoch`'s order."""
        n = len(self._bounds) - 1
        return (
            np.random.default_rng([self.seed, epoch]).permutation(n)
            if self.shuffle
            else np.arange(n)
        )

    def _make_block(self, epoch: int, position: int) -> Block:
        """The plan of the block at `position` in `epoch`'s order: its document copies shuffled, then packed."""
        block = int(self._order(epoch)[position])
        a, b = int(self._bounds[block]), int(self._bounds[block + 1])
        lengths = self.corpus.doc_lengths(a, b)
        ids = np.arange(b - a)
        if self.upsample:
            sources = None if self._sources is None else self._sources.doc_sources(a, b)
            names = () if self._sources is None else self._sources.source_names
            ids = np.repeat(
                ids,
                self.upsample.copies(
                    lengths, np.random.default_rng([self.seed, epoch, block, 1]), sources, names
                ),
            )
        if self.shuffle:
            ids = ids[np.random.default_rng([self.seed, epoch, block]).permutation(len(ids))]
        rng = np.random.default_rng([self.seed, epoch, block, 2]) if self.shuffle else None
        return self.packing.plan_block(a + ids, lengths[ids], rng)

    def _next(self, cursor: Cursor) -> Cursor:
        """The cursor of the block after `cursor`'s (remembered)."""
        first = cursor.first_unit + self._block(cursor.epoch, cursor.position).units
        if cursor.position + 1 < len(self._bounds) - 1:
            after = Cursor(first, cursor.epoch, cursor.position + 1, cursor.epoch_first_unit)
        elif first == cursor.epoch_first_unit and not some_document_has_weight(
            self.corpus, self.upsample
        ):
            raise ValueError(
                f"epoch {cursor.epoch} holds no tokens: length_upsample {self.upsample.as_dict()} "
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
        """The rows whose first unit lies in `epoch` (under concat the last may end in the next epoch)."""
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
    packing: Strategy = "concat",
    *,
    attention: Attention = "document",
    seed: int = 0,
    shuffle: bool = True,
    shuffle_block: int = 1 << 20,
    upsample: LengthUpsample | Mapping[str, float] | None = None,
    epoch: int = 0,
) -> EpochPrediction:
    """The trained-length histogram of one epoch of a run with these data settings (the trainer's `data.*` and
    `seed`), from document lengths alone; Eq. 2 over it (analysis/frequency.py) is the epoch's trained f(i).

    `corpus`: a TokenDataset (exact, row by row), `Documents` (e.g. `Documents.from_histogram` of a corpus
    histogram, with sources for per-source weights), or an array of document lengths in corpus order.
    """
    documents = Documents(corpus) if isinstance(corpus, np.ndarray) else corpus
    return PackingPlan(
        documents,
        train_len,
        packing,
        attention=attention,
        seed=seed,
        shuffle=shuffle,
        shuffle_block=shuffle_block,
        upsample=upsample,
    ).predict_epoch(epoch)

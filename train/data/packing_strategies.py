"""Packing strategies: which pieces of which documents fill each row of L tokens, from document lengths alone.

`make_packing` picks a strategy; each plans one shuffle block (`plan_block`) and lays out the rows
that blocks cover (`layout`, a `RowLayout`: attention segments and padding, no tokens). The
schedule over epochs that calls them is train/data/packing_schedule.py.

Strategies (``packing``)
------------------------
- ``concat``: the documents of all epochs form one endless token stream and row k is its tokens
  [kL, (k+1)L). No padding, no token lost. Attention segments are the pieces cut at row
  boundaries (``attention="document"``), or whole rows (``attention="row"``, the paper's Fig. 1c;
  ``stream`` with it is the same).
- ``best_fit``: within each block (the buffer, many rows), pieces are packed whole into rows by
  best-fit decreasing (Ding et al. 2024, 'Fewer Truncations Improve Language Modeling'): longest
  first, each into the open row with the least free space that holds it, else a new row; the rows
  are then shuffled (seeded). A piece is never split below L; the rest of a row is padding.
- ``padded``: one piece per row, in stream order, the rest of the row padding.
- ``stream``: ``concat`` without pieces: a document is cut only where a row ends (the document
  stream cut into rows as TinyLlama's data loader cuts it; attention per document, as the paper
  adds), so a long document's rows between its first and last are whole L-token segments.

Padding is its own attention segment and never a target; it is not in the trained-length
histogram. Rows never cross epochs under ``best_fit`` and ``padded``, so one epoch of those trains
exactly Eq. 2 over the epoch's pieces.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from bisect import bisect_left, insort
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np

from posfreq.train.data.tokens.shards import concat_ranges

Strategy = Literal["concat", "best_fit", "padded", "stream"]
STRATEGIES: tuple[str, ...] = ("concat", "best_fit", "padded", "stream")
TOKEN_STREAMS: tuple[str, ...] = ("concat", "stream")
"""The strategies whose rows are cut from one endless token stream (a unit is a token; no padding)."""
Attention = Literal["document", "row"]


# --------------------------------------------------------------------------------------------
# Corpora as document lengths
# --------------------------------------------------------------------------------------------


class DocumentLengths(Protocol):
    """What a packing schedule reads from a corpus: how many documents, and the lengths of a range of them (TokenDataset)."""

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
        so a schedule over it is exact in distribution, not row by row, for the corpus it was counted from."""
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
    """``concat``: rows of L tokens cut from the endless token stream; a unit is a token. With
    `pieces` False (``stream``) documents are cut only at row ends, not at document-local multiples of L."""

    train_len: int
    attention: Attention = "document"
    pieces: bool = True

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
        elif not self.pieces:  # where each document starts, and the row ends
            cuts = np.union1d(dest[starts_ == 0], row_cuts)
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
    if packing in TOKEN_STREAMS:
        return ConcatRows(train_len, attention, pieces=packing == "concat")
    if packing == "best_fit":
        return BestFitRows(train_len)
    if packing == "padded":
        return PaddedRows(train_len)
    raise ValueError(f"packing must be one of {list(STRATEGIES)}, not {packing!r}")

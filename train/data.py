"""Token shards on disk and the packed, resumable, rank-aware batch stream built from them.

Shards
------
A data directory holds shards written by `scripts/prepare_data.py`, each three files:
``NAME.tokens.bin`` (uint32 tokens of all documents, each already ending in EOS),
``NAME.offsets.npy`` (int64 document start offsets, ``num_docs + 1`` entries, first 0, last
the token count) and ``NAME.json`` (metadata; written last, so its presence marks a complete
shard). `TokenDataset` memory-maps every shard in sorted name order: documents are numbered
globally in that order.

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

import hashlib
import json
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Iterator, Literal

import numpy as np
import torch

from posfreq.train.atomic import AtomicFile, atomic_open, write_json_atomic

FORMAT = "posfreq-tokens-v1"
TOKENS_SUFFIX = ".tokens.bin"
OFFSETS_SUFFIX = ".offsets.npy"
META_SUFFIX = ".json"
IGNORE_INDEX = -100
PREPARE_HINT = "Fix: run `python scripts/prepare_data.py --corpus <name or path> --out <this directory>`"


# --------------------------------------------------------------------------------------------
# Shards on disk
# --------------------------------------------------------------------------------------------


class ShardWriter:
    """Writes one shard under temporary names and renames it into place on `finish()`.

    Documents are stored exactly as given (the caller appends EOS). The metadata file is
    renamed last, so a crash never leaves a shard that `TokenDataset` takes for complete.
    """

    def __init__(self, directory: str | Path, name: str, *, tokenizer: str, vocab_size: int,
                 eos_id: int, extra: dict | None = None) -> None:
        if vocab_size > 2**32:
            raise ValueError(f"vocab_size={vocab_size} does not fit the uint32 token format")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.meta = {"format": FORMAT, "name": name, "tokenizer": tokenizer,
                     "vocab_size": int(vocab_size), "eos_id": int(eos_id), **(extra or {})}
        self._tokens = AtomicFile(self.directory / f"{name}{TOKENS_SUFFIX}", "wb")
        self._lengths: list[int] = []

    def add(self, tokens: np.ndarray | list[int]) -> None:
        """Append one document (its tokens, EOS included)."""
        array = np.asarray(tokens, dtype=np.int64)
        if array.size and (array.min() < 0 or array.max() >= self.meta["vocab_size"]):
            raise ValueError(f"shard {self.name}: token ids outside [0, {self.meta['vocab_size']})")
        self._tokens.file.write(array.astype(np.uint32).tobytes())
        self._lengths.append(int(array.size))

    def add_many(self, documents: Iterable[np.ndarray | list[int]]) -> None:
        """Append several documents."""
        for doc in documents:
            self.add(doc)

    def finish(self) -> dict:
        """Publish the tokens, then the offsets, then the metadata (each atomically); returns the metadata."""
        offsets = np.zeros(len(self._lengths) + 1, dtype=np.int64)
        np.cumsum(self._lengths, out=offsets[1:])
        self.meta.update(num_docs=len(self._lengths), num_tokens=int(offsets[-1]))
        self._tokens.commit()
        with atomic_open(self.directory / f"{self.name}{OFFSETS_SUFFIX}", "wb") as f:
            np.save(f, offsets)
        write_json_atomic(self.directory / f"{self.name}{META_SUFFIX}", self.meta, indent=1, sort_keys=True)
        return self.meta

    def abort(self) -> None:
        """Close and delete the temporary token file; nothing of the shard is published."""
        self._tokens.discard()

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finish()
        else:
            self.abort()


def shard_is_complete(directory: str | Path, name: str) -> dict | None:
    """The metadata of shard `name` if all three of its files exist, else None."""
    base = Path(directory)
    meta = base / f"{name}{META_SUFFIX}"
    if not (meta.is_file() and (base / f"{name}{TOKENS_SUFFIX}").is_file()
            and (base / f"{name}{OFFSETS_SUFFIX}").is_file()):
        return None
    try:
        return json.loads(meta.read_text())
    except json.JSONDecodeError:
        return None


@dataclass(frozen=True)
class _Shard:
    """One validated shard: its name, metadata and files (memory-mapped only when read)."""

    name: str
    meta: dict
    tokens_path: Path
    offsets_path: Path


def _check_shard(base: Path, name: str) -> _Shard:
    """Check that the three files of a shard exist and agree (reads only headers and sizes)."""
    shard = _Shard(name, {}, base / f"{name}{TOKENS_SUFFIX}", base / f"{name}{OFFSETS_SUFFIX}")
    meta_path = base / f"{name}{META_SUFFIX}"
    rerun = ("Fix: rerun scripts/prepare_data.py with the same --out; it redoes incomplete shards "
             "(or delete this shard's files).")
    for path in (shard.tokens_path, shard.offsets_path, meta_path):
        if not path.is_file():
            raise FileNotFoundError(f"incomplete shard {base / name}: {path.name} is missing. {rerun}")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{meta_path}: not valid JSON ({err}). {rerun}") from err
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"{meta_path}: format {found!r}, expected {FORMAT!r}; is this a token shard? {rerun}")
    size = shard.tokens_path.stat().st_size
    if size % 4:
        raise ValueError(f"{shard.tokens_path}: {size} bytes is not a whole number of uint32 tokens. {rerun}")
    offsets = np.load(shard.offsets_path, mmap_mode="r")
    n_tokens = size // 4
    if (offsets.dtype != np.int64 or offsets.ndim != 1 or len(offsets) != meta["num_docs"] + 1
            or offsets[0] != 0 or offsets[-1] != n_tokens or n_tokens != meta["num_tokens"]):
        raise ValueError(
            f"{shard.offsets_path}: offsets inconsistent with {shard.tokens_path.name} ({n_tokens} tokens) "
            f"and {meta_path.name} ({meta['num_docs']} docs, {meta['num_tokens']} tokens): need int64, "
            f"num_docs+1 entries, first 0, last the token count. {rerun}"
        )
    return replace(shard, meta=meta)


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, s + n) for each (s, n), without a Python loop."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    run_starts = np.cumsum(lengths) - lengths
    return np.repeat(np.asarray(starts, dtype=np.int64) - run_starts, lengths) + np.arange(total)


class TokenDataset:
    """All shards of a data directory as one list of documents (EOS included), memory-mapped.

    Shards are validated on opening and memory-mapped on first use; at most `max_open`
    shards stay mapped at once (SlimPajama has ~59k shards, more than the kernel's default
    limit of memory maps per process).
    """

    def __init__(self, directory: str | Path, tokenizer: str | None = None, max_open: int = 256) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise FileNotFoundError(f"data directory {self.directory} does not exist. {PREPARE_HINT}")
        names = sorted({p.name[: -len(suffix)] for suffix in (TOKENS_SUFFIX, OFFSETS_SUFFIX, META_SUFFIX)
                        for p in self.directory.glob(f"*{suffix}") if not p.name.startswith(".")})
        if not names:
            raise FileNotFoundError(f"data directory {self.directory} holds no token shards "
                                    f"(*{TOKENS_SUFFIX} + *{OFFSETS_SUFFIX} + *{META_SUFFIX}). {PREPARE_HINT}")
        self.shards = [_check_shard(self.directory, name) for name in names]
        first = self.shards[0]
        for shard in self.shards[1:]:
            for key in ("tokenizer", "vocab_size", "eos_id"):
                if shard.meta[key] != first.meta[key]:
                    raise ValueError(
                        f"{self.directory}: shard {shard.name} has {key}={shard.meta[key]!r} but shard "
                        f"{first.name} has {first.meta[key]!r}; all shards of a directory must share one "
                        "tokenizer. Fix: re-tokenize into a fresh --out with a single --tokenizer."
                    )
        if tokenizer is not None and first.meta["tokenizer"] != tokenizer:
            raise ValueError(f"{self.directory} was tokenized with {first.meta['tokenizer']!r}, not "
                             f"{tokenizer!r}. Fix: point to data tokenized with {tokenizer!r} (scripts/"
                             "prepare_data.py --tokenizer) or change the tokenizer setting.")
        self.tokenizer: str = first.meta["tokenizer"]
        self.vocab_size: int = int(first.meta["vocab_size"])
        self.eos_id: int = int(first.meta["eos_id"])
        docs = np.array([s.meta["num_docs"] for s in self.shards], dtype=np.int64)
        toks = np.array([s.meta["num_tokens"] for s in self.shards], dtype=np.int64)
        self._doc_starts = np.concatenate([[0], np.cumsum(docs)])  # first global doc id per shard
        self._tok_starts = np.concatenate([[0], np.cumsum(toks)])  # first global token per shard
        self.num_docs = int(self._doc_starts[-1])
        self.num_tokens = int(self._tok_starts[-1])
        self._maps = lru_cache(maxsize=max_open)(self._open)

    def _open(self, s: int) -> tuple[np.ndarray, np.ndarray]:
        """Memory maps of shard s: (uint32 tokens, int64 offsets)."""
        shard = self.shards[s]
        tokens = (np.memmap(shard.tokens_path, dtype=np.uint32, mode="r") if shard.meta["num_tokens"]
                  else np.zeros(0, dtype=np.uint32))
        return tokens, np.load(shard.offsets_path, mmap_mode="r")

    def __len__(self) -> int:
        return self.num_docs

    def fingerprint(self) -> str:
        """sha256 over each shard's name, file sizes and document offsets: which documents these are, wherever
        the directory lives (token contents are not read: they are the bulk of the data)."""
        digest = hashlib.sha256()
        for shard in self.shards:
            sizes = (shard.tokens_path.stat().st_size, shard.offsets_path.stat().st_size)
            digest.update(f"{shard.name}\0{sizes[0]}\0{sizes[1]}\n".encode())
            digest.update(np.load(shard.offsets_path, mmap_mode="r"))
        return digest.hexdigest()

    def __repr__(self) -> str:
        return (f"TokenDataset({str(self.directory)!r}: {len(self.shards)} shards, {self.num_docs} docs, "
                f"{self.num_tokens} tokens, tokenizer={self.tokenizer})")

    def document(self, i: int) -> np.ndarray:
        """The tokens of document i (global numbering, EOS included), as int64."""
        if not 0 <= i < self.num_docs:
            raise IndexError(f"document {i} out of range [0, {self.num_docs})")
        s = int(np.searchsorted(self._doc_starts, i, side="right") - 1)
        tokens, offsets = self._maps(s)
        local = i - int(self._doc_starts[s])
        return np.asarray(tokens[offsets[local]: offsets[local + 1]], dtype=np.int64)

    def doc_lengths(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Lengths (EOS included) of documents [start, stop), as int64."""
        stop = self.num_docs if stop is None else stop
        parts = [np.zeros(0, dtype=np.int64)]
        first = max(int(np.searchsorted(self._doc_starts, start, side="right")) - 1, 0)
        for s in range(first, len(self.shards)):
            if self._doc_starts[s] >= stop:
                break
            lo = max(start - int(self._doc_starts[s]), 0)
            hi = min(stop - int(self._doc_starts[s]), self.shards[s].meta["num_docs"])
            if lo < hi:
                parts.append(np.diff(np.asarray(self._maps(s)[1][lo: hi + 1])))
        return np.concatenate(parts).astype(np.int64)

    def token_offsets(self, docs: np.ndarray) -> np.ndarray:
        """Global token offset of the first token of each document in `docs`."""
        docs = np.asarray(docs, dtype=np.int64)
        shard_of = np.searchsorted(self._doc_starts, docs, side="right") - 1
        out = np.empty(len(docs), dtype=np.int64)
        for s in np.unique(shard_of):
            sel = shard_of == s
            out[sel] = self._tok_starts[s] + self._maps(int(s))[1][docs[sel] - self._doc_starts[s]]
        return out

    def read_runs(self, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Concatenated tokens of runs [start, start + length) in global token coordinates, as int64.

        A run must not cross a shard boundary (runs inside one document never do).
        """
        starts, lengths = np.asarray(starts, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
        out = np.empty(int(lengths.sum()), dtype=np.int64)
        dest = np.cumsum(lengths) - lengths
        shard_of = np.searchsorted(self._tok_starts, starts, side="right") - 1
        for s in np.unique(shard_of[lengths > 0]):
            sel = (shard_of == s) & (lengths > 0)
            src = _ranges(starts[sel] - self._tok_starts[s], lengths[sel])
            out[_ranges(dest[sel], lengths[sel])] = self._maps(int(s))[0][src]
        return out


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
        self._block_bounds = np.append(np.arange(0, dataset.num_docs, shuffle_block), dataset.num_docs)
        self._block_units = np.array([self._units(dataset.doc_lengths(a, b)).sum() for a, b in
                                      zip(self._block_bounds[:-1], self._block_bounds[1:])], dtype=np.int64)
        self.units_per_epoch = int(self._block_units.sum())  # tokens (mixed) or pieces (one per row)
        self.next_row = 0  # index of the first row of the next global batch
        self._epoch_order = lru_cache(maxsize=2)(self._make_epoch_order)
        self._block_plan = lru_cache(maxsize=4)(self._make_block_plan)

    # -- stream layout -------------------------------------------------------------------------

    def _units(self, lengths: np.ndarray) -> np.ndarray:
        """Stream units per document: tokens when rows mix documents, else pieces (one per row)."""
        return lengths if self.mix_documents else -(-lengths // self.seq_len)

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
        return a + perm, lengths, np.concatenate([[0], np.cumsum(self._units(lengths))])

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
        """Rows [first_row, first_row + rows) of the global stream, as one batch."""
        if self.mix_documents:
            return self._mixed_rows(first_row, rows)
        return self._padded_rows(first_row, rows)

    def _mixed_rows(self, first_row: int, rows: int) -> PackedBatch:
        """Rows cut from the concatenated token stream (no padding)."""
        L, total = self.seq_len, rows * self.seq_len
        docs, _, starts, counts = self._runs(first_row * L, total)
        tokens = self.dataset.read_runs(self.dataset.token_offsets(docs) + starts, counts)
        row_cuts = np.arange(0, total + 1, L, dtype=np.int64)
        if self.attention == "row":
            return _assemble(tokens, row_cuts, None, rows, L)
        where = np.cumsum(counts) - counts  # batch position of each run
        first_piece = -(-starts // L)  # piece cuts are at document-local multiples of L
        n_cuts = -(-(starts + counts) // L) - first_piece
        piece = _ranges(first_piece, n_cuts)
        cuts = np.repeat(where - starts, n_cuts) + piece * L
        return _assemble(tokens, np.union1d(cuts, row_cuts), None, rows, L)

    def _padded_rows(self, first_row: int, rows: int) -> PackedBatch:
        """One piece per row, padded to L with `pad_id` (its own, never-trained segment)."""
        L, total = self.seq_len, rows * self.seq_len
        docs, lengths, firsts, counts = self._runs(first_row, rows)
        doc = np.repeat(docs, counts)
        piece = _ranges(firsts, counts)
        piece_len = np.minimum(L, np.repeat(lengths, counts) - piece * L)
        row_start = np.arange(rows, dtype=np.int64) * L
        dest = _ranges(row_start, piece_len)
        tokens = np.full(total, self.pad_id, dtype=np.int64)
        tokens[dest] = self.dataset.read_runs(self.dataset.token_offsets(doc) + piece * L, piece_len)
        pad = np.ones(total, dtype=bool)
        pad[dest] = False
        cuts = np.union1d(np.append(row_start, total), row_start + piece_len)
        return _assemble(tokens, cuts, pad, rows, L)

    # -- iteration and state -------------------------------------------------------------------

    @property
    def rows_per_global_batch(self) -> int:
        """Rows that one step consumes over all ranks."""
        return self.rows_per_batch * self.world_size

    @property
    def epoch(self) -> int:
        """The epoch that the next batch starts in."""
        return self.next_row * (self.seq_len if self.mix_documents else 1) // self.units_per_epoch

    def __iter__(self) -> Iterator[PackedBatch]:
        return self

    def __next__(self) -> PackedBatch:
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
        units = self.next_row * (self.seq_len if self.mix_documents else 1)
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

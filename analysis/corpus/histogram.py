"""The counting job: exact document-length histograms of a corpus, per source, cached by content and mergeable.

Document length follows the trainer: ``len(tokenizer.encode(text)) + 1`` (the appended EOS).
Files are counted in worker processes (the result does not depend on how many); a finished count
is cached under a key hashed from the corpus files, the tokenizer and the settings; a SLURM array
counts shards i/n of the files into partial histograms that `merge_partials` sums.
"""

from __future__ import annotations

import functools
import hashlib
import json
import multiprocessing
import os
import sys
import time
import zipfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from posfreq.train.atomic import atomic_open
from posfreq.train.data.corpora import Corpus, CorpusFile, SourceFilter, file_size, iter_documents
from posfreq.train.data.essays import cache_dir
from posfreq.train.data.records import CorpusError, OnError, ReadStats

CACHE_VERSION = 3  # 2: truncated .zst files are detected (version 1 read them cut short); 3: keyed by ctime and inode too
BATCH_CHARS = 1 << 20  # tokenize about a megabyte of text per encode_batch call
HISTOGRAM_FILE = "histogram.npz"


@dataclass
class LengthHistogram:
    """Exact counts of document lengths per source (dense int64 arrays, index = length)."""

    by_source: dict[str, np.ndarray] = field(default_factory=dict)

    def add(self, source: str, lengths: np.ndarray, counts: np.ndarray | None = None) -> None:
        """Count documents of the given lengths (each once, or `counts` times) for a source."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.size == 0:
            return
        if counts is None:
            lengths, counts = np.unique(lengths, return_counts=True)
        hist = self.by_source.get(source, np.zeros(0, dtype=np.int64))
        top = int(lengths.max()) + 1
        if top > hist.size:
            grown = np.zeros(max(top, 2 * hist.size), dtype=np.int64)
            grown[: hist.size] = hist
            hist = grown
        np.add.at(hist, lengths, np.asarray(counts, dtype=np.int64))
        self.by_source[source] = hist

    def merge(self, other: LengthHistogram) -> None:
        """Add another histogram's counts into this one."""
        for source, hist in other.by_source.items():
            nonzero = np.flatnonzero(hist)
            self.add(source, nonzero, hist[nonzero])

    @property
    def sources(self) -> list[str]:
        """Source names, sorted."""
        return sorted(self.by_source)

    def counts(self, source: str | None = None) -> np.ndarray:
        """The histogram of one source, or of all sources summed (trimmed after the longest document)."""
        parts = [self.by_source[source]] if source is not None else list(self.by_source.values())
        size = max((int(np.flatnonzero(h).max()) + 1 for h in parts if h.any()), default=0)
        total = np.zeros(size, dtype=np.int64)
        for hist in parts:
            total += hist[:size] if hist.size >= size else np.pad(hist, (0, size - hist.size))
        return total

    def to_arrays(self) -> dict[str, np.ndarray]:
        """Sparse arrays for an .npz: per source, the lengths that occur and their counts."""
        arrays = {"sources": np.array(self.sources, dtype=str)}
        for k, source in enumerate(self.sources):
            hist = self.by_source[source]
            nonzero = np.flatnonzero(hist)
            arrays[f"lengths_{k}"] = nonzero
            arrays[f"counts_{k}"] = hist[nonzero]
        return arrays

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray]) -> LengthHistogram:
        """The inverse of `to_arrays`."""
        histogram = cls()
        for k, source in enumerate(arrays["sources"]):
            histogram.add(str(source), arrays[f"lengths_{k}"], arrays[f"counts_{k}"])
        return histogram


def save_histogram(path: Path, histogram: LengthHistogram, meta: dict) -> Path:
    """Write a histogram and its metadata (settings, read stats, shard) to an .npz atomically; return the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(path, "wb") as fh:
        np.savez_compressed(fh, meta=np.array(json.dumps(meta)), **histogram.to_arrays())
    return path


def load_histogram(path: Path) -> tuple[LengthHistogram, dict]:
    """Read a histogram .npz written by `save_histogram`; CorpusError naming the file and the fix when it is not
    one (truncated, garbage, pickled data, arrays or metadata missing)."""
    try:
        with np.load(path, allow_pickle=False) as arrays:
            histogram, meta = LengthHistogram.from_arrays(arrays), json.loads(str(arrays["meta"]))
    except (OSError, EOFError, ValueError, KeyError, TypeError, zipfile.BadZipFile) as err:
        # BadZipFile: truncated; ValueError: not an .npz ("pickled data"), or its metadata is not JSON
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        if "pickled" in reason:  # numpy's word for bytes that are neither .npz nor .npy
            reason = "not an .npz archive"
        raise CorpusError(
            f"{path}: not a readable length histogram ({reason}). Fix: delete it and count "
            "again (a --merge part: posfreq analyze --shard i/n into its folder; the cache: --no-cache)"
        ) from None
    if not isinstance(meta, dict):
        raise CorpusError(
            f"{path}: its metadata is not a JSON object. Fix: delete it and count again"
        )
    return histogram, meta


@dataclass(frozen=True)
class CountSettings:
    """Everything besides the files that determines a length histogram (part of the cache key)."""

    tokenizer: str = "llama3"
    text_field: str = "text"
    sources: tuple[str, ...] = ()
    default_source: str = "unknown"
    max_docs_per_file: int | None = None
    on_error: OnError = "raise"
    tokenizer_fingerprint: str = ""
    """The tokenizer by content (`cached_count` sets it): an hf:DIR whose files changed counts anew."""


@dataclass
class FileResult:
    """One file's contribution: its length histogram, read stats, tokens and bytes on disk."""

    file: str
    histogram: LengthHistogram
    stats: ReadStats
    tokens: int
    bytes: int


_WORKER_TOKENIZERS: dict = {}


def _tokenizer(spec: str, fingerprint: str = ""):
    """The tokenizer for `spec` with this content fingerprint, built once per process (a replaced hf:DIR is
    another fingerprint, so another tokenizer)."""
    if (spec, fingerprint) not in _WORKER_TOKENIZERS:
        from posfreq.train.data.tokenizer import get_tokenizer

        _WORKER_TOKENIZERS[(spec, fingerprint)] = get_tokenizer(spec)
    return _WORKER_TOKENIZERS[(spec, fingerprint)]


def count_file(settings: CountSettings, file: str | CorpusFile) -> FileResult:
    """Tokenize one file's documents in batches and count their lengths (tokens + EOS) per source."""
    tokenizer = _tokenizer(settings.tokenizer, settings.tokenizer_fingerprint)
    stats = ReadStats()
    lengths: dict[str, list[np.ndarray]] = {}
    texts: list[str] = []
    sources: list[str] = []
    chars = 0

    def flush() -> None:
        """Tokenize the batch and file its lengths under each document's source."""
        encoded = tokenizer.encode_batch(texts)
        doc_lengths = np.fromiter(
            (len(ids) + 1 for ids in encoded), dtype=np.int64, count=len(encoded)
        )
        names = np.array(sources)
        for source in set(sources):
            lengths.setdefault(source, []).append(doc_lengths[names == source])
        texts.clear()
        sources.clear()

    documents = iter_documents(
        file,
        text_field=settings.text_field,
        sources=SourceFilter(settings.sources),
        default_source=settings.default_source,
        on_error=settings.on_error,
        stats=stats,
    )
    for n_docs, doc in enumerate(documents, start=1):
        texts.append(doc.text)
        sources.append(doc.source)
        chars += len(doc.text)
        if chars >= BATCH_CHARS:
            flush()
            chars = 0
        if settings.max_docs_per_file is not None and n_docs >= settings.max_docs_per_file:
            break
    if texts:
        flush()
    histogram = LengthHistogram()
    tokens = 0
    for source, parts in lengths.items():
        all_lengths = np.concatenate(parts)
        histogram.add(source, all_lengths)
        tokens += int(all_lengths.sum())
    return FileResult(str(file), histogram, stats, tokens, file_size(file))


def count_lengths(
    files: Sequence[CorpusFile], settings: CountSettings, workers: int = 1, progress: bool = True
) -> tuple[LengthHistogram, ReadStats]:
    """The length histogram of many files, over `workers` processes; the result does not depend on it."""
    from posfreq.train.progress import progress_bar

    histogram, stats = LengthHistogram(), ReadStats()
    tokens = nbytes = 0
    start = time.perf_counter()
    work = functools.partial(count_file, settings)
    bar = progress_bar(
        total=len(files), unit="file", desc="length histogram", disable=not progress, smoothing=0.05
    )
    for result in _file_results(work, files, workers):
        histogram.merge(result.histogram)
        stats.merge(result.stats)
        tokens += result.tokens
        nbytes += result.bytes
        elapsed = max(time.perf_counter() - start, 1e-9)
        bar.set_postfix_str(
            f"docs={stats.documents:,} tokens={tokens:,}"
            + (
                f" {nbytes / elapsed / 1e6:.1f}MB/s(disk)" if nbytes else ""
            )  # streams have no size on disk
            + (f" skipped={stats.skipped}" if stats.skipped else ""),
            refresh=False,
        )
        bar.update(1)
    bar.close()
    return histogram, stats


def _file_results(
    work: Callable[[CorpusFile], FileResult], files: Sequence[CorpusFile], workers: int
) -> Iterator[FileResult]:
    """`work(file)` for every file: in this process, or in a pool of processes (results in any order)."""
    workers = max(1, min(workers, len(files)))
    if workers == 1:
        yield from map(work, files)
        return
    with multiprocessing.get_context().Pool(workers) as pool:
        yield from pool.imap_unordered(work, files)


def default_workers() -> int:
    """All the cores this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cache_key(corpus: Corpus, settings: CountSettings) -> str:
    """A hash of the corpus files (path, inode, size, mtime and change time: `Corpus.fingerprint`; a stream's
    dataset, split, revision) and the settings, the tokenizer's content fingerprint among them (a replaced
    tokenizer.json is another tokenizer). Not of the files' bytes: reading them is the work the cache saves."""
    payload = {
        "version": CACHE_VERSION,
        "files": corpus.fingerprint(),
        "settings": asdict(settings),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:24]


def cached_count(
    corpus: Corpus,
    settings: CountSettings,
    workers: int,
    use_cache: bool = True,
    progress: bool = True,
) -> tuple[LengthHistogram, dict]:
    """The corpus's length histogram and metadata, from the cache when the key matches."""
    from posfreq.train.data.tokenizer import get_tokenizer

    fingerprint = get_tokenizer(settings.tokenizer).fingerprint
    settings = replace(settings, tokenizer_fingerprint=fingerprint)
    key = cache_key(corpus, settings)
    path = cache_dir() / "position_freq" / f"{key}.npz"
    if use_cache and path.is_file():
        print(
            f"length histogram read from the cache: {path} (--no-cache recounts)", file=sys.stderr
        )
        return load_histogram(path)
    histogram, stats = count_lengths(corpus.files, settings, workers, progress)
    meta = {
        "corpus": corpus.name,
        "files": len(corpus.files),
        "cache_key": key,
        "settings": asdict(settings),
        "read": asdict(stats),
    }
    if use_cache:
        save_histogram(path, histogram, meta)
    return histogram, meta


def merge_partials(parts: Iterable[Path]) -> tuple[LengthHistogram, dict]:
    """Sum shard histograms (files, or directories holding histogram.npz) after checking they share settings
    and cover shards 0..n-1 exactly once."""
    paths = [p / HISTOGRAM_FILE if p.is_dir() else p for p in parts]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise CorpusError(f"--merge: no partial histogram at {', '.join(missing)}")
    histogram, metas = LengthHistogram(), []
    for path in paths:
        part, meta = load_histogram(path)
        histogram.merge(part)
        metas.append(meta)
    settings = {json.dumps(m["settings"], sort_keys=True) for m in metas}
    if len(settings) > 1:
        raise CorpusError("--merge: the partial histograms were computed with different settings")
    shards = sorted(tuple(m["shard"]) for m in metas if m.get("shard"))
    count = shards[0][1] if shards else 0
    if len(shards) != len(metas) or shards != [(i, count) for i in range(count)]:
        raise CorpusError(f"--merge: expected shards 0..n-1 of one n exactly once, got {shards}")
    read = ReadStats()
    for m in metas:
        read.merge(ReadStats(**m["read"]))
    meta = {
        "corpus": metas[0]["corpus"],
        "files": sum(m["files"] for m in metas),
        "settings": metas[0]["settings"],
        "merged_shards": count,
        "read": asdict(read),
    }
    return histogram, meta

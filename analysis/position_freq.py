"""Position frequency f(i) (the paper's Eq. 2) from document-length histograms, and the corpus CLI.

Eq. 2 lives in `position_frequency` only: documents are cut into pieces of at most L tokens
(the paper's truncation), then f(i) = sum over pieces of max(|piece| - i, 0) for 0 <= i < L.
The same function serves a corpus histogram, the analytic cases of Fig. 1b/1c, and a trainer
checkpoint's histogram of trained segment lengths (already <= L, so truncation is a no-op).

Document length follows the trainer: ``len(tokenizer.encode(text)) + 1`` (the appended EOS).

    python analysis/position_freq.py --corpus slimpajama --data-dir DIR --out runs/pf
    python analysis/position_freq.py --corpus pg-essays --out runs/pf_pg
    python analysis/position_freq.py --corpus slimpajama --hf-dataset cerebras/SlimPajama-627B --out runs/pf
    python analysis/position_freq.py --corpus slimpajama --shard 3/64 --out runs/pf/shard_3
    python analysis/position_freq.py --merge runs/pf/shard_* --out runs/pf
"""

from __future__ import annotations

import argparse
import csv
import functools
import hashlib
import json
import multiprocessing
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

if __package__ in (None, ""):  # run as a file: import the installed posfreq package, never this folder's files by bare name
    sys.path.pop(0)

from posfreq.train.corpora import (
    Corpus,
    CorpusError,
    CorpusFile,
    MAX_ERRORS_KEPT,
    OnError,
    ReadStats,
    SourceFilter,
    cache_dir,
    file_size,
    iter_documents,
    lost_files_report,
    resolve_corpus,
)
from posfreq.train.cli import parse_shard

CACHE_VERSION = 2  # 2: truncated .zst files are detected (version 1 read them cut short)
PERCENTILES = (10, 25, 50, 75, 90, 99)
BATCH_CHARS = 1 << 20  # tokenize about a megabyte of text per encode_batch call


# ----------------------------------------------------------------------------------- Eq. 2


def _as_histogram(length_hist: Sequence[int] | np.ndarray) -> np.ndarray:
    """Validate a length histogram (index = length, value = count) and return it as int64."""
    hist = np.asarray(length_hist)
    if hist.ndim != 1:
        raise ValueError(f"length histogram must be 1-D (index = length), got shape {hist.shape}")
    if hist.size and not np.issubdtype(hist.dtype, np.integer):
        raise ValueError(f"length histogram must hold integer counts, got dtype {hist.dtype}")
    hist = hist.astype(np.int64, copy=False)
    if (hist < 0).any():
        raise ValueError("length histogram has negative counts")
    return hist


def piece_histogram(length_hist: Sequence[int] | np.ndarray, train_len: int) -> np.ndarray:
    """Counts of pieces by length (0..L) after cutting every document into pieces of at most L.

    A document of length n gives n // L pieces of length L and one piece of length n % L when that
    is non-zero. O(max length), exact in int64.
    """
    if train_len < 1:
        raise ValueError(f"train_len must be >= 1, got {train_len}")
    hist = _as_histogram(length_hist)
    n_rows = -(-hist.size // train_len)
    padded = np.zeros(n_rows * train_len, dtype=np.int64)
    padded[: hist.size] = hist
    by_remainder = padded.reshape(n_rows, train_len)  # row q, column r: documents of length qL + r
    pieces = np.zeros(train_len + 1, dtype=np.int64)
    pieces[1:train_len] = by_remainder[:, 1:].sum(axis=0)
    pieces[train_len] = int(by_remainder.sum(axis=1) @ np.arange(n_rows, dtype=np.int64))
    return pieces


def position_frequency(length_hist: Sequence[int] | np.ndarray, train_len: int) -> np.ndarray:
    """Eq. 2: f(i) = sum over pieces s (documents cut to <= L) of max(|s| - i, 0), for 0 <= i < L.

    `length_hist[n]` is the number of documents of length n: a corpus histogram, or a trainer
    checkpoint's bincount of trained segment lengths. O(L + max length) with cumulative sums,
    exact in int64.
    """
    pieces = piece_histogram(length_hist, train_len)
    lengths = np.arange(train_len + 1, dtype=np.int64)
    # f(i) = sum_{l > i} c_l * l  -  i * sum_{l > i} c_l, both suffix sums over l = i+1 .. L.
    count_above = np.cumsum(pieces[::-1])[::-1][1:]
    tokens_above = np.cumsum((pieces * lengths)[::-1])[::-1][1:]
    return tokens_above - lengths[:train_len] * count_above


def uniform_length_histogram(train_len: int, docs_per_length: int = 1) -> np.ndarray:
    """Fig. 1b's corpus: the same number of documents at every length 1..L."""
    hist = np.full(train_len + 1, docs_per_length, dtype=np.int64)
    hist[0] = 0
    return hist


def concatenated_histogram(n_rows: int, train_len: int) -> np.ndarray:
    """Fig. 1c's corpus: everything concatenated into `n_rows` full rows of L tokens."""
    hist = np.zeros(train_len + 1, dtype=np.int64)
    hist[train_len] = n_rows
    return hist


def scale_to_budget(f: np.ndarray, budget_tokens: float) -> np.ndarray:
    """f(i) after training on `budget_tokens` tokens drawn like this histogram (f(0) is its token count)."""
    if f.size == 0 or f[0] == 0:
        raise ValueError("cannot scale an empty position frequency (no tokens)")
    return f.astype(np.float64) * (float(budget_tokens) / float(f[0]))


# ------------------------------------------------------------------------------ histograms


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
    def from_arrays(cls, arrays) -> LengthHistogram:
        """The inverse of `to_arrays`."""
        histogram = cls()
        for k, source in enumerate(arrays["sources"]):
            histogram.add(str(source), arrays[f"lengths_{k}"], arrays[f"counts_{k}"])
        return histogram


def save_histogram(path: Path, histogram: LengthHistogram, meta: dict) -> None:
    """Write a histogram and its metadata (settings, read stats, shard) to an .npz atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez_compressed(tmp, meta=np.array(json.dumps(meta)), **histogram.to_arrays())
    tmp.replace(path)


def load_histogram(path: Path) -> tuple[LengthHistogram, dict]:
    """Read a histogram .npz written by `save_histogram`."""
    with np.load(path, allow_pickle=False) as arrays:
        return LengthHistogram.from_arrays(arrays), json.loads(str(arrays["meta"]))


# ----------------------------------------------------------------------------- counting job


@dataclass(frozen=True)
class CountSettings:
    """Everything besides the files that determines a length histogram (part of the cache key)."""

    tokenizer: str = "llama3"
    text_field: str = "text"
    sources: tuple[str, ...] = ()
    default_source: str = "unknown"
    max_docs_per_file: int | None = None
    on_error: OnError = "raise"


@dataclass
class FileResult:
    """One file's contribution: its length histogram, read stats, tokens and bytes on disk."""

    file: str
    histogram: LengthHistogram
    stats: ReadStats
    tokens: int
    bytes: int


_WORKER_TOKENIZERS: dict = {}


def _tokenizer(spec: str):
    """The tokenizer for `spec`, built once per process."""
    if spec not in _WORKER_TOKENIZERS:
        from posfreq.train.tokenizer import get_tokenizer

        _WORKER_TOKENIZERS[spec] = get_tokenizer(spec)
    return _WORKER_TOKENIZERS[spec]


def count_file(settings: CountSettings, file: str | CorpusFile) -> FileResult:
    """Tokenize one file's documents in batches and count their lengths (tokens + EOS) per source."""
    tokenizer = _tokenizer(settings.tokenizer)
    stats = ReadStats()
    lengths: dict[str, list[np.ndarray]] = {}
    texts: list[str] = []
    sources: list[str] = []
    chars = 0

    def flush() -> None:
        encoded = tokenizer.encode_batch(texts)
        doc_lengths = np.fromiter((len(ids) + 1 for ids in encoded), dtype=np.int64, count=len(encoded))
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
    from tqdm.auto import tqdm

    histogram, stats = LengthHistogram(), ReadStats()
    tokens = nbytes = 0
    start = time.perf_counter()
    work = functools.partial(count_file, settings)
    bar = tqdm(total=len(files), unit="file", desc="length histogram", disable=not progress, smoothing=0.05)
    for result in _file_results(work, files, workers):
        histogram.merge(result.histogram)
        stats.merge(result.stats)
        tokens += result.tokens
        nbytes += result.bytes
        elapsed = max(time.perf_counter() - start, 1e-9)
        bar.set_postfix_str(
            f"docs={stats.documents:,} tokens={tokens:,}"
            + (f" {nbytes / elapsed / 1e6:.1f}MB/s(disk)" if nbytes else "")  # streams have no size on disk
            + (f" skipped={stats.skipped}" if stats.skipped else ""),
            refresh=False,
        )
        bar.update(1)
    bar.close()
    return histogram, stats


def _file_results(work, files: Sequence[CorpusFile], workers: int) -> Iterator[FileResult]:
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
    """A hash of the corpus files (paths, sizes, mtimes; a stream's dataset, split, revision), the tokenizer
    and the settings."""
    payload = {"version": CACHE_VERSION, "files": corpus.fingerprint(), "settings": asdict(settings)}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:24]


def cached_count(
    corpus: Corpus, settings: CountSettings, workers: int, use_cache: bool = True, progress: bool = True
) -> tuple[LengthHistogram, dict]:
    """The corpus's length histogram and metadata, from the cache when the key matches."""
    key = cache_key(corpus, settings)
    path = cache_dir() / "position_freq" / f"{key}.npz"
    if use_cache and path.is_file():
        print(f"length histogram read from the cache: {path} (--no-cache recounts)", file=sys.stderr)
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


# ----------------------------------------------------------------------------------- summary


def length_stats(hist: np.ndarray) -> dict:
    """Documents, tokens, mean/median/percentile/max lengths of a length histogram."""
    hist = _as_histogram(hist)
    docs = int(hist.sum())
    if docs == 0:
        return {"documents": 0, "tokens": 0}
    tokens = int((hist * np.arange(hist.size)).sum())
    cumulative = np.cumsum(hist)

    def percentile(p: int) -> int:
        """Nearest-rank percentile: the smallest length with at least ceil(p% of documents) at or below it."""
        return int(np.searchsorted(cumulative, max(1, -(-p * docs // 100))))

    return {
        "documents": docs,
        "tokens": tokens,
        "mean_length": tokens / docs,
        "median_length": percentile(50),
        "percentiles": {f"p{p}": percentile(p) for p in PERCENTILES},
        "max_length": int(np.flatnonzero(hist).max()),
    }


def length_buckets(train_len: int) -> list[tuple[int, int]]:
    """Fig. 1a's bars: [1, 128), [128, 256), ... doubling up to L, then exactly L."""
    edges = [1] + [2**k for k in range(7, 64) if 2**k < train_len] + [train_len]
    return [(a, b) for a, b in zip(edges[:-1], edges[1:])] + [(train_len, train_len + 1)]


def bucket_shares(pieces: np.ndarray, train_len: int) -> dict[str, float]:
    """Share of pieces (documents after truncation) in each of Fig. 1a's length buckets."""
    total = pieces.sum()
    shares = {}
    for lo, hi in length_buckets(train_len):
        label = f"{lo}" if hi == lo + 1 else f"{lo}-{hi - 1}"
        shares[label] = float(pieces[lo:hi].sum() / total) if total else 0.0
    return shares


def frequency_stats(hist: np.ndarray, train_len: int, budget_tokens: float) -> dict:
    """The paper's numbers for one L: pieces at exactly L and where the position occurrences sit.

    ``share_positions_le_half_L`` is the share of all f(i) with i <= L/2 (the paper: over 80% at
    i <= 1024 for L = 2048); ``share_positions_ge_three_quarter_L`` the share with i >= 3L/4 (under 5%).
    """
    pieces = piece_histogram(hist, train_len)
    f = position_frequency(hist, train_len)
    occurrences = int(f.sum())
    if occurrences == 0:
        return {"train_len": train_len, "pieces": 0}
    half, three_quarters = train_len // 2, (3 * train_len) // 4
    return {
        "train_len": train_len,
        "pieces": int(pieces.sum()),
        "share_pieces_at_L": float(pieces[train_len] / pieces.sum()),
        "share_documents_longer_than_L": float(hist[train_len + 1:].sum() / hist.sum()),
        "position_occurrences": occurrences,
        "share_positions_le_half_L": float(f[: half + 1].sum() / occurrences),
        "share_positions_ge_three_quarter_L": float(f[three_quarters:].sum() / occurrences),
        "piece_length_shares": bucket_shares(pieces, train_len),
        "budget_tokens": budget_tokens,
        "f_at_half_L_after_budget": float(scale_to_budget(f, budget_tokens)[half]),
    }


def summarize(histogram: LengthHistogram, train_lens: Sequence[int], budget_tokens: float) -> dict:
    """summary.json: length stats and per-L position stats, for the whole corpus and per source."""

    def one(hist: np.ndarray) -> dict:
        out = length_stats(hist)
        out["by_train_len"] = {str(L): frequency_stats(hist, L, budget_tokens) for L in train_lens}
        return out

    return {"all": one(histogram.counts()), "by_source": {s: one(histogram.counts(s)) for s in histogram.sources}}


def format_summary(summary: dict, meta: dict) -> str:
    """A one-screen text summary of summary.json."""
    total = summary["all"]
    read = meta.get("read", {})
    percentiles = ", ".join(f"{k} {v}" for k, v in total["percentiles"].items())
    lines = [
        f"corpus {meta.get('corpus')}: {meta.get('files')} files, {total['documents']:,} documents, "
        f"{total['tokens']:,} tokens (tokenizer {meta['settings']['tokenizer']}, length = tokens + EOS)",
        f"  lengths: mean {total['mean_length']:.1f}, median {total['median_length']}, {percentiles}, "
        f"max {total['max_length']}",
    ]
    if read.get("filtered") or read.get("skipped"):
        lines.append(f"  filtered by source: {read.get('filtered', 0):,}; "
                     f"skipped bad items: {read.get('skipped', 0):,} (the first {MAX_ERRORS_KEPT} in summary.json "
                     "meta.read.errors)")
    lines += lost_files_report(read.get("lost_files", []), "summary.json meta.read.lost_files")
    lines.append(f"  {'source':<26}{'docs':>12}{'L':>7}{'at L':>8}{'i<=L/2':>9}{'i>=3L/4':>9}")
    rows = [("all", total)]
    if len(summary["by_source"]) > 1:
        rows += sorted(summary["by_source"].items())
    for name, stats in rows:
        for L, fs in stats["by_train_len"].items():
            lines.append(
                f"  {name[:25]:<26}{stats['documents']:>12,}{L:>7}{fs['share_pieces_at_L']:>8.1%}"
                f"{fs['share_positions_le_half_L']:>9.1%}{fs['share_positions_ge_three_quarter_L']:>9.1%}"
            )
    return "\n".join(lines)


# ----------------------------------------------------------------------------------- outputs


def write_outputs(
    out: Path, histogram: LengthHistogram, meta: dict, train_lens: Sequence[int], budget_tokens: float,
    figures: bool = True,
) -> dict:
    """Write histogram (npz, CSV), f(i) per L (npz, CSV), summary.json and figures; return the summary."""
    out.mkdir(parents=True, exist_ok=True)
    save_histogram(out / "histogram.npz", histogram, meta)
    _write_length_csv(out / "lengths.csv", histogram)
    arrays = {}
    for L in train_lens:
        columns = {"f": position_frequency(histogram.counts(), L)}
        columns[f"f_after_{budget_tokens:.3g}_tokens"] = scale_to_budget(columns["f"], budget_tokens)
        for source in histogram.sources:
            columns[f"f_{source}"] = position_frequency(histogram.counts(source), L)
        _write_columns_csv(out / f"position_frequency_L{L}.csv", columns)
        arrays.update({f"L{L}/{name}": values for name, values in columns.items()})
    np.savez_compressed(out / "position_frequency.npz", **arrays)
    summary = summarize(histogram, train_lens, budget_tokens)
    (out / "summary.json").write_text(json.dumps({"meta": meta, **summary}, indent=2) + "\n")
    if figures:
        _write_figures(out / "figures", histogram.counts(), train_lens, budget_tokens)
    return summary


def _write_length_csv(path: Path, histogram: LengthHistogram) -> None:
    """lengths.csv: every length that occurs, with its count overall and per source."""
    total = histogram.counts()
    per_source = {s: histogram.counts(s) for s in histogram.sources}
    with open(path, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["length", "documents"] + [f"documents_{s}" for s in per_source])
        for n in np.flatnonzero(total):
            writer.writerow([int(n), int(total[n])] + [int(h[n]) if n < h.size else 0 for h in per_source.values()])


def _write_columns_csv(path: Path, columns: dict[str, np.ndarray]) -> None:
    """A CSV with an index column i and one column per array."""
    with open(path, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["i", *columns])
        for i, row in enumerate(zip(*columns.values())):
            writer.writerow([i, *(v.item() if isinstance(v, np.generic) else v for v in row)])


def _write_figures(directory: Path, hist: np.ndarray, train_lens: Sequence[int], budget_tokens: float) -> None:
    """Fig. 1a/1b/1c for every L and Fig. 3 comparing all L at the same token budget."""
    from posfreq.analysis import plots

    for L in train_lens:
        pieces = piece_histogram(hist, L)
        f = position_frequency(hist, L)
        plots.plot_fig1a_length_and_frequency(pieces, f, L, directory / f"fig1a_L{L}")
        tokens = int(f[0])
        uniform = position_frequency(uniform_length_histogram(L), L)
        plots.plot_fig1b_uniform_lengths(scale_to_budget(uniform, tokens), L, directory / f"fig1b_L{L}")
        full = position_frequency(concatenated_histogram(1, L), L)
        plots.plot_fig1c_concatenated(scale_to_budget(full, tokens), L, directory / f"fig1c_L{L}")
    if len(train_lens) > 1:
        curves = {L: scale_to_budget(position_frequency(hist, L), budget_tokens) for L in train_lens}
        name = "fig3_" + "_vs_".join(f"L{L}" for L in train_lens)
        plots.plot_fig3_budget_comparison(curves, budget_tokens, directory / name)


# -------------------------------------------------------------------------------------- CLI


def _csv_list(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    p = argparse.ArgumentParser(
        prog="python analysis/position_freq.py",
        description="Document-length histogram of a corpus and the position frequency f(i) (Eq. 2).",
    )
    p.add_argument("--corpus", default="slimpajama", help="slimpajama, pg-essays, or a local file/dir")
    p.add_argument("--data-dir", help="SlimPajama root (default: $SLIMPAJAMA_DIR)")
    p.add_argument("--hf-dataset", help="with no local SlimPajama, stream this dataset with `datasets` "
                   "(e.g. cerebras/SlimPajama-627B; default: $SLIMPAJAMA_HF, else the hub is not tried)")
    p.add_argument("--split", default="train", help="SlimPajama split: train, validation, test")
    p.add_argument("--text-field", default="text", help="JSON key / Parquet column holding the text")
    p.add_argument("--sources", type=_csv_list, default=[], help="keep only these sources (comma-separated, "
                   "e.g. arxiv,book; the RedPajama prefix and case are optional)")
    p.add_argument("--exclude-sources", type=_csv_list, default=[], help="drop these sources, e.g. github")
    p.add_argument("--tokenizer", default="llama3", help="llama3 (exact ids), bytes, or hf:<dir>")
    p.add_argument("--train-len", type=int, nargs="+", default=[2048, 4096], help="training lengths L")
    p.add_argument("--budget-tokens", type=float, default=1e12, help="token budget for scaled f (Fig. 3)")
    p.add_argument("--workers", type=int, default=default_workers(), help="processes (default: all cores)")
    p.add_argument("--max-docs", type=int, help="quick estimate: about this many documents, spread over the files")
    p.add_argument("--sample-files", type=int, help="quick estimate: this many evenly spaced files")
    p.add_argument("--on-error", choices=["raise", "skip"], default="raise", help="bad input: stop, or count and skip")
    p.add_argument("--shard", type=parse_shard, help="i/n: count shard i of n only and write a partial histogram")
    p.add_argument("--merge", nargs="+", type=Path, metavar="PART",
                   help="sum partial histograms (histogram.npz files or their directories) instead of counting")
    p.add_argument("--out", type=Path, help="output directory (default runs/position_freq/<corpus>)")
    p.add_argument("--no-cache", action="store_true", help="recount even when a cached histogram matches")
    p.add_argument("--no-figures", action="store_true", help="skip the PNG/PDF figures")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def merge_partials(parts: Iterable[Path]) -> tuple[LengthHistogram, dict]:
    """Sum shard histograms after checking they share settings and cover shards 0..n-1 exactly once."""
    paths = [p / "histogram.npz" if p.is_dir() else p for p in parts]
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
    meta = {"corpus": metas[0]["corpus"], "files": sum(m["files"] for m in metas), "settings": metas[0]["settings"],
            "merged_shards": count, "read": asdict(read)}
    return histogram, meta


def main(argv: Sequence[str] | None = None) -> int:
    """Count (or merge), then write outputs and print the summary."""
    args = build_parser().parse_args(argv)
    bad = [L for L in args.train_len if L < 2]
    if bad:
        raise SystemExit(f"--train-len must be >= 2, got {bad}")
    try:
        if args.merge:
            histogram, meta = merge_partials(args.merge)
        else:
            histogram, meta = _count(args)
            if args.shard:
                out = args.out or Path("runs/position_freq") / f"shard_{args.shard[0]}"
                save_histogram(out / "histogram.npz", histogram, meta)
                print(f"shard {args.shard[0]}/{args.shard[1]}: {meta['read']['documents']:,} documents "
                      f"from {meta['files']} files ({meta['read']['skipped']:,} bad items skipped) -> "
                      f"{out / 'histogram.npz'}")
                where = f"{out / 'histogram.npz'} meta.read.lost_files"
                for line in lost_files_report(meta["read"]["lost_files"], where):
                    print(line)
                return 0
        if not histogram.counts().any():
            read = meta.get("read", {})
            raise CorpusError(
                f"corpus {meta['corpus']}: no documents ({meta['files']} files; {read.get('filtered', 0)} "
                f"filtered by source, {read.get('skipped', 0)} bad items skipped). Check --sources/--split."
            )
    except CorpusError as err:
        raise SystemExit(f"error: {err}") from None
    out = args.out or Path("runs/position_freq") / Path(meta["corpus"]).name
    summary = write_outputs(out, histogram, meta, args.train_len, args.budget_tokens, figures=not args.no_figures)
    print(format_summary(summary, meta))
    print(f"outputs in {out}/ (summary.json, histogram.npz, lengths.csv, position_frequency*, figures/)")
    return 0


def _count(args: argparse.Namespace) -> tuple[LengthHistogram, dict]:
    """Resolve the corpus from the arguments and count (or load from the cache) its histogram."""
    sources = list(args.sources) + [f"-{s}" for s in args.exclude_sources]
    corpus = resolve_corpus(args.corpus, args.data_dir, args.split, args.text_field, sources, args.hf_dataset)
    corpus = corpus.sample_files(args.sample_files)
    if args.shard:
        corpus = corpus.shard(*args.shard)
    per_file = None if args.max_docs is None else max(1, -(-args.max_docs // max(1, len(corpus.files))))
    settings = CountSettings(args.tokenizer, args.text_field, corpus.sources, corpus.default_source,
                             per_file, args.on_error)
    histogram, meta = cached_count(corpus, settings, args.workers, not args.no_cache, not args.quiet)
    if args.shard:
        meta["shard"] = list(args.shard)
    return histogram, meta


if __name__ == "__main__":
    from posfreq.analysis.position_freq import main as _main  # one module identity for pickling in workers

    sys.exit(_main())

"""Tokenizing a corpus into memory-mapped token shards, one shard per input file (`posfreq prepare`).

The corpus options (--corpus, --data-dir, --sources, --exclude-sources, --tokenizer, --workers,
--shard, --on-error, ...) are those of `posfreq analyze` (train/data/corpus_cli.py); `--config FILE.yaml`
reads them from YAML and `--print-config` prints them.

Each document becomes its tokens followed by EOS. A shard is named after its input file's
path relative to the corpus's common root (``train/chunk1/example_train_0.jsonl.zst`` ->
``train__chunk1__example_train_0``), or for a streamed dataset after its shard
(``train__shard_00042_of_59166``), so names do not depend on --shard or --workers.
Shards are written under temporary names and renamed when complete; a rerun skips the
complete ones (same source bytes by size and sha256, or stream revision, and the same tokenizer by
content; the finished inputs are read again for that, --workers at once) and redoes the rest, so the job is
restartable
file by file. A complete shard made from another input (another path and other bytes) is refused, never replaced. ``--shard i/n`` takes files i, i+n, i+2n, ... (0-based), for a SLURM job array.

A job that would write no document at all (every record filtered out, blank files) is refused, naming what was
read and what removed it, and keeps no empty shard; one ``--shard i/n`` task of several only warns, as its partners
may have documents. A ``--sources``/``--exclude-sources`` name that matches no document read is warned about (not
refused: one task's files may lack a source the corpus has), and a shard made under another filter or
``--text-field`` is redone.

Bad input stops the job with an ``error:`` line naming the file and line (exit status 1). With
``--on-error skip`` bad records are counted instead: each shard's NAME.json records ``skipped_items``,
the first messages (``skipped_errors``) and the input files cut short (``lost_files``: truncated or
corrupt ``.zst``, corrupt Parquet row groups, empty files); the summary line repeats them, and a rerun
redoes every shard that lost data.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from posfreq.train.data.corpora import Corpus, CorpusFile, SourceFilter, check_out_apart
from posfreq.train.data.formats import SUFFIXES
from posfreq.train.data.records import CorpusError, ReadStats, lost_files_report
from posfreq.train.data.stream import StreamShard
from posfreq.train.data.tokenizer import Tokenizer, get_tokenizer
from posfreq.train.data.tokens.rerun import (
    PREPARE,
    VAL_DIR,
    holds_only_shards,
    moved_tokenizer,
    pending_files,
    source_identity,
)
from posfreq.train.data.tokens.shard_files import (
    META_SUFFIX,
    OFFSETS_SUFFIX,
    TOKENS_SUFFIX,
    ShardWriter,
    shard_is_complete,
    write_shard_meta,
)
from posfreq.train.data.tokens.shards import MANIFEST_FILE, write_manifest
from posfreq.train.outdir import claim_output_dir
from posfreq.train.progress import progress_bar

BATCH_CHARS = 4 << 20  # tokenize this many characters of text at a time


def shard_names(files: tuple[CorpusFile, ...]) -> dict[CorpusFile, str]:
    """A stable, unique shard name per input file: its path under the common root, flattened."""
    names: dict[CorpusFile, str] = {f: f.shard_name for f in files if isinstance(f, StreamShard)}
    local = [f for f in files if not isinstance(f, StreamShard)]
    paths = [f.resolve() for f in local]
    root = (
        Path(os.path.commonpath(paths))
        if len(paths) > 1
        else (paths[0].parent if paths else Path())
    )
    for file, path in zip(local, paths):
        rel = str(path.relative_to(root))
        suffix = next((s for s in SUFFIXES if rel.endswith(s)), "")
        stem = rel[: len(rel) - len(suffix)] if suffix else rel
        names[file] = (
            re.sub(r"[^A-Za-z0-9._-]+", "_", stem.replace(os.sep, "__")).strip(".") or "shard"
        )
    seen: dict[str, CorpusFile] = {}
    for file, name in names.items():
        if name in seen:
            raise ValueError(
                f"input files {seen[name]} and {file} would both be written to shard {name!r}; "
                "rename one of them or tokenize them into separate --out directories"
            )
        seen[name] = file
    return names


def _init_worker(tokenizer_spec: str) -> None:
    """Build the tokenizer once per worker process."""
    global _worker_tokenizer
    _worker_tokenizer = get_tokenizer(tokenizer_spec)


def held_out(text: str, fraction: float) -> bool:
    """Whether a document goes to the validation shards: decided by a hash of its text, so the split is the same
    for any --shard, --workers or file order, and a document is never in both."""
    return (
        fraction > 0
        and int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") < fraction * 2**64
    )


def remove_shard_leftovers(out: Path, name: str, val_fraction: float) -> None:
    """Before shard `name` is (re)written: delete the temporaries an interrupted write of it left (atomic writes
    use unique hidden names, which no rerun would overwrite), and, when no documents are held out now, its
    validation shard from an earlier --val-fraction (else those documents would be in both splits)."""
    for directory in (out, out / VAL_DIR):
        for temporary in directory.glob(f".{name}.*.tmp"):
            temporary.unlink(missing_ok=True)
    if val_fraction == 0:
        for suffix in (
            META_SUFFIX,
            TOKENS_SUFFIX,
            OFFSETS_SUFFIX,
        ):  # metadata first: never a complete-looking shard
            (out / VAL_DIR / f"{name}{suffix}").unlink(missing_ok=True)


def tokenize_file(
    corpus: Corpus,
    file: CorpusFile,
    name: str,
    out: Path,
    tokenizer: Tokenizer,
    on_error: str = "raise",
    val_fraction: float = 0.0,
) -> dict:
    """Tokenize one input file into shard `name` under `out` (atomically), and its held-out documents into shard
    `name` under `out/val` when val_fraction > 0; returns the training shard's metadata."""
    stats = ReadStats()
    extra = {
        **source_identity(file),
        "tokenizer_fingerprint": tokenizer.fingerprint,  # the tokenizer by content, for a resume to compare
        "corpus": corpus.name,
        "text_field": corpus.text_field,
        "sources": list(corpus.sources),
        "val_fraction": val_fraction,
    }
    eos = np.array([tokenizer.eos_id], dtype=np.int64)
    spec = dict(
        tokenizer=tokenizer.name,
        vocab_size=tokenizer.vocab_size,
        eos_id=tokenizer.eos_id,
        extra=extra,
    )
    remove_shard_leftovers(out, name, val_fraction)
    with ExitStack() as stack:
        writers = [stack.enter_context(ShardWriter(out, name, **spec))]
        if val_fraction > 0:
            writers.append(stack.enter_context(ShardWriter(out / VAL_DIR, name, **spec)))
        batches: list[list[str]] = [[] for _ in writers]
        size = 0

        def flush() -> None:
            for writer, texts in zip(writers, batches):
                writer.add_many(np.concatenate([ids, eos]) for ids in tokenizer.encode_batch(texts))
                texts.clear()

        for doc in corpus.iter_documents(file, on_error=on_error, stats=stats):
            batches[held_out(doc.text, val_fraction)].append(doc.text)
            size += len(doc.text)
            if size >= BATCH_CHARS:
                flush()
                size = 0
        flush()
        for writer in writers:
            writer.meta.update(
                skipped_items=stats.skipped,
                filtered_items=stats.filtered,
                skipped_errors=stats.errors,
                lost_files=stats.lost_files,
                source_counts=stats.sources,  # documents per source before the filter (when one is set)
            )
    writers[0].meta["val_docs"] = writers[1].meta["num_docs"] if val_fraction > 0 else 0
    return writers[0].meta


def _tokenize_in_worker(
    corpus: Corpus, file: CorpusFile, name: str, out: Path, on_error: str, val_fraction: float
) -> dict:
    """`tokenize_file` with this worker process's tokenizer (built once by `_init_worker`)."""
    assert _worker_tokenizer is not None
    return tokenize_file(corpus, file, name, out, _worker_tokenizer, on_error, val_fraction)


@dataclass
class PrepareTotals:
    """What one `posfreq prepare` task read and wrote, for its summary line and its refusals."""

    files: int
    skipped_complete: int
    docs: int = 0
    tokens: int = 0
    val_docs: int = 0
    skipped_items: int = 0
    lost_files: list = field(default_factory=list)
    filtered_items: int = 0
    """Over every file of this task, complete ones included, as are the next two."""
    docs_in_out: int = 0
    source_counts: dict[str, int] | None = field(default_factory=dict)
    """Documents per source before the filter; None when a complete shard did not record its own."""
    relabelled: list[str] = field(default_factory=list)
    """Complete shards whose tokenizer folder had moved: the same files by content, now recorded at its new path."""

    def count_read(self, meta: dict) -> None:
        """Add one shard's documents (kept and filtered) and its sources."""
        self.docs_in_out += meta["num_docs"] + meta.get("val_docs", 0)
        self.filtered_items += meta.get("filtered_items", 0)
        counts = meta.get("source_counts")
        if counts is None or self.source_counts is None:
            self.source_counts = None
            return
        for source, n in counts.items():
            self.source_counts[source] = self.source_counts.get(source, 0) + n

    def count_written(self, meta: dict) -> None:
        """Add one shard this task wrote: its tokens, held-out and skipped records, and what it read."""
        self.docs += meta["num_docs"]
        self.tokens += meta["num_tokens"]
        self.val_docs += meta["val_docs"]
        self.skipped_items += meta["skipped_items"]
        self.lost_files += meta["lost_files"]
        self.count_read(meta)


def drop_manifests(out: Path) -> None:
    """Remove the manifests of --out and its val folder before their shards change: until every shard is complete
    again, readers scan the shards, not a manifest of what they were."""
    for directory in (out, out / VAL_DIR):
        (directory / MANIFEST_FILE).unlink(missing_ok=True)


def _claim_val(out: Path) -> None:
    """Claim OUT/val, the held-out shards' folder, for prepare (shared by array tasks)."""
    claim_output_dir(
        out / VAL_DIR, PREPARE, flag="--out's val", written_before=holds_only_shards, shared=True
    )


def prepare(
    corpus: Corpus,
    out: Path,
    tokenizer_spec: str = "llama3",
    workers: int = 1,
    shard: tuple[int, int] = (0, 1),
    on_error: str = "raise",
    progress: bool = True,
    val_fraction: float = 0.0,
) -> PrepareTotals:
    """Tokenize this shard's files of `corpus` into `out` (held-out documents into `out/val`); returns counts for
    the summary line."""
    names = shard_names(
        corpus.files
    )  # from the full file list, so names are independent of --shard
    mine = corpus.shard(*shard)
    check_out_apart(corpus, out)
    tokenizer = get_tokenizer(tokenizer_spec)
    directories = (out, out / VAL_DIR) if val_fraction > 0 else (out,)
    claim_output_dir(out, PREPARE, flag="--out", written_before=holds_only_shards, shared=True)
    # a held-out folder that exists is claimed (or refused) before the inputs are hashed again; a new one only after
    # the shards' refusals (another tokenizer's, another input's), so that a refusal leaves none behind
    val_now = val_fraction > 0 and (out / VAL_DIR).exists()
    if val_now:
        _claim_val(out)
    todo = pending_files(mine, names, out, tokenizer, val_fraction, workers)
    if val_fraction > 0 and not val_now:
        _claim_val(out)
    totals = PrepareTotals(files=len(mine.files), skipped_complete=len(mine.files) - len(todo))
    pending = set(todo)
    for file in (
        f for f in mine.files if f not in pending
    ):  # complete: NAME.json and its val shard count, and its tokenizer's path if the folder moved
        meta = shard_is_complete(out, names[file])
        val = shard_is_complete(out / VAL_DIR, names[file]) if val_fraction > 0 else None
        for directory, shard_meta in ((out, meta), (out / VAL_DIR, val)):
            if shard_meta is not None and moved_tokenizer(shard_meta, tokenizer):
                drop_manifests(out)  # first: a crash mid-relabel leaves no manifest of the old spec
                write_shard_meta(directory, names[file], shard_meta | {"tokenizer": tokenizer.name})
                totals.relabelled.append(str(directory / names[file]))
        totals.count_read(
            dict(meta or {"num_docs": 0}) | {"val_docs": val["num_docs"] if val else 0}
        )
    if todo:
        drop_manifests(out)
    with progress_bar(
        total=len(todo), unit="file", desc=f"tokenize {corpus.name} -> {out}", disable=not progress
    ) as bar:
        jobs = [(file, names[file]) for file in todo]
        for meta in tokenized(
            mine, jobs, out, tokenizer, tokenizer_spec, workers, on_error, val_fraction
        ):
            totals.count_written(meta)
            bar.update(1)
            bar.set_postfix(tokens=f"{totals.tokens:,}")
    if totals.docs_in_out == 0 and shard[1] == 1:
        for file in todo:  # every shard this run wrote is empty: none is kept to look complete
            for directory in (out, out / VAL_DIR):
                for suffix in (META_SUFFIX, TOKENS_SUFFIX, OFFSETS_SUFFIX):
                    (directory / f"{names[file]}{suffix}").unlink(missing_ok=True)
        raise CorpusError(no_documents(mine, totals))
    for directory in directories:
        if _all_shards_present(
            directory, names.values()
        ):  # the last array task to finish writes it
            write_manifest(directory)
    return totals


def tokenized(
    corpus: Corpus,
    todo: list[tuple[CorpusFile, str]],
    out: Path,
    tokenizer: Tokenizer,
    tokenizer_spec: str,
    workers: int,
    on_error: str,
    val_fraction: float,
) -> Iterator[dict]:
    """Tokenize each (file, shard name) of `todo` into its shard, here with `tokenizer` or in `workers` processes
    (each builds its own from `tokenizer_spec`), and yield each shard's metadata as it is finished."""
    if workers <= 1:
        for file, name in todo:
            yield tokenize_file(corpus, file, name, out, tokenizer, on_error, val_fraction)
        return
    with ProcessPoolExecutor(workers, initializer=_init_worker, initargs=(tokenizer_spec,)) as pool:
        futures = [
            pool.submit(_tokenize_in_worker, corpus, file, name, out, on_error, val_fraction)
            for file, name in todo
        ]
        for future in as_completed(futures):
            yield future.result()


def _all_shards_present(directory: Path, names) -> bool:
    """Whether `directory` holds the three files of every shard in `names` (one listing)."""
    if not directory.is_dir():
        return False
    with os.scandir(directory) as entries:
        listed = {e.name for e in entries}
    suffixes = (META_SUFFIX, TOKENS_SUFFIX, OFFSETS_SUFFIX)
    return all(f"{name}{suffix}" in listed for name in names for suffix in suffixes)


def no_documents(corpus: Corpus, totals: PrepareTotals) -> str:
    """Why a prepare job has no document to write: what was read and what removed it."""
    read = totals.docs_in_out + totals.filtered_items + totals.skipped_items
    seen = totals.source_counts
    by_source = (
        f" (documents by source: {', '.join(f'{s} ({n:,})' for s, n in sorted(seen.items()))})"
        if seen
        else ""
    )
    keep = SourceFilter(corpus.sources)
    parts = [f"{totals.files} files, {read:,} records read"]
    if keep:
        parts.append(
            f"{totals.filtered_items:,} removed by the source filter ({keep.flags()}){by_source}"
        )
    parts.append(f"{totals.skipped_items:,} bad records skipped")
    return (
        f"corpus {corpus.name}: no documents to write ({', '.join(parts)}). Fix: check "
        "--sources/--exclude-sources, --text-field and --split, or that the files hold records; no shard "
        "was kept"
    )


def skip_report(totals: PrepareTotals, out: Path) -> list[str]:
    """Lines saying how many bad records were skipped, which files were cut short, and where both are recorded."""
    lines = []
    if totals.skipped_items:
        lines.append(
            f"skipped {totals.skipped_items:,} bad records (--on-error skip); recorded per shard as "
            f"skipped_items and skipped_errors in {out}/NAME.json"
        )
    where = f"lost_files in {out}/NAME.json; a rerun redoes these shards"
    return lines + lost_files_report(totals.lost_files, where)

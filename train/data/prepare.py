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
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from posfreq.train.data.corpora import Corpus, CorpusFile, SourceFilter, check_out_apart
from posfreq.train.data.formats import SUFFIXES
from posfreq.train.data.records import CorpusError, ReadStats, lost_files_report
from posfreq.train.data.shards import (
    MANIFEST_FILE,
    META_SUFFIX,
    OFFSETS_SUFFIX,
    TOKENS_SUFFIX,
    ShardWriter,
    shard_is_complete,
    write_manifest,
)
from posfreq.train.data.stream import StreamShard
from posfreq.train.data.tokenizer import Tokenizer, get_tokenizer, hf_dir
from posfreq.train.fingerprint import file_sha256
from posfreq.train.journal import is_record
from posfreq.train.outdir import OutputDirError, claim_output_dir, owner_of
from posfreq.train.progress import progress_bar

BATCH_CHARS = 4 << 20  # tokenize this many characters of text at a time


VAL_DIR = "val"  # held-out documents' shards, under --out (the trainer's data.val_dir)


PREPARE = "prepare"  # the command that owns --out (train/outdir.py)


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


def source_identity(file: CorpusFile, hash_content: bool = True) -> dict:
    """What pins an input's content: path, size (and sha256) of a file; dataset shard and revision of a stream."""
    if isinstance(file, StreamShard):
        return {"source": str(file), "source_revision": file.revision}
    identity = {"source": str(file.resolve()), "source_size": file.stat().st_size}
    return identity | ({"source_sha256": file_sha256(file)} if hash_content else {})


def held_out(text: str, fraction: float) -> bool:
    """Whether a document goes to the validation shards: decided by a hash of its text, so the split is the same
    for any --shard, --workers or file order, and a document is never in both."""
    return (
        fraction > 0
        and int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") < fraction * 2**64
    )


def holds_only_shards(out: Path) -> bool:
    """Whether `out` (unmarked: written before owners were recorded) holds only token shards, their temporaries and
    a val folder of the same: an earlier `posfreq prepare`'s output, which a rerun resumes. A .json counts only
    beside its shard's tokens."""

    def is_shard_file(entry: Path) -> bool:
        name = entry.name
        if (
            name.endswith((TOKENS_SUFFIX, OFFSETS_SUFFIX))
            or name == MANIFEST_FILE
            or (name.startswith(".") and name.endswith(".tmp"))
        ):
            return True
        stem = name.removesuffix(META_SUFFIX)
        return name.endswith(META_SUFFIX) and (entry.parent / f"{stem}{TOKENS_SUFFIX}").is_file()

    return all(
        (entry.is_file() and (is_shard_file(entry) or is_record(entry.name)))
        or (
            entry.name == VAL_DIR
            and entry.is_dir()
            and (owner_of(entry) == PREPARE or holds_only_shards(entry))
        )
        for entry in out.iterdir()
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


def pending_files(
    corpus: Corpus,
    names: dict[CorpusFile, str],
    out: Path,
    tokenizer: Tokenizer,
    val_fraction: float = 0.0,
    workers: int = 1,
) -> list[CorpusFile]:
    """Files whose shard (and validation shard) is not complete yet, was split with another --val-fraction, or lost
    data to a bad input file (it may have been fetched again); refuses an --out tokenized with another tokenizer.
    Each finished input is hashed again to see that it is the same: `workers` threads read them at once (a
    SlimPajama task's thousand inputs are gigabytes)."""

    def pending(file: CorpusFile) -> bool:
        return _is_pending(corpus, file, names[file], out, tokenizer, val_fraction)

    # results, and the first refusal, in file order
    with ThreadPoolExecutor(max(1, workers)) as pool:
        return [file for file, todo in zip(corpus.files, pool.map(pending, corpus.files)) if todo]


def _is_pending(
    corpus: Corpus,
    file: CorpusFile,
    name: str,
    out: Path,
    tokenizer: Tokenizer,
    val_fraction: float,
) -> bool:
    """Whether `file`'s shard is to be made (again); OutputDirError for a shard that is another input's or another
    tokenizer's."""
    meta = shard_is_complete(out, name)
    recorded = other_source(meta, file) if meta is not None else None
    if recorded is not None:
        raise OutputDirError(
            f"{out}/{name} holds the tokens of {recorded}, not of {source_identity(file, False)['source']}, "
            f"which would replace them: both inputs take the shard name {name!r}. Fix: tokenize each "
            f"corpus into its own --out, or delete {out}/{name}.* (and {out}/{VAL_DIR}/{name}.*) "
            "to replace that shard"
        )
    if meta is not None and (
        meta.get("val_fraction", 0.0) != val_fraction
        or list(meta.get("sources", [])) != list(corpus.sources)  # another filter: other documents
        or meta.get("text_field", "text") != corpus.text_field
        or (val_fraction > 0 and shard_is_complete(out / VAL_DIR, name) is None)
    ):
        meta = None
    recorded = meta.get("tokenizer_fingerprint") if meta is not None else None
    if meta is not None and (
        absolute_spec(str(meta.get("tokenizer"))) != tokenizer.name
        or (recorded is not None and recorded != tokenizer.fingerprint)
    ):
        raise OutputDirError(
            f"{out}/{name} was tokenized with {meta.get('tokenizer')!r}"
            + (" whose files have changed since" if meta.get("tokenizer") == tokenizer.name else "")
            + f", not {tokenizer.name!r} as it is now. Fix: use a fresh --out directory per tokenizer."
        )
    return meta is None or bool(meta.get("lost_files")) or not same_source(meta, file)


def absolute_spec(spec: str) -> str:
    """A tokenizer spec with an hf:DIR made absolute (older shards recorded the folder as prepare was given it)."""
    directory = hf_dir(spec)
    return spec if directory is None else f"hf:{directory.resolve()}"


def other_source(meta: dict, file: CorpusFile) -> str | None:
    """The input a complete shard was made from when that is another input than `file`: another path (or stream
    shard) and, for a file, other bytes. None when it is `file` (its content may have changed since: redone), the
    same bytes moved or copied (sha256 equal), or the shard recorded no source."""
    recorded = meta.get("source")
    if recorded is None or recorded == source_identity(file, hash_content=False)["source"]:
        return None
    if not isinstance(file, StreamShard) and "source_sha256" in meta and same_source(meta, file):
        return None
    return str(recorded)


def same_source(meta: dict, file: CorpusFile) -> bool:
    """Whether a shard's recorded source is still `file`'s content: size first (cheap), then its sha256 where
    the shard recorded one (a same-size edit is another input)."""
    cheap = source_identity(file, hash_content=False)
    if any(meta.get(key) != value for key, value in cheap.items() if key != "source"):
        return False
    return (
        "source_sha256" not in meta
        or source_identity(file)["source_sha256"] == meta["source_sha256"]
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
) -> dict:
    """Tokenize this shard's files of `corpus` into `out` (held-out documents into `out/val`); returns counts for
    the summary line."""
    names = shard_names(
        corpus.files
    )  # from the full file list, so names are independent of --shard
    mine = corpus.shard(*shard)
    check_out_apart(corpus, out)
    tokenizer = get_tokenizer(tokenizer_spec)
    claim_output_dir(out, PREPARE, written_before=holds_only_shards, shared=True)
    if val_fraction > 0:
        claim_output_dir(
            out / VAL_DIR,
            PREPARE,
            flag="--out's val",
            written_before=holds_only_shards,
            shared=True,
        )
    todo = pending_files(mine, names, out, tokenizer, val_fraction, workers)
    if (
        todo
    ):  # the shards change: until all are complete again, readers scan them, not an older manifest
        for directory in (out, out / VAL_DIR):
            (directory / MANIFEST_FILE).unlink(missing_ok=True)
    totals = {
        "files": len(mine.files),
        "skipped_complete": len(mine.files) - len(todo),
        "docs": 0,
        "tokens": 0,
        "val_docs": 0,
        "skipped_items": 0,
        "lost_files": [],
        "filtered_items": 0,  # these and the next: over every file of this task, complete ones included
        "docs_in_out": 0,
        "source_counts": {},  # None when a complete shard did not record its own
    }
    pending = set(todo)

    def count_read(meta: dict) -> None:
        """Add one shard's documents (kept and filtered) and its sources to the task's totals."""
        totals["docs_in_out"] += meta["num_docs"] + meta.get("val_docs", 0)
        totals["filtered_items"] += meta.get("filtered_items", 0)
        counts = meta.get("source_counts")
        if counts is None or totals["source_counts"] is None:
            totals["source_counts"] = None
            return
        for source, n in counts.items():
            totals["source_counts"][source] = totals["source_counts"].get(source, 0) + n

    for file in mine.files:
        if (
            file not in pending
        ):  # complete: its NAME.json has the counts, its val shard the held-out documents
            meta = dict(shard_is_complete(out, names[file]) or {"num_docs": 0})
            val = shard_is_complete(out / VAL_DIR, names[file]) if val_fraction > 0 else None
            count_read(meta | {"val_docs": val["num_docs"] if val else 0})
    bar = progress_bar(
        total=len(todo), unit="file", desc=f"tokenize {corpus.name} -> {out}", disable=not progress
    )

    def done(meta: dict) -> None:
        """Add one finished shard's counts to the totals and the progress bar."""
        totals["docs"] += meta["num_docs"]
        totals["tokens"] += meta["num_tokens"]
        totals["val_docs"] += meta["val_docs"]
        totals["skipped_items"] += meta["skipped_items"]
        totals["lost_files"] += meta["lost_files"]
        count_read(meta)
        bar.update(1)
        bar.set_postfix(tokens=f"{totals['tokens']:,}")

    if workers <= 1:
        for file in todo:
            done(tokenize_file(mine, file, names[file], out, tokenizer, on_error, val_fraction))
    else:
        with ProcessPoolExecutor(
            workers, initializer=_init_worker, initargs=(tokenizer_spec,)
        ) as pool:
            futures = [
                pool.submit(_tokenize_in_worker, mine, f, names[f], out, on_error, val_fraction)
                for f in todo
            ]
            for future in as_completed(futures):
                done(future.result())
    bar.close()
    if totals["docs_in_out"] == 0 and shard[1] == 1:
        for file in todo:  # every shard this run wrote is empty: none is kept to look complete
            for directory in (out, out / VAL_DIR):
                for suffix in (META_SUFFIX, TOKENS_SUFFIX, OFFSETS_SUFFIX):
                    (directory / f"{names[file]}{suffix}").unlink(missing_ok=True)
        raise CorpusError(no_documents(mine, totals))
    for directory in (out, out / VAL_DIR) if val_fraction > 0 else (out,):
        if _all_shards_present(
            directory, names.values()
        ):  # the last array task to finish writes it
            write_manifest(directory)
    return totals


def _all_shards_present(directory: Path, names) -> bool:
    """Whether `directory` holds the three files of every shard in `names` (one listing)."""
    if not directory.is_dir():
        return False
    with os.scandir(directory) as entries:
        listed = {e.name for e in entries}
    suffixes = (META_SUFFIX, TOKENS_SUFFIX, OFFSETS_SUFFIX)
    return all(f"{name}{suffix}" in listed for name in names for suffix in suffixes)


def no_documents(corpus: Corpus, totals: dict) -> str:
    """Why a prepare job has no document to write: what was read and what removed it."""
    read = totals["docs_in_out"] + totals["filtered_items"] + totals["skipped_items"]
    seen = totals["source_counts"]
    by_source = (
        f" (documents by source: {', '.join(f'{s} ({n:,})' for s, n in sorted(seen.items()))})"
        if seen
        else ""
    )
    keep = SourceFilter(corpus.sources)
    parts = [f"{totals['files']} files, {read:,} records read"]
    if keep:
        parts.append(
            f"{totals['filtered_items']:,} removed by the source filter ({keep.flags()}){by_source}"
        )
    parts.append(f"{totals['skipped_items']:,} bad records skipped")
    return (
        f"corpus {corpus.name}: no documents to write ({', '.join(parts)}). Fix: check "
        "--sources/--exclude-sources, --text-field and --split, or that the files hold records; no shard "
        "was kept"
    )


def skip_report(totals: dict, out: Path) -> list[str]:
    """Lines saying how many bad records were skipped, which files were cut short, and where both are recorded."""
    lines = []
    if totals["skipped_items"]:
        lines.append(
            f"skipped {totals['skipped_items']:,} bad records (--on-error skip); recorded per shard as "
            f"skipped_items and skipped_errors in {out}/NAME.json"
        )
    where = f"lost_files in {out}/NAME.json; a rerun redoes these shards"
    return lines + lost_files_report(totals["lost_files"], where)

"""What a rerun of `posfreq prepare` keeps: the --out it resumes (its own, or an older one holding only shards),
and which inputs are still to tokenize (a shard incomplete, split otherwise, cut short, or made from other
bytes); a shard of another input or another tokenizer is refused, never replaced."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from posfreq.train.data.corpora import Corpus, CorpusFile
from posfreq.train.data.stream import StreamShard
from posfreq.train.data.tokenizer import Tokenizer
from posfreq.train.data.tokens.shard_files import (
    META_SUFFIX,
    OFFSETS_SUFFIX,
    TOKENS_SUFFIX,
    shard_is_complete,
)
from posfreq.train.data.tokens.shards import MANIFEST_FILE, share_tokenizer
from posfreq.train.fingerprint import file_sha256
from posfreq.train.journal import is_record
from posfreq.train.outdir import OutputDirError, owner_of

VAL_DIR = "val"  # held-out documents' shards, under --out (the trainer's data.val_dir)


PREPARE = "prepare"  # the command that owns --out (train/outdir.py)


def source_identity(file: CorpusFile, hash_content: bool = True) -> dict:
    """What pins an input's content: path, size (and sha256) of a file; dataset shard and revision of a stream."""
    if isinstance(file, StreamShard):
        return {"source": str(file), "source_revision": file.revision}
    identity = {"source": str(file.resolve()), "source_size": file.stat().st_size}
    return identity | ({"source_sha256": file_sha256(file)} if hash_content else {})


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
    tokenizer's, even where a changed setting (--val-fraction, sources) would redo it."""
    meta = shard_is_complete(out, name)
    recorded = other_source(meta, file) if meta is not None else None
    if recorded is not None:
        raise OutputDirError(
            f"{out}/{name} holds the tokens of {recorded}, not of {source_identity(file, False)['source']}, "
            f"which would replace them: both inputs take the shard name {name!r}. Fix: tokenize each "
            f"corpus into its own --out, or delete {out}/{name}.* (and {out}/{VAL_DIR}/{name}.*) "
            "to replace that shard"
        )
    if meta is not None and not shard_holds_tokenizer(meta, tokenizer):
        raise OutputDirError(
            f"{out}/{name} was tokenized with {meta.get('tokenizer')!r}"
            + (" whose files have changed since" if meta.get("tokenizer") == tokenizer.name else "")
            + f", not {tokenizer.name!r} as it is now. Fix: use a fresh --out directory per tokenizer."
        )
    if meta is not None and (
        meta.get("val_fraction", 0.0) != val_fraction
        or list(meta.get("sources", [])) != list(corpus.sources)  # another filter: other documents
        or meta.get("text_field", "text") != corpus.text_field
        or (val_fraction > 0 and shard_is_complete(out / VAL_DIR, name) is None)
    ):
        meta = None
    return meta is None or bool(meta.get("lost_files")) or not same_source(meta, file)


def shard_holds_tokenizer(meta: dict, tokenizer: Tokenizer) -> bool:
    """Whether a shard was tokenized with `tokenizer`, by `share_tokenizer`'s rule (content where recorded)."""
    return share_tokenizer(
        meta,
        {
            "tokenizer": tokenizer.name,
            "tokenizer_fingerprint": tokenizer.fingerprint,
            "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id,
        },
    )


def moved_tokenizer(meta: dict, tokenizer: Tokenizer) -> bool:
    """Whether complete shard metadata `meta` holds `tokenizer` (`shard_holds_tokenizer`) under another spec (its
    folder moved, or an older shard's relative path): prepare's rerun then records `tokenizer`'s spec in it, so that
    a directory's shards keep naming one tokenizer and the trainer records a path that exists."""
    return meta.get("tokenizer") != tokenizer.name and shard_holds_tokenizer(meta, tokenizer)


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

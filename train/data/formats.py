"""The local file formats a corpus may hold: .txt, JSON lines (plain or .zst), a JSON array, Parquet.

Each reader yields ``(where, record)`` pairs (``where`` names the line, record or row), or a
`BadItem` where a record cannot be read, so bad input is reported with its place in the file.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Iterator

from posfreq.train.data.records import BadItem, CorpusError

READ_SIZE = 1 << 20


REFETCH = "Fix: download or copy this file again, or remove it."


def corpus_suffix(path: Path) -> str:
    """The supported suffix a file name ends with, or '' when none."""
    return next((s for s in SUFFIXES if path.name.endswith(s)), "")


def file_records(path: Path, text_field: str) -> Iterator[tuple[str, object]]:
    """The raw records of a local file, by its type."""
    suffix = corpus_suffix(path)
    if not suffix:
        raise CorpusError(f"{path}: unsupported file type; expected one of {', '.join(SUFFIXES)}")
    return READERS[suffix](path, text_field)


def _txt_records(path: Path, text_field: str) -> Iterator[tuple[str, object]]:
    """A .txt file is one document."""
    try:
        yield "line 1", {text_field: path.read_text(encoding="utf-8")}
    except UnicodeDecodeError as err:
        yield "line 1", BadItem(f"not UTF-8 text ({err})")


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
            BadItem(f"empty file (0 bytes), e.g. an interrupted download. {REFETCH}", True),
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
                BadItem(f"{err}; the rest of the file is unreadable. {REFETCH}", True),
            )


def _json_line(line: bytes) -> object:
    """One parsed JSON line, or why it is not one (a last line cut mid-way is reported as truncation)."""
    try:
        return json.loads(line)
    except (
        RecursionError
    ):  # a value nested deeper than Python's parser goes: one bad line, not a crash
        return BadItem("JSON nested too deeply to read (over Python's recursion limit)")
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        if not line.endswith(b"\n"):
            return BadItem(f"truncated file: its last line is cut off ({err}). {REFETCH}", True)
        return BadItem(
            f"{'not UTF-8 text' if isinstance(err, UnicodeDecodeError) else 'malformed JSON'} ({err})"
        )


def _json_array_records(stream: IO[bytes]) -> Iterator[tuple[str, object]]:
    """The records of a .json file holding one array of objects."""
    try:
        records = json.loads(stream.read())
    except RecursionError:
        yield "line 1", BadItem("JSON nested too deeply to read; the file is unreadable", True)
        return
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        yield (
            f"line {getattr(err, 'lineno', 1)}",
            BadItem(f"malformed JSON ({err}); the file is unreadable", True),
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
        yield "row 0", BadItem(f"unreadable Parquet file ({err})", True)
        return
    names = set(parquet.schema_arrow.names)
    if text_field not in names:
        yield (
            "row 0",
            BadItem(
                f"no column {text_field!r} (columns: {', '.join(sorted(names))}); set --text-field",
                True,
            ),
        )
        return
    columns = [c for c in (text_field, "meta", "source") if c in names]
    row, groups = 0, parquet.num_row_groups
    for group in range(
        groups
    ):  # group by group, so a corrupt one (snappy data, page headers, ...) is named
        batches = parquet.iter_batches(batch_size=4096, row_groups=[group], columns=columns)
        while True:
            try:
                batch = next(batches, None)
                records = [] if batch is None else batch.to_pylist()
            except (pyarrow.ArrowException, OSError) as err:
                first = sum(parquet.metadata.row_group(g).num_rows for g in range(group))
                size = parquet.metadata.row_group(group).num_rows
                reason = " ".join(f"{type(err).__name__}: {err}".split()).rstrip(".")
                yield (
                    f"row {row}",
                    BadItem(
                        f"corrupt Parquet data in row group {group} (0-based, of {groups}; rows "
                        f"{first}..{first + size - 1}): {reason}; the rest of the file is unreadable. "
                        f"{REFETCH}",
                        True,
                    ),
                )
                return
            if batch is None:
                break
            for record in records:
                yield f"row {row}", record
                row += 1


READERS: dict[str, Callable[[Path, str], Iterator[tuple[str, object]]]] = {
    ".jsonl.zst": lambda path, text_field: _json_records(path, ".jsonl.zst"),
    ".jsonl": lambda path, text_field: _json_records(path, ".jsonl"),
    ".json": lambda path, text_field: _json_records(path, ".json"),
    ".parquet": _parquet_records,
    ".txt": _txt_records,
}
"""Each supported file suffix and its reader of (where, record) pairs: a new format is one entry here and its
reader. Longer suffixes first (.jsonl.zst before .jsonl)."""
SUFFIXES = tuple(READERS)


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

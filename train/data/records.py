"""What reading a corpus yields: `Document`s, the `ReadStats` of what was dropped, and the errors.

A reader yields a `BadItem` for a record it cannot read; `iter_documents` raises it as a
`CorpusError` or counts it in `ReadStats`, as the caller asks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Sequence

MAX_ERRORS_KEPT = 20


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
    """What reading yielded and dropped: documents, source-filtered, skipped bad items, every file whose rest
    could not be read (each message names the file and where it stopped) and, when a source filter is set, the
    documents read per source before it (so a filter name that matches nothing can be reported)."""

    documents: int = 0
    filtered: int = 0
    skipped: int = 0
    errors: list[str] = field(default_factory=list)
    lost_files: list[str] = field(default_factory=list)
    sources: dict[str, int] = field(default_factory=dict)

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
        for source, count in other.sources.items():
            self.sources[source] = self.sources.get(source, 0) + count


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


@dataclass(frozen=True)
class BadItem:
    """A record that could not be read, with the reason; `rest_lost`: nothing after it in the file was read."""

    message: str
    rest_lost: bool = False

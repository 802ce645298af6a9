"""Progress bars that read well in a terminal and in a batch job's log: on a terminal, tqdm's bar; in a file (a
SLURM log, a redirect), the same bar's text as a whole line at most every LOG_EVERY_S seconds and once at the
end, never carriage returns that pile a job's whole history into one line."""

from __future__ import annotations

import sys
import time
from typing import IO, Any

from tqdm import tqdm

LOG_EVERY_S = 30.0
"""Seconds between two progress lines in a log file."""


class _LogLines:
    """A file for tqdm that turns its redraws into lines: the newest text is written when LOG_EVERY_S have passed
    since the last line, and on close, so the log has the start, a line per interval and the end."""

    def __init__(self, stream: IO[str], every_s: float) -> None:
        self.stream, self.every_s = stream, every_s
        self.pending: str | None = None
        self.last = -float("inf")

    def write(self, text: str) -> None:
        bar = text.strip("\r\n ")
        if bar:
            self.pending = bar
            if time.monotonic() - self.last >= self.every_s:
                self._emit()
        if "\n" in text:  # tqdm ends a closed bar with a newline: its final state is always written
            self._emit()

    def _emit(self) -> None:
        if self.pending:
            self.stream.write(self.pending + "\n")
            self.stream.flush()
            self.pending, self.last = None, time.monotonic()

    def flush(self) -> None:
        self.stream.flush()


def progress_bar(stream: IO[str] | None = None, **options: Any) -> tqdm:
    """A tqdm bar on `stream` (default stderr) with `options`: redrawn in place on a terminal, written as whole
    lines every LOG_EVERY_S seconds otherwise."""
    stream = stream or sys.stderr
    if stream.isatty():
        return tqdm(file=stream, **{"dynamic_ncols": True, **options})
    return tqdm(
        file=_LogLines(stream, LOG_EVERY_S), **{"ncols": 120, "mininterval": 1.0, **options}
    )

"""Progress bars that read well in a terminal and in a batch job's log: on a terminal (or in a notebook), tqdm's
bar; in a file (a SLURM log, a redirect), the same bar's text as a whole line at most every LOG_EVERY_S seconds
and once at the end, never carriage returns that pile a job's whole history into one line."""

from __future__ import annotations

import re
import sys
import time
from typing import IO, Any

from tqdm import tqdm

LOG_EVERY_S = 30.0
"""Seconds between two progress lines in a log file."""

_CURSOR_MOVES = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # tqdm's moves between nested bars


class _LogLines:
    """A file for tqdm that turns its redraws into lines: the newest text is written when LOG_EVERY_S have passed
    since the last line, and when the bar closes, so the log has the start, a line per interval and the end."""

    def __init__(self, stream: IO[str], every_s: float) -> None:
        self.stream, self.every_s = stream, every_s
        self.pending: str | None = None
        self.last = -float("inf")

    def write(self, text: str) -> None:
        bar = _CURSOR_MOVES.sub("", text).strip("\r\n ")
        if bar:
            self.pending = bar
            if time.monotonic() - self.last >= self.every_s:
                self.finish()

    def finish(self) -> None:
        """Write the newest state not written yet."""
        if self.pending:
            self.stream.write(self.pending + "\n")
            self.stream.flush()
            self.pending, self.last = None, time.monotonic()

    def flush(self) -> None:
        self.stream.flush()


class _LogBar(tqdm):
    """tqdm on _LogLines, whose last state it writes when it closes (with leave=False tqdm itself writes none)."""

    def __init__(self, lines: _LogLines, **options: Any) -> None:
        self._lines = lines
        super().__init__(file=lines, **{"ncols": 120, "mininterval": 1.0, **options})

    def close(self) -> None:
        # the state now, which tqdm draws on close only when the bar is left standing
        if not self.disable:
            self._lines.pending = _CURSOR_MOVES.sub("", str(self)).strip()
        super().close()
        self._lines.finish()


def _in_notebook() -> bool:
    """Whether this process is a running Jupyter kernel (as tqdm.autonotebook tells it: an IPython shell whose
    config has IPKernelApp), not merely one that imported IPython or ipykernel (a test of a notebook does)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


def progress_bar(stream: IO[str] | None = None, **options: Any) -> tqdm:
    """A tqdm bar on `stream` (default stderr) with `options`: redrawn in place on a terminal or in a notebook,
    written as whole lines every LOG_EVERY_S seconds otherwise."""
    stream = stream or sys.stderr
    if stream.isatty() or _in_notebook():
        from tqdm.auto import tqdm as auto

        return auto(file=stream, **{"dynamic_ncols": True, **options})
    return _LogBar(_LogLines(stream, LOG_EVERY_S), **options)

"""Output directories a command may write: new, empty, or already its own; never a user's.

A command claims its output directory with `claim_output_dir`, which records the command in
OWNER_FILE inside it. A directory that exists and holds anything without that record (a run, a
model someone downloaded, a paper) is refused with a line naming it and the fix, and nothing in it
is touched. A command replaces only what it wrote there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from posfreq.train.atomic import write_json_atomic

OWNER_FILE = ".posfreq-output.json"


class OutputDirError(ValueError):
    """An output directory the command does not own; the message names it and the fix."""


def owner_of(path: Path) -> str | None:
    """The command recorded as the owner of directory `path`, or None."""
    try:
        return json.loads((path / OWNER_FILE).read_text()).get("command")
    except (OSError, ValueError, AttributeError):
        return None


def check_output_dir(
    path: str | Path,
    command: str,
    flag: str = "--out",
    written_before: Callable[[Path], bool] | None = None,
) -> Path:
    """`path` if `command` may write there (absent, empty, or owned by `command`), else OutputDirError.

    `written_before(path)` recognises an unmarked directory an older posfreq's `command` wrote (before owners were
    recorded): it is marked as the command's own instead of refused.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputDirError(
            f"{flag} {path} is a file, not a directory. Fix: pass a directory (nothing was changed)"
        )
    if path.is_dir() and any(path.iterdir()) and owner_of(path) != command:
        if owner_of(path) is None and written_before is not None and written_before(path):
            _mark_owned(path, command)
            return path
        found = sorted(p.name for p in path.iterdir())
        shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
        raise OutputDirError(
            f"{flag} {path} holds files `posfreq {command}` did not write ({shown}). Fix: pass a "
            "new or empty directory (nothing was changed)"
        )
    return path


def claim_output_dir(
    path: str | Path,
    command: str,
    flag: str = "--out",
    written_before: Callable[[Path], bool] | None = None,
) -> Path:
    """Create (or reuse) `command`'s output directory `path`, recording the owner; OutputDirError for another's
    (`written_before` as in `check_output_dir`)."""
    path = check_output_dir(path, command, flag, written_before)
    path.mkdir(parents=True, exist_ok=True)
    if owner_of(path) != command:
        _mark_owned(path, command)
    return path


def entry_names(path: Path) -> set[str]:
    """The names of a directory's entries (what a `written_before` test usually looks at)."""
    return {p.name for p in path.iterdir()}


def _mark_owned(path: Path, command: str) -> None:
    write_json_atomic(path / OWNER_FILE, {"command": command})

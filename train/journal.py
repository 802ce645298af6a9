"""The record of what a command wrote into its output folder: the one mechanism every command's rerun trusts.

A claimed output folder (train/outdir.py) holds OWNER_FILE, naming the command, and JOURNAL_FILE, one line per
file or folder a posfreq command wrote there, appended *before* the file appears under its name (train/atomic.py
records every atomic write; a writer that appends records its file when it creates it). So a crash never leaves
a written file unrecorded, and two processes writing one folder (array jobs) only append. A rerun deletes or
replaces only what the journal names, inside the folder and never through a link; anything else there is a
user's, and the folder is refused (train/outdir.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
from pathlib import Path, PurePosixPath
from typing import IO, Iterator

OWNER_FILE = ".posfreq-output.json"
JOURNAL_FILE = ".posfreq-files"
LOCK_FILE = ".posfreq-lock"
"""Held (flock) by the process writing the folder, when its command writes alone (train/outdir.py)."""
RECORD_FILES = (OWNER_FILE, JOURNAL_FILE, LOCK_FILE)
MAX_LEVELS = 8
"""How far up from a written file the owning folder is looked for."""
TAIL_BYTES = 4096
"""How much of the journal's end a record reads to skip a name recorded moments ago."""


class JournalError(ValueError):
    """A journal line that names something outside its folder: nothing is deleted on its word."""


def is_record(name: str) -> bool:
    """OWNER_FILE, JOURNAL_FILE or LOCK_FILE, or a temporary of one while a process writes it (train/atomic.py's
    naming)."""
    return name in RECORD_FILES or any(
        name.startswith(f".{record}.") and name.endswith(".tmp") for record in RECORD_FILES
    )


def owning_folder(path: Path) -> Path | None:
    """The nearest folder above `path` that a posfreq command claimed (it holds OWNER_FILE), or None."""
    folder = Path(os.path.abspath(path)).parent
    for _ in range(MAX_LEVELS):
        if (folder / OWNER_FILE).is_file():
            return folder
        if folder.parent == folder:
            return None
        folder = folder.parent
    return None


def record_names(folder: Path, names: list[str]) -> None:
    """Append `names` (relative to `folder`) to its journal in one write, whether or not it is claimed yet. A name
    among the journal's last lines is not appended again, so a file rewritten after every step (a probe's partial
    results) adds one line, not one per rewrite."""
    if not names:
        return
    flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(folder / JOURNAL_FILE, flags, 0o644)
    try:
        with _locked(fd):  # never between a rewrite's read and its write (`_drop`)
            recent = _last_lines(fd)
            new = [name for name in dict.fromkeys(names) if name not in recent]
            if new:  # one O_APPEND write: appends never interleave
                os.write(fd, "".join(f"{name}\n" for name in new).encode())
    finally:
        os.close(fd)


def _last_lines(fd: int) -> set[str]:
    """The whole lines within the last TAIL_BYTES of the journal open at `fd`: a bounded read per record, however
    long the journal has grown."""
    size = os.fstat(fd).st_size
    start = max(0, size - TAIL_BYTES)
    lines = os.pread(fd, size - start, start).decode(errors="replace").split("\n")
    if start > 0:
        lines = lines[1:]  # the first may be cut
    return set(lines[:-1])  # the last is empty, or an unterminated line being written


def record_written(path: str | Path) -> None:
    """Append `path` (a file or folder about to be written) to the journal of the folder that owns it, if one does.
    Called before the write, so the record is never behind the disk."""
    path = Path(os.path.abspath(path))
    folder = owning_folder(path)
    if folder is None or is_record(path.name):  # the records themselves are never journaled
        return
    relative = path.relative_to(folder)
    if any(part.endswith(".tmp") for part in relative.parts[:-1]):
        return  # inside a folder being built: its final name is recorded when it is published
    # a link inside the folder (a run's checkpoints/ on scratch) is recorded itself, never what is behind it
    for depth in range(1, len(relative.parts)):
        if folder.joinpath(*relative.parts[:depth]).is_symlink():
            relative = PurePosixPath(*relative.parts[:depth])
            break
    record_names(folder, [relative.as_posix()])


@contextlib.contextmanager
def _locked(fd: int) -> Iterator[None]:
    """flock the journal for the block; a filesystem without locks (Lustre without `flock`) runs it unlocked."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
        yield
        return
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def open_recorded(path: str | Path, mode: str = "a") -> IO:
    """Open `path` to append to ('a') or rewrite in place ('w'), for logs written as they go: recorded first, and
    never through a link planted at its name (O_NOFOLLOW: the open fails instead)."""
    if mode not in ("a", "w"):
        raise ValueError(f"mode {mode!r}: 'a' or 'w'")
    record_written(path)
    flags = os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
    flags |= os.O_APPEND if mode == "a" else os.O_TRUNC
    return os.fdopen(os.open(path, flags, 0o644), mode)


def recorded(folder: Path) -> list[str]:
    """The relative paths the journal of `folder` names, in order of first record, or [] without a journal.

    JournalError for a line that leads out of the folder (absolute, `..`, or through a link inside it)."""
    journal = folder / JOURNAL_FILE
    if journal.is_symlink() or not journal.is_file():
        return []
    names = list(
        dict.fromkeys(line for line in journal.read_text(errors="replace").splitlines() if line)
    )
    for name in names:
        inside(folder, name)
    return names


def inside(folder: Path, name: str) -> Path:
    """folder/name, if `name` is a relative path that stays in `folder` without following a link (JournalError)."""
    pure = PurePosixPath(name)
    if pure.is_absolute() or ".." in pure.parts or not pure.parts:
        raise JournalError(
            f"{folder / JOURNAL_FILE} names {name!r}, outside the folder. Fix: remove that line "
            "(nothing was deleted)"
        )
    path = folder
    for part in pure.parts[:-1]:
        path = path / part
        if path.is_symlink():
            raise JournalError(
                f"{folder / JOURNAL_FILE} names {name!r}, through the link {path}. Fix: remove that line "
                "(nothing was deleted)"
            )
    return path / pure.parts[-1]


def unrecorded(folder: Path, allowed: set[str] = frozenset()) -> list[str]:
    """The entries directly in `folder` that neither its journal nor `allowed` accounts for: what a user put there.
    Writes in progress are accounted for too (``*.tmp``, and the ``NAME.old`` of a directory being replaced):
    tolerated, never deleted on that account."""
    names = recorded(folder)
    tops = {PurePosixPath(name).parts[0] for name in names} | set(allowed)
    return sorted(
        entry.name
        for entry in folder.iterdir()
        if not is_record(entry.name)
        and entry.name not in tops
        and not entry.name.endswith(".tmp")
        and not (entry.name.endswith(".old") and entry.name[: -len(".old")] in tops)
    )


def remove_recorded(folder: Path, under: str | None = None, sub_steps: bool = False) -> list[Path]:
    """Delete what the journal of `folder` names (only under the relative folder `under`, if given): files and links
    themselves (never what a link points to), a claimed folder with only what its own journal names, a folder
    posfreq published whole (a checkpoint) whole, then the folders left empty; the journal keeps the other lines.
    A folder another command claimed inside (a probe's results under an export or a run) is that command's and
    stays, still named by the journal, unless `sub_steps`: the caller ran those commands itself into `under` (the
    doctor's parts). Returns what was deleted."""
    names = recorded(folder)
    chosen = [n for n in names if under is None or PurePosixPath(n).parts[0] == under]
    owner = _owner_command(folder)
    neighbours = (
        set() if sub_steps else {n for n in chosen if _claimed_by_another(inside(folder, n), owner)}
    )
    chosen = [n for n in chosen if not any(n == m or n.startswith(f"{m}/") for m in neighbours)]
    removed: list[Path] = []
    for name in sorted(chosen, key=lambda n: -len(PurePosixPath(n).parts)):
        path = inside(folder, name)
        if path.is_symlink() or path.is_file():
            path.unlink()
            removed.append(path)
        elif (
            path.is_dir() and (path / OWNER_FILE).is_file()
        ):  # a claimed folder of this folder's command (or a sub-step's): what its journal names
            removed += remove_recorded(path, sub_steps=sub_steps)
            for record in RECORD_FILES:
                (path / record).unlink(missing_ok=True)
            _remove_if_empty(path)
        elif (
            path.is_dir()
        ):  # a folder posfreq published whole (a checkpoint): its files were never listed
            shutil.rmtree(path)  # removes links inside, never what they point to
            removed.append(path)
    for path in sorted({p.parent for p in removed}, key=lambda p: -len(p.parts)):
        while path != folder and folder in path.parents:
            if not _remove_if_empty(path):
                break
            path = path.parent
    _drop(folder, set(chosen))
    return removed


def claimed_inside(folder: Path) -> list[str]:
    """The entries the journal of `folder` names that another command claimed (a neighbour's results nested in it):
    what a rerun of its command must leave alone."""
    owner = _owner_command(folder)
    return [n for n in recorded(folder) if _claimed_by_another(inside(folder, n), owner)]


def _owner_command(folder: Path) -> str | None:
    """The command OWNER_FILE in `folder` names, or None (no owner, or a record that cannot be read)."""
    try:
        owner = json.loads((folder / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return owner.get("command") if isinstance(owner, dict) else None


def _claimed_by_another(path: Path, command: str | None) -> bool:
    """Whether `path` is a real folder (not a link) that a command other than `command` claimed."""
    if path.is_symlink() or not (path / OWNER_FILE).is_file():
        return False
    return _owner_command(path) != command


def _remove_if_empty(path: Path) -> bool:
    try:
        path.rmdir()
        return True
    except OSError:
        return False


def _drop(folder: Path, names: set[str]) -> None:
    """Remove `names` from the journal in place, under its lock: a line another process appended since the
    journal was read (an array job writing the same folder) is kept."""
    journal = folder / JOURNAL_FILE
    try:
        fd = os.open(journal, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return
    try:
        with _locked(fd):
            lines = os.read(fd, os.fstat(fd).st_size).decode(errors="replace").splitlines()
            keep = list(dict.fromkeys(line for line in lines if line and line not in names))
            os.lseek(fd, 0, os.SEEK_SET)
            os.ftruncate(fd, 0)
            os.write(fd, "".join(f"{name}\n" for name in keep).encode())
    finally:
        os.close(fd)

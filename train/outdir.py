"""Output directories a command may write: new, empty, or already its own; never a user's.

A command claims its output directory with `claim_output_dir`, which records the command in
OWNER_FILE inside it; what it then writes there is recorded in the folder's journal (train/journal.py).
A directory that exists and holds anything without that record (a run, a model someone downloaded, a
paper), or, once it has a journal, anything its journal does not name, is refused with a line naming
it and the fix, and nothing in it is touched. A command replaces only what it wrote there. Two
exceptions, both its own: folders a command names as its parts (`parts`, e.g. a sharded analysis's
shard_<i> under the merged output) that it owns, and the records of another process claiming the
same directory at once.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import fnmatch
import json
import os
import socket
from pathlib import Path
from typing import Callable, Iterator

from posfreq.train.atomic import write_json_atomic
from posfreq.train.journal import (
    JOURNAL_FILE,
    LOCK_FILE,
    OWNER_FILE,
    is_record,
    record_names,
    record_written,
    unrecorded,
)


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
    parts: str | None = None,
    alone: bool = True,
) -> Path:
    """`path` if `command` may write there (absent, empty, or owned by `command`, and, when it writes `alone`, not
    being written by another process now), else OutputDirError.

    Folders inside `path` whose names match the pattern `parts` and that `command` owns count as its own (a sharded
    job's parts under the merged output), and so does another process's owner record still being written (array
    jobs claiming one directory at once). `written_before(path)` recognises an unmarked directory an older
    posfreq's `command` wrote (before owners were recorded): it is marked as the command's own instead of refused.
    """
    path = Path(path)
    if path.is_symlink() and not path.exists():
        raise OutputDirError(
            f"{flag} {path} is a symbolic link to {os.readlink(path)}, which does not exist. Fix: create "
            "the directory it points to, remove the link, or pass another directory (nothing was changed)"
        )
    if path.exists() and not path.is_dir():
        raise OutputDirError(
            f"{flag} {path} is a file, not a directory. Fix: pass a directory (nothing was changed)"
        )
    if not path.is_dir():
        return path
    owner = owner_of(path)
    if owner == command:
        if alone:
            _refuse_while_written(path, flag)  # before the command's slow work, not after it
        if (path / JOURNAL_FILE).is_file():
            _refuse_unrecorded(path, command, flag, parts)
        return path
    fix = "Fix: pass a new or empty directory (nothing was changed)"
    if owner is not None:
        raise OutputDirError(f"{flag} {path} holds the outputs of `posfreq {owner}`. {fix}")
    found = foreign_entries(path, command, parts)
    if not found:
        return path
    if written_before is not None and written_before(path):
        _adopt(path, command)
        return path
    if owner_of(path) == command:  # another process claimed it since the first look
        return path
    shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
    raise OutputDirError(
        f"{flag} {path} holds files `posfreq {command}` did not write ({shown}). {fix}"
    )


def _refuse_unrecorded(path: Path, command: str, flag: str, parts: str | None) -> None:
    """OutputDirError if `command`'s own folder holds entries its journal does not name (a user's files)."""
    found = unrecorded(path, _own_parts(path, command, parts))
    if found:
        shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
        raise OutputDirError(
            f"{flag} {path} holds files `posfreq {command}` did not write ({shown}; its record "
            f"{path / JOURNAL_FILE} lists what it wrote). Fix: move them out, or pass another directory "
            "(nothing was changed)"
        )


def foreign_entries(path: Path, command: str, parts: str | None = None) -> list[str]:
    """The names in directory `path` that `command` did not write: all but owner records (whole or in progress) and
    folders named like `parts` that `command` owns."""
    own = _own_parts(path, command, parts)
    return sorted(e.name for e in path.iterdir() if not is_record(e.name) and e.name not in own)


def _own_parts(path: Path, command: str, parts: str | None) -> set[str]:
    """The folders in `path` named like `parts` that `command` owns (a sharded job's parts under its output)."""
    if parts is None:
        return set()
    return {
        e.name
        for e in path.iterdir()
        if fnmatch.fnmatchcase(e.name, parts) and e.is_dir() and owner_of(e) == command
    }


def claim_output_dir(
    path: str | Path,
    command: str,
    flag: str = "--out",
    written_before: Callable[[Path], bool] | None = None,
    parts: str | None = None,
    shared: bool = False,
) -> Path:
    """Create (or reuse) `command`'s output directory `path`, recording the owner; OutputDirError for another's
    (`written_before` and `parts` as in `check_output_dir`). Unless `shared` (commands whose array jobs write one
    folder at once, each its own files: prepare, probe, ruler), this process then writes it alone: a second
    process claiming it is refused until this one ends (`release_output_locks`)."""
    path = check_output_dir(path, command, flag, written_before, parts, alone=not shared)
    if not path.is_dir():
        record_written(path)  # a new folder inside another claimed one is that one's to remove
    path.mkdir(parents=True, exist_ok=True)
    if not shared:
        _lock(path, command, flag)
    if owner_of(path) != command:
        _mark_owned(path, command)
    return path


_HELD: dict[Path, int] = {}
"""The folders this process writes alone, and the descriptor holding each one's lock."""


def _lock(path: Path, command: str, flag: str) -> None:
    """flock `path`'s LOCK_FILE for this process (the kernel releases it when the process ends, however it ends);
    OutputDirError naming the holder if another process holds it."""
    key = path.resolve()
    if key in _HELD or _held_here(path / LOCK_FILE):
        return
    try:
        fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as err:
        if err.errno != errno.ELOOP:
            raise
        raise OutputDirError(
            f"{path / LOCK_FILE} is a symbolic link (to {os.readlink(path / LOCK_FILE)}); posfreq never takes a "
            f"lock through one, as it would write where the link points. Fix: remove the link {path / LOCK_FILE} "
            "(nothing was changed)"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        error = _being_written(path, flag, fd)
        os.close(fd)
        raise error from None
    except (
        OSError
    ):  # a filesystem without locks (Lustre mounted without `flock`): write unlocked, as before
        os.close(fd)
        return
    os.ftruncate(fd, 0)
    os.write(fd, f"posfreq {command} (pid {os.getpid()} on {socket.gethostname()})".encode())
    _HELD[key] = fd


def _being_written(path: Path, flag: str, fd: int) -> OutputDirError:
    """The refusal of a folder whose lock (open as `fd`) another process holds, naming the holder it recorded."""
    holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
    return OutputDirError(
        f"{flag} {path} is being written by {holder}. Fix: wait for it to finish, or pass another "
        "directory (nothing was changed)"
    )


def _held_here(lock: Path) -> bool:
    """Whether this process holds the lock file `lock` already, under another name (a folder it claimed as OUT.tmp
    and renamed to OUT): a second look or lock through a new descriptor would find it held, by this process."""
    try:
        found = os.stat(lock, follow_symlinks=False)
    except OSError:
        return False
    for fd in _HELD.values():
        held = os.fstat(fd)
        if (held.st_dev, held.st_ino) == (found.st_dev, found.st_ino):
            return True
    return False


def _refuse_while_written(path: Path, flag: str) -> None:
    """OutputDirError if another process holds `path`'s lock now: a look only (nothing is created or written, and
    the lock is let go at once), so a command is refused before its slow work; `_lock` takes the lock later."""
    if path.resolve() in _HELD or _held_here(path / LOCK_FILE):
        return
    try:
        fd = os.open(path / LOCK_FILE, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return  # no lock file yet, or a link `_lock` refuses by name
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _being_written(path, flag, fd) from None
    except OSError:
        pass  # a filesystem without locks
    finally:
        os.close(fd)  # releases the look's lock, if it got it


@contextlib.contextmanager
def lock_beside(out: Path) -> Iterator[None]:
    """Hold, for the block, an exclusive lock on the folder that holds `out` (flock on the directory itself: no
    file is created there), so a command that builds `out` under a temporary beside it (OUT.tmp, OUT.old) creates,
    reuses or deletes those only while no other process does: a second one waits its turn. A filesystem without
    locks runs the block unlocked, as before."""
    parent = Path(os.path.abspath(out)).parent
    parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass  # no locks on this filesystem
        yield
    finally:
        os.close(fd)  # releases the lock


def release_output_locks() -> None:
    """Let other processes write the folders this one claimed (the `posfreq` dispatcher calls it when a command
    returns; a process that ends releases them anyway)."""
    for fd in _HELD.values():
        os.close(fd)
    _HELD.clear()


def entry_names(path: Path) -> set[str]:
    """The names of a directory's entries (what a `written_before` test usually looks at)."""
    return {p.name for p in path.iterdir()}


def own_entry_names(path: Path) -> set[str]:
    """The names in directory `path` other than posfreq's owner records."""
    return {entry.name for entry in path.iterdir() if not is_record(entry.name)}


def only_files(folder: Path, accept: Callable[[str], bool]) -> bool:
    """Whether `folder` is absent, or a real directory of regular files whose names `accept` takes."""
    if not folder.exists() and not folder.is_symlink():
        return True
    return (
        folder.is_dir()
        and not folder.is_symlink()
        and all(
            entry.is_file() and not entry.is_symlink() and accept(entry.name)
            for entry in folder.iterdir()
        )
    )


def json_object_with(path: Path, field: str, kind: type) -> bool:
    """Whether `path` is a regular file holding a JSON object whose `field` is a `kind`."""
    if not path.is_file() or path.is_symlink():
        return False
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and isinstance(data.get(field), kind)


def _mark_owned(path: Path, command: str) -> None:
    write_json_atomic(path / OWNER_FILE, {"command": command})


def _adopt(path: Path, command: str) -> None:
    """Mark a folder an older posfreq's `command` wrote (before owners were recorded) as its own and journal what is
    in it: all of it is the command's, and a journal that a later write starts must not leave it out. The journal
    comes first, in one append, and the owner record last: a process that finds the owner finds the whole journal
    (several ranks or array tasks may adopt one folder at once; each writes the same lines)."""
    record_names(
        path,
        sorted(
            e.name for e in path.iterdir() if not is_record(e.name) and not e.name.endswith(".tmp")
        ),
    )
    _mark_owned(path, command)

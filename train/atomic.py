"""Atomic writes of files and directories: a crash leaves the old one or the new one under the final name, never
half of either.

Every write goes to a temporary sibling (same directory, so the rename stays on one filesystem),
is flushed and fsynced, renamed over the final name with `os.replace`, and the directory is
fsynced so the rename itself survives a power loss. Temporaries are named
``.NAME.<random>.tmp``: hidden, unique per writer (two processes writing the same file never
share one), and created with mode ``0o666 & ~umask`` like any other file, so results users
share are world-readable under the usual umask (``tempfile.mkstemp`` would make them 0600).

A directory (a checkpoint, a consolidated model) is built under ``NAME.tmp`` and published by
`publish_dir`: fsynced (files, then directories) and renamed into place. Replacing an existing
directory goes ``NAME -> NAME.old``, ``NAME.tmp -> NAME``, ``NAME.old -> NAME.old.tmp`` (then
deleted), so ``NAME`` or ``NAME.old`` is complete at every instant, and a directory being deleted
is always named ``*.tmp`` first.

Every final name is recorded in the journal of the output folder it lands in (train/journal.py) before
anything is written under it, so a rerun knows exactly which files its command wrote.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Callable

from posfreq.train.journal import record_written


def fsync_path(path: str | Path) -> None:
    """Flush one file's or directory's data and metadata to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary(path: Path) -> Path:
    """Where directory `path` is built before `publish_dir` renames it into place."""
    return path.with_name(path.name + ".tmp")


def fsync_tree(root: Path) -> None:
    """fsync every file under `root`, then its directories bottom-up: a rename then publishes durable bytes."""
    for directory, _, names in os.walk(root, topdown=False):
        for name in names:
            fsync_path(Path(directory) / name)
        fsync_path(Path(directory))


def discard_dir(path: Path) -> None:
    """Delete directory `path` if present, renaming it to NAME.tmp first so a half-deleted one never looks whole."""
    if not path.exists():
        return
    trash = temporary(path)
    if trash.exists():
        shutil.rmtree(trash)
    os.replace(path, trash)
    shutil.rmtree(trash)


def publish_dir(tmp: Path, final: Path) -> None:
    """Make a complete `tmp` durable and rename it to `final`; `final` or `final.old` is whole at every instant."""
    record_written(final)
    fsync_tree(tmp)
    fsync_path(tmp.parent)
    old = final.with_name(final.name + ".old")
    if final.exists():
        discard_dir(old)  # `final` is whole, so the copy before it may go
        os.replace(final, old)
    os.replace(tmp, final)  # with no `final`, a left-over `old` stays until this rename is done
    fsync_path(final.parent)
    discard_dir(old)


def staging_dir(final: Path) -> Path:
    """A new, empty folder beside `final`, unique to this call, to build a cache folder in (`publish_cache_dir`)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))


def publish_cache_dir(staging: Path, final: Path, complete: Callable[[Path], bool]) -> None:
    """Rename a built `staging` folder to `final`, which processes may build at once with the same content: the
    first rename wins and the others drop theirs. An incomplete `final` (damaged from outside) is moved aside under
    a name of this process's own, never deleted while another process might be publishing."""
    for _ in range(2):
        try:
            staging.rename(final)
            return
        except OSError:
            if complete(final):
                shutil.rmtree(staging, ignore_errors=True)
                return
            aside = Path(
                tempfile.mkdtemp(prefix=f".{final.name}.broken.", suffix=".tmp", dir=final.parent)
            )
            try:
                os.replace(final, aside / final.name)
            except OSError:
                pass  # another process moved it first
            shutil.rmtree(aside, ignore_errors=True)
    staging.rename(final)


class AtomicFile:
    """A file being written under a temporary name; `commit()` publishes it as `path`, `discard()` drops it.

    For writers that keep the file open across calls (a shard's token stream); one-shot writes
    use `atomic_open` or the `write_*_atomic` functions.
    """

    def __init__(self, path: str | Path, mode: str = "w", **open_kwargs: Any) -> None:
        if not set(mode) <= set("wbt"):
            raise ValueError(
                f"mode {mode!r}: an atomic write creates a new file (use 'w', 'wb' or 'wt')"
            )
        self.path = Path(path)
        record_written(self.path)
        self.tmp = self.path.with_name(f".{self.path.name}.{secrets.token_hex(6)}.tmp")
        fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        self.file: IO = os.fdopen(fd, mode, **open_kwargs)

    def commit(self) -> Path:
        """Flush, fsync and close the file, rename it over `path`, fsync the directory; returns `path`."""
        try:
            self.file.flush()
            os.fsync(self.file.fileno())
        except BaseException:
            self.discard()
            raise
        self.file.close()
        os.replace(self.tmp, self.path)
        fsync_path(self.path.parent)
        return self.path

    def discard(self) -> None:
        """Close and delete the temporary file; `path` is left as it was."""
        self.file.close()
        self.tmp.unlink(missing_ok=True)


@contextmanager
def atomic_open(path: str | Path, mode: str = "w", **open_kwargs: Any) -> Iterator[IO]:
    """Open a temporary sibling of `path` for writing; on a clean exit it replaces `path`, on an error it is deleted."""
    atomic = AtomicFile(path, mode, **open_kwargs)
    try:
        yield atomic.file
    except BaseException:
        atomic.discard()
        raise
    atomic.commit()


def write_text_atomic(path: str | Path, text: str) -> None:
    """Replace `path` with `text` (UTF-8) atomically."""
    with atomic_open(path, "w", encoding="utf-8") as f:
        f.write(text)


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """Replace `path` with `data` atomically."""
    with atomic_open(path, "wb") as f:
        f.write(data)


def write_json_atomic(path: str | Path, obj: Any, **dumps_kwargs: Any) -> None:
    """Replace `path` with `obj` as JSON plus a final newline, atomically (`dumps_kwargs` go to `json.dumps`)."""
    write_text_atomic(path, json.dumps(obj, **dumps_kwargs) + "\n")


LOW_DISK_BYTES = 2**30


def disk_full(err: BaseException, directory: str | Path | None = None) -> str | None:
    """Why a write failed if the disk is full, else None: ENOSPC/EDQUOT anywhere in the error's chain, or, given the
    `directory` written to, less than LOW_DISK_BYTES free there (libraries word a short write their own way)."""
    import errno

    cause: BaseException | None = err
    while cause is not None:
        if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
            where = directory or (Path(cause.filename).parent if cause.filename else None)
            return f"the disk{f' holding {where}' if where else ''} is full ({os.strerror(cause.errno)})"
        cause = cause.__cause__ or cause.__context__
    if directory is None:
        return None
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        return None
    return (
        f"the disk holding {directory} is full ({free / 2**20:,.0f} MiB free)"
        if free < LOW_DISK_BYTES
        else None
    )

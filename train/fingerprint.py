"""Content fingerprints: what a result was made from, by the bytes of its inputs, never by a name.

Results are keyed by `files_sha256` of the model's weight and config files and by `code_sha256` of
the source files that decide their answers (which files: analysis/keys.py), so a renamed, moved or
reused folder can never hand one model's results to another.
"""

from __future__ import annotations

import ast
import fnmatch
import functools
import hashlib
from pathlib import Path
from typing import Iterable

REPO = Path(__file__).resolve().parents[1]
CHUNK = 1 << 22


def imported_modules(file: Path) -> set[Path]:
    """The repository's own module files that `file` imports anywhere (top level or inside a function)."""
    found = set()
    for node in ast.walk(ast.parse(file.read_text(), str(file))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "posfreq" and len(parts) > 2:
                path = REPO.joinpath(*parts[1:])
                for module in (path.with_suffix(".py"), path / "__init__.py"):
                    if module.is_file():
                        found.add(module)
    return found


@functools.lru_cache(maxsize=None)
def import_closure(entries: tuple[str, ...], excluded: tuple[str, ...]) -> tuple[str, ...]:
    """The repository's source files `entries` import, directly or not (themselves included), less those matching
    an `excluded` pattern, as sorted paths relative to the repository. Who declares which: analysis/keys.py."""
    seen, todo = set(), [REPO / entry for entry in entries]
    while todo:
        file = todo.pop()
        if file not in seen:
            seen.add(file)
            todo.extend(imported_modules(file) - seen)
    files = {f.relative_to(REPO).as_posix() for f in seen}
    return tuple(sorted(f for f in files if not any(fnmatch.fnmatch(f, p) for p in excluded)))


def file_sha256(path: Path) -> str:
    """sha256 of one file's bytes, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def files_sha256(root: Path, paths: Iterable[Path]) -> str:
    """sha256 over (path relative to `root`, file sha256) of each file, in sorted order."""
    digest = hashlib.sha256()
    for path in sorted(Path(p) for p in paths):
        digest.update(f"{path.relative_to(root).as_posix()}\0{file_sha256(path)}\n".encode())
    return digest.hexdigest()


@functools.lru_cache(maxsize=None)
def code_sha256(files: tuple[str, ...]) -> str:
    """sha256 of the given source files of this repository (paths relative to it), their bytes, not a git
    revision."""
    return files_sha256(REPO, (REPO / f for f in files))

"""Content fingerprints: what a result was made from, by the bytes of its inputs, never by a name.

Probe results are keyed by `files_sha256` of the model's weight and config files and by
`code_sha256` of the source files that decide a probe's answers, so a renamed, moved or reused
folder can never hand one model's results to another.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Iterable

REPO = Path(__file__).resolve().parents[1]
CHUNK = 1 << 22

# The modules whose code decides a probe's answers: prompt building, decoding, the model, its loading.
PROBE_CODE = (
    "analysis/niah.py",
    "analysis/probe.py",
    "train/model.py",
    "train/attention.py",
    "train/positions.py",
    "train/rotary.py",
    "train/tokenizer.py",
    "train/checkpoint.py",
    "train/hf.py",
    "train/config.py",
)


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
def code_sha256(files: tuple[str, ...] = PROBE_CODE) -> str:
    """sha256 of the given source files of this repository (their bytes, not a git revision)."""
    return files_sha256(REPO, (REPO / f for f in files))

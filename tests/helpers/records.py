"""Output folders as an older posfreq left them: before owner records and journals (train/journal.py)."""

from __future__ import annotations

from pathlib import Path

from posfreq.train.journal import RECORD_FILES


def as_older_posfreq(folder: Path) -> None:
    """Remove the owner record and the journal: the folder holds only the outputs, as older versions wrote it."""
    for name in RECORD_FILES:
        (folder / name).unlink(missing_ok=True)

"""An output directory that never contradicts itself: summary.json's ``files`` lists exactly the files the run
wrote there (summary.json included).

The directory is claimed for its command first (train/outdir.py): a folder holding anything the command did not
write is refused untouched, whatever a summary.json there says. A rerun into the same directory then removes what
the previous run listed (never anything else), so outputs no longer asked for do not linger; summary.json is removed
first and written last, so a directory without one is an unfinished run.
"""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path
from typing import Callable, Sequence

from posfreq.train.atomic import write_json_atomic
from posfreq.train.journal import JOURNAL_FILE, is_record, recorded
from posfreq.train.outdir import OutputDirError, claim_output_dir, owner_of

SUMMARY_FILE = "summary.json"


def previous_outputs(out: Path) -> list[Path]:
    """The files the previous run wrote into `out`, as its summary.json lists them (none without a summary.json).

    Raises OutputDirError when a summary.json is there but lists no files (an older version, or another job,
    wrote it), or lists a path outside `out` or a folder: nothing is deleted then.
    """
    path = out / SUMMARY_FILE
    if not path.is_file():
        return []
    fix = f"Fix: remove the old outputs in {out}, or write to another --out."
    try:
        listed = json.loads(path.read_text()).get("files")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        listed = None
    if not isinstance(listed, list) or not all(isinstance(name, str) for name in listed):
        raise OutputDirError(
            f"{path} does not list the files of the run that wrote it, so this job cannot tell "
            f"its own outputs from other files there. {fix}"
        )
    root = out.resolve()
    files = [out / name for name in listed]
    outside = [name for name, file in zip(listed, files) if root not in file.resolve().parents]
    if outside:
        raise OutputDirError(f"{path} lists files outside {out}: {outside}. {fix}")
    folders = [name for name, file in zip(listed, files) if file.is_dir()]
    if folders:
        raise OutputDirError(f"{path} lists folders, not files: {folders}. {fix}")
    return files


def remove_outputs(out: Path, files: Sequence[Path]) -> None:
    """Delete the listed files of a previous run (summary.json first) and the folders they leave empty."""
    for file in sorted(files, key=lambda f: f.name != SUMMARY_FILE):
        file.unlink(missing_ok=True)
    for folder in sorted({f.parent for f in files if f.parent != out}, key=lambda d: -len(d.parts)):
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()


def write_summary(out: Path, written: Sequence[Path], content: dict) -> None:
    """Write summary.json last: `content` plus ``files``, the sorted paths (relative to `out`) of every file written."""
    names = {str(path.relative_to(out)) for path in written} | {SUMMARY_FILE}
    write_json_atomic(out / SUMMARY_FILE, {**content, "files": sorted(names)}, indent=2)


def replace_outputs(out: Path, command: str, parts: str | None = None) -> None:
    """Make `out` ready for a new run of `command`: claim it (refused if it holds what `command` did not write;
    `parts` as in `claim_output_dir`), and remove what the previous run there wrote."""
    claim_output_dir(out, command, written_before=earlier_run(command, parts), parts=parts)
    previous = previous_outputs(out)
    if (
        out / JOURNAL_FILE
    ).is_file():  # summary.json says what the run wrote; the journal, what posfreq wrote
        written = {out / name for name in recorded(out)}
        previous = [file for file in previous if file in written]
    remove_outputs(out, previous)


def earlier_run(command: str, parts: str | None = None) -> Callable[[Path], bool]:
    """The `written_before` test of `command`'s outputs from before owner records: a folder that holds only what
    its summary.json lists, the owner records, and folders named like `parts` that are `command`'s own or such
    earlier runs themselves (a sharded run's parts, which may sit in a folder of their own without a summary)."""

    def lists_everything(out: Path) -> bool:
        summary = out / SUMMARY_FILE
        try:
            listed = json.loads(summary.read_text()).get("files") if summary.is_file() else []
        except (OSError, ValueError, AttributeError):
            return False
        if not isinstance(listed, list) or not all(isinstance(name, str) for name in listed):
            return False
        accounted = {Path(name).parts[0] for name in listed if Path(name).parts}
        return all(
            entry.name in accounted
            or is_record(entry.name)
            or (
                parts is not None
                and fnmatch.fnmatchcase(entry.name, parts)
                and entry.is_dir()
                and (owner_of(entry) == command or lists_everything(entry))
            )
            for entry in out.iterdir()
        )

    return lists_everything

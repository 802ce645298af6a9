"""The analysis's table files: dict rows to and from CSV (written atomically), and GitHub markdown tables.

Every CSV an analysis command writes goes through `write_csv`, and every one it reads back through
`read_csv`, so the cell formats stay one convention. At analysis/'s root, below its packages: corpus writes
CSVs too, and imports nothing later than itself.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Callable, Mapping, Sequence

from posfreq.train.atomic import atomic_open

RENAMED_COLUMNS = {"tokens_seen": "tokens_trained", "tokens_this_run": "run_tokens"}
"""Columns renamed since: older outputs (and a probe's older meta.json) are read under today's names."""


def write_csv(path: Path, rows: Sequence[Mapping], columns: Sequence[str] | None = None) -> Path:
    """Write dict rows to CSV atomically (missing cells empty); returns `path`."""
    columns = list(columns or (rows[0] if rows else []))
    with atomic_open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns, restval="")
        writer.writeheader()
        writer.writerows(rows)
    return path


def current_names(row: Mapping) -> dict:
    """`row` with every renamed column under its current name."""
    return {RENAMED_COLUMNS.get(key, key): value for key, value in row.items()}


def _number(text: str) -> float | int | str | None:
    """A CSV cell as int, float, None (empty) or the string itself."""
    if text == "":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


class DamagedTable(ValueError):
    """A CSV table posfreq wrote that does not read back as one (not UTF-8, a row of the wrong width, a cell of the
    wrong kind); the message names the file and line and the fix."""


def read_csv(path: Path) -> list[dict]:
    """CSV rows with numeric cells converted (empty cells become None), renamed columns under today's names;
    DamagedTable naming the file and line for a row that does not have the header's width, or bytes that are not
    UTF-8 (a CSV posfreq wrote never holds either)."""
    fix = "Fix: restore the file, or write it again (the command that made it)"
    rows = []
    try:
        with open(path, newline="", encoding="utf-8") as fh:
            reader = csv.DictReader(fh)
            for row in reader:
                if (
                    None in row or None in row.values()
                ):  # more, or fewer, cells than the header names
                    raise DamagedTable(
                        f"{path}, line {reader.line_num}: {len(reader.fieldnames or [])} columns in the "
                        f"header, a row of another width. {fix}"
                    )
                rows.append(current_names({k: _number(v) for k, v in row.items()}))
    except UnicodeDecodeError as err:
        raise DamagedTable(
            f"{path}: not UTF-8 text ({err.reason} at byte {err.start}). {fix}"
        ) from None
    except csv.Error as err:
        raise DamagedTable(f"{path}: not a readable CSV table ({err}). {fix}") from None
    return rows


def _three_decimals(value: object) -> str:
    """A markdown cell: floats to 3 decimals, anything else as str()."""
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def markdown_table(
    rows: Sequence[Mapping],
    columns: Sequence[str] | None = None,
    cell: Callable[[object], str] = _three_decimals,
) -> str:
    """A GitHub markdown table of dict rows (`columns` default: the first row's keys; a missing cell is "";
    `cell` formats a value)."""
    if not rows:
        return ""
    cols = list(columns or rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"

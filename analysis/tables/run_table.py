"""A run's effective_length.csv: one row per checkpoint (`RUN_COLUMNS`, then `pass_rate_<length>` per probed
length), written, found in a run's probe directory, read back, and drawn as Fig. 2a / 2b.

f(effective length) is Eq. 2 on the checkpoint's trained-length histogram, evaluated at i = effective length,
as in the paper ("f(1280) = 100B"); for i >= L it is 0, since no trained segment is longer than L.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from posfreq.analysis.niah import store
from posfreq.analysis.table_files import DamagedTable, read_csv, write_csv
from posfreq.analysis.tables.columns import RUN_COLUMNS
from posfreq.analysis.tables.pass_curve import (
    STATUS_NONE_PASSED,
    Analysis,
    bootstrap_interval,
    effective_length,
    frequency_at,
)


def pass_rate_column(length: int) -> str:
    """The effective_length.csv column holding the pass rate at `length`."""
    return f"pass_rate_{length}"


def probed_lengths(row: Mapping) -> list[int]:
    """The lengths a checkpoint's row was probed at: its filled `pass_rate_<length>` cells, ascending."""
    return sorted(
        int(k.removeprefix("pass_rate_"))
        for k, v in row.items()
        if k.startswith("pass_rate_") and v not in ("", None)
    )


@dataclass(frozen=True)
class ProbedModel:
    """What an effective_length.csv row says of the model it measured, beside the measurement."""

    name: str
    train_len: int
    positions: str
    length_hist: np.ndarray | None = None
    """The trained-length bincount (size L+1); None (a Hugging Face model) leaves f empty."""
    tokens_trained: int | None = None
    """Every token the weights were trained on, a warm-up included."""
    run_tokens: int | None = None
    """The tokens of the checkpoint's own run."""


def checkpoint_row(
    model: ProbedModel,
    summary: Sequence[Mapping],
    passed: Sequence[Sequence[bool]],
    analysis: Analysis,
    tests_per_length: int,
) -> dict:
    """One effective_length.csv row: effective length, its interval and status, f at each, and the curve.

    `summary` holds one summary.csv row per probed length and `passed` each length's per-test
    passes (for the bootstrap). f is left empty when `model` has no trained-length histogram, as it is when
    no length passed.
    """
    name, train_len, length_hist = model.name, model.train_len, model.length_hist
    if length_hist is not None and len(length_hist) != train_len + 1:
        raise ValueError(
            f"{name}: trained-length histogram has {len(length_hist)} bins, expected L+1 = {train_len + 1}"
        )
    order = np.argsort([int(r["length"]) for r in summary])
    summary = [summary[i] for i in order]
    passed = [passed[i] for i in order]
    lengths = [int(r["length"]) for r in summary]
    eff = effective_length(lengths, [float(r["pass_rate"]) for r in summary], analysis.threshold)
    interval = bootstrap_interval(lengths, passed, analysis)

    def f_at(value: int | None, undefined: bool = False) -> int | str:
        return (
            ""
            if undefined or value is None or length_hist is None
            else frequency_at(length_hist, train_len, value)
        )

    tf_rates = [r.get("tf_pass_rate") for r in summary]
    # the teacher-forced length carries its status too: an all_passed value is a lower bound capped by the
    # longest probed length, and none_passed is 0 by convention, not a measurement
    tf_eff = (
        None
        if any(v in ("", None) for v in tf_rates)
        else effective_length(lengths, tf_rates, analysis.threshold)
    )
    row = {
        "checkpoint": name,
        "tokens_trained": "" if model.tokens_trained is None else int(model.tokens_trained),
        "run_tokens": "" if model.run_tokens is None else int(model.run_tokens),
        "train_len": train_len,
        "positions": model.positions,
        "effective_length": eff.value,
        "effective_length_status": eff.status,
        "effective_length_lo": "" if interval is None else interval[0],
        "effective_length_hi": "" if interval is None else interval[1],
        "f_effective_length": f_at(eff.value, eff.status == STATUS_NONE_PASSED),
        "f_effective_length_lo": f_at(
            None if interval is None else interval[0], interval is not None and interval[0] == 0
        ),
        "f_effective_length_hi": f_at(
            None if interval is None else interval[1], interval is not None and interval[1] == 0
        ),
        "tf_effective_length": "" if tf_eff is None else tf_eff.value,
        "tf_effective_length_status": "" if tf_eff is None else tf_eff.status,
        "threshold": analysis.threshold,
        "min_retrieved": analysis.min_retrieved,
        "scoring": analysis.scoring,
        "tests_per_length": tests_per_length,
    }
    row.update({pass_rate_column(int(r["length"])): float(r["pass_rate"]) for r in summary})
    return row


def write_effective_length_csv(path: Path, rows: Sequence[Mapping]) -> None:
    """effective_length.csv: RUN_COLUMNS then pass_rate_<length> for every length any checkpoint probed."""
    lengths = sorted(
        {int(k.removeprefix("pass_rate_")) for r in rows for k in r if k.startswith("pass_rate_")}
    )
    rows = sorted(rows, key=lambda r: (r["tokens_trained"] == "", r["tokens_trained"] or 0))
    write_csv(path, rows, list(RUN_COLUMNS) + [pass_rate_column(n) for n in lengths])


def find_run_results(path: str | Path) -> Path:
    """The probe output directory of a run: PATH itself, PATH/probe, or its one PATH/probe-* holding effective_length.csv."""
    path = Path(path)
    if (path / store.EFFECTIVE_LENGTH_FILE).is_file():
        return path
    found = [
        c
        for c in [path / "probe", *sorted(path.glob("probe-*"))]
        if (c / store.EFFECTIVE_LENGTH_FILE).is_file()
    ]
    if len(found) == 1:
        return found[0]
    if not found:
        raise FileNotFoundError(
            f"{path}: no effective_length.csv here, in probe/ or in probe-*/; run "
            "scripts/commands/probe.py --run first"
        )
    raise FileNotFoundError(
        f"{path}: several probe results ({', '.join(c.name for c in found)}); name one of them"
    )


@dataclass
class RunResults:
    """One run's probe outputs: its label, effective_length.csv rows and f(i) of its last checkpoint."""

    label: str
    rows: list[dict]
    frequency: np.ndarray

    @property
    def train_len(self) -> int:
        return int(self.rows[-1]["train_len"]) if self.rows else len(self.frequency)


def load_run(path: str | Path, label: str | None = None) -> RunResults:
    """Read effective_length.csv and position_frequency.csv from a run's probe directory."""
    directory = find_run_results(path)
    table = directory / store.EFFECTIVE_LENGTH_FILE
    rows = read_csv(table)
    for number, row in enumerate(rows, 2):
        if not isinstance(row.get("tokens_trained"), int) or not isinstance(
            row.get("train_len"), int
        ):
            raise DamagedTable(
                f"{table}, line {number}: tokens_trained and train_len are not whole numbers. Fix: restore "
                "the file, or write it again (posfreq effective-length RUN --out DIR re-derives it)"
            )
    rows = sorted(rows, key=lambda r: r["tokens_trained"])
    freq_path = directory / store.POSITION_FREQUENCY_FILE
    frequency = (
        np.array([r["f"] for r in read_csv(freq_path)], dtype=np.int64)
        if freq_path.is_file()
        else np.zeros(0, np.int64)
    )
    if label is None:
        meta_path = directory / store.META_FILE
        meta = store.read_json(meta_path) if meta_path.is_file() else {}
        run = meta.get("run") or str(directory.parent if directory.name == "probe" else directory)
        label = f"{Path(run).name} (L = {rows[-1]['train_len']})" if rows else Path(run).name
    return RunResults(label, rows, frequency)

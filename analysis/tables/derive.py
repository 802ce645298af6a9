"""The tables of a probe's result directory, derived from its records (analysis/niah/store.py) under an `Analysis`:
re-derivable at any time, nothing decoded again. The figures of a derivation: analysis/plots/derived.py.

A model's: summary.csv, distance.csv, effective_length.csv, failure_by_thirds.csv/.md. A run's: each checkpoint's,
then effective_length.csv (a row per checkpoint), distance_by_checkpoint.csv and position_frequency.csv.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from posfreq.analysis.corpus.frequency import position_frequency
from posfreq.analysis.niah import store
from posfreq.analysis.niah.store import StaleResults
from posfreq.analysis.table_files import current_names, markdown_table, read_csv, write_csv
from posfreq.analysis.tables.pass_curve import STATUS_NONE_PASSED, Analysis
from posfreq.analysis.tables.records import (
    distance_rows,
    failure_by_thirds,
    summarize_length,
)
from posfreq.analysis.tables.run_table import (
    ProbedModel,
    checkpoint_row,
    write_effective_length_csv,
)
from posfreq.train.atomic import write_text_atomic


@dataclass
class DerivedModel:
    """One model's derivation: its effective_length.csv row, and what its figures draw."""

    dest: Path
    """Where the tables were written."""
    row: dict
    """The effective_length.csv row."""
    title: str
    """The model's name, the figures' title."""
    records: list[dict] = field(default_factory=list)
    """The checked records the tables came from."""
    analysis: Analysis = Analysis()
    """How they were scored."""
    thirds: list[dict] = field(default_factory=list)
    """failure_by_thirds' rows."""


@dataclass
class DerivedRun:
    """A run's derivation: one DerivedModel per checkpoint derived, in the order of the run's probe.json."""

    dest: Path
    models: list[DerivedModel]

    @property
    def rows(self) -> list[dict]:
        """The run's effective_length.csv rows."""
        return [m.row for m in self.models]


def _scorable_records(
    out: Path, meta: dict, analysis: Analysis, tests: int
) -> dict[int, tuple[dict, list[dict]]]:
    """Each finished length's (marker, first `tests` records) of a result directory; StaleResults when there is
    none, or when its probe decoded nothing for `analysis` to score."""
    if not meta["settings"].get("greedy", True) and analysis.scoring != "teacher_forced":
        raise StaleResults(
            f"{out} was probed with greedy false: no answer was decoded for scoring {analysis.scoring}. "
            "Fix: --scoring teacher_forced"
        )
    finished = store.finished_records(out, meta, tests)
    if not finished:
        raise StaleResults(
            f"{out}: no length is probed under its key yet; run scripts/commands/probe.py first"
        )
    return finished


def derive_model(
    out: Path,
    analysis: Analysis = Analysis(),
    dest: Path | None = None,
    tests: int | None = None,
) -> DerivedModel:
    """The tables of one result directory from the first `tests` tests of each length (None: its probe.json's
    tests_per_length).

    Reads only the directory's own files (records, probe.json, trained_lengths.npy) and writes the tables and
    probe.json (with the analysis) into `dest` (None: `out` itself; another directory leaves `out` untouched and
    records where the tables came from).
    """
    dest = _destination(out, dest)
    meta = store.read_meta(out, "settings", "lengths", "model")
    tests = int(tests or meta["settings"]["tests_per_length"])
    finished = _scorable_records(out, meta, analysis, tests)
    lengths = list(finished)
    by_length = {n: records for n, (_, records) in finished.items()}
    # the marker's time is that of all its tests, of which these are a prefix
    summary = [
        summarize_length(
            by_length[n], marker["seconds"] * len(by_length[n]) / marker["n_tests"], analysis
        )
        for n, (marker, _) in finished.items()
    ]
    write_csv(dest / store.SUMMARY_FILE, summary)
    hist_path = out / store.HIST_FILE
    hist = np.load(hist_path, allow_pickle=False) if hist_path.is_file() else None
    train_len = int(meta["train_len"])
    records = [r for n in lengths for r in by_length[n]]
    write_csv(
        dest / store.DISTANCE_FILE,
        distance_rows(records, [0, *lengths], analysis, hist, train_len),
    )
    passed = [[analysis.passed(r) for r in by_length[n]] for n in lengths]
    tokens = current_names(meta)  # a probe's older meta.json holds tokens_seen
    probed = ProbedModel(
        meta["model"],
        train_len,
        meta["settings"]["positions"],
        hist,
        tokens.get("tokens_trained"),
        tokens.get("run_tokens"),
    )
    row = checkpoint_row(probed, summary, passed, analysis, tests)
    write_effective_length_csv(dest / store.EFFECTIVE_LENGTH_FILE, [row])
    thirds = failure_by_thirds(records, analysis)
    write_csv(dest / store.THIRDS_FILE, thirds)
    write_text_atomic(dest / store.THIRDS_MARKDOWN, markdown_table(thirds))
    store.write_json(
        dest / store.META_FILE,
        {
            **meta,
            **_derived_from(out, dest),
            "analysis": asdict(analysis),
            "complete": set(lengths) == set(meta["lengths"]),
            "effective_length": {
                k: row[k]
                for k in (
                    "effective_length",
                    "effective_length_status",
                    "effective_length_lo",
                    "effective_length_hi",
                )
            },
        },
    )
    return DerivedModel(dest, row, meta["model"], records, analysis, thirds)


def derive_run(out: Path, analysis: Analysis = Analysis(), dest: Path | None = None) -> DerivedRun:
    """The run tables of a run's result directory from its complete checkpoint directories.

    Each checkpoint's own tables (`derive_model`), then effective_length.csv (a row per checkpoint),
    distance_by_checkpoint.csv and position_frequency.csv (Eq. 2 on the last checkpoint's histogram); the
    checkpoints are those listed in the run's probe.json with the key each one's results must have (results under
    another key, e.g. of a checkpoint since retrained, are left out and listed as missing). Everything is written
    into `dest` (None: `out` itself), each checkpoint's tables into dest/<checkpoint>.
    """
    dest = _destination(out, dest)
    meta = store.read_meta(out, "settings", "checkpoints")
    tests = int(meta["settings"]["tests_per_length"])  # every checkpoint's, as the run asked
    models, distances, missing = [], [], []
    for name, key in meta["checkpoints"].items():
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise StaleResults(
                f"{out / store.META_FILE}: checkpoint {name!r} is not a directory name inside {out}; "
                "re-derivation writes only there. Fix: probe the run again (posfreq probe --run)"
            )
        sub = out / name
        sub_meta = (
            store.read_json(sub / store.META_FILE) if (sub / store.META_FILE).is_file() else {}
        )
        if sub_meta.get("key") != key or set(sub_meta.get("lengths", [None])) - set(
            store.done_lengths(sub, key, tests)
        ):
            missing.append(name)  # not (fully) probed under the key the checkpoint has now
            continue
        model = derive_model(sub, analysis, dest / name, tests)
        models.append(model)
        for d in read_csv(dest / name / store.DISTANCE_FILE):
            distances.append(
                {"checkpoint": name, "tokens_trained": model.row["tokens_trained"], **d}
            )
    if not models:
        raise StaleResults(
            f"{out}: no checkpoint of the run is fully probed with these settings; nothing to merge"
        )
    rows = [m.row for m in models]
    write_effective_length_csv(dest / store.EFFECTIVE_LENGTH_FILE, rows)
    write_csv(dest / store.DISTANCE_BY_CHECKPOINT_FILE, distances)
    last = max(rows, key=lambda r: (r["tokens_trained"] == "", r["tokens_trained"] or 0))[
        "checkpoint"
    ]
    hist_path = out / last / store.HIST_FILE
    if hist_path.is_file():
        hist = np.load(hist_path, allow_pickle=False)
        f = position_frequency(hist, len(hist) - 1)
        write_csv(
            dest / store.POSITION_FREQUENCY_FILE, [{"i": i, "f": int(v)} for i, v in enumerate(f)]
        )
    store.write_json(
        dest / store.META_FILE,
        {
            **meta,
            **_derived_from(out, dest),
            "analysis": asdict(analysis),
            "missing": missing,
            "position_frequency_from": last,
        },
    )
    return DerivedRun(dest, models)


def _destination(out: Path, dest: Path | None) -> Path:
    """Where a derivation from `out` writes: `out` itself, or `dest` (created)."""
    if dest is None:
        return out
    dest.mkdir(parents=True, exist_ok=True)
    return dest


def _derived_from(out: Path, dest: Path) -> dict:
    """probe.json's record of a re-derivation elsewhere: the source directory (nothing when written in place)."""
    return {} if dest == out else {store.DERIVED_FROM: str(out.resolve())}


def effective_length_line(row: dict) -> str:
    """An effective_length.csv row in one line: the length, what its status makes it (undefined, a lower bound),
    its interval and f there."""
    status = row["effective_length_status"]
    flag = (
        ""
        if status == "ok"
        else f" ({status}{': undefined' if status == STATUS_NONE_PASSED else ': lower bound'})"
    )
    interval = (
        f" [95% interval {row['effective_length_lo']}-{row['effective_length_hi']}]"
        if row["effective_length_lo"] != ""
        else ""
    )
    return (
        f"effective length {row['effective_length']}{flag}{interval}, "
        f"f(effective length) = {row['f_effective_length'] or 'n/a'}"
    )

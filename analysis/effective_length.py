"""Effective context length from NIAH pass-rate curves, joined with the position frequency f(i).

Definition (the paper's, made exact): the pass-rate curve is probed at increasing lengths
l_1 < l_2 < ...; the effective length is the largest probed length before the first length
whose pass rate falls strictly below the threshold (default 0.5). The whole curve is kept in
every output so any other definition can be recomputed. Two edge cases carry a status:

- ``none_passed``: the first probed length already fails; the effective length is written as 0
  and f(effective length) is left empty (undefined).
- ``all_passed``: no probed length fails; the effective length is the largest probed length,
  a lower bound (censored).

f(effective length) is Eq. 2 (`analysis.position_freq.position_frequency`) applied to the
checkpoint's histogram of trained segment lengths, evaluated at i = effective length, as in the
paper ("f(1280) = 100B"); for i >= L it is 0, since no trained segment is longer than L.

The run-level table `effective_length.csv` has one row per checkpoint (see `RUN_COLUMNS`, then
one ``pass_rate_<length>`` column per probed length). Comparing runs:

    python analysis/effective_length.py runs/L2048/probe runs/L4096/probe --out runs/compare
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from analysis.position_freq import position_frequency

STATUS_OK = "ok"
STATUS_NONE_PASSED = "none_passed"
STATUS_ALL_PASSED = "all_passed"
THIRDS = ("0-33.3%", "33.3-66.7%", "66.7-100%")
RUN_COLUMNS = (
    "checkpoint", "tokens_seen", "train_len", "positions", "effective_length", "effective_length_status",
    "f_effective_length", "threshold", "min_retrieved", "tests_per_length",
)
SUMMARY_COLUMNS = (
    "length", "n_tests", "passed", "pass_rate", "needle_recall", "recall_depth_0_33", "recall_depth_33_67",
    "recall_depth_67_100", "mean_retrieved", "seconds", "tests_per_s",
)


@dataclass(frozen=True)
class EffectiveLength:
    """An effective length, its status (ok / none_passed / all_passed) and the first failing length."""

    value: int
    status: str
    first_failure: int | None


def effective_length(lengths: Sequence[int], pass_rates: Sequence[float], threshold: float = 0.5) -> EffectiveLength:
    """The largest length before the first one whose pass rate is below `threshold` (0 if the first fails)."""
    lengths = [int(n) for n in lengths]
    if not lengths or len(lengths) != len(pass_rates):
        raise ValueError(f"need one pass rate per length, got {len(lengths)} lengths and {len(pass_rates)} rates")
    if any(b <= a for a, b in zip(lengths, lengths[1:])):
        raise ValueError(f"lengths must be strictly increasing, got {lengths}")
    for i, (length, rate) in enumerate(zip(lengths, pass_rates)):
        if rate < threshold:
            if i == 0:
                return EffectiveLength(0, STATUS_NONE_PASSED, length)
            return EffectiveLength(lengths[i - 1], STATUS_OK, length)
    return EffectiveLength(lengths[-1], STATUS_ALL_PASSED, None)


def frequency_at(length_hist: np.ndarray, train_len: int, position: int) -> int:
    """f(position) by Eq. 2 on a trained-length histogram; 0 beyond the training length."""
    if position < 0:
        raise ValueError(f"position must be >= 0, got {position}")
    if position >= train_len:
        return 0
    return int(position_frequency(length_hist, train_len)[position])


# ------------------------------------------------------------------ per-test aggregation


def _third(depth: float) -> int:
    """0, 1 or 2: the third of the document a depth in [0, 1) falls in."""
    return min(int(depth * 3), 2)


def summarize_length(records: Sequence[Mapping], seconds: float) -> dict:
    """One summary.csv row from the scored tests of one length."""
    hits = np.array([r["hits"] for r in records], dtype=bool)
    thirds = np.array([[_third(d) for d in r["depths"]] for r in records])
    row = {
        "length": int(records[0]["length"]),
        "n_tests": len(records),
        "passed": sum(bool(r["passed"]) for r in records),
        "needle_recall": float(hits.mean()),
        "mean_retrieved": float(hits.sum(axis=1).mean()),
        "seconds": round(seconds, 3),
        "tests_per_s": round(len(records) / seconds, 3) if seconds > 0 else "",
    }
    row["pass_rate"] = row["passed"] / row["n_tests"]
    for k, name in enumerate(("recall_depth_0_33", "recall_depth_33_67", "recall_depth_67_100")):
        in_third = thirds == k
        row[name] = float(hits[in_third].mean()) if in_third.any() else ""
    return {c: row[c] for c in SUMMARY_COLUMNS}


def depth_grid(records: Iterable[Mapping], bins: int = 10) -> tuple[list[int], np.ndarray, np.ndarray]:
    """Needle recall per (depth bin, length) for a Fig. 4 heatmap: (lengths, bin edges, recall or NaN)."""
    by_length: dict[int, list[Mapping]] = {}
    for r in records:
        by_length.setdefault(int(r["length"]), []).append(r)
    lengths = sorted(by_length)
    hit_sum = np.zeros((bins, len(lengths)))
    count = np.zeros((bins, len(lengths)))
    for j, length in enumerate(lengths):
        for r in by_length[length]:
            for depth, hit in zip(r["depths"], r["hits"]):
                b = min(int(depth * bins), bins - 1)
                hit_sum[b, j] += bool(hit)
                count[b, j] += 1
    with np.errstate(invalid="ignore", divide="ignore"):
        recall = np.where(count > 0, hit_sum / np.maximum(count, 1), np.nan)
    return lengths, np.linspace(0.0, 1.0, bins + 1), recall


def failure_by_thirds(records: Iterable[Mapping]) -> list[dict]:
    """Table 4 style: missed needles per document third, per length and overall; peak = highest miss rate (first on ties)."""
    misses: dict[object, np.ndarray] = {}
    needles: dict[object, np.ndarray] = {}
    for r in records:
        for key in (int(r["length"]), "all"):
            misses.setdefault(key, np.zeros(3, dtype=np.int64))
            needles.setdefault(key, np.zeros(3, dtype=np.int64))
            for depth, hit in zip(r["depths"], r["hits"]):
                needles[key][_third(depth)] += 1
                misses[key][_third(depth)] += not hit
    rows = []
    for key in sorted((k for k in misses if k != "all"), key=int) + (["all"] if misses else []):
        m, n = misses[key], needles[key]
        row: dict = {"length": key}
        for k, third in enumerate(THIRDS):
            row[f"missed_{third}"] = int(m[k])
            row[f"miss_rate_{third}"] = float(m[k] / n[k]) if n[k] else 0.0
        rates = m / np.maximum(n, 1)  # rates, not counts: the thirds hold different numbers of needles
        row["peak_failure_depth"] = THIRDS[int(np.argmax(rates))] if m.any() else "none"
        rows.append(row)
    return rows


def markdown_table(rows: Sequence[Mapping]) -> str:
    """A GitHub markdown table of dict rows (floats to 3 decimals)."""
    if not rows:
        return ""
    cols = list(rows[0])
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ CSV files


def write_csv(path: Path, rows: Sequence[Mapping], columns: Sequence[str] | None = None) -> None:
    """Write dict rows to CSV atomically (missing cells empty)."""
    columns = list(columns or (rows[0] if rows else []))
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns, restval="")
        writer.writeheader()
        writer.writerows(rows)
    tmp.replace(path)


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


def read_csv(path: Path) -> list[dict]:
    """CSV rows with numeric cells converted (empty cells become None)."""
    with open(path, newline="") as fh:
        return [{k: _number(v) for k, v in row.items()} for row in csv.DictReader(fh)]


def pass_rate_column(length: int) -> str:
    """The effective_length.csv column holding the pass rate at `length`."""
    return f"pass_rate_{length}"


def checkpoint_row(
    name: str, tokens_seen: int | None, train_len: int, positions: str, summary: Sequence[Mapping],
    length_hist: np.ndarray | None, threshold: float, min_retrieved: int, tests_per_length: int,
) -> dict:
    """One effective_length.csv row: effective length, its status, f(effective length) and the curve.

    `length_hist` is the checkpoint's trained-length bincount (size L+1); without one (e.g. a
    Hugging Face model) f(effective length) is left empty, as it is when no length passed.
    """
    if length_hist is not None and len(length_hist) != train_len + 1:
        raise ValueError(f"{name}: trained-length histogram has {len(length_hist)} bins, expected L+1 = {train_len + 1}")
    summary = sorted(summary, key=lambda r: int(r["length"]))
    eff = effective_length([r["length"] for r in summary], [float(r["pass_rate"]) for r in summary], threshold)
    undefined = eff.status == STATUS_NONE_PASSED or length_hist is None
    f = "" if undefined else frequency_at(length_hist, train_len, eff.value)
    row = {
        "checkpoint": name, "tokens_seen": "" if tokens_seen is None else int(tokens_seen), "train_len": train_len, "positions": positions,
        "effective_length": eff.value, "effective_length_status": eff.status, "f_effective_length": f,
        "threshold": threshold, "min_retrieved": min_retrieved, "tests_per_length": tests_per_length,
    }
    row.update({pass_rate_column(int(r["length"])): float(r["pass_rate"]) for r in summary})
    return row


def write_effective_length_csv(path: Path, rows: Sequence[Mapping]) -> None:
    """effective_length.csv: RUN_COLUMNS then pass_rate_<length> for every length any checkpoint probed."""
    lengths = sorted({int(k.removeprefix("pass_rate_")) for r in rows for k in r if k.startswith("pass_rate_")})
    rows = sorted(rows, key=lambda r: (r["tokens_seen"] == "", r["tokens_seen"] or 0))
    write_csv(path, rows, list(RUN_COLUMNS) + [pass_rate_column(n) for n in lengths])


def find_run_results(path: str | Path) -> Path:
    """The probe output directory of a run: PATH itself or PATH/probe, whichever holds effective_length.csv."""
    path = Path(path)
    for candidate in (path, path / "probe"):
        if (candidate / "effective_length.csv").is_file():
            return candidate
    raise FileNotFoundError(f"{path}: no effective_length.csv here or in {path / 'probe'}; run analysis/probe.py --run first")


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
    rows = sorted(read_csv(directory / "effective_length.csv"), key=lambda r: r["tokens_seen"])
    freq_path = directory / "position_frequency.csv"
    frequency = np.array([r["f"] for r in read_csv(freq_path)], dtype=np.int64) if freq_path.is_file() else np.zeros(0, np.int64)
    if label is None:
        meta_path = directory / "probe.json"
        meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
        run = meta.get("run") or str(directory.parent if directory.name == "probe" else directory)
        label = f"{Path(run).name} (L = {rows[-1]['train_len']})" if rows else Path(run).name
    return RunResults(label, rows, frequency)


def draw_run_figures(runs: Sequence[RunResults], out: Path) -> list[Path]:
    """Fig. 2a (effective length vs tokens seen) and Fig. 2b (f(effective length) vs effective length)."""
    from analysis import plots

    curves = {r.label: (
        [row["tokens_seen"] for row in r.rows], [row["effective_length"] for row in r.rows],
        [row["effective_length_status"] for row in r.rows], [row["f_effective_length"] for row in r.rows],
    ) for r in runs}
    paths = plots.plot_fig2a_effective_length_vs_tokens(
        {k: (t, e, s) for k, (t, e, s, _) in curves.items()}, out / "fig2a_effective_length_vs_tokens")
    paths += plots.plot_fig2b_frequency_vs_effective_length(
        {k: (e, f, s) for k, (_, e, s, f) in curves.items()}, out / "fig2b_frequency_vs_effective_length")
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    """Draw Fig. 2a/2b (and Fig. 3 from the runs' f(i)) for several runs on shared axes."""
    p = argparse.ArgumentParser(prog="python analysis/effective_length.py", description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="run directories or their probe output directories")
    p.add_argument("--out", type=Path, required=True, help="directory for the figures")
    args = p.parse_args(argv)
    runs = [load_run(r) for r in args.runs]
    paths = draw_run_figures(runs, args.out)
    with_f = [r for r in runs if r.frequency.size and r.frequency[0] > 0]
    if len(with_f) > 1:
        from analysis import plots
        from analysis.position_freq import scale_to_budget

        budget = min(float(r.frequency[0]) for r in with_f)
        curves = {r.train_len: scale_to_budget(r.frequency, budget) for r in with_f}
        paths += plots.plot_fig3_budget_comparison(curves, budget, args.out / "fig3_position_frequency")
    for run in runs:
        last = run.rows[-1] if run.rows else {}
        print(f"{run.label}: {len(run.rows)} checkpoints; last effective length "
              f"{last.get('effective_length')} ({last.get('effective_length_status')})")
    print("figures: " + ", ".join(str(p) for p in paths if p.suffix == ".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

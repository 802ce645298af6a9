"""Effective context length from NIAH pass-rate curves, joined with the position frequency f(i).

Definition (the paper's, made exact): the pass-rate curve is probed at increasing lengths
l_1 < l_2 < ...; the effective length is the largest probed length before the first length
whose pass rate falls strictly below the threshold (default 0.5). The whole curve is kept in
every output so any other definition can be recomputed. Two edge cases carry a status:

- ``none_passed``: the first probed length already fails; the effective length is written as 0
  and f(effective length) is left empty (undefined).
- ``all_passed``: no probed length fails; the effective length is the largest probed length,
  a lower bound (censored).

f(effective length) is Eq. 2 (`analysis.frequency.position_frequency`) applied to the
checkpoint's histogram of trained segment lengths, evaluated at i = effective length, as in the
paper ("f(1280) = 100B"); for i >= L it is 0, since no trained segment is longer than L.

Every figure here is derived from the probe's stored per-test records under an `Analysis`
(threshold, needles a pass needs, scoring rule, bootstrap), so any of them can be changed and
recomputed without decoding again (`--threshold` etc. below). Beside the pass-rate curve:
- a bootstrap interval of the effective length (tests resampled within each length, 95%);
- needle recall and the teacher-forced needle score by distance to the question, joined with f
  at every distance (`distance.csv`); a test's distance is that of its k-th nearest needle
  (k = min_retrieved), the farthest it must reach to pass.

The run-level table `effective_length.csv` has one row per checkpoint (see `RUN_COLUMNS`, then
one ``pass_rate_<length>`` column per probed length). Comparing runs:

    python analysis/effective_length.py runs/L2048/probe runs/L4096/probe --out runs/compare
    python analysis/effective_length.py runs/L2048/probe --threshold 0.4 --out runs/t04   # re-derive first
"""

from __future__ import annotations

import csv
import json
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Iterable, Literal, Mapping, Sequence, get_args

import numpy as np
from jsonargparse import ArgumentParser

if __package__ in (
    None,
    "",
):  # run as a file: import the installed posfreq package, never this folder's files by bare name
    sys.path.pop(0)

from posfreq.analysis.frequency import position_frequency
from posfreq.train.atomic import atomic_open
from posfreq.train.cli import add_runs_argument, command_parser, parse, runs_of
from posfreq.train.outdir import OutputDirError, claim_output_dir, entry_names

STATUS_OK = "ok"
STATUS_NONE_PASSED = "none_passed"
STATUS_ALL_PASSED = "all_passed"
THIRDS = ("0-33.3%", "33.3-66.7%", "66.7-100%")
RUN_COLUMNS = (
    "checkpoint",
    "tokens_seen",
    "tokens_this_run",
    "train_len",
    "positions",
    "effective_length",
    "effective_length_status",
    "effective_length_lo",
    "effective_length_hi",
    "f_effective_length",
    "f_effective_length_lo",
    "f_effective_length_hi",
    "tf_effective_length",
    "threshold",
    "min_retrieved",
    "scoring",
    "tests_per_length",
)
SUMMARY_COLUMNS = (
    "length",
    "prompt_length",
    "n_tests",
    "passed",
    "pass_rate",
    "needle_recall",
    "recall_depth_0_33",
    "recall_depth_33_67",
    "recall_depth_67_100",
    "mean_retrieved",
    "tf_pass_rate",
    "tf_recall",
    "tf_needle_prob",
    "seconds",
    "tests_per_s",
)
DISTANCE_COLUMNS = (
    "distance_lo",
    "distance_hi",
    "needles",
    "needle_recall",
    "tf_recall",
    "tf_needle_prob",
    "tests",
    "pass_rate",
    "f_distance_lo",
)
ScoringRule = Literal["anywhere", "first_line"]
SCORING_RULES: tuple[str, ...] = get_args(ScoringRule)


@dataclass(frozen=True)
class Analysis:
    """How stored per-test records become pass rates and intervals (no decoding involved)."""

    threshold: float = 0.5
    """A length fails when its pass rate is below this."""
    min_retrieved: int = 2
    """Needles (of 4) a passing answer must contain."""
    scoring: ScoringRule = "anywhere"
    """Where needles count: anywhere in the answer (the official script) or on its first line only."""
    bootstrap: int = 1000
    """Bootstrap resamples of the tests for the effective length's interval (0: no interval)."""
    bootstrap_seed: int = 0
    """Seed of the bootstrap resampling."""
    level: float = 0.95
    """Coverage of the bootstrap interval, in (0, 1)."""

    def __post_init__(self) -> None:
        if self.scoring not in SCORING_RULES:
            raise ValueError(f"scoring must be one of {SCORING_RULES}, got {self.scoring!r}")
        if not 1 <= self.min_retrieved <= 4:
            raise ValueError(f"min_retrieved must be in 1..4, got {self.min_retrieved}")
        if not 0 < self.level < 1 or self.bootstrap < 0:
            raise ValueError(
                f"need 0 < level < 1 and bootstrap >= 0, got {self.level}, {self.bootstrap}"
            )

    def hits(self, record: Mapping) -> list[bool]:
        """The record's per-needle hits under this scoring rule."""
        return [bool(h) for h in record[f"hits_{self.scoring}"]]

    def passed(self, record: Mapping) -> bool:
        return sum(self.hits(record)) >= self.min_retrieved

    def tf_passed(self, record: Mapping) -> bool | None:
        """Teacher-forced pass: >= min_retrieved needles whose every token is the model's argmax (None: not measured)."""
        acc = record.get("tf_token_accuracy")
        return None if acc is None else sum(a == 1.0 for a in acc) >= self.min_retrieved


@dataclass(frozen=True)
class EffectiveLength:
    """An effective length, its status (ok / none_passed / all_passed) and the first failing length."""

    value: int
    status: str
    first_failure: int | None


def effective_length(
    lengths: Sequence[int], pass_rates: Sequence[float], threshold: float = 0.5
) -> EffectiveLength:
    """The largest length before the first one whose pass rate is below `threshold` (0 if the first fails)."""
    lengths = [int(n) for n in lengths]
    if not lengths or len(lengths) != len(pass_rates):
        raise ValueError(
            f"need one pass rate per length, got {len(lengths)} lengths and {len(pass_rates)} rates"
        )
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


def _mean(values: Sequence[float]) -> float | str:
    return float(np.mean(values)) if len(values) else ""


def _tf_fields(records: Sequence[Mapping], analysis: Analysis) -> dict:
    """Teacher-forced pass rate, needle recall and mean needle probability (empty when not measured)."""
    measured = [r for r in records if r.get("tf_token_accuracy") is not None]
    return {
        "tf_pass_rate": _mean([analysis.tf_passed(r) for r in measured]),
        "tf_recall": _mean([a == 1.0 for r in measured for a in r["tf_token_accuracy"]]),
        "tf_needle_prob": _mean([float(np.exp(lp)) for r in measured for lp in r["tf_logprob"]]),
    }


def summarize_length(
    records: Sequence[Mapping], seconds: float, analysis: Analysis = Analysis()
) -> dict:
    """One summary.csv row from the scored tests of one length."""
    hits = np.array([analysis.hits(r) for r in records], dtype=bool)
    thirds = np.array([[_third(d) for d in r["depths"]] for r in records])
    row = {
        "length": int(records[0]["length"]),
        "prompt_length": records[0].get("prompt_length", ""),
        "n_tests": len(records),
        "passed": sum(analysis.passed(r) for r in records),
        "needle_recall": float(hits.mean()),
        "mean_retrieved": float(hits.sum(axis=1).mean()),
        "seconds": round(seconds, 3),
        "tests_per_s": round(len(records) / seconds, 3) if seconds > 0 else "",
        **_tf_fields(records, analysis),
    }
    row["pass_rate"] = row["passed"] / row["n_tests"]
    for k, name in enumerate(("recall_depth_0_33", "recall_depth_33_67", "recall_depth_67_100")):
        in_third = thirds == k
        row[name] = float(hits[in_third].mean()) if in_third.any() else ""
    return {c: row[c] for c in SUMMARY_COLUMNS}


def bootstrap_interval(
    lengths: Sequence[int],
    passed: Sequence[Sequence[bool]],
    analysis: Analysis = Analysis(),
) -> tuple[int, int] | None:
    """A percentile bootstrap interval of the effective length: tests resampled within each length.

    Every replicate redraws each length's tests with replacement, recomputes the pass rates and
    applies `effective_length`; the interval holds the replicates' central `level` mass and is
    made of probed lengths (0 for none passed). Deterministic for `analysis.bootstrap_seed`.
    """
    if analysis.bootstrap == 0 or not lengths:
        return None
    rng = np.random.default_rng(analysis.bootstrap_seed)
    rates = np.stack(
        [
            np.asarray(p, dtype=float)[
                rng.integers(0, len(p), size=(analysis.bootstrap, len(p)))
            ].mean(1)
            for p in passed
        ],
        axis=1,
    )
    fails = rates < analysis.threshold
    first = np.where(fails.any(axis=1), fails.argmax(axis=1), len(lengths))
    values = np.where(first == 0, 0, np.asarray(lengths)[np.maximum(first - 1, 0)])
    tail = (1 - analysis.level) / 2
    lo, hi = np.quantile(values, [tail, 1 - tail], method="inverted_cdf")
    return int(lo), int(hi)


def distance_rows(
    records: Sequence[Mapping],
    edges: Sequence[int],
    analysis: Analysis = Analysis(),
    length_hist: np.ndarray | None = None,
    train_len: int | None = None,
) -> list[dict]:
    """Needle recall, teacher-forced score and pass rate per distance bin (lo, hi], joined with f(lo).

    A needle's distance is from its first token to the question's; a test sits in the bin of its
    `min_retrieved`-th nearest needle. f is Eq. 2 on the trained-length histogram (empty without one).
    """
    edges = [int(e) for e in edges]
    needles = [[] for _ in edges[1:]]
    tests = [[] for _ in edges[1:]]

    def bin_of(distance: int) -> int | None:
        k = int(np.searchsorted(edges, distance, side="left")) - 1
        return k if 0 <= k < len(edges) - 1 else None

    for r in records:
        hits = analysis.hits(r)
        tf_acc = r.get("tf_token_accuracy") or [None] * len(hits)
        tf_lp = r.get("tf_logprob") or [None] * len(hits)
        for d, hit, acc, lp in zip(r["distances"], hits, tf_acc, tf_lp):
            if (k := bin_of(int(d))) is not None:
                needles[k].append((hit, acc, lp))
        kth = sorted(int(d) for d in r["distances"])[analysis.min_retrieved - 1]
        if (k := bin_of(kth)) is not None:
            tests[k].append(analysis.passed(r))
    f = (
        position_frequency(length_hist, train_len)
        if length_hist is not None and train_len
        else None
    )
    rows = []
    for k, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
        tf = [(acc, lp) for _, acc, lp in needles[k] if acc is not None]
        rows.append(
            {
                "distance_lo": lo,
                "distance_hi": hi,
                "needles": len(needles[k]),
                "needle_recall": _mean([h for h, _, _ in needles[k]]),
                "tf_recall": _mean([acc == 1.0 for acc, _ in tf]),
                "tf_needle_prob": _mean([float(np.exp(lp)) for _, lp in tf]),
                "tests": len(tests[k]),
                "pass_rate": _mean(tests[k]),
                "f_distance_lo": "" if f is None else (int(f[lo]) if lo < len(f) else 0),
            }
        )
    return rows


def depth_grid(
    records: Iterable[Mapping], bins: int = 10, analysis: Analysis = Analysis()
) -> tuple[list[int], np.ndarray, np.ndarray]:
    """Needle recall per (depth bin, length) for a Fig. 4 heatmap: (lengths, bin edges, recall or NaN)."""
    by_length: dict[int, list[Mapping]] = {}
    for r in records:
        by_length.setdefault(int(r["length"]), []).append(r)
    lengths = sorted(by_length)
    hit_sum = np.zeros((bins, len(lengths)))
    count = np.zeros((bins, len(lengths)))
    for j, length in enumerate(lengths):
        for r in by_length[length]:
            for depth, hit in zip(r["depths"], analysis.hits(r)):
                b = min(int(depth * bins), bins - 1)
                hit_sum[b, j] += bool(hit)
                count[b, j] += 1
    with np.errstate(invalid="ignore", divide="ignore"):
        recall = np.where(count > 0, hit_sum / np.maximum(count, 1), np.nan)
    return lengths, np.linspace(0.0, 1.0, bins + 1), recall


def failure_by_thirds(records: Iterable[Mapping], analysis: Analysis = Analysis()) -> list[dict]:
    """Table 4 style: missed needles per document third, per length and overall; peak = highest miss rate (first on ties)."""
    misses: dict[object, np.ndarray] = {}
    needles: dict[object, np.ndarray] = {}
    for r in records:
        for key in (int(r["length"]), "all"):
            misses.setdefault(key, np.zeros(3, dtype=np.int64))
            needles.setdefault(key, np.zeros(3, dtype=np.int64))
            for depth, hit in zip(r["depths"], analysis.hits(r)):
                needles[key][_third(depth)] += 1
                misses[key][_third(depth)] += not hit
    rows = []
    for key in sorted((k for k in misses if k != "all"), key=int) + (["all"] if misses else []):
        m, n = misses[key], needles[key]
        row: dict = {"length": key}
        for k, third in enumerate(THIRDS):
            row[f"missed_{third}"] = int(m[k])
            row[f"miss_rate_{third}"] = float(m[k] / n[k]) if n[k] else 0.0
        rates = m / np.maximum(
            n, 1
        )  # rates, not counts: the thirds hold different numbers of needles
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
    with atomic_open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns, restval="")
        writer.writeheader()
        writer.writerows(rows)


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
    name: str,
    train_len: int,
    positions: str,
    summary: Sequence[Mapping],
    passed: Sequence[Sequence[bool]],
    length_hist: np.ndarray | None,
    analysis: Analysis,
    tests_per_length: int,
    tokens_seen: int | None = None,
    tokens_this_run: int | None = None,
) -> dict:
    """One effective_length.csv row: effective length, its interval and status, f at each, and the curve.

    `summary` holds one summary.csv row per probed length and `passed` each length's per-test
    passes (for the bootstrap). `length_hist` is the checkpoint's trained-length bincount (size
    L+1); without one (e.g. a Hugging Face model) f is left empty, as it is when no length passed.
    `tokens_seen` counts every token the weights were trained on (a warm-up included);
    `tokens_this_run` those of the checkpoint's own run.
    """
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
    tf_eff = (
        ""
        if any(v in ("", None) for v in tf_rates)
        else effective_length(lengths, tf_rates, analysis.threshold).value
    )
    row = {
        "checkpoint": name,
        "tokens_seen": "" if tokens_seen is None else int(tokens_seen),
        "tokens_this_run": "" if tokens_this_run is None else int(tokens_this_run),
        "train_len": train_len,
        "positions": positions,
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
        "tf_effective_length": tf_eff,
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
    rows = sorted(rows, key=lambda r: (r["tokens_seen"] == "", r["tokens_seen"] or 0))
    write_csv(path, rows, list(RUN_COLUMNS) + [pass_rate_column(n) for n in lengths])


def find_run_results(path: str | Path) -> Path:
    """The probe output directory of a run: PATH itself, PATH/probe, or its one PATH/probe-* holding effective_length.csv."""
    path = Path(path)
    if (path / "effective_length.csv").is_file():
        return path
    found = [
        c
        for c in [path / "probe", *sorted(path.glob("probe-*"))]
        if (c / "effective_length.csv").is_file()
    ]
    if len(found) == 1:
        return found[0]
    if not found:
        raise FileNotFoundError(
            f"{path}: no effective_length.csv here, in probe/ or in probe-*/; run "
            "analysis/probe.py --run first"
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
    rows = sorted(read_csv(directory / "effective_length.csv"), key=lambda r: r["tokens_seen"])
    freq_path = directory / "position_frequency.csv"
    frequency = (
        np.array([r["f"] for r in read_csv(freq_path)], dtype=np.int64)
        if freq_path.is_file()
        else np.zeros(0, np.int64)
    )
    if label is None:
        meta_path = directory / "probe.json"
        meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
        run = meta.get("run") or str(directory.parent if directory.name == "probe" else directory)
        label = f"{Path(run).name} (L = {rows[-1]['train_len']})" if rows else Path(run).name
    return RunResults(label, rows, frequency)


def draw_run_figures(runs: Sequence[RunResults], out: Path) -> list[Path]:
    """Fig. 2a (effective length vs tokens seen) and Fig. 2b (f(effective length) vs effective length)."""
    from posfreq.analysis import plots

    curves = {
        r.label: (
            [row["tokens_seen"] for row in r.rows],
            [row["effective_length"] for row in r.rows],
            [row["effective_length_status"] for row in r.rows],
            [row["f_effective_length"] for row in r.rows],
        )
        for r in runs
    }
    intervals = {
        r.label: (
            [row.get("effective_length_lo") for row in r.rows],
            [row.get("effective_length_hi") for row in r.rows],
        )
        for r in runs
    }
    paths = plots.plot_fig2a_effective_length_vs_tokens(
        {k: (t, e, s) for k, (t, e, s, _) in curves.items()},
        out / "fig2a_effective_length_vs_tokens",
        intervals,
    )
    paths += plots.plot_fig2b_frequency_vs_effective_length(
        {k: (e, f, s) for k, (_, e, s, f) in curves.items()},
        out / "fig2b_frequency_vs_effective_length",
        intervals,
    )
    return paths


def build_parser() -> ArgumentParser:
    """`posfreq effective-length`: the runs, the figures' directory and the `Analysis` options to re-derive with."""
    parser = command_parser(
        "posfreq effective-length",
        "Draw Fig. 2a / 2b (and Fig. 3 from the runs' f(i)) for several probed runs on shared axes. An analysis "
        "option given here re-derives every table from the stored per-test records first (no decoding); one left "
        "unset (null) keeps the value the tables were derived with.",
    )
    add_runs_argument(parser)
    parser.add_argument(
        "--out", type=Path, default=Path("runs/effective_length"), help="Directory for the figures."
    )
    parser.add_class_arguments(Analysis, nested_key=None, as_group=True)
    parser.set_defaults({f.name: None for f in fields(Analysis)})
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Draw Fig. 2a/2b (and Fig. 3 from the runs' f(i)) for several runs on shared axes, re-deriving them first if asked."""
    from posfreq.analysis.results import StaleResults

    parser = build_parser()
    args = parse(parser, argv)
    args.runs = runs_of(args, parser)
    try:
        return _main(args)
    except (StaleResults, FileNotFoundError, OutputDirError) as err:
        raise SystemExit(f"error: {err}") from None


def _main(args) -> int:
    """`main` once the arguments are parsed."""
    options = {f.name: args[f.name] for f in fields(Analysis) if args[f.name] is not None}
    if options:
        from posfreq.analysis import results

        for run in args.runs:
            directory = find_run_results(run)
            meta = json.loads((directory / results.META_FILE).read_text())
            try:
                analysis = Analysis(**{**meta.get("analysis", {}), **options})
            except ValueError as err:
                raise SystemExit(f"error: {err}") from None
            derive = results.derive_run if "checkpoints" in meta else results.derive_model
            derive(directory, analysis)
            print(f"{directory}: tables re-derived from the stored records with {options}")
    runs = [load_run(r) for r in args.runs]
    claim_output_dir(
        args.out,
        "effective-length",
        written_before=lambda path: all(n.endswith((".png", ".pdf")) for n in entry_names(path)),
    )
    paths = draw_run_figures(runs, args.out)
    with_f = [r for r in runs if r.frequency.size and r.frequency[0] > 0]
    if len(with_f) > 1:
        from posfreq.analysis import plots
        from posfreq.analysis.frequency import scale_to_budget

        budget = min(float(r.frequency[0]) for r in with_f)
        curves = {r.train_len: scale_to_budget(r.frequency, budget) for r in with_f}
        paths += plots.plot_fig3_budget_comparison(
            curves, budget, args.out / "fig3_position_frequency"
        )
    for run in runs:
        last = run.rows[-1] if run.rows else {}
        print(
            f"{run.label}: {len(run.rows)} checkpoints; last effective length "
            f"{last.get('effective_length')} ({last.get('effective_length_status')})"
        )
    print("figures: " + ", ".join(str(p) for p in paths if p.suffix == ".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

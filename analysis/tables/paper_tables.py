"""The paper's Table 1 and Table 2 for one model: NIAH pass rate per position scheme and length, with 95% intervals
and each scheme's paired difference from rope over the same tests; RULER's score per task and scheme.

Every scheme is probed with the same tests (one probe seed), so a test's outcome under a scheme and under rope form
a pair. Intervals are percentile bootstraps over tests: of the pass rate, and of the mean paired difference.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from posfreq.analysis.tables.pass_curve import Analysis, percentile_interval

MEASURES = ("greedy", "teacher_forced")
"""What makes a test pass: its greedy answer holds enough needles (the paper's), or, under teacher forcing, enough
needles have every token as the model's argmax (one forward per test, no decoding: paired and cheap)."""

TABLE1_COLUMNS = (
    "scheme",
    "length",
    "tests",
    "pass_rate",
    "pass_lo",
    "pass_hi",
    "difference_from_rope",
    "difference_lo",
    "difference_hi",
)


def outcomes_by_test(
    records: Sequence[Mapping], measure: str, analysis: Analysis = Analysis()
) -> dict[tuple[int, int], float]:
    """Each test's outcome (1 pass, 0 fail) under `measure`, by (length, test index)."""
    if measure not in MEASURES:
        raise ValueError(f"measure must be one of {MEASURES}, got {measure!r}")
    outcomes = {}
    for record in records:
        passed = analysis.passed(record) if measure == "greedy" else analysis.tf_passed(record)
        if passed is None:
            raise ValueError(
                f"test {record.get('index')} at {record.get('length')} has no teacher-forced score; "
                "Fix: probe with --teacher-forced true, or use the greedy measure"
            )
        outcomes[(int(record["length"]), int(record["index"]))] = float(passed)
    return outcomes


def token_accuracy_by_test(records: Sequence[Mapping]) -> dict[tuple[int, int], float]:
    """Each test's mean teacher-forced needle token accuracy (the share of its needles' tokens that are the model's
    argmax), by (length, test index): a continuous score paired across schemes like the pass, which it smooths."""
    scores = {}
    for record in records:
        accuracy = record.get("tf_token_accuracy")
        if accuracy is None:
            raise ValueError(
                f"test {record.get('index')} at {record.get('length')} has no teacher-forced score; "
                "Fix: probe with --teacher-forced true"
            )
        scores[(int(record["length"]), int(record["index"]))] = float(np.mean(accuracy))
    return scores


TOKEN_ACCURACY_COLUMNS = {
    "pass_rate": "token_accuracy",
    "pass_lo": "token_accuracy_lo",
    "pass_hi": "token_accuracy_hi",
}
"""table1's value columns as table1_token_accuracy.csv names them (the rows of `table1` over
`token_accuracy_by_test`)."""


def table1(
    outcomes: Mapping[str, Mapping[tuple[int, int], float]],
    n_boot: int = 2000,
    seed: int = 0,
    baseline: str = "rope",
) -> list[dict]:
    """A row per scheme and length: the pass rate (the mean of any per-test score in `outcomes`) with its
    interval, and the mean paired difference from `baseline` over the tests both ran, with its interval (empty
    for the baseline itself)."""
    rng = np.random.default_rng(seed)
    rows = []
    for scheme, by_test in outcomes.items():
        for length in sorted({n for n, _ in by_test}):
            tests = sorted(i for n, i in by_test if n == length)
            passed = np.array([by_test[(length, i)] for i in tests])
            draws = rng.integers(0, len(tests), size=(n_boot, len(tests)))
            row = {"scheme": scheme, "length": length, "tests": len(tests)}
            row["pass_rate"] = float(passed.mean())
            row["pass_lo"], row["pass_hi"] = percentile_interval(passed[draws].mean(1))
            shared = [i for i in tests if (length, i) in outcomes.get(baseline, {})]
            if scheme != baseline and shared:
                diff = np.array(
                    [by_test[(length, i)] - outcomes[baseline][(length, i)] for i in shared]
                )
                resampled = diff[rng.integers(0, len(shared), size=(n_boot, len(shared)))]
                row["difference_from_rope"] = float(diff.mean())
                row["difference_lo"], row["difference_hi"] = percentile_interval(resampled.mean(1))
            else:
                row |= {"difference_from_rope": "", "difference_lo": "", "difference_hi": ""}
            rows.append(row)
    return rows


def table1_markdown(rows: Sequence[Mapping]) -> str:
    """Table 1 as the paper lays it out: a row per scheme, a column per length, each cell the pass rate in percent
    with its 95% interval and, below rope, the paired difference from rope with its interval."""
    lengths = sorted({r["length"] for r in rows})
    schemes = list(dict.fromkeys(r["scheme"] for r in rows))
    cell = {(r["scheme"], r["length"]): r for r in rows}
    lines = [
        "| scheme | " + " | ".join(f"{n:,}" for n in lengths) + " |",
        "|---|" + "---|" * len(lengths),
    ]
    for scheme in schemes:
        parts = []
        for n in lengths:
            r = cell.get((scheme, n))
            if r is None:
                parts.append("–")
                continue
            text = (
                f"{100 * r['pass_rate']:.1f} [{100 * r['pass_lo']:.1f}, {100 * r['pass_hi']:.1f}]"
            )
            if r["difference_from_rope"] != "":
                text += (
                    f"<br>{100 * r['difference_from_rope']:+.1f} "
                    f"[{100 * r['difference_lo']:+.1f}, {100 * r['difference_hi']:+.1f}]"
                )
            parts.append(text)
        lines.append(f"| {scheme} | " + " | ".join(parts) + " |")
    return "\n".join(lines) + "\n"


def table2(scores: Mapping[str, Sequence[Mapping]]) -> list[dict]:
    """A row per task and length (and the mean over tasks), a column per scheme: RULER's scores.csv rows by
    scheme, joined."""
    joined: dict[tuple[str, int], dict] = {}
    for scheme, rows in scores.items():
        for row in rows:
            key = (str(row["task"]), int(row["length"]))
            joined.setdefault(key, {"task": key[0], "length": key[1]})[scheme] = float(row["score"])
    return list(joined.values())

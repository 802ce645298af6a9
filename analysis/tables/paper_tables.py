"""The paper's Table 1 and Table 2 for one model: NIAH pass rate per position scheme and length, with 95% intervals
and each scheme's paired difference from a baseline (rope) over the same tests; RULER's score per task and scheme.

Every scheme is probed with the same tests (one probe seed), so a test's outcome under a scheme and under rope form
a pair. Every cell of one length uses the tests that every scheme probed at that length has (a scheme's others
are counted as left out). A pass rate's interval is the Wilson score interval (a proportion of independent tests;
it keeps a width at 0 and 100%); a continuous score's mean and every paired difference get a percentile bootstrap
over the tests, each cell resampled by its own generator (from the seed, the scheme and the length), so a cell's
interval does not depend on which other schemes are listed, or in what order.
"""

from __future__ import annotations

import json
import re
import zlib
from typing import Mapping, Sequence

import numpy as np

from posfreq.analysis.table_files import markdown_table
from posfreq.analysis.tables.measures import PASS, TF_PASS, scores_by_test
from posfreq.analysis.tables.pass_curve import Analysis, percentile_interval, wilson_interval
from posfreq.train.positions.names import SCHEMES

TABLE1_MEASURES = {"greedy": PASS, "teacher_forced": TF_PASS}
"""Table 1's --measure: a test passes when its greedy answer holds enough needles (the paper's), or, under teacher
forcing, when enough needles have every scored token as the model's argmax (one forward per test, no decoding: paired and
cheap). Both are measures of analysis/tables/measures.py."""

AUTO = "string_auto"
"""Table 1's row of STRING with the shift derived from the model's measured effective length."""
ROW_LABEL = re.compile(r"[a-z0-9_]{1,32}")
"""What may follow '@' in a row name (it names the row's probe folder)."""
PAPER_ORDER = ("rope", "rerope", "ntk", "self_extend", "yarn", "dca", "string")
"""Table 1's rows in the paper's order (`posfreq table`'s default rows)."""

TABLE1_COLUMNS = (
    "scheme",
    "length",
    "tests",
    "tests_left_out",
    "pass_rate",
    "pass_lo",
    "pass_hi",
    "baseline",
    "difference",
    "difference_lo",
    "difference_hi",
    "only_scheme_passed",
    "only_baseline_passed",
    "mcnemar_p",
    "holm_p",
)
"""`tests`: the tests every scheme probed at the length has, which every cell of the length uses;
`tests_left_out`: this scheme's other tests there. `difference` is the mean paired difference from `baseline`
(empty, as is `baseline`, for the baseline's own row). For pass rates, `only_scheme_passed` and
`only_baseline_passed` count the discordant tests, `mcnemar_p` is the exact McNemar test's p-value and `holm_p` its
Holm adjustment over every comparison with the baseline in the table (empty for a continuous score)."""


def scheme_of(row: str) -> str:
    """The position scheme a Table 1 row runs: its name up to '@' (`string@half` is STRING with options of its
    own; `string_auto` is STRING with the measured shift)."""
    return "string" if row == AUTO else row.split("@", 1)[0]


def chosen_schemes(spec: str) -> list[str]:
    """The comma list of rows, checked: known schemes (a label after '@' of letters, digits and '_'), the
    plain rope row among them, each once."""
    schemes = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = sorted(
        s
        for s in schemes
        if s == AUTO
        or scheme_of(s) not in SCHEMES
        or ("@" in s and not ROW_LABEL.fullmatch(s.split("@", 1)[1]))
    )
    if unknown or "rope" not in schemes or len(set(schemes)) != len(schemes):
        raise ValueError(
            f"--schemes {spec}: need distinct rows, each one of {', '.join(SCHEMES)} or SCHEME@LABEL (a label of "
            "up to 32 lowercase letters, digits and '_'), rope included"
            + (f" (unknown: {unknown})" if unknown else "")
        )
    return schemes


def outcomes_by_test(
    records: Sequence[Mapping], measure: str, analysis: Analysis = Analysis()
) -> dict[tuple[int, int], float]:
    """Each test's outcome (1 pass, 0 fail) under Table 1's `measure` (TABLE1_MEASURES), by (length, test index)."""
    if measure not in TABLE1_MEASURES:
        raise ValueError(f"measure must be one of {tuple(TABLE1_MEASURES)}, got {measure!r}")
    return scores_by_test(TABLE1_MEASURES[measure], records, analysis)


TOKEN_ACCURACY_COLUMNS = {
    "pass_rate": "token_accuracy",
    "pass_lo": "token_accuracy_lo",
    "pass_hi": "token_accuracy_hi",
}
"""table1's value columns as table1_token_accuracy.csv names them (the rows of `table1` over the TOKEN_ACCURACY
measure's scores by test)."""


def cell_rng(seed: int, scheme: str, length: int) -> np.random.Generator:
    """The generator of one Table 1 cell: from the seed, the scheme's name (crc32, stable across runs, unlike
    Python's hash) and the length, so no cell's draws depend on another's."""
    return np.random.default_rng(
        np.random.SeedSequence([seed, zlib.crc32(scheme.encode()), length])
    )


def shared_tests(outcomes: Mapping[str, Mapping[tuple[int, int], float]]) -> dict[int, list[int]]:
    """Length -> the test indices that every scheme with any test at that length has."""
    shared = {}
    for length in sorted({n for by_test in outcomes.values() for n, _ in by_test}):
        held = [{i for n, i in by_test if n == length} for by_test in outcomes.values()]
        shared[length] = sorted(set.intersection(*(h for h in held if h)))
        if not shared[length]:
            raise ValueError(
                f"at length {length} the schemes share no test. Fix: probe every scheme with the same seed"
            )
    return shared


def table1(
    outcomes: Mapping[str, Mapping[tuple[int, int], float]],
    n_boot: int = 2000,
    seed: int = 0,
    baseline: str = "rope",
    binary: bool = True,
) -> list[dict]:
    """A row per scheme and length, over the tests every scheme at that length has: the mean score with its 95%
    interval (binary: a pass rate, with the Wilson score interval; otherwise a continuous score's mean, with a
    percentile bootstrap) and the mean paired difference from `baseline`, with a paired percentile bootstrap
    interval (the same resampled tests for both; empty for the baseline itself and where it lacks the length). Pass
    rates also get the exact McNemar test against the baseline, Holm-adjusted over every such comparison in the
    table."""
    from posfreq.analysis.tables.paired_tests import (  # scipy: when tables are made
        holm_adjust,
        mcnemar_exact,
    )

    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
    shared = shared_tests(outcomes)
    base = outcomes.get(baseline, {})
    rows = []
    for scheme, by_test in outcomes.items():
        for length in sorted({n for n, _ in by_test}):
            tests = shared[length]
            scores = np.array([by_test[(length, i)] for i in tests])
            held = sum(n == length for n, _ in by_test)
            row = {"scheme": scheme, "length": length, "tests": len(tests)}
            row |= {"tests_left_out": held - len(tests), "pass_rate": float(scores.mean())}
            draws = cell_rng(seed, scheme, length).integers(
                0, len(tests), size=(n_boot, len(tests))
            )
            if binary:
                if not np.isin(scores, (0.0, 1.0)).all():
                    raise ValueError(
                        f"{scheme} at {length}: scores other than 0 and 1 are no pass rate. "
                        "Fix: binary=False for a continuous score"
                    )
                row["pass_lo"], row["pass_hi"] = wilson_interval(int(scores.sum()), len(tests))
            else:
                row["pass_lo"], row["pass_hi"] = percentile_interval(scores[draws].mean(1))
            if scheme != baseline and (length, tests[0]) in base:
                diff = scores - np.array([base[(length, i)] for i in tests])
                row |= {"baseline": baseline, "difference": float(diff.mean())}
                row["difference_lo"], row["difference_hi"] = percentile_interval(
                    diff[draws].mean(1)
                )
                if binary:
                    before = [base[(length, i)] for i in tests]
                    better, worse, p = mcnemar_exact(before, scores)
                    row |= {
                        "only_scheme_passed": better,
                        "only_baseline_passed": worse,
                        "mcnemar_p": p,
                    }
            else:
                row |= {"baseline": "", "difference": "", "difference_lo": "", "difference_hi": ""}
            rows.append(row)
    tested = [r for r in rows if "mcnemar_p" in r]
    for row, adjusted in zip(tested, holm_adjust([r["mcnemar_p"] for r in tested])):
        row["holm_p"] = adjusted
    for row in rows:
        for column in ("only_scheme_passed", "only_baseline_passed", "mcnemar_p", "holm_p"):
            row.setdefault(column, "")
    return rows


def table1_markdown(rows: Sequence[Mapping]) -> str:
    """Table 1 as the paper lays it out: a row per scheme, a column per length headed by its number of tests n,
    each cell the pass rate in percent with its 95% interval and, below it, the paired difference from the
    baseline with its interval, then (pass rates) the discordant tests `only scheme:only baseline` with the exact
    McNemar p and its Holm adjustment."""
    lengths = sorted({r["length"] for r in rows})
    schemes = list(dict.fromkeys(r["scheme"] for r in rows))
    cell = {(r["scheme"], r["length"]): r for r in rows}
    tests = {r["length"]: r["tests"] for r in rows}
    lines = [
        "| scheme | " + " | ".join(f"{n:,} (n = {tests[n]})" for n in lengths) + " |",
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
            if r["difference"] != "":
                text += (
                    f"<br>{100 * r['difference']:+.1f} "
                    f"[{100 * r['difference_lo']:+.1f}, {100 * r['difference_hi']:+.1f}]"
                )
            if r.get("mcnemar_p") not in (None, ""):
                text += (
                    f"<br>{r['only_scheme_passed']}:{r['only_baseline_passed']}, "
                    f"p {p_text(r['mcnemar_p'])}, Holm {p_text(r['holm_p'])}"
                )
            parts.append(text)
        lines.append(f"| {scheme} | " + " | ".join(parts) + " |")
    return "\n".join(lines) + "\n"


def p_text(value) -> str:
    """A p-value in a table cell: three significant digits, and '< 0.001' below that."""
    value = float(value)
    return "< 0.001" if value < 0.001 else f"{value:.3g}"


def left_out_note(rows: Sequence[Mapping]) -> str:
    """A line per length where some scheme had tests beyond those every scheme has (empty when none had)."""
    lines = []
    for length in sorted({r["length"] for r in rows}):
        mine = [r for r in rows if r["length"] == length]
        extra = [f"{r['scheme']} {r['tests_left_out']}" for r in mine if r["tests_left_out"]]
        if extra:
            lines.append(
                f"- At {length:,} every cell uses the {mine[0]['tests']} tests all its schemes have; "
                f"tests left out: {', '.join(extra)}.\n"
            )
    return "".join(lines)


def table2(scores: Mapping[str, Sequence[Mapping]]) -> list[dict]:
    """A row per task and length (and the mean over tasks), a column per scheme: RULER's scores.csv rows by
    scheme, joined."""
    joined: dict[tuple[str, int], dict] = {}
    for scheme, rows in scores.items():
        for row in rows:
            key = (str(row["task"]), int(row["length"]))
            joined.setdefault(key, {"task": key[0], "length": key[1]})[scheme] = float(row["score"])
    return list(joined.values())


def table1_document(
    rows: Sequence[Mapping],
    accuracy: Sequence[Mapping],
    *,
    model: str,
    tests: int,
    measure: str,
    answer_order: str,
    bootstrap: int,
    options: Mapping[str, dict],
) -> str:
    """table1.md: what the table measured and how each cell reads, Table 1 (`table1_markdown`), the note on tests
    left out, the token-accuracy companion table when `accuracy` has rows, and every row's options as run."""
    # the answer order decides only the teacher-forced score: a greedy answer is read whatever its order
    order = f" (answer order: {answer_order})" if measure == "teacher_forced" else ""
    header = (
        f"# Table 1: 4-needle NIAH pass rate (%) by position scheme and length\n\n"
        f"Model `{model}`, {tests} tests per length asked; every cell of a length uses the same tests, "
        f"those every scheme has there (n in the column's head); measure: {measure}{order}. Each cell: the pass "
        "rate with its 95% Wilson score interval, then (every "
        "scheme but rope) the mean paired difference from rope over the same tests with its 95% paired percentile "
        f"bootstrap interval ({bootstrap} resamples), then the tests only the scheme passed : only rope "
        "passed, the exact McNemar test's p, and its Holm adjustment over every comparison with rope in this table "
        "(a comparison is significant at 5% when its Holm p is at most 0.05).\n\n"
    )
    note = left_out_note(rows)  # said whenever some scheme had tests the others lack
    options_lines = "\n".join(f"- {s}: `{json.dumps(o)}`" for s, o in options.items())
    companion = (
        "\n## Teacher-forced needle token accuracy (%)\n\nThe same tests and layout, each test scored by the share "
        "of its needles' scored tokens that are the model's argmax under teacher forcing (answer order: "
        f"{answer_order}): a continuous, paired score that moves where pass rates sit at 0 or 100 "
        "(`table1_token_accuracy.csv`). Its intervals, of a mean rather than a proportion, are percentile "
        "bootstraps over the tests.\n\n" + table1_markdown(accuracy)
        if accuracy
        else ""
    )
    return (
        header
        + table1_markdown(rows)
        + (f"\n{note}" if note else "")
        + companion
        + "\nOptions as run (defaults included):\n\n"
        + options_lines
    )


def table2_document(joined: Sequence[Mapping], schemes: Sequence[str]) -> str:
    """table2.md: RULER's scores (`table2`'s rows), a row per task and length, a column per scheme."""
    title = "# Table 2: RULER score by task and position scheme\n\n"
    return title + markdown_table(joined, ["task", "length", *schemes])

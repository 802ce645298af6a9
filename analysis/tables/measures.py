"""The probe's measures, each declared once: its value for one stored test (per test, or one per needle), its
column, and which way is better. summary.csv, distance.csv and Table 1 read them from here, so adding a measure
touches its entry, its test and its line in docs/probe.md.

A record without a measure's score (a probe run with --teacher-forced false) gives None: not measured, never 0.
The order-free teacher-forced score is not an entry of its own: it is these teacher-forced entries on a probe
run with --answer-order alone, whose stored scores have the same fields (over each needle's tokens after its cue).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Mapping, Sequence

import numpy as np

from posfreq.analysis.tables.pass_curve import Analysis, tf_hits

Value = Callable[[Mapping, Analysis], "float | list[float] | None"]


@dataclass(frozen=True)
class Measure:
    """One measure of a stored test under an `Analysis`, averaged over tests (or needles) wherever it is a column."""

    column: str
    """Its column in summary.csv and distance.csv (and its name here)."""
    unit: Literal["test", "needle"]
    """What one value scores: a test (its pass) or each of its needles."""
    value: Value
    """The value(s) of one record: a float for a test, a list of floats (one per needle) for needles; None where the
    record did not measure it."""
    higher_is_better: bool
    """Which way is better (every probe measure so far: higher)."""
    doc: str
    """What it is, in a line."""

    def test_score(self, record: Mapping, analysis: Analysis) -> float | None:
        """One number for the test: its value, or the mean over its needles."""
        value = self.value(record, analysis)
        if value is None or self.unit == "test":
            return value
        return float(np.mean(value))


def _measured(record: Mapping) -> bool:
    return record.get("tf_token_accuracy") is not None


PASS = Measure(
    "pass_rate",
    "test",
    lambda r, a: float(a.passed(r)),
    True,
    "the answer holds at least min_retrieved needles under the Analysis' scoring (the paper's, greedy)",
)
NEEDLE_RECALL = Measure(
    "needle_recall",
    "needle",
    lambda r, a: [float(h) for h in a.hits(r)],
    True,
    "each needle found in the answer under the Analysis' scoring",
)
TF_PASS = Measure(
    "tf_pass_rate",
    "test",
    lambda r, a: float(a.tf_passed(r)) if _measured(r) else None,
    True,
    "at least min_retrieved needles have every scored token as the model's argmax under teacher forcing",
)
TF_RECALL = Measure(
    "tf_recall",
    "needle",
    lambda r, a: [float(h) for h in tf_hits(r)] if _measured(r) else None,
    True,
    "each needle has every scored token as the model's argmax under teacher forcing (pass_curve.tf_hits)",
)
TF_NEEDLE_PROB = Measure(
    "tf_needle_prob",
    "needle",
    lambda r, a: [float(np.exp(lp)) for lp in r["tf_logprob"]] if _measured(r) else None,
    True,
    "each needle's probability under teacher forcing (the exp of its scored tokens' summed log-probability; "
    "under --answer-order alone, of its tokens after the cue, so not comparable with a named order's)",
)
TOKEN_ACCURACY = Measure(
    "token_accuracy",
    "test",
    lambda r, a: float(np.mean(r["tf_token_accuracy"])) if _measured(r) else None,
    True,
    "the mean over needles of the share of a needle's scored tokens that are the model's argmax (teacher-forced)",
)

MEASURES = {
    m.column: m for m in (PASS, NEEDLE_RECALL, TF_PASS, TF_RECALL, TF_NEEDLE_PROB, TOKEN_ACCURACY)
}
"""Every probe measure by its column."""


def mean_of(measure: Measure, records: Sequence[Mapping], analysis: Analysis) -> float | str:
    """The measure's mean over the records that measured it (over their needles for a needle measure); "" where
    none did (a CSV's empty cell)."""
    values: list[float] = []
    for record in records:
        value = measure.value(record, analysis)
        if value is not None:
            values.extend(value if measure.unit == "needle" else [value])
    return float(np.mean(values)) if values else ""


def scores_by_test(
    measure: Measure, records: Sequence[Mapping], analysis: Analysis = Analysis()
) -> dict[tuple[int, int], float]:
    """Each test's score under `measure` by (length, test index), for tables that pair tests across schemes; a
    record that did not measure it is a ValueError naming the test and the fix."""
    scores = {}
    for record in records:
        score = measure.test_score(record, analysis)
        if score is None:
            raise ValueError(
                f"test {record.get('index')} at {record.get('length')} has no teacher-forced score for "
                f"{measure.column}; Fix: probe with --teacher-forced true, or use the greedy measure"
            )
        scores[(int(record["length"]), int(record["index"]))] = score
    return scores

"""The probe's measures, declared once: each one's value on a record against a hand count, their means over
records, and what an unmeasured record gives (nothing, never 0)."""

from __future__ import annotations

import math

import pytest

from posfreq.analysis.tables.columns import SUMMARY_COLUMNS
from posfreq.analysis.tables.measures import (
    MEASURES,
    NEEDLE_RECALL,
    PASS,
    TF_NEEDLE_PROB,
    TF_PASS,
    TF_RECALL,
    TOKEN_ACCURACY,
    mean_of,
    scores_by_test,
)
from posfreq.analysis.tables.pass_curve import Analysis

RECORDS = [
    {
        "length": 100,
        "index": 0,
        "hits_anywhere": [True, True, False, False],
        "tf_token_accuracy": [1.0, 0.5, 1.0, 0.0],
        "tf_logprob": [0.0, math.log(0.5), math.log(0.25), math.log(0.25)],
    },
    {
        "length": 100,
        "index": 1,
        "hits_anywhere": [True, False, False, False],
        "tf_token_accuracy": None,  # --teacher-forced false
        "tf_logprob": None,
    },
]


def test_each_measure_of_a_record_is_the_hand_count() -> None:
    first, second = RECORDS
    analysis = Analysis()  # 2 of 4 needles anywhere in the answer
    assert (PASS.value(first, analysis), PASS.value(second, analysis)) == (1.0, 0.0)
    assert NEEDLE_RECALL.value(first, analysis) == [1.0, 1.0, 0.0, 0.0]
    assert TF_PASS.value(first, analysis) == 1.0  # needles 1 and 3 have every token right
    assert TF_RECALL.value(first, analysis) == [1.0, 0.0, 1.0, 0.0]
    assert TF_NEEDLE_PROB.value(first, analysis) == pytest.approx([1.0, 0.5, 0.25, 0.25])
    assert TOKEN_ACCURACY.value(first, analysis) == 0.625
    for measure in (TF_PASS, TF_RECALL, TF_NEEDLE_PROB, TOKEN_ACCURACY):
        assert measure.value(second, analysis) is None, measure.column
    assert (
        Analysis(min_retrieved=3).passed(first) is False
        and PASS.value(first, Analysis(min_retrieved=3)) == 0.0
    )


def test_means_skip_what_a_record_did_not_measure_and_needle_measures_average_needles() -> None:
    analysis = Analysis()
    assert mean_of(PASS, RECORDS, analysis) == 0.5
    assert mean_of(NEEDLE_RECALL, RECORDS, analysis) == 3 / 8  # 3 of the 8 needles found
    assert mean_of(TF_RECALL, RECORDS, analysis) == 0.5  # the first record's 4 needles only
    assert mean_of(TF_NEEDLE_PROB, RECORDS, analysis) == pytest.approx(0.5)
    assert mean_of(TF_PASS, RECORDS[1:], analysis) == ""  # nothing measured: an empty cell
    assert NEEDLE_RECALL.test_score(RECORDS[0], analysis) == 0.5


def test_a_paired_table_refuses_a_test_without_the_score_it_pairs() -> None:
    assert scores_by_test(TOKEN_ACCURACY, RECORDS[:1]) == {(100, 0): 0.625}
    with pytest.raises(
        ValueError, match="test 1 at 100 has no teacher-forced score for token_accuracy"
    ):
        scores_by_test(TOKEN_ACCURACY, RECORDS)


def test_every_measure_is_a_column_of_the_summary_or_of_table_1() -> None:
    assert set(MEASURES) - set(SUMMARY_COLUMNS) == {"token_accuracy"}
    assert all(m.higher_is_better and m.doc for m in MEASURES.values())

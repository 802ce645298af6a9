"""NIAH scoring: which needles an answer holds, under both rules, against answers written by hand."""

from __future__ import annotations

import pytest

from posfreq.analysis.niah.needles import NiahBuilder, NiahTest, PromptFormat, load_haystack
from posfreq.analysis.niah.scoring import all_needles_in, cut_answer, extract_numbers, score_answer
from posfreq.train.data.tokenizer import get_tokenizer


@pytest.fixture(scope="module")
def test0() -> NiahTest:
    builder = NiahBuilder(
        get_tokenizer("llama3"), load_haystack("pg"), PromptFormat(answer_budget=16)
    )
    return builder.build(512, seed=0, index=0)


def test_extract_numbers_whole_runs_only():
    assert extract_numbers("144231, 1442310 and 44231 or x543171y 264468.") == [
        "144231",
        "543171",
        "264468",
    ]
    assert extract_numbers("no digits") == []


def test_scoring_counts_and_threshold(test0):
    a, b, c, d = test0.needles
    assert score_answer(test0, f" {a}, {b}.").passed
    one = score_answer(test0, f" {a} and {c}0.")  # the second is inside a 7-digit run: no hit
    assert one.hits == (True, False, False, False) and one.retrieved == 1 and not one.passed
    assert score_answer(test0, f" {a}", min_retrieved=1).passed
    full = score_answer(test0, f" {d}, {c}, {b} and {a}.")
    assert full.retrieved == 4 and full.depths == test0.depths
    assert full.distances == tuple(test0.question_position - p for p in test0.positions)
    assert all(dist > 0 for dist in full.distances)
    assert not score_answer(test0, "").passed
    with pytest.raises(ValueError):
        score_answer(test0, "", min_retrieved=5)
    with pytest.raises(ValueError):
        score_answer(test0, "", rule="somewhere")


@pytest.mark.parametrize(
    "form, expected",
    [
        ("1. {a}\n2. {b}\n3. {c}\n4. {d}", 4),  # a numbered list (instruct models)
        ("{a}, {b}, {c}, {d}", 4),  # comma-separated
        (": the first is {c}. Later the text says {a}, then {d}.", 3),  # prose
        (" 111111, {a}, 222222 and {b} and 999999.", 2),  # extra numbers count nothing
        (" {a}, {a}, {a} and {a}.", 1),  # one needle repeated scores 1
        ("\n\n- {b}\n- {d}", 2),  # a list after blank lines
    ],
)
def test_answers_in_any_form_score_the_needles_they_contain(test0, form, expected):
    a, b, c, d = test0.needles
    result = score_answer(test0, form.format(a=a, b=b, c=c, d=d))
    assert result.retrieved == expected and result.passed == (expected >= 2)
    assert sum(result.hits_anywhere) == expected


def test_echoed_prompt_is_not_scored(test0):
    a = test0.needles[0]
    assert all(n in test0.prompt for n in test0.needles)
    for echo in (test0.prompt, "<|begin_of_text|>" + test0.prompt):
        result = score_answer(test0, echo + f" {a}.")
        assert result.retrieved == 1 and not result.passed and result.answer == f" {a}."


def test_first_line_rule_stops_at_first_newline_after_digits(test0):
    a, b, c, d = test0.needles
    assert cut_answer(f":\n\n{a}, {b}\n{c}") == f":\n\n{a}, {b}"
    assert cut_answer("no digits\nyet") == "no digits\nyet"
    result = score_answer(test0, f" {a}.\nWhat are the magic numbers? {b}, {c}", rule="first_line")
    assert (
        result.retrieved == 1
        and not result.passed
        and result.hits_anywhere == (True, True, True, False)
    )
    assert score_answer(test0, f"\n {a},\n{b}", rule="first_line").retrieved == 1
    assert score_answer(test0, f"\n {a},\n{b}").retrieved == 2
    assert not all_needles_in(test0.needles, f" {a}, {b}, {c}") and all_needles_in(
        test0.needles, f"{d} {c} {b} {a}"
    )

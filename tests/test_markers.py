"""The suite's marker rule (tests/helpers/markers.py), on a small suite of its own."""

from __future__ import annotations

import pytest


def test_a_test_marked_e2e_alone_is_left_out_of_the_quick_loop(pytester: pytest.Pytester) -> None:
    """`-m "not slow"` (make test-fast) deselects a test marked e2e but not slow; `-m e2e` still selects it."""
    pytester.makeini("[pytest]\nmarkers =\n    slow: slow\n    e2e: end to end\n")
    pytester.makepyfile(
        "import pytest\n"
        "@pytest.mark.e2e\ndef test_long(): pass\n"
        "@pytest.mark.slow\ndef test_slow(): pass\n"
        "def test_quick(): pass\n"
    )
    quick = pytester.runpytest_inprocess(
        "-p", "helpers.markers", "-m", "not slow", "--strict-markers"
    )
    quick.assert_outcomes(passed=1, deselected=2)
    end_to_end = pytester.runpytest_inprocess(
        "-p", "helpers.markers", "-m", "e2e", "--strict-markers"
    )
    end_to_end.assert_outcomes(passed=1, deselected=2)
    without_the_rule = pytester.runpytest_inprocess("-m", "not slow", "--strict-markers")
    without_the_rule.assert_outcomes(passed=2, deselected=1)  # what the rule prevents

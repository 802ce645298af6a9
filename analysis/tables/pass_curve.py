"""How a stored NIAH test scores (`Analysis`), and the effective length of a pass-rate curve with its interval.

The effective length is the largest probed length before the first one whose pass rate falls below
the threshold; `none_passed` (the first length fails: 0) and `all_passed` (none fails: the
largest length, a lower bound) carry a status. f(effective length) is Eq. 2 on the checkpoint's
trained-length histogram (`frequency_at`).
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import NormalDist
from typing import Literal, Mapping, Sequence, get_args

import numpy as np

from posfreq.analysis.corpus.frequency import position_frequency
from posfreq.analysis.niah.scoring import SCORING_RULES

AnalysisScoring = Literal[(*SCORING_RULES, "teacher_forced")]
ANALYSIS_SCORINGS: tuple[str, ...] = get_args(AnalysisScoring)
"""The answer-text rules (niah/scoring.py) and teacher_forced: a needle counts when every one of its scored tokens
is the model's argmax under teacher forcing (`tf_hits`; the only rule for a probe run with greedy false)."""

STATUS_OK = "ok"
STATUS_NONE_PASSED = "none_passed"
STATUS_ALL_PASSED = "all_passed"


def percentile_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """The central `level` percentile interval of bootstrap replicates."""
    tail = (1 - level) / 2
    lo, hi = np.quantile(np.asarray(values, dtype=float), [tail, 1 - tail])
    return float(lo), float(hi)


def wilson_interval(passed: int, tests: int, level: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval of a proportion, `passed` of `tests` independent tests: unlike a percentile
    bootstrap it keeps a width at 0 and at 100% (100 of 100: [0.963, 1])."""
    if not 0 <= passed <= tests or tests < 1:
        raise ValueError(f"need 0 <= passed <= tests and tests >= 1, got {passed} of {tests}")
    z = NormalDist().inv_cdf(0.5 + level / 2)
    rate, shrink = passed / tests, 1 + z * z / tests
    center = (rate + z * z / (2 * tests)) / shrink
    half = z / shrink * np.sqrt(rate * (1 - rate) / tests + z * z / (4 * tests * tests))
    return float(max(center - half, 0.0)), float(min(center + half, 1.0))


@dataclass(frozen=True)
class Analysis:
    """How stored per-test records become pass rates and intervals (no decoding involved)."""

    threshold: float = 0.5
    """A length fails when its pass rate is below this."""
    min_retrieved: int = 2
    """Needles (of 4) a passing answer must contain."""
    scoring: AnalysisScoring = "anywhere"
    """Where needles count: anywhere in the answer (the official script), on its first line only, or
    teacher_forced (every scored token of the needle is the argmax under teacher forcing: `tf_hits`)."""
    bootstrap: int = 1000
    """Bootstrap resamples of the tests for the effective length's interval (0: no interval)."""
    bootstrap_seed: int = 0
    """Seed of the bootstrap resampling."""
    level: float = 0.95
    """Coverage of the bootstrap interval, in (0, 1)."""

    def __post_init__(self) -> None:
        if self.scoring not in ANALYSIS_SCORINGS:
            raise ValueError(f"scoring must be one of {ANALYSIS_SCORINGS}, got {self.scoring!r}")
        if not 1 <= self.min_retrieved <= 4:
            raise ValueError(f"min_retrieved must be in 1..4, got {self.min_retrieved}")
        if not 0 < self.threshold <= 1:  # at <= 0 every length "passes", with no test passed
            raise ValueError(f"threshold must be in (0, 1], got {self.threshold}")
        if not 0 < self.level < 1 or self.bootstrap < 0:
            raise ValueError(
                f"need 0 < level < 1 and bootstrap >= 0, got {self.level}, {self.bootstrap}"
            )

    def hits(self, record: Mapping) -> list[bool]:
        """The record's per-needle hits under this scoring rule."""
        if self.scoring == "teacher_forced":
            return tf_hits(record)
        return [bool(h) for h in record[f"hits_{self.scoring}"]]

    def passed(self, record: Mapping) -> bool:
        return sum(self.hits(record)) >= self.min_retrieved

    def tf_passed(self, record: Mapping) -> bool | None:
        """Teacher-forced pass: >= min_retrieved needles whose every token is the model's argmax (None: not measured)."""
        if record.get("tf_token_accuracy") is None:
            return None
        return sum(tf_hits(record)) >= self.min_retrieved


def tf_hits(record: Mapping) -> list[bool]:
    """Per needle: is every one of its scored tokens the model's argmax under teacher forcing. Scored: all of the
    needle's tokens in a named answer order; under --answer-order alone, those after its cue (niah/decoding.py
    `cue_lengths`), a number that varies by needle and tokenizer (one of a 6-digit needle's two Llama-3 tokens)."""
    return [a == 1.0 for a in record["tf_token_accuracy"]]


@dataclass(frozen=True)
class EffectiveLength:
    """An effective length, its status (ok / none_passed / all_passed) and the first failing length."""

    value: int
    status: str
    first_failure: int | None


def effective_length(
    lengths: Sequence[int], pass_rates: Sequence[float], threshold: float = 0.5
) -> EffectiveLength:
    """The largest length before the first one whose pass rate is below `threshold` (0 if the first fails).
    A NaN pass rate (a length without tests) is refused: it would compare as passing."""
    lengths = [int(n) for n in lengths]
    if not lengths or len(lengths) != len(pass_rates):
        raise ValueError(
            f"need one pass rate per length, got {len(lengths)} lengths and {len(pass_rates)} rates"
        )
    if any(b <= a for a, b in zip(lengths, lengths[1:])):
        raise ValueError(f"lengths must be strictly increasing, got {lengths}")
    for length, rate in zip(lengths, pass_rates):
        if np.isnan(rate):
            raise ValueError(f"the pass rate at length {length} is NaN (no tests?)")
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


def bootstrap_interval(
    lengths: Sequence[int],
    passed: Sequence[Sequence[bool]],
    analysis: Analysis = Analysis(),
) -> tuple[int, int] | None:
    """A percentile bootstrap interval of the effective length: tests resampled within each length.

    Every replicate redraws each length's tests with replacement, recomputes the pass rates and
    applies `effective_length`; the interval holds the replicates' central `level` mass and is
    made of probed lengths (0 for none passed). Deterministic for `analysis.bootstrap_seed`. A length
    without tests is refused (its resampled rates would be NaN, which compares as passing).
    """
    if analysis.bootstrap == 0 or not lengths:
        return None
    if len(passed) != len(lengths):
        raise ValueError(
            f"need the tests of each length, got {len(passed)} for {len(lengths)} lengths"
        )
    for length, tests in zip(lengths, passed):
        if len(tests) == 0:
            raise ValueError(f"length {length} has no tests to resample")
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

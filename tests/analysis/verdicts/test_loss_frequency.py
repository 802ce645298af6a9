"""C2 on the loss by distance (analysis/verdicts/loss_frequency.py) on constructed curves whose shift in f and
whose loss difference at equal distance are known by construction."""

from __future__ import annotations

import numpy as np
import pytest

from posfreq.analysis.verdicts.loss_frequency import (
    MIN_BUCKET_TOKENS,
    LossCurve,
    loss_curves_coincide,
)
from posfreq.train.run.loss_by_distance import LossByDistance, distance_edges

SHORT, LONG = 64, 128


def curve(
    train_len: int,
    seed: int,
    loss_of: callable,
    f_of: callable,
    noise: float = 0.0,
    tokens: int = 100,
) -> LossCurve:
    """A run's curve on the real bucket edges: f and loss given per bucket by the callables (of its first
    distance, and of log10 f), plus seed noise on the loss."""
    first = distance_edges(train_len - 1)[:-1]
    f = np.array([f_of(train_len, d) for d in first], dtype=float)
    rng = np.random.default_rng([seed, train_len])
    loss = np.array([loss_of(train_len, d, np.log10(x)) for d, x in zip(first, f)])
    loss = loss + noise * rng.standard_normal(len(first))
    return LossCurve(train_len, seed, 10_000, first, np.full(len(first), tokens, np.int64), loss, f)


def f_linear(train_len: int, distance: int) -> float:
    """f of a run that trained rows of train_len tokens of one document 100 times: 100 (L - i)."""
    return 100.0 * (train_len - distance)


def runs(loss_of, seeds=(0, 1, 2), noise=0.01, **kw) -> list[LossCurve]:
    return [curve(L, s, loss_of, f_linear, noise, **kw) for L in (SHORT, LONG) for s in seeds]


def test_loss_that_is_a_function_of_f_alone_coincides() -> None:
    verdict = loss_curves_coincide(runs(lambda L, d, log_f: 9.0 - log_f))
    assert verdict["holds"] is True
    assert abs(verdict["D_log10_f"]) < 0.02
    assert verdict["interval_95"][0] <= 0 <= verdict["interval_95"][1]


@pytest.mark.parametrize(
    "shift, expected",
    [(0.5, "does not hold"), (-0.45, "does not hold"), (-0.3, "holds"), (-0.078, "holds")],
)  # -0.078 (the demo's): a shift shown, but within a factor of 2 in f: the curves coincide at that margin
def test_the_shift_in_decades_of_f_at_equal_loss_is_recovered_with_its_sign(
    shift: float, expected: str
) -> None:
    # the longer length needs 10**shift times the f for the same loss: loss = 9 - (log10 f - shift)
    def loss_of(L, d, log_f):
        return 9.0 - log_f + (shift if L == LONG else 0.0)

    verdict = loss_curves_coincide(runs(loss_of, noise=0.0))
    assert verdict["D_log10_f"] == pytest.approx(shift, abs=1e-9)
    assert verdict["outcome"] == expected and verdict["n"] == 6 and verdict["unit"] == "run"


def test_a_shift_whose_interval_covers_0_and_reaches_past_the_margin_is_inconclusive() -> None:
    """The L = 128 seeds are shifted by -0.5, +0.7 and +1.9 decades of f (mean +0.7; each run's loss still reaches
    the shorter length's): the interval over runs holds 0 because it is wide, which an old rule reported as 'the
    curves coincide'."""
    offsets = {0: -0.5, 1: 0.7, 2: 1.9}
    curves = [
        curve(
            L,
            s,
            lambda L, d, log_f, s=s: 9.0 - log_f + (offsets[s] if L == LONG else 0.0),
            f_linear,
        )
        for L in (SHORT, LONG)
        for s in offsets
    ]
    verdict = loss_curves_coincide(curves)
    assert verdict["D_log10_f"] == pytest.approx(np.mean(list(offsets.values())), abs=0.1)
    lo, hi = verdict["interval_95"]
    assert lo < 0 < hi and max(-lo, hi) > np.log10(2)
    assert verdict["holds"] is None and "reason" not in verdict
    assert (
        verdict["outcome"] == "inconclusive"
        and "Welch t-interval over 3 and 3 runs" in verdict["interval_method"]
    )


def test_equal_distance_difference_is_the_constructed_excess_where_the_short_length_trained_rarely() -> (
    None
):
    # the loss depends on distance only, plus 0.2 nats for the shorter length where f_short < f_long / 2
    def loss_of(L, d, log_f):
        rare = L == SHORT and f_linear(SHORT, d) < 0.5 * f_linear(LONG, d)
        return 5.0 - 0.01 * d + (0.2 if rare else 0.0)

    verdict = loss_curves_coincide(runs(loss_of, noise=0.0))
    e = verdict["at_equal_distance"]
    # by hand: 100 (64 - d) < 50 (128 - d) <=> d > 0, so every shared bucket from distance 1 on
    first = distance_edges(SHORT - 1)[:-1]
    assert e["distances"] == [int(first[1]), int(first[-1])]
    assert e["buckets"] == len(first) - 1
    assert e["mean_loss_difference"] == pytest.approx(0.2, abs=1e-9)
    assert e["holds"] is True
    assert e["f_ratio"][1] < 0.5


def test_sparse_buckets_are_left_out() -> None:
    verdict = loss_curves_coincide(
        runs(lambda L, d, log_f: 9.0 - log_f, tokens=MIN_BUCKET_TOKENS - 1)
    )
    assert verdict["holds"] is None


def test_two_seeds_per_length_are_not_enough() -> None:
    verdict = loss_curves_coincide(runs(lambda L, d, log_f: 9.0 - log_f, seeds=(0, 1)))
    assert verdict["holds"] is None and "3 seeds" in verdict["reason"]


def test_one_training_length_is_not_testable() -> None:
    only_short = [c for c in runs(lambda L, d, log_f: 1.0) if c.train_len == SHORT]
    assert loss_curves_coincide(only_short)["holds"] is None


def test_a_milestone_table_joins_f_of_eq_2_at_each_bucket_first_distance() -> None:
    lengths = [3, 5, 5, 70, 100]  # segment lengths trained
    trained = np.bincount(lengths)
    table = LossByDistance.empty(127)
    table.tokens[:] = 1
    table.loss_sum[:] = 2.0
    joined = LossCurve.of(128, 0, 1234, table, trained)
    for first, last, f in zip(table.edges[:-1], table.edges[1:] - 1, joined.f):
        if last < max(lengths):
            assert f == sum(max(n - int(first), 0) for n in lengths)  # Eq. 2 by hand
        else:  # the bucket reaches a distance no trained segment had: untrained, left out
            assert f == 0
    assert (joined.f == 0).sum() >= 1 and (joined.f > 0).sum() > 60
    assert np.all(joined.loss == 2.0)

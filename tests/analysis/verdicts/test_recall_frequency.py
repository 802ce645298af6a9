"""C2 on needle recall by distance (analysis/verdicts/recall_frequency.py) on constructed distance tables whose
shift in f and whose recall deficit at equal tokens are known by construction."""

from __future__ import annotations

import numpy as np
import pytest

from posfreq.analysis.verdicts.recall_frequency import MIN_NEEDLES, recall_curves_coincide

SHORT, LONG = 256, 512
EDGES = list(range(0, 512, 32))


def f_at(train_len: int, tokens: int, distance: int) -> float:
    """f of a run that trained rows of L tokens: tokens / L (L - d), more with training, none from L on."""
    return tokens / train_len * max(train_len - distance, 0)


def table(train_len, seed, recall_of, noise=0.0, needles=16) -> list[dict]:
    """A run's distance_by_checkpoint.csv rows at four milestones: recall given by `recall_of(L, distance, log10 f)`,
    clipped to [0, 1], plus noise per bin."""
    rng = np.random.default_rng([seed, train_len])
    rows = []
    for tokens in (2_000, 4_000, 8_000, 16_000):
        for lo, hi in zip(EDGES[:-1], EDGES[1:]):
            f = f_at(train_len, tokens, lo)
            if f <= 0:
                continue
            recall = float(
                np.clip(recall_of(train_len, lo, np.log10(f)) + noise * rng.normal(), 0, 1)
            )
            rows.append(
                {
                    "checkpoint": f"tokens-{tokens}",
                    "tokens_trained": tokens,
                    "distance_lo": lo,
                    "distance_hi": hi,
                    "needles": needles,
                    "needle_recall": recall,
                    "f_distance_lo": int(f),
                }
            )
    return rows


def runs(recall_of, seeds=(0, 1, 2), **kw) -> dict:
    return {(L, s): table(L, s, recall_of, **kw) for L in (SHORT, LONG) for s in seeds}


@pytest.mark.parametrize(
    "shift, expected",
    [(0.0, "holds"), (0.1, "holds"), (0.5, "does not hold"), (-0.6, "does not hold")],
)
def test_recall_a_function_of_f_coincides_and_a_shift_in_f_is_recovered(shift, expected) -> None:
    """recall = (log10 f - 1.5) / 2 (+ shift for L = 512, so L = 512 needs 10^shift the f for a recall): D = shift."""

    def recall_of(L, d, log_f):
        return (log_f - 1.5 + (-shift if L == LONG else 0.0)) / 2

    verdict = recall_curves_coincide(runs(recall_of))
    assert verdict["D_log10_f"] == pytest.approx(shift, abs=1e-9)
    assert verdict["outcome"] == expected and verdict["unit"] == "run" and verdict["n"] == 6


def test_at_equal_tokens_and_distance_the_deficit_where_f_is_rare_is_recovered() -> None:
    """Recall depends on distance only, less 0.2 for L = 256 where its f is below half of L = 512's (by hand:
    tokens/256 (256 - d) < tokens/1024 (512 - d) <=> d > 170.7, the bins from 192 on)."""

    def recall_of(L, d, log_f):
        rare = L == SHORT and f_at(SHORT, 1, d) < 0.5 * f_at(LONG, 1, d)
        return 0.9 - d / 1000 - (0.2 if rare else 0.0)

    verdict = recall_curves_coincide(runs(recall_of))["at_equal_tokens"]
    assert verdict["estimate"] == pytest.approx(0.2, abs=1e-9) and verdict["outcome"] == "holds"
    assert verdict["bins_compared"] == 3 * 4 * len([d for d in EDGES[:-1] if 170 < d < 256])
    flat = recall_curves_coincide(runs(lambda L, d, log_f: 0.9 - d / 1000))["at_equal_tokens"]
    assert flat["estimate"] == pytest.approx(0.0, abs=1e-12) and flat["outcome"] == "not shown"
    two = recall_curves_coincide(runs(recall_of, seeds=(0, 1)))["at_equal_tokens"]
    assert two["outcome"] == "not testable" and "needs at least 3" in two["reason"]


def test_sparse_bins_and_one_length_are_not_testable() -> None:
    sparse = recall_curves_coincide(runs(lambda L, d, log_f: 0.5, needles=MIN_NEEDLES - 1))
    assert (
        sparse["outcome"] == "not testable"
        and sparse["at_equal_tokens"]["outcome"] == "not testable"
    )
    one = recall_curves_coincide(
        {k: v for k, v in runs(lambda L, d, log_f: 0.5).items() if k[0] == SHORT}
    )
    assert one["outcome"] == "not testable" and "exactly two training lengths" in one["reason"]

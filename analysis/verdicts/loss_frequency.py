"""The paper's C2 on the loss by distance: do the curves of mean validation loss at distance i against f(i) of two
training lengths coincide, and, at equal distance (so equal context), is the loss higher where a run trained that
distance less often?

Why both: a token at distance i has i tokens of context, so loss falls with distance whatever f does, and f falls
with distance too; curves against f can differ for that reason alone. Comparing the two lengths at the same
distance holds the context fixed and leaves f as the difference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from posfreq.analysis.corpus.frequency import position_frequency
from posfreq.analysis.verdicts.coincidence import (
    C2_MARGIN_DECADES,
    C2_MIN_SEEDS,
    run_levels,
    shift_verdict,
)
from posfreq.analysis.verdicts.rules import difference, not_testable, welch_interval
from posfreq.train.run.loss_by_distance import LossByDistance

MIN_BUCKET_TOKENS = 32
"""A distance bucket counts only where each run's validation scored at least this many tokens in it: the mean
loss of fewer is noise."""

RARE_RATIO = 0.5
"""The equal-distance test uses the distances the shorter length trained less than this share as often as the
longer one did."""


@dataclass(frozen=True)
class LossCurve:
    """One run's loss by distance at one milestone, joined with the f(i) it had trained, per distance bucket."""

    train_len: int
    seed: object
    tokens_trained: int
    first_distance: np.ndarray  # each bucket's first distance
    tokens: np.ndarray  # validation tokens scored in the bucket
    loss: np.ndarray  # their mean loss (NaN where none)
    f: np.ndarray  # f at the bucket's first distance, from the milestone's trained-length histogram

    @classmethod
    def of(
        cls,
        train_len: int,
        seed: object,
        tokens_trained: int,
        table: LossByDistance,
        trained: np.ndarray,
    ) -> LossCurve:
        """Join a milestone's table with f(i) of its trained-length histogram: f at each bucket's first distance,
        0 for a bucket that reaches past the longest trained distance."""
        f = position_frequency(trained, len(trained) - 1)
        first, last = table.edges[:-1], table.edges[1:] - 1
        # a bucket reaching a distance the run never trained (validation rows longer than its training rows)
        # counts as untrained: its loss mixes in extrapolation
        at = np.where(last < len(f), f[np.minimum(first, len(f) - 1)], 0.0)
        return cls(train_len, seed, tokens_trained, first, table.tokens, table.mean(), at)

    def points(self) -> list[tuple[int, float, float]]:
        """(train_len, mean loss, log10 f) of each bucket with enough tokens and f > 0."""
        keep = (self.tokens >= MIN_BUCKET_TOKENS) & (self.f > 0) & np.isfinite(self.loss)
        return [
            (self.train_len, float(y), float(np.log10(x)))
            for y, x in zip(self.loss[keep], self.f[keep])
        ]


def loss_curves_coincide(curves: Sequence[LossCurve]) -> dict:
    """C2 on the loss: D, the shift in log10 f at equal loss between the longer and the shorter training length
    (`run_levels` over every bucket of each run's curve; an equivalence claim on the Welch interval over runs), and
    the equal-distance difference (a difference claim over runs). One curve per run (its last milestone)."""
    lengths = sorted({c.train_len for c in curves})
    if len(lengths) != 2:
        return {
            "claim": "loss at distance i vs f(i) of two training lengths coincide",
            **not_testable(
                f"needs runs of exactly two training lengths with a loss by distance, got {lengths}"
            ),
        }
    short, long = lengths
    claim = (
        f"loss at distance i vs f(i) of L = {short} and L = {long} coincide (the paper's C2 on the validation "
        f"loss): D, the shift in log10 f at equal loss, is within ±{C2_MARGIN_DECADES:.3f} decades (a factor of 2 "
        "in f)"
    )
    by_length = {
        L: sorted((c for c in curves if c.train_len == L), key=lambda c: str(c.seed))
        for L in lengths
    }
    n_seeds = {L: len(v) for L, v in by_length.items()}
    levels = run_levels(
        {(c.train_len, str(c.seed)): c.points() for c in curves}, short, long, "overlap"
    )
    if min(n_seeds.values()) < C2_MIN_SEEDS or levels is None:
        return {
            "claim": claim,
            "n_seeds": {str(L): n for L, n in n_seeds.items()},
            **not_testable(
                f"fewer than {C2_MIN_SEEDS} seeds per length with a loss by distance, or losses that do not "
                "overlap"
            ),
        }
    rare = _rare_buckets(by_length[short], by_length[long])
    verdict = {
        "claim": claim,
        **shift_verdict(levels, short, long),
        "n_points": {str(L): sum(len(c.points()) for c in v) for L, v in by_length.items()},
        "seeds": {str(L): [c.seed for c in v] for L, v in by_length.items()},
        "tokens_trained": {str(L): [c.tokens_trained for c in v] for L, v in by_length.items()},
        "test": "log10 f = a_run + b loss, b the within-run slope fitted to every distance bucket with at least "
        f"{MIN_BUCKET_TOKENS} validation tokens of each run's last milestone whose loss both lengths reach; each "
        "run's level a_run = its mean residual there; D = mean level of the longer length's runs minus the "
        "shorter's, with a Welch t-interval over runs",
    }
    verdict["at_equal_distance"] = _equal_distance_verdict(by_length[short], by_length[long], rare)
    return verdict


def _mean_f(curves: Sequence[LossCurve], buckets: int) -> np.ndarray:
    """f per bucket, the mean over `curves` (over runs)."""
    return np.mean([c.f[:buckets] for c in curves], axis=0)


def _rare_buckets(short: Sequence[LossCurve], long: Sequence[LossCurve]) -> np.ndarray:
    """The buckets both lengths scored (every run at least MIN_BUCKET_TOKENS) where the shorter length trained the
    distance (f > 0: never-trained distances are extrapolation, another question) but less than RARE_RATIO as often
    as the longer: fixed from all seeds, so every run is averaged over the same ones."""
    buckets = min(len(c.tokens) for c in (*short, *long))
    enough = np.all([c.tokens[:buckets] >= MIN_BUCKET_TOKENS for c in (*short, *long)], axis=0)
    f_short, f_long = _mean_f(short, buckets), _mean_f(long, buckets)
    with np.errstate(invalid="ignore", divide="ignore"):
        return enough & (f_short > 0) & (f_short < RARE_RATIO * f_long)


def _rare_loss(curve: LossCurve, rare: np.ndarray) -> float:
    """A run's mean loss over the `rare` buckets, each bucket's loss weighted by its validation tokens."""
    n = len(rare)
    tokens, loss = curve.tokens[:n][rare], np.nan_to_num(curve.loss[:n][rare])
    return float((loss * tokens).sum() / tokens.sum())


def _equal_distance_verdict(
    short: Sequence[LossCurve], long: Sequence[LossCurve], rare: np.ndarray
) -> dict:
    """At equal distance, is the loss of the shorter length higher where it trained the distance rarely? A claim of
    difference on the Welch interval over runs of each run's mean loss over those distances."""
    L_short, L_long = short[0].train_len, long[0].train_len
    claim = (
        f"at equal distance, L = {L_short} has a higher loss than L = {L_long} where it trained the distance "
        f"less than {RARE_RATIO:g} times as often (f's effect with the context held fixed)"
    )
    if not rare.any():
        return {
            "claim": claim,
            **not_testable(
                f"no distance with at least {MIN_BUCKET_TOKENS} validation tokens in every run where "
                f"L = {L_short} trained it less than {RARE_RATIO:g} times as often"
            ),
        }
    first = short[0].first_distance[: len(rare)][rare]
    f_short, f_long = _mean_f(short, len(rare))[rare], _mean_f(long, len(rare))[rare]
    interval = welch_interval(
        [_rare_loss(c, rare) for c in long], [_rare_loss(c, rare) for c in short], "run"
    )
    return {
        "claim": claim,
        "mean_loss_difference": interval.estimate,
        **difference(interval),
        "value_unit": "nats",
        "distances": [int(first.min()), int(first.max())],
        "buckets": int(rare.sum()),
        "f_ratio": [float((f_short / f_long).min()), float((f_short / f_long).max())],
        "test": "each run's mean loss over those distance buckets (weighted by its validation tokens); the shorter "
        "length's mean over runs minus the longer's, with a Welch t-interval over runs",
    }

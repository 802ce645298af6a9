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
from posfreq.analysis.tables.pass_curve import percentile_interval
from posfreq.analysis.verdicts.claims import (
    C2_MARGIN_DECADES,
    C2_MIN_SEEDS,
    coincidence,
    curve_shift,
)
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


def loss_curves_coincide(curves: Sequence[LossCurve], n_boot: int, seed: int) -> dict:
    """C2 on the loss: D, the shift in log10 f at equal loss between the longer and the shorter training length
    (`curve_shift` on every bucket of each run's curve), and the equal-distance difference; both with
    percentile intervals from resampling seeds within each length. One curve per run (its last milestone)."""
    lengths = sorted({c.train_len for c in curves})
    if len(lengths) != 2:
        return {
            "claim": "loss at distance i vs f(i) of two training lengths coincide",
            "holds": None,
            "reason": f"needs runs of exactly two training lengths with a loss by distance, got {lengths}",
        }
    short, long = lengths
    claim = (
        f"loss at distance i vs f(i) of L = {short} and L = {long} coincide (the paper's C2 on the validation "
        "loss): the 95% interval of D, the shift in log10 f at equal loss, covers 0 and lies within "
        f"±{C2_MARGIN_DECADES:.3f}"
    )
    by_length = {
        L: sorted((c for c in curves if c.train_len == L), key=lambda c: str(c.seed))
        for L in lengths
    }
    n_seeds = {L: len(v) for L, v in by_length.items()}
    observed = curve_shift([p for c in curves for p in c.points()], short, long, "overlap")
    if min(n_seeds.values()) < C2_MIN_SEEDS or observed is None:
        return {
            "claim": claim,
            "holds": None,
            "n_seeds": {str(L): n for L, n in n_seeds.items()},
            "reason": f"fewer than {C2_MIN_SEEDS} seeds per length with a loss by distance, or losses that do "
            "not overlap",
        }
    rng = np.random.default_rng(seed)
    shifts, differences = [], []
    rare = _rare_buckets(by_length[short], by_length[long])
    for _ in range(n_boot):
        chosen = {
            L: [v[i] for i in rng.integers(0, len(v), size=len(v))] for L, v in by_length.items()
        }
        d = curve_shift(
            [p for v in chosen.values() for c in v for p in c.points()], short, long, "overlap"
        )
        if d is not None:
            shifts.append(d)
        if rare.any():
            differences.append(_loss_difference(chosen[short], chosen[long], rare))
    lo, hi = percentile_interval(shifts)
    verdict = {
        "claim": claim,
        "D_log10_f": observed,
        "interval_95": [lo, hi],
        **coincidence(lo, hi),
        "margin_decades": C2_MARGIN_DECADES,
        "n_points": {str(L): sum(len(c.points()) for c in v) for L, v in by_length.items()},
        "seeds": {str(L): [c.seed for c in v] for L, v in by_length.items()},
        "tokens_trained": {str(L): [c.tokens_trained for c in v] for L, v in by_length.items()},
        "bootstrap_replicates_used": len(shifts),
        "test": "log10 f = a + b loss + D [longer length], fitted by least squares to every distance bucket "
        f"with at least {MIN_BUCKET_TOKENS} validation tokens of each run's last milestone whose loss both "
        "lengths reach; seeds resampled within each length (percentile bootstrap)",
    }
    verdict["at_equal_distance"] = _equal_distance_verdict(
        by_length[short], by_length[long], rare, differences
    )
    return verdict


def _pooled(curves: Sequence[LossCurve], buckets: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, mean loss, mean f) per bucket over `curves`, pooled by token (loss) and by run (f)."""
    tokens = np.sum([c.tokens[:buckets] for c in curves], axis=0)
    loss_sum = np.sum(
        [np.nan_to_num(c.loss[:buckets]) * c.tokens[:buckets] for c in curves], axis=0
    )
    with np.errstate(invalid="ignore", divide="ignore"):
        loss = np.where(tokens > 0, loss_sum / np.maximum(tokens, 1), np.nan)
    return tokens, loss, np.mean([c.f[:buckets] for c in curves], axis=0)


def _rare_buckets(short: Sequence[LossCurve], long: Sequence[LossCurve]) -> np.ndarray:
    """The buckets both lengths scored (every run at least MIN_BUCKET_TOKENS) where the shorter length trained the
    distance (f > 0: never-trained distances are extrapolation, another question) but less than RARE_RATIO as often
    as the longer: fixed from all seeds, so every bootstrap replicate averages the same ones."""
    buckets = min(len(c.tokens) for c in (*short, *long))
    enough = np.all([c.tokens[:buckets] >= MIN_BUCKET_TOKENS for c in (*short, *long)], axis=0)
    f_short, f_long = _pooled(short, buckets)[2], _pooled(long, buckets)[2]
    with np.errstate(invalid="ignore", divide="ignore"):
        return enough & (f_short > 0) & (f_short < RARE_RATIO * f_long)


def _loss_difference(
    short: Sequence[LossCurve], long: Sequence[LossCurve], rare: np.ndarray
) -> float:
    """Mean over the `rare` buckets of pooled loss (shorter length) minus pooled loss (longer length)."""
    n = len(rare)
    return float(np.mean(_pooled(short, n)[1][rare] - _pooled(long, n)[1][rare]))


def _equal_distance_verdict(
    short: Sequence[LossCurve],
    long: Sequence[LossCurve],
    rare: np.ndarray,
    differences: list[float],
) -> dict:
    """At equal distance, is the loss of the shorter length higher where it trained the distance rarely?"""
    L_short, L_long = short[0].train_len, long[0].train_len
    claim = (
        f"at equal distance, L = {L_short} has a higher loss than L = {L_long} where it trained the distance "
        f"less than {RARE_RATIO:g} times as often (f's effect with the context held fixed)"
    )
    if not rare.any():
        return {
            "claim": claim,
            "holds": None,
            "reason": f"no distance with at least {MIN_BUCKET_TOKENS} validation tokens in every run where "
            f"L = {L_short} trained it less than {RARE_RATIO:g} times as often",
        }
    first = short[0].first_distance[: len(rare)][rare]
    f_short, f_long = _pooled(short, len(rare))[2][rare], _pooled(long, len(rare))[2][rare]
    lo, hi = percentile_interval(differences)
    return {
        "claim": claim,
        "mean_loss_difference": _loss_difference(short, long, rare),
        "interval_95": [lo, hi],
        "holds": bool(lo > 0),
        "distances": [int(first.min()), int(first.max())],
        "buckets": int(rare.sum()),
        "f_ratio": [float((f_short / f_long).min()), float((f_short / f_long).max())],
        "test": "mean over those distance buckets of the loss difference (each length's tokens pooled over its "
        "seeds); seeds resampled within each length (percentile bootstrap)",
    }

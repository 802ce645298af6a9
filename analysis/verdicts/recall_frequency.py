"""The paper's C2 where it has the most points: per-needle recall against f at the needle's distance, over every
probed milestone of both training lengths (each run's distance_by_checkpoint.csv, written by the probe).

Two verdicts. Against f: do the curves of recall vs log10 f of the two lengths coincide (D, the shift in log10 f
at equal recall, within +-log10 2)? At equal tokens and distance: where the shorter length trained a distance less
than half as often as the longer (same seed, same milestone, same needle distance), does it recall it less often?
The first asks whether f alone places the curves; the second holds tokens and context fixed and leaves f as the
difference.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from posfreq.analysis.verdicts.coincidence import (
    C2_MARGIN_DECADES,
    C2_MIN_SEEDS,
    run_levels,
    shift_verdict,
)
from posfreq.analysis.verdicts.rules import difference, mean_interval, not_testable

MIN_NEEDLES = 8
"""A distance bin counts only where the milestone's probe placed at least this many needles in it."""

RARE_RATIO = 0.5
"""The equal-tokens test uses the bins where the shorter length trained the distance less than this share as
often as the longer one did."""


def _bins(rows: Sequence[Mapping]) -> list[tuple[int, int, float, float]]:
    """(tokens trained, first distance, recall, f) of each bin of a run's distance_by_checkpoint.csv rows with at
    least MIN_NEEDLES needles and a recall and f recorded."""
    out = []
    for r in rows:
        if r.get("needle_recall") in (None, "") or r.get("f_distance_lo") in (None, ""):
            continue
        if int(r["needles"]) >= MIN_NEEDLES:
            out.append(
                (
                    int(r["tokens_trained"]),
                    int(r["distance_lo"]),
                    float(r["needle_recall"]),
                    float(r["f_distance_lo"]),
                )
            )
    return out


def recall_curves_coincide(runs: Mapping[tuple, Sequence[Mapping]]) -> dict:
    """C2 on needle recall, from each run's distance_by_checkpoint.csv rows (`runs`: (train_len, seed) -> rows): the
    equivalence of the recall vs log10 f curves (bins of every milestone whose recall lies strictly between 0 and
    1, where recall says something about f), and the difference at equal tokens and distance."""
    lengths = sorted({L for L, _ in runs})
    claim = "needle recall vs f at the needle's distance of two training lengths coincide (the paper's C2)"
    if len(lengths) != 2:
        return {
            "claim": claim,
            **not_testable(f"needs runs of exactly two training lengths, got {lengths}"),
        }
    short, long = lengths
    claim = (
        f"needle recall vs f(needle distance) of L = {short} and L = {long} coincide (the paper's C2, every "
        f"milestone): D, the shift in log10 f at equal recall, is within ±{C2_MARGIN_DECADES:.3f} decades"
    )
    bins = {run: _bins(rows) for run, rows in runs.items()}
    points = {
        run: [
            (run[0], recall, float(np.log10(f)))
            for _, _, recall, f in found
            if 0 < recall < 1 and f > 0
        ]
        for run, found in bins.items()
    }
    points = {run: p for run, p in points.items() if p}
    levels = run_levels(points, short, long, "overlap")
    verdict = {
        "claim": claim,
        "n_points": {
            str(L): sum(len(p) for (LL, _), p in points.items() if LL == L) for L in lengths
        },
        "test": f"bins of at least {MIN_NEEDLES} needles with a recall strictly between 0 and 1, from every "
        "milestone: log10 f = a_run + b recall, b the within-run slope fitted over the recalls both lengths reach; "
        "D = mean level of the longer length's runs minus the shorter's, with a Welch t-interval over runs",
    }
    if levels is None:
        verdict |= not_testable(
            "the two lengths' recalls (strictly between 0 and 1) do not overlap"
        )
    else:
        verdict |= shift_verdict(levels, short, long)
    verdict["at_equal_tokens"] = _equal_tokens_verdict(bins, short, long)
    return verdict


def _equal_tokens_verdict(
    bins: Mapping[tuple, Sequence[tuple[int, int, float, float]]], short: int, long: int
) -> dict:
    """Per seed: the mean, over the milestones both lengths reached and the distance bins both probed where the
    shorter length's f is below RARE_RATIO of the longer's, of recall(longer) - recall(shorter); a claim of
    difference on the t-interval over seeds."""
    claim = (
        f"at equal tokens and distance, L = {short} recalls needles less often than L = {long} where it trained the "
        f"distance less than {RARE_RATIO:g} times as often (f's effect, tokens and context held fixed)"
    )
    per_seed, pairs = {}, 0
    for seed in sorted(
        {s for L, s in bins if L == short} & {s for L, s in bins if L == long}, key=str
    ):
        mine = {
            L: {(t, d): (recall, f) for t, d, recall, f in bins[(L, seed)]} for L in (short, long)
        }
        diffs = []
        for at in sorted(set(mine[short]) & set(mine[long])):
            (r_short, f_short), (r_long, f_long) = mine[short][at], mine[long][at]
            if 0 < f_short < RARE_RATIO * f_long:
                diffs.append(r_long - r_short)
        if diffs:
            per_seed[seed] = float(np.mean(diffs))
            pairs += len(diffs)
    # as every verdict over seeds: its interval's coverage is checked from 3 on
    if len(per_seed) < C2_MIN_SEEDS:
        return {
            "claim": claim,
            **not_testable(
                f"{len(per_seed)} seeds have a milestone and a distance both lengths probed where L = {short} "
                f"trained it less than {RARE_RATIO:g} times as often (with at least {MIN_NEEDLES} needles); the "
                f"interval over seeds needs at least {C2_MIN_SEEDS}"
            ),
        }
    return {
        "claim": claim,
        **difference(mean_interval(list(per_seed.values()), "seed")),
        "value_unit": "recall",
        "per_seed": {str(s): v for s, v in per_seed.items()},
        "bins_compared": pairs,
        "test": "per seed, the mean over shared milestones and distance bins of the recall difference; t-interval "
        "over seeds",
    }

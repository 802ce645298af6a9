"""C2 (the paper's claim that effective length against f is one curve, whatever the training length or data):
each run's level in log10 f at equal effective length, and D, the shift between two groups' levels, judged as a
claim of equivalence at C2_MARGIN_DECADES (analysis/verdicts/rules.py) on a Welch t-interval over runs."""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from posfreq.analysis.tables.pass_curve import STATUS_OK
from posfreq.analysis.verdicts.rules import equivalence, not_testable, welch_interval

C2_MIN_POINTS = 3


C2_MIN_SEEDS = 3
"""C2 is tested only with at least this many uncensored points, from this many runs (seeds), per length: with fewer
points D rests on one or two checkpoints, and with two runs per length the t-interval has one degree of freedom
per length. Fig. 2a's paired test (`longer_reaches_further`) needs this many paired seeds, for the same reason."""


C2_MARGIN_DECADES = float(np.log10(2))
"""C2's equivalence margin on D, in decades of f (a factor of 2 in f): the curves coincide when D's whole 95%
interval lies within +-this margin, do not when it lies wholly outside, and the test is inconclusive otherwise
(rules.equivalence)."""

MARGIN_UNIT = "decades of f"


def run_levels(
    runs: Mapping[object, Sequence[tuple[object, float, float]]],
    short: object,
    long: object,
    slope_from: str,
) -> dict[object, list[float]] | None:
    """Each run's level on lines of one slope, per group: y = a_run + b x fitted to every run's (group, x, y) points,
    b the within-run least-squares slope (each run centred on its own means, so neither a shift between the groups
    nor one between runs tilts it), and a_run the mean of y - b x over the run's points inside the x range both
    groups reach. b is fitted to the points of that overlap (`slope_from="overlap"`) or to every point (`"all"`:
    for sparse points, such as a few effective lengths per run). D, the shift between the groups, is the difference
    of their mean levels, and the runs are the independent units its interval is computed over; a run without a
    point in the overlap has no level. None without two points per group, a point of each in the overlap, or,
    when no fitted x varies within a run, one x to compare at."""
    by_group = {
        g: np.array([(x, y) for v in runs.values() for gg, x, y in v if gg == g], dtype=float)
        for g in (short, long)
    }
    if any(len(v) < 2 for v in by_group.values()):
        return None
    lo = max(v[:, 0].min() for v in by_group.values())
    hi = min(v[:, 0].max() for v in by_group.values())
    inside = {
        run: np.array([(x, y) for _, x, y in v if lo <= x <= hi], dtype=float).reshape(-1, 2)
        for run, v in runs.items()
    }
    if any(not any(len(inside[r]) and runs[r][0][0] == g for r in runs) for g in (short, long)):
        return None
    fitted = (
        inside
        if slope_from == "overlap"
        else {
            run: np.array([(x, y) for _, x, y in v], dtype=float).reshape(-1, 2)
            for run, v in runs.items()
        }
    )
    centred = [
        (v[:, 0] - v[:, 0].mean(), v[:, 1] - v[:, 1].mean()) for v in fitted.values() if len(v)
    ]
    sxx = sum(float(dx @ dx) for dx, _ in centred)
    if sxx > 0:
        slope = sum(float(dx @ dy) for dx, dy in centred) / sxx
    elif hi == lo:  # every point compared sits at one x: the slope does not matter
        slope = 0.0
    else:
        return None
    levels: dict[object, list[float]] = {short: [], long: []}
    for run, points in inside.items():
        if len(points):
            levels[runs[run][0][0]].append(float(np.mean(points[:, 1] - slope * points[:, 0])))
    return levels


def shift_verdict(levels: Mapping[object, Sequence[float]], short: object, long: object) -> dict:
    """C2's equivalence verdict on D = mean level of `long`'s runs minus `short`'s, with its Welch interval over
    runs (rules.equivalence at +-C2_MARGIN_DECADES), or not testable with fewer than C2_MIN_SEEDS runs a group."""
    counts = {str(g): len(levels[g]) for g in (short, long)}
    if min(counts.values()) < C2_MIN_SEEDS:
        return {
            **not_testable(
                f"fewer than {C2_MIN_SEEDS} runs per group with a point where both groups' curves reach "
                f"({counts})"
            ),
            "runs_compared": counts,
        }
    interval = welch_interval(levels[short], levels[long], "run")
    return {
        "D_log10_f": interval.estimate,
        **equivalence(interval, C2_MARGIN_DECADES, MARGIN_UNIT),
        "runs_compared": counts,
        "levels": {str(g): [float(v) for v in levels[g]] for g in (short, long)},
    }


def curves_coincide(
    rows: Sequence[Mapping],
    group: str = "train_len",
    groups: Sequence | None = None,
) -> dict:
    """C2: do the f(effective length) vs effective length curves of two groups coincide? By default the groups are
    the two training lengths (the paper's C2); `group="variant", groups=(baseline, other)` compares data variants.
    A claim of equivalence at +-C2_MARGIN_DECADES on D, the shift in log10 f at equal effective length, over runs."""
    lengths = list(groups) if groups is not None else sorted({r[group] for r in rows})
    if len(lengths) != 2:
        return {
            "claim": f"needs exactly two values of {group}",
            **not_testable(f"needs exactly two values of {group}"),
        }
    short, long = lengths
    points: dict[tuple, list] = {}
    for r in rows:
        f = r["f_effective_length"]
        if (
            r[group] in lengths
            and r["effective_length_status"] == STATUS_OK
            and f not in (None, "")
            and float(f) > 0
        ):
            points.setdefault((r[group], r["seed"]), []).append(
                (r[group], int(r["effective_length"]), float(np.log10(float(f))))
            )
    names = f"L = {short} and L = {long}" if group == "train_len" else f"{short} and {long}"
    claim = (
        f"f(effective length) vs effective length of {names} coincide (the paper's C2): D, the shift in log10 f at "
        f"equal effective length, is within ±{C2_MARGIN_DECADES:.3f} decades (a factor of 2 in f)"
    )
    n_points = {L: sum(len(v) for (LL, _), v in points.items() if LL == L) for L in lengths}
    n_seeds = {L: sum(1 for LL, _ in points if LL == L) for L in lengths}
    counts = {
        "n_points": {str(L): n for L, n in n_points.items()},
        "n_seeds": {str(L): n for L, n in n_seeds.items()},
    }
    enough = all(n_points[L] >= C2_MIN_POINTS and n_seeds[L] >= C2_MIN_SEEDS for L in lengths)
    levels = run_levels(points, short, long, "all") if enough else None
    if levels is None:
        return {
            "claim": claim,
            **counts,
            **not_testable(
                f"fewer than {C2_MIN_POINTS} defined, uncensored points from {C2_MIN_SEEDS} seeds per length, or "
                "their effective lengths do not overlap"
            ),
        }
    return {
        "claim": claim,
        **shift_verdict(levels, short, long),
        **counts,
        "seeds": {str(L): sorted({s for LL, s in points if LL == L}, key=str) for L in lengths},
        "test": "log10 f = a_run + b effective length, b the within-run slope fitted to every point; each run's "
        "level a_run = its mean residual over the effective lengths both lengths reach; D = mean level of the "
        "longer length's runs minus the shorter's, with a Welch t-interval over runs",
    }

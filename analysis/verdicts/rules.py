"""One decision rule per kind of claim, and the intervals they read; every verdict states its rule, unit and n.

A claim of equivalence (two curves coincide) holds when the 95% interval of the difference lies inside
+-margin, does not hold when it lies wholly outside, and is inconclusive otherwise. A claim of difference (one
thing exceeds another) holds when the interval lies above 0, does not hold when it lies below 0, and is not
shown when it covers 0. The intervals are t-intervals over independent units (seeds or runs): a percentile
bootstrap over 3 seeds has 10 distinct resamples and covers far less often than it says
(tests/analysis/verdicts/test_coverage.py simulates both).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy import stats

LEVEL = 0.95
"""Every verdict's interval level."""

HOLDS, DOES_NOT_HOLD, INCONCLUSIVE, NOT_SHOWN, NOT_TESTABLE = (
    "holds",
    "does not hold",
    "inconclusive",
    "not shown",
    "not testable",
)
OUTCOMES = (HOLDS, DOES_NOT_HOLD, INCONCLUSIVE, NOT_SHOWN, NOT_TESTABLE)

EQUIVALENCE_RULE = (
    "equivalence at ±{margin:g} {unit}: holds when the 95% interval lies inside ±{margin:g}, does not hold when it "
    "lies wholly outside, inconclusive otherwise"
)
DIFFERENCE_RULE = (
    "difference: holds when the 95% interval lies above 0, does not hold when it lies below 0, not shown when it "
    "covers 0"
)


@dataclass(frozen=True)
class Interval:
    """An estimate with its 95% interval, the kind of unit it was computed over and how many there were."""

    estimate: float
    lo: float
    hi: float
    n: int
    unit: str
    method: str

    def fields(self) -> dict:
        """The JSON fields every verdict carries for its interval."""
        return {
            "estimate": self.estimate,
            "interval_95": [self.lo, self.hi],
            "n": self.n,
            "unit": self.unit,
            "interval_method": self.method,
        }


def mean_interval(
    values: Sequence[float], unit: str, floor_variance: float = 0.0, level: float = LEVEL
) -> Interval:
    """The mean of one value per independent unit with its t-interval (n - 1 degrees of freedom).

    `floor_variance` is a variance the units' spread cannot be below (the measurement noise each unit's value is
    known to carry, e.g. from its interval over tests): with a few discrete values, all n can agree by chance, and
    their sample variance 0 would claim an exact mean. ValueError for fewer than 2 units."""
    x = np.asarray(values, dtype=float)
    if len(x) < 2:
        raise ValueError(f"a t-interval needs at least 2 {unit}s, got {len(x)}")
    variance = max(float(x.var(ddof=1)), float(floor_variance))
    half = float(stats.t.ppf(0.5 + level / 2, len(x) - 1)) * np.sqrt(variance / len(x))
    floored = " (variance floored at the within-unit measurement noise)" if floor_variance else ""
    return Interval(
        float(x.mean()),
        float(x.mean() - half),
        float(x.mean() + half),
        len(x),
        unit,
        f"t-interval over {len(x)} {unit}s{floored}",
    )


def welch_interval(
    first: Sequence[float], second: Sequence[float], unit: str, level: float = LEVEL
) -> Interval:
    """mean(second) - mean(first), with the Welch t-interval (Welch-Satterthwaite degrees of freedom) over the two
    groups' independent units. ValueError unless each group has at least 2."""
    a, b = np.asarray(first, dtype=float), np.asarray(second, dtype=float)
    if min(len(a), len(b)) < 2:
        raise ValueError(
            f"a Welch interval needs at least 2 {unit}s per group, got {len(a)} and {len(b)}"
        )
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    se2 = float(va + vb)
    difference = float(b.mean() - a.mean())
    if se2 == 0:
        df = float(len(a) + len(b) - 2)
    else:
        df = se2**2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    half = float(stats.t.ppf(0.5 + level / 2, df)) * np.sqrt(se2)
    return Interval(
        difference,
        difference - half,
        difference + half,
        len(a) + len(b),
        unit,
        f"Welch t-interval over {len(a)} and {len(b)} {unit}s ({df:.1f} degrees of freedom)",
    )


def equivalence(interval: Interval, margin: float, margin_unit: str) -> dict:
    """A claim of sameness judged on `interval` at +-`margin`: holds, does not hold or inconclusive, with the rule."""
    lo, hi = interval.lo, interval.hi
    if -margin <= lo and hi <= margin:
        result = HOLDS
    elif lo > margin or hi < -margin:
        result = DOES_NOT_HOLD
    else:
        result = INCONCLUSIVE
    return {
        **interval.fields(),
        **_judged(result),
        "margin": margin,
        "value_unit": margin_unit,
        "rule": EQUIVALENCE_RULE.format(margin=round(margin, 3), unit=margin_unit),
    }


def difference(interval: Interval) -> dict:
    """A claim that the estimated quantity is above 0, judged on `interval`: holds, does not hold or not shown."""
    if interval.lo > 0:
        result = HOLDS
    elif interval.hi < 0:
        result = DOES_NOT_HOLD
    else:
        result = NOT_SHOWN
    return {**interval.fields(), **_judged(result), "rule": DIFFERENCE_RULE}


def not_testable(reason: str) -> dict:
    """A verdict with too little to test, and why."""
    return {**_judged(NOT_TESTABLE), "reason": reason}


def _judged(result: str) -> dict:
    """The outcome in words and as `holds` (True, False, or None for inconclusive, not shown, not testable)."""
    holds = {HOLDS: True, DOES_NOT_HOLD: False}.get(result)
    return {"outcome": result, "holds": holds}


def outcome(verdict: dict) -> str:
    """A verdict's outcome in words (verdicts of older files, without `outcome`, from `holds`)."""
    if verdict.get("outcome") in OUTCOMES:
        return verdict["outcome"]
    if verdict.get("holds") is None:
        return INCONCLUSIVE if "inconclusive" in verdict else NOT_TESTABLE
    return HOLDS if verdict["holds"] else DOES_NOT_HOLD


def estimate_text(verdict: dict) -> str:
    """'+256 [+120, +392] tokens' or '-0.078 [-0.086, -0.068] decades of f': a verdict's estimate with its interval,
    in its unit (whole tokens, else three decimals)."""
    unit = verdict.get("value_unit", "")
    digits = 0 if unit == "tokens" else 3
    lo, hi = verdict["interval_95"]
    value = verdict.get("estimate", (lo + hi) / 2)
    return f"{value:+.{digits}f} [{lo:+.{digits}f}, {hi:+.{digits}f}] {unit}".rstrip()


def verdict_line(verdict: dict) -> str:
    """A verdict in one line: its outcome, estimate and interval, the units and n, the rule, and why where it was
    not tested; a verdict made of several (by_* parts) lists each part's."""
    parts = [outcome(verdict)]
    if "interval_95" in verdict:
        parts.append(f"{estimate_text(verdict)} ({verdict.get('interval_method', '')})")
    elif "n" in verdict:  # judged unit by unit (the shortfall): how many
        parts.append(f"n = {verdict['n']} {verdict.get('unit', 'unit')}s")
    part_rules = []
    for key, part in verdict.items():
        if key.startswith("by_") and isinstance(part, dict):
            detail = (
                f"{estimate_text(part)}, {part['interval_method']}" if "interval_95" in part else ""
            )
            detail = detail or part.get("reason", "")
            against = f" against {part['best_baseline']}" if part.get("best_baseline") else ""
            parts.append(f"{key}: {outcome(part)}{against} ({detail})")
            if part.get("rule") and part["rule"] not in part_rules:
                part_rules.append(part["rule"])
    if "rule" in verdict:
        parts.append(f"rule: {verdict['rule']}")
    parts += [f"each part's rule: {rule}" for rule in part_rules]
    for key in ("reason", "caveat"):
        if verdict.get(key):
            parts.append(verdict[key])
    return "; ".join(parts) + f"  [{verdict.get('claim', '')}]"

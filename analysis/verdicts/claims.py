"""Computed verdicts on the paper's claims from checkpoint rows (`probed_runs.load_checkpoints`), each with its
numbers and a percentile bootstrap over seeds: C1 (shortfall), Fig. 2a (longer L reaches further), C2 (curves
coincide against f), data variants against a baseline, and when retrieval emerges.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from posfreq.analysis.tables.pass_curve import (
    STATUS_ALL_PASSED,
    STATUS_NONE_PASSED,
    STATUS_OK,
    percentile_interval,
)
from posfreq.analysis.tables.run_table import probed_lengths


def shortfall(rows: Sequence[Mapping]) -> dict:
    """C1: each run's last checkpoint, its effective length interval against its training length L.

    A run passed by none of its probed lengths has no effective length: it is left out, with a caveat. Of the
    others, a run is short when its status is ok and its interval's upper end lies below both L and its longest
    probed length P (an end at P may be the probe's ceiling, not the model's). It is not short when it is not
    shown short although probed up to L or beyond (P >= L). It is untestable when its interval has no upper end
    (probed with bootstrap 0) or when, probed only below L, it is not shown short: its lengths from P to L were
    never tried. The claim is about every run, so one run that is not short decides it (does not hold) whatever
    the untestable runs would show; otherwise any untestable run leaves it not testable, naming those runs.
    """
    runs = {}
    for r in rows:
        key = (r["train_len"], r["variant"], r["seed"])
        if key not in runs or r["tokens_trained"] > runs[key]["tokens_trained"]:
            runs[key] = r
    last = [
        {
            "train_len": L,
            "variant": v,
            "seed": s,
            "effective_length": r["effective_length"],
            "effective_length_hi": r["effective_length_hi"],
            "status": r["effective_length_status"],
            "longest_probed": max(probed_lengths(r), default=None),
        }
        for (L, v, s), r in sorted(runs.items(), key=lambda kv: (kv[0][0], kv[0][1], str(kv[0][2])))
    ]
    claim = "the effective length of every run's last checkpoint falls short of its training length"
    undefined = [x for x in last if x["status"] == STATUS_NONE_PASSED]
    tested = [x for x in last if x["status"] != STATUS_NONE_PASSED]
    verdict = {"claim": claim, "last_checkpoints": last}
    if undefined:
        verdict["caveat"] = (
            f"{len(undefined)} of {len(last)} runs passed no probed length at their last checkpoint "
            "(effective length undefined): left out of the test"
        )
    if not tested:
        return {
            **verdict,
            "holds": None,
            "reason": "no run has a defined effective length at its last checkpoint",
        }
    judged = [(x, *_judge(x)) for x in tested]
    untestable = [
        f"L = {x['train_len']} seed {x['seed']} {x['variant']} ({why})"
        for x, short, why in judged
        if short is None
    ]
    if untestable:
        verdict["untestable"] = untestable
    if any(short is False for _, short, _ in judged):
        return {**verdict, "holds": False}
    if untestable:
        return {
            **verdict,
            "holds": None,
            "reason": f"{len(untestable)} of {len(tested)} runs cannot be judged: {'; '.join(untestable)}",
        }
    return {**verdict, "holds": True}


def _judge(run: Mapping) -> tuple[bool | None, str]:
    """Is a run's last checkpoint short of its training length, by `shortfall`'s rule (None: it cannot be told),
    and why."""
    hi, L, longest = run["effective_length_hi"], run["train_len"], run["longest_probed"]
    if hi in (None, ""):
        return None, "no upper interval end: probed with bootstrap 0"
    if longest is None:
        return None, "its probed lengths are not recorded"
    if run["status"] == STATUS_OK and hi < min(L, longest):
        return True, f"interval up to {hi}"
    if longest < L:
        return None, f"probed only up to {longest}, below L, and not shown short there"
    return False, f"interval up to {hi}, status {run['status']}"


def longer_reaches_further(rows: Sequence[Mapping], n_boot: int, seed: int) -> dict:
    """Fig. 2a: paired (same seed) difference of effective lengths, longer minus shorter L, at each seed's largest
    tokens_trained both runs reached (`shared_milestones`: a run's own last checkpoint may be further on than the
    other's); not testable with fewer than C2_MIN_SEEDS such seeds."""
    lengths = sorted({r["train_len"] for r in rows})
    if len(lengths) != 2:
        return {"claim": "needs exactly two training lengths", "holds": None}
    short, long = lengths
    claim = (
        f"at equal tokens (each seed's last milestone both lengths reached), L = {long} reaches a larger "
        f"effective length than L = {short} (paired by seed)"
    )
    shared, too_few = shared_milestones(rows, "train_len", short, long, claim)
    if too_few:
        return too_few
    seeds = list(shared)
    at = {(r["train_len"], r["seed"], int(r["tokens_trained"])): r for r in rows}
    compared = {L: [at[(L, s, shared[s][-1])] for s in seeds] for L in lengths}
    diffs = np.array(
        [
            int(longer["effective_length"]) - int(shorter["effective_length"])
            for longer, shorter in zip(compared[long], compared[short])
        ],
        dtype=float,
    )
    rng = np.random.default_rng(seed)
    boots = diffs[rng.integers(0, len(diffs), size=(n_boot, len(diffs)))].mean(axis=1)
    lo, hi = percentile_interval(boots)
    return {
        "claim": claim,
        "seeds": seeds,
        "tokens_compared": [shared[s][-1] for s in seeds],
        "differences": diffs.tolist(),
        "mean_difference": float(diffs.mean()),
        "interval_95": [lo, hi],
        "holds": bool(lo > 0),
        "test": "percentile bootstrap over seeds",
        "censored": {
            str(L): sum(r["effective_length_status"] == STATUS_ALL_PASSED for r in compared[L])
            for L in lengths
        },
        "note": "a run whose every probed length passed (all_passed) has an effective length that is only a "
        "lower bound: its training length caps it",
    }


C2_MIN_POINTS = 3


C2_MIN_SEEDS = 3
"""C2 is tested only with at least this many uncensored points, from this many seeds, per length: with fewer points
D rests on one or two checkpoints, and two seeds give the seed bootstrap 3 distinct resamples per length, so its
"95% interval" is the spread of a handful of values. Fig. 2a's paired test (`longer_reaches_further`) needs this
many paired seeds, for the same reason."""


C2_MARGIN_DECADES = float(np.log10(2))
"""C2's equivalence margin on D, in decades of f (a factor of 2 in f). The curves coincide only when D's whole 95%
interval covers 0 and lies within +-this margin: an interval that covers 0 because it is wide (few or noisy
points) shows no coincidence, and is inconclusive rather than a confirmation."""


def coincidence(lo: float, hi: float) -> dict:
    """C2's rule on D's 95% interval [lo, hi]: does not hold when the interval excludes 0 (a shift is shown, however
    small), holds when it lies within +-C2_MARGIN_DECADES, else inconclusive (holds None, with the text saying so)."""
    if lo > 0 or hi < 0:
        return {"holds": False}
    if -C2_MARGIN_DECADES <= lo and hi <= C2_MARGIN_DECADES:
        return {"holds": True}
    return {
        "holds": None,
        "inconclusive": f"inconclusive: the interval covers 0 but reaches past ±{C2_MARGIN_DECADES:.3f} decades "
        "(a factor of 2 in f)",
    }


def outcome(verdict: Mapping) -> str:
    """A verdict's outcome in words: holds, does not hold, inconclusive (tested, but its interval decides nothing),
    or not testable (too little to test)."""
    if verdict.get("holds") is None:
        return "inconclusive" if "inconclusive" in verdict else "not testable"
    return "holds" if verdict["holds"] else "does not hold"


def curve_shift(
    points: Sequence[tuple[object, float, float]], short: object, long: object, slope_from: str
) -> float | None:
    """D for (group, x, y) points of two groups: the longer group's offset in y over a line of one slope and an
    intercept per group, over the x both groups reach (mean residual of long minus short there). The slope is the
    within-group least-squares slope, so the shift itself does not tilt it (a line pooled over both groups would,
    wherever their x ranges differ), fitted to the points of that overlap (`slope_from="overlap"`) or to every
    point (`"all"`: for sparse points, such as a few effective lengths per run). Exact when the curves are
    parallel lines. None without two fitted points per group, a point of each in the overlap, or, when no fitted
    x varies within a group, equal x to compare at."""
    by_group = {
        g: np.array([(x, y) for gg, x, y in points if gg == g], dtype=float) for g in (short, long)
    }
    if any(len(v) < 2 for v in by_group.values()):
        return None
    lo = max(v[:, 0].min() for v in by_group.values())
    hi = min(v[:, 0].max() for v in by_group.values())
    inside = {g: v[(v[:, 0] >= lo) & (v[:, 0] <= hi)] for g, v in by_group.items()}
    fitted = inside if slope_from == "overlap" else by_group
    if any(len(v) < 2 for v in fitted.values()) or any(len(v) == 0 for v in inside.values()):
        return None
    centred = [(v[:, 0] - v[:, 0].mean(), v[:, 1] - v[:, 1].mean()) for v in fitted.values()]
    sxx = sum(float(dx @ dx) for dx, _ in centred)
    if sxx > 0:
        slope = sum(float(dx @ dy) for dx, dy in centred) / sxx
    elif hi == lo:  # every point compared sits at one x: the slope does not matter
        slope = 0.0
    else:
        return None
    level = {g: float(np.mean(v[:, 1] - slope * v[:, 0])) for g, v in inside.items()}
    return level[long] - level[short]


def curves_coincide(
    rows: Sequence[Mapping],
    n_boot: int,
    seed: int,
    group: str = "train_len",
    groups: Sequence | None = None,
) -> dict:
    """C2: do the f(effective length) vs effective length curves of two groups coincide? By default the groups are
    the two training lengths (the paper's C2); `group="variant", groups=(baseline, other)` compares data variants."""
    lengths = list(groups) if groups is not None else sorted({r[group] for r in rows})
    if len(lengths) != 2:
        return {"claim": f"needs exactly two values of {group}", "holds": None}
    short, long = lengths
    points = {}
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
        f"f(effective length) vs effective length of {names} coincide (the paper's C2): the 95% interval of D, "
        f"the shift in log10 f at equal effective length, covers 0 and lies within ±{C2_MARGIN_DECADES:.3f}"
    )
    n_points = {L: sum(len(v) for (LL, _), v in points.items() if LL == L) for L in lengths}
    n_seeds = {L: sum(1 for LL, _ in points if LL == L) for L in lengths}
    enough = all(n_points[L] >= C2_MIN_POINTS and n_seeds[L] >= C2_MIN_SEEDS for L in lengths)
    observed = (
        curve_shift([p for v in points.values() for p in v], short, long, "all") if enough else None
    )
    if observed is None:
        return {
            "claim": claim,
            "holds": None,
            "n_points": {str(L): n for L, n in n_points.items()},
            "n_seeds": {str(L): n for L, n in n_seeds.items()},
            "reason": f"fewer than {C2_MIN_POINTS} defined, uncensored points from {C2_MIN_SEEDS} seeds per "
            "length, or their effective lengths do not overlap",
        }
    seeds = {L: sorted({s for LL, s in points if LL == L}, key=str) for L in lengths}
    rng = np.random.default_rng(seed)
    boots = []
    for _ in range(n_boot):
        chosen = [
            p
            for L in lengths
            for i in rng.integers(0, len(seeds[L]), size=len(seeds[L]))
            for p in points[(L, seeds[L][i])]
        ]
        d = curve_shift(chosen, short, long, "all")
        if d is not None:
            boots.append(d)
    lo, hi = percentile_interval(boots)
    return {
        "claim": claim,
        "D_log10_f": observed,
        "interval_95": [lo, hi],
        **coincidence(lo, hi),
        "margin_decades": C2_MARGIN_DECADES,
        "n_points": {str(L): sum(len(points[(L, s)]) for s in seeds[L]) for L in lengths},
        "seeds": {str(L): seeds[L] for L in lengths},
        "bootstrap_replicates_used": len(boots),
        "test": "log10 f = a + b effective length + D [longer length], b the within-length slope fitted to every "
        "point; D = mean residual of the longer length minus the shorter over the effective lengths both reach; "
        "seeds resampled within each length (percentile bootstrap)",
    }


def shared_milestones(
    rows: Sequence[Mapping], group: str, a: object, b: object, claim: str
) -> tuple[dict[object, list[int]], dict | None]:
    """Per seed whose `group == a` and `group == b` runs share a checkpoint, the tokens_trained they share,
    ascending (seeds in order); and, with fewer than C2_MIN_SEEDS such seeds, the `claim`'s not-testable verdict
    (else None): the paired tests over seeds that both Fig. 2a and the variant comparison run."""
    tokens: dict[object, dict[object, set[int]]] = {}
    for r in rows:
        if r[group] in (a, b):
            tokens.setdefault(r["seed"], {a: set(), b: set()})[r[group]].add(
                int(r["tokens_trained"])
            )
    shared = {s: sorted(t[a] & t[b]) for s, t in sorted(tokens.items(), key=lambda kv: str(kv[0]))}
    shared = {s: both for s, both in shared.items() if both}
    if len(shared) >= C2_MIN_SEEDS:
        return shared, None
    return shared, {
        "claim": claim,
        "holds": None,
        "seeds": list(shared),
        "reason": f"{len(shared)} seeds have checkpoints of both {group} values {a} and {b} at equal tokens; "
        f"the bootstrap over seeds needs at least {C2_MIN_SEEDS}",
    }


def variant_effect(
    rows: Sequence[Mapping], baseline: str, other: str, n_boot: int, seed: int
) -> dict:
    """At equal tokens, does data variant `other` reach a larger effective length than `baseline`? (Rows of one
    training length.)

    Per seed: the mean over the milestones both runs reached of EL(other) - EL(baseline) (0 before retrieval
    counts), then a percentile bootstrap over seeds; also the difference at the last shared milestone. A seed
    whose two runs share no milestone is left out; with fewer than C2_MIN_SEEDS seeds it is not testable (one
    seed's 'interval' has no width).
    """
    if len({r["train_len"] for r in rows}) > 1:
        raise ValueError(
            "variant_effect compares variants at one training length; filter the rows by train_len"
        )
    el = {
        (r["variant"], r["seed"], int(r["tokens_trained"])): int(r["effective_length"])
        for r in rows
    }
    claim = f"at equal tokens, {other} reaches a larger effective length than {baseline} (paired by seed)"
    shared, too_few = shared_milestones(rows, "variant", baseline, other, claim)
    if too_few:
        return too_few
    seeds = list(shared)
    means, last = [], []
    for s in seeds:
        diffs = [el[(other, s, t)] - el[(baseline, s, t)] for t in shared[s]]
        means.append(float(np.mean(diffs)))
        last.append(diffs[-1])
    rng = np.random.default_rng(seed)
    boots = [float(np.mean(rng.choice(means, size=len(means)))) for _ in range(n_boot)]
    lo, hi = percentile_interval(boots)
    return {
        "claim": claim,
        "seeds": seeds,
        "mean_difference_per_seed": means,
        "mean_difference": float(np.mean(means)),
        "interval_95": [lo, hi],
        "last_milestone_differences": last,
        "holds": bool(lo > 0),
        "differs": not lo <= 0 <= hi,
        "test": "per seed, mean over shared milestones of the effective-length difference; percentile bootstrap "
        "over seeds",
    }


def baseline_variant(rows: Sequence[Mapping]) -> str:
    """The data variant others are compared with: plain concat when present, else the first label."""
    variants = sorted({r["variant"] for r in rows})
    return "concat" if "concat" in variants else variants[0]


def variant_comparisons(
    rows: Sequence[Mapping], baseline: str, n_boot: int, seed: int
) -> list[dict]:
    """Per training length, every other data variant against the baseline: at equal tokens and against f."""
    out = []
    for L in sorted({r["train_len"] for r in rows}):
        at_L = [r for r in rows if r["train_len"] == L]
        for other in sorted({r["variant"] for r in at_L} - {baseline}):
            out.append(
                {
                    "train_len": L,
                    "baseline": baseline,
                    "variant": other,
                    "equal_tokens": variant_effect(at_L, baseline, other, n_boot, seed),
                    "against_f": curves_coincide(at_L, n_boot, seed, "variant", (baseline, other)),
                }
            )
    return out


def emergence(rows: Sequence[Mapping]) -> list[dict]:
    """Per run: the first checkpoint with a non-zero effective length, as a share of the run's tokens."""
    out = []
    runs = {(r["train_len"], r["variant"], r["seed"]) for r in rows}
    for L, v, s in sorted(runs, key=lambda k: (k[0], k[1], str(k[2]))):
        mine = sorted(
            (r for r in rows if (r["train_len"], r["variant"], r["seed"]) == (L, v, s)),
            key=lambda r: r["tokens_trained"],
        )
        first = next((r for r in mine if int(r["effective_length"]) > 0), None)
        share = None if first is None else first["tokens_trained"] / mine[-1]["tokens_trained"]
        out.append(
            {
                "train_len": L,
                "variant": v,
                "seed": s,
                "checkpoints": len(mine),
                "first_retrieval_tokens": None if first is None else first["tokens_trained"],
                "share_of_budget": share,
            }
        )
    return out

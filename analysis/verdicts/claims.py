"""Computed verdicts on the paper's claims from checkpoint rows (`probed_runs.load_checkpoints`): C1 (shortfall),
Fig. 2a (longer L reaches further), data variants against a baseline (each with C2's test, coincidence.py), and when
retrieval emerges. Each is judged by its kind's rule (analysis/verdicts/rules.py: equivalence or difference) on a
t-interval over seeds or runs, and states the rule, the unit and n.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from posfreq.analysis.tables.pass_curve import (
    STATUS_ALL_PASSED,
    STATUS_NONE_PASSED,
    STATUS_OK,
)
from posfreq.analysis.tables.run_table import probed_lengths
from posfreq.analysis.verdicts.coincidence import C2_MIN_SEEDS, curves_coincide
from posfreq.analysis.verdicts.rules import (
    DOES_NOT_HOLD,
    HOLDS,
    NOT_SHOWN,
    NOT_TESTABLE,
    difference,
    mean_interval,
    not_testable,
)

SHORTFALL_RULE = (
    "every run: short when its last checkpoint's interval over tests ends below L (and below its longest probed "
    "length); not short when the interval's lower end is at L or above; not shown otherwise. The claim holds when "
    "every run is short, does not hold when one run is not short, and is not shown otherwise"
)


def shortfall(rows: Sequence[Mapping]) -> dict:
    """C1: each run's last checkpoint, its effective length interval (over tests) against its training length L.

    A run passed by none of its probed lengths has no effective length: it is left out, with a caveat. Of the
    others, a run is short when its status is ok and its interval's upper end lies below both L and its longest
    probed length P (an end at P may be the probe's ceiling, not the model's); not short when its interval's lower
    end is L or more (shown to reach L); otherwise it is not shown short, or untestable when its interval has no
    upper end (probed with bootstrap 0) or when it was probed only below L. The claim is about every run: one run
    shown not short decides it (does not hold); else a run not shown short leaves it not shown, and an untestable
    run leaves it not testable, naming those runs.
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
            "effective_length_lo": r.get("effective_length_lo"),
            "effective_length_hi": r["effective_length_hi"],
            "status": r["effective_length_status"],
            "longest_probed": max(probed_lengths(r), default=None),
        }
        for (L, v, s), r in sorted(runs.items(), key=lambda kv: (kv[0][0], kv[0][1], str(kv[0][2])))
    ]
    claim = "the effective length of every run's last checkpoint falls short of its training length"
    undefined = [x for x in last if x["status"] == STATUS_NONE_PASSED]
    tested = [x for x in last if x["status"] != STATUS_NONE_PASSED]
    verdict = {"claim": claim, "last_checkpoints": last, "rule": SHORTFALL_RULE, "unit": "run"}
    if undefined:
        verdict["caveat"] = (
            f"{len(undefined)} of {len(last)} runs passed no probed length at their last checkpoint "
            "(effective length undefined): left out of the test"
        )
    if not tested:
        return {
            **verdict,
            **not_testable("no run has a defined effective length at its last checkpoint"),
            "n": 0,
        }
    judged = [(x, *_judge(x)) for x in tested]
    for x, result, why in judged:
        x["judged"] = f"{result}: {why}"
    verdict["n"] = len(tested)
    named = {
        result: [
            f"L = {x['train_len']} seed {x['seed']} {x['variant']} ({why})"
            for x, r, why in judged
            if r == result
        ]
        for result in (DOES_NOT_HOLD, NOT_SHOWN, NOT_TESTABLE)
    }
    if named[NOT_TESTABLE]:
        verdict["untestable"] = named[NOT_TESTABLE]
    for result in (DOES_NOT_HOLD, NOT_SHOWN, NOT_TESTABLE):
        if named[result]:
            what = {
                DOES_NOT_HOLD: "not short",
                NOT_SHOWN: "not shown short",
                NOT_TESTABLE: "cannot be judged",
            }
            return {
                **verdict,
                "outcome": result,
                "holds": False if result == DOES_NOT_HOLD else None,
                "reason": f"{len(named[result])} of {len(tested)} runs {what[result]}: {'; '.join(named[result])}",
            }
    return {**verdict, "outcome": HOLDS, "holds": True}


def _judge(run: Mapping) -> tuple[str, str]:
    """A run's last checkpoint by `shortfall`'s rule: HOLDS (short), DOES_NOT_HOLD (shown to reach L), NOT_SHOWN or
    NOT_TESTABLE, and why."""
    lo, hi, L, longest = (
        run.get("effective_length_lo"),
        run["effective_length_hi"],
        run["train_len"],
        run["longest_probed"],
    )
    if hi in (None, ""):
        return NOT_TESTABLE, "no upper interval end: probed with bootstrap 0"
    if longest is None:
        return NOT_TESTABLE, "its probed lengths are not recorded"
    if run["status"] == STATUS_OK and hi < min(L, longest):
        return HOLDS, f"interval up to {hi}"
    if lo not in (None, "") and int(lo) >= L:
        return DOES_NOT_HOLD, f"interval from {lo}, status {run['status']}"
    if longest < L:
        return NOT_TESTABLE, f"probed only up to {longest}, below L, and not shown short there"
    return NOT_SHOWN, f"interval [{lo}, {hi}], status {run['status']}"


Z_95 = 1.959963984540054
"""The normal quantile a 95% interval's half-width spans, to read a checkpoint's standard error from its interval."""


def within_variance(row: Mapping) -> float:
    """The variance of a checkpoint's effective length from its 95% interval over tests ((hi - lo) / 2z)^2, 0
    without one: the measurement noise a seed's value carries whatever the seed."""
    lo, hi = row.get("effective_length_lo"), row.get("effective_length_hi")
    if lo in (None, "") or hi in (None, ""):
        return 0.0
    return ((float(hi) - float(lo)) / (2 * Z_95)) ** 2


def longer_reaches_further(rows: Sequence[Mapping]) -> dict:
    """Fig. 2a: paired (same seed) difference of effective lengths, longer minus shorter L, at each seed's largest
    tokens_trained both runs reached (`shared_milestones`: a run's own last checkpoint may be further on than the
    other's); a claim of difference on the t-interval over seeds, its variance floored at the checkpoints' own
    noise over tests; not testable with fewer than C2_MIN_SEEDS such seeds."""
    lengths = sorted({r["train_len"] for r in rows})
    if len(lengths) != 2:
        return {
            "claim": "needs exactly two training lengths",
            **not_testable("needs exactly two training lengths"),
        }
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
    diffs = [
        int(longer["effective_length"]) - int(shorter["effective_length"])
        for longer, shorter in zip(compared[long], compared[short])
    ]
    noise = float(
        np.mean(
            [
                within_variance(a) + within_variance(b)
                for a, b in zip(compared[long], compared[short])
            ]
        )
    )
    return {
        "claim": claim,
        "seeds": seeds,
        "tokens_compared": [shared[s][-1] for s in seeds],
        "differences": diffs,
        "mean_difference": float(np.mean(diffs)),
        **difference(mean_interval(diffs, "seed", floor_variance=noise)),
        "value_unit": "tokens",
        "censored": {
            str(L): sum(r["effective_length_status"] == STATUS_ALL_PASSED for r in compared[L])
            for L in lengths
        },
        "note": "a run whose every probed length passed (all_passed) has an effective length that is only a "
        "lower bound: its training length caps it",
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
        "seeds": list(shared),
        **not_testable(
            f"{len(shared)} seeds have checkpoints of both {group} values {a} and {b} at equal tokens; the "
            f"interval over seeds needs at least {C2_MIN_SEEDS}"
        ),
    }


def variant_effect(rows: Sequence[Mapping], baseline: str, other: str) -> dict:
    """At equal tokens, does data variant `other` reach a larger effective length than `baseline`? (Rows of one
    training length.)

    Per seed: the mean over the milestones both runs reached of EL(other) - EL(baseline) (0 before retrieval
    counts); a claim of difference on the t-interval over seeds (variance floored at the checkpoints' own noise
    over tests); also the difference at the last shared milestone. A seed whose two runs share no milestone is
    left out; with fewer than C2_MIN_SEEDS seeds it is not testable.
    """
    if len({r["train_len"] for r in rows}) > 1:
        raise ValueError(
            "variant_effect compares variants at one training length; filter the rows by train_len"
        )
    at = {(r["variant"], r["seed"], int(r["tokens_trained"])): r for r in rows}
    claim = f"at equal tokens, {other} reaches a larger effective length than {baseline} (paired by seed)"
    shared, too_few = shared_milestones(rows, "variant", baseline, other, claim)
    if too_few:
        return too_few
    seeds = list(shared)
    means, last, noise = [], [], []
    for s in seeds:
        pairs = [(at[(other, s, t)], at[(baseline, s, t)]) for t in shared[s]]
        diffs = [int(a["effective_length"]) - int(b["effective_length"]) for a, b in pairs]
        means.append(float(np.mean(diffs)))
        last.append(diffs[-1])
        noise.append(
            sum(within_variance(a) + within_variance(b) for a, b in pairs) / len(pairs) ** 2
        )
    verdict = difference(mean_interval(means, "seed", floor_variance=float(np.mean(noise))))
    return {
        "claim": claim,
        "seeds": seeds,
        "mean_difference_per_seed": means,
        "mean_difference": float(np.mean(means)),
        **verdict,
        "value_unit": "tokens",
        "last_milestone_differences": last,
        "differs": verdict["outcome"] != NOT_SHOWN,
        "test": "per seed, mean over shared milestones of the effective-length difference; t-interval over seeds",
    }


def baseline_variant(rows: Sequence[Mapping]) -> str:
    """The data variant others are compared with: plain concat when present, else the first label."""
    variants = sorted({r["variant"] for r in rows})
    return "concat" if "concat" in variants else variants[0]


def variant_comparisons(rows: Sequence[Mapping], baseline: str) -> list[dict]:
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
                    "equal_tokens": variant_effect(at_L, baseline, other),
                    "against_f": curves_coincide(at_L, "variant", (baseline, other)),
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

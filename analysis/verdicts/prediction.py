"""Predicting effective length from f before probing: the paper's threshold form, fitted on some runs and tested on
held-out ones, against the strongest of three fair baselines.

The rule: a checkpoint's predicted effective length is the longest probed length n (n <= L) whose f at the
distance a pass at n needs (`f_at` gives it per n: compare.py reads f at the k-th nearest needle's distance, k the
needles a pass needs) is at least a threshold tau; 0 when none is. tau is fitted to the training runs by least
absolute error. Held out: each seed in turn (its runs of every length), each training length in turn (fitted on
the other), and each data variant in turn when there are several (the packing experiment's). Baselines, each as
capped as the rule: tokens trained alone (the mean effective length of the training runs' checkpoints at the
nearest tokens, whatever their L, capped at the held-out run's L), the constant L, and the run's previous
checkpoint's effective length. The verdict compares the rule with the baseline of least error on the held-out
checkpoints (a choice that favours the baselines), over runs: each run's mean gain in absolute error is one unit
of a t-interval, since a run's milestones depend on each other.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np

from posfreq.analysis.tables.pass_curve import STATUS_NONE_PASSED
from posfreq.analysis.verdicts.claims import within_variance
from posfreq.analysis.verdicts.rules import (
    DOES_NOT_HOLD,
    HOLDS,
    NOT_SHOWN,
    difference,
    mean_interval,
    not_testable,
)

BASELINES = ("tokens_alone", "constant_L", "previous_checkpoint")
"""The fair baselines, each capped at the held-out run's L as the f rule is."""

PREDICTORS = ("f_rule", *BASELINES)


def observed(row: Mapping) -> float:
    """A checkpoint's effective length, 0 when no probed length passed."""
    return (
        0.0
        if row["effective_length_status"] == STATUS_NONE_PASSED
        else float(row["effective_length"])
    )


def threshold_prediction(f_at: Mapping[int, float], train_len: int, tau: float) -> float:
    """The longest probed n <= train_len with f(n) >= tau (`f_at` maps each probed n to its f), else 0."""
    return float(max((n for n, f in f_at.items() if n <= train_len and f >= tau), default=0))


def fit_threshold(rows: Sequence[Mapping], f_at: Callable[[Mapping], Mapping[int, float]]) -> float:
    """The tau with the least total absolute error over `rows` (candidates: every f(n) they hold, and infinity)."""
    candidates = sorted({f for r in rows for f in f_at(r).values()} | {float("inf")})
    errors = [
        sum(abs(threshold_prediction(f_at(r), r["train_len"], tau) - observed(r)) for r in rows)
        for tau in candidates
    ]
    return candidates[int(np.argmin(errors))]


def _tokens_baseline(train: Sequence[Mapping], row: Mapping) -> float:
    """The mean effective length of the training checkpoints at the nearest tokens to `row`'s, whatever their L,
    capped at `row`'s L (as the f rule is)."""
    tokens = np.array([r["tokens_trained"] for r in train], dtype=float)
    nearest = tokens[np.argmin(np.abs(tokens - row["tokens_trained"]))]
    mean = float(np.mean([observed(r) for r in train if r["tokens_trained"] == nearest]))
    return min(mean, float(row["train_len"]))


def _previous_baseline(rows: Sequence[Mapping], row: Mapping) -> float:
    """The same run's previous checkpoint's effective length (0 before its first)."""
    same = [r for r in rows if _run(r) == _run(row) and r["tokens_trained"] < row["tokens_trained"]]
    return observed(max(same, key=lambda r: r["tokens_trained"])) if same else 0.0


def _run(row: Mapping) -> tuple:
    """The run a checkpoint row belongs to: the unit the verdict resamples."""
    return (row["train_len"], row["seed"], row["variant"])


HELD_OUT = ("seed", "train_len", "variant")
"""What is held out in turn: each seed (all its runs), each training length, and each data variant (the packing
experiment's runs: fitted on the other variants)."""


def predict_held_out(
    rows: Sequence[Mapping], f_at: Callable[[Mapping], Mapping[int, float]], key: str
) -> list[dict]:
    """For each value of `key` (one of HELD_OUT) in turn: fit tau on the other rows, predict these; a row per
    held-out checkpoint with its observed value, the rule's and each baseline's prediction."""
    out = []
    for held in sorted({r[key] for r in rows}):
        train = [r for r in rows if r[key] != held]
        test = [r for r in rows if r[key] == held]
        if not train or not test:
            continue
        tau = fit_threshold(train, f_at)
        for r in test:
            out.append(
                {
                    "held_out": f"{key}={held}",
                    "run": _run(r),
                    "train_len": r["train_len"],
                    "seed": r["seed"],
                    "variant": r["variant"],
                    "tokens_trained": r["tokens_trained"],
                    "tau": tau,
                    "observed": observed(r),
                    "noise": within_variance(r),
                    "f_rule": threshold_prediction(f_at(r), r["train_len"], tau),
                    "tokens_alone": _tokens_baseline(train, r),
                    "constant_L": float(r["train_len"]),
                    "previous_checkpoint": _previous_baseline(rows, r),
                }
            )
    return out


def _by_run_gain(predictions: Sequence[Mapping], baseline: str) -> dict:
    """The rule's gain in absolute error over `baseline`, per run (its held-out checkpoints' mean), as a claim of
    difference on the t-interval over runs. Its variance is floored at the observed values' own noise: a gain moves
    by at most twice an observed value's error."""
    runs: dict[tuple, list[Mapping]] = {}
    for p in predictions:
        runs.setdefault(p["run"], []).append(p)
    gains = [
        float(
            np.mean(
                [abs(p[baseline] - p["observed"]) - abs(p["f_rule"] - p["observed"]) for p in mine]
            )
        )
        for mine in runs.values()
    ]
    noise = float(
        np.mean([4 * sum(p["noise"] for p in mine) / len(mine) ** 2 for mine in runs.values()])
    )
    if len(gains) < 2:
        return not_testable(f"{len(gains)} held-out run: the interval over runs needs at least 2")
    return difference(mean_interval(gains, "run", floor_variance=noise))


def prediction_verdict(
    rows: Sequence[Mapping], f_at: Callable[[Mapping], Mapping[int, float]]
) -> dict:
    """How well f's threshold rule predicts held-out effective lengths, against the best of the capped baselines:
    mean absolute errors of every predictor, and whether the rule beats the best baseline (over runs)."""
    claim = (
        "f predicts held-out runs' effective length better than the best of tokens alone (capped at L), the "
        "constant L and the previous checkpoint"
    )
    result: dict = {
        "claim": claim,
        "test": "the rule's gain in absolute error over the baseline of least held-out error (chosen on the held-out "
        "checkpoints themselves, which favours the baselines), each run's mean over its checkpoints one unit of a "
        "t-interval; f read at the k-th nearest needle's distance of each probed length, k the needles a pass needs",
        "value_unit": "tokens",
    }
    for key in HELD_OUT:
        if key == "variant" and len({r["variant"] for r in rows}) < 2:
            continue  # one data variant: nothing to hold out
        predictions = predict_held_out(rows, f_at, key)
        if len(predictions) < 2:
            result[f"by_{key}"] = {
                "checkpoints": len(predictions),
                **not_testable("fewer than 2 held-out checkpoints"),
            }
            continue
        errors = {
            name: float(np.mean([abs(p[name] - p["observed"]) for p in predictions]))
            for name in PREDICTORS
        }
        best = min(BASELINES, key=lambda name: errors[name])
        result[f"by_{key}"] = {
            "checkpoints": len(predictions),
            "mean_abs_error": errors,
            "best_baseline": best,
            **_by_run_gain(predictions, best),
            "value_unit": "tokens",
            "taus": sorted({p["tau"] for p in predictions}),
        }
    outcomes = [v["outcome"] for k, v in result.items() if k.startswith("by_")]
    tested = [o for o in outcomes if o in (HOLDS, DOES_NOT_HOLD, NOT_SHOWN)]
    if not tested:
        return {**result, **not_testable("no way of holding out left two checkpoints to predict")}
    overall = (
        HOLDS
        if all(o == HOLDS for o in tested)
        else DOES_NOT_HOLD
        if DOES_NOT_HOLD in tested
        else NOT_SHOWN
    )
    result["outcome"] = overall
    result["holds"] = {HOLDS: True, DOES_NOT_HOLD: False}.get(overall)
    result["rule"] = (
        "holds when it holds for every way of holding out (each a difference over runs), does not hold when one "
        "does not, not shown otherwise"
    )
    return result

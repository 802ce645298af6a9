"""Predicting effective length from f before probing: the paper's threshold form, fitted on some runs and tested on
held-out ones, against two baselines.

The rule: a checkpoint's predicted effective length is the longest probed length n (n <= L) whose f(n), from the
checkpoint's own trained-length histogram, is at least a threshold tau; 0 when none is. tau is fitted to the
training runs by least absolute error. Held out: each seed in turn (its runs of every length), each training
length in turn (fitted on the other), and each data variant in turn when there are several (the packing
experiment's). Baselines: tokens trained alone (the mean effective length of the training
runs' checkpoints at the same tokens, whatever their L) and the run's previous checkpoint's effective length. The
verdict is a paired percentile bootstrap over held-out checkpoints of the absolute error of the baseline minus
that of f: f predicts better when the interval lies above 0.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np

from posfreq.analysis.tables.pass_curve import STATUS_NONE_PASSED, percentile_interval


def observed(row: Mapping) -> float:
    """A checkpoint's effective length, 0 when no probed length passed."""
    return (
        0.0
        if row["effective_length_status"] == STATUS_NONE_PASSED
        else float(row["effective_length"])
    )


def threshold_prediction(f_at: Mapping[int, float], train_len: int, tau: float) -> float:
    """The longest probed n <= train_len with f(n) >= tau (`f_at` maps each probed n to f(n)), else 0."""
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
    """The mean effective length of the training checkpoints at the nearest tokens to `row`'s, whatever their L."""
    tokens = np.array([r["tokens_trained"] for r in train], dtype=float)
    nearest = tokens[np.argmin(np.abs(tokens - row["tokens_trained"]))]
    return float(np.mean([observed(r) for r in train if r["tokens_trained"] == nearest]))


def _previous_baseline(rows: Sequence[Mapping], row: Mapping) -> float:
    """The same run's previous checkpoint's effective length (0 before its first)."""
    same = [
        r
        for r in rows
        if (r["train_len"], r["seed"], r["variant"])
        == (row["train_len"], row["seed"], row["variant"])
        and r["tokens_trained"] < row["tokens_trained"]
    ]
    return observed(max(same, key=lambda r: r["tokens_trained"])) if same else 0.0


HELD_OUT = ("seed", "train_len", "variant")
"""What is held out in turn: each seed (all its runs), each training length, and each data variant (the packing
experiment's runs: fitted on the other variants)."""


def predict_held_out(
    rows: Sequence[Mapping], f_at: Callable[[Mapping], Mapping[int, float]], key: str
) -> list[dict]:
    """For each value of `key` (one of HELD_OUT) in turn: fit tau on the other rows, predict these; a row per
    held-out checkpoint with its observed value and the three predictions."""
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
                    "train_len": r["train_len"],
                    "seed": r["seed"],
                    "variant": r["variant"],
                    "tokens_trained": r["tokens_trained"],
                    "tau": tau,
                    "observed": observed(r),
                    "f_rule": threshold_prediction(f_at(r), r["train_len"], tau),
                    "tokens_alone": _tokens_baseline(train, r),
                    "previous_checkpoint": _previous_baseline(rows, r),
                }
            )
    return out


def prediction_verdict(
    rows: Sequence[Mapping],
    f_at: Callable[[Mapping], Mapping[int, float]],
    n_boot: int,
    seed: int,
) -> dict:
    """How well f's threshold rule predicts held-out effective lengths, against tokens alone and the previous
    checkpoint: mean absolute errors, and whether f beats tokens alone (paired bootstrap over checkpoints)."""
    claim = "f(n) predicts held-out runs' effective length better than tokens trained alone"
    result: dict = {"claim": claim, "test": "paired percentile bootstrap over held-out checkpoints"}
    for key in HELD_OUT:
        if key == "variant" and len({r["variant"] for r in rows}) < 2:
            continue  # one data variant: nothing to hold out
        predictions = predict_held_out(rows, f_at, key)
        if len(predictions) < 2:
            result[f"by_{key}"] = {
                "n": len(predictions),
                "reason": "fewer than 2 held-out checkpoints",
            }
            continue
        errors = {
            name: np.array([abs(p[name] - p["observed"]) for p in predictions])
            for name in ("f_rule", "tokens_alone", "previous_checkpoint")
        }
        gain = errors["tokens_alone"] - errors["f_rule"]
        rng = np.random.default_rng(seed)
        boots = [gain[rng.integers(0, len(gain), len(gain))].mean() for _ in range(n_boot)]
        lo, hi = percentile_interval(boots)
        result[f"by_{key}"] = {
            "n": len(predictions),
            "mean_abs_error": {name: float(e.mean()) for name, e in errors.items()},
            "gain_over_tokens": float(gain.mean()),
            "interval_95": [lo, hi],
            "holds": bool(lo > 0),
            "taus": sorted({p["tau"] for p in predictions}),
        }
    tested = [v["holds"] for k, v in result.items() if k.startswith("by_") and "holds" in v]
    result["holds"] = all(tested) if tested else None
    return result

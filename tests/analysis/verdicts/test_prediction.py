"""Predicting effective length from f (analysis/verdicts/prediction.py) on constructed checkpoints whose effective
length follows the threshold rule exactly, and on ones where it follows tokens alone."""

from __future__ import annotations

import numpy as np
import pytest

from posfreq.analysis.verdicts.prediction import (
    fit_threshold,
    predict_held_out,
    prediction_verdict,
    threshold_prediction,
)

LENGTHS = (64, 128, 192, 256, 384, 512)


def runs(rule) -> tuple[list[dict], dict]:
    """Two lengths x three seeds x four checkpoints; f(n) = tokens * (L - n) / L (more at short n, more with
    training, spread over a longer L for L = 512); the effective length set by `rule`."""
    rows, f_of = [], {}
    for train_len in (256, 512):
        for seed in range(3):
            for k in range(1, 5):
                tokens = 1000 * k
                f = {
                    n: tokens * (train_len - n) / train_len + seed
                    for n in LENGTHS
                    if n <= train_len
                }
                eff = rule(f, train_len, tokens)
                row = {
                    "train_len": train_len,
                    "seed": seed,
                    "variant": "concat",
                    "tokens_trained": tokens,
                    "effective_length": eff,
                    "effective_length_status": "ok" if eff else "none_passed",
                }
                rows.append(row)
                f_of[(train_len, seed, tokens)] = f
    return rows, lambda r: f_of[(r["train_len"], r["seed"], r["tokens_trained"])]


def test_the_threshold_rule_by_hand():
    f = {64: 900.0, 128: 500.0, 256: 0.0}
    assert threshold_prediction(f, 256, 500.0) == 128 and threshold_prediction(f, 256, 1e9) == 0
    assert threshold_prediction(f, 256, 0.0) == 256 and threshold_prediction(f, 100, 0.0) == 64


def test_effective_lengths_that_follow_f_are_fitted_exactly_and_predicted_better_than_by_tokens():
    rows, f_at = runs(lambda f, L, tokens: threshold_prediction(f, L, 1500.0))
    tau = fit_threshold(rows, f_at)
    assert all(
        threshold_prediction(f_at(r), r["train_len"], tau) == r["effective_length"] for r in rows
    )
    verdict = prediction_verdict(rows, f_at)
    for key in ("by_seed", "by_train_len"):
        errors = verdict[key]["mean_abs_error"]
        # held out, tau is only bracketed by the data, so f's error need not be 0
        assert errors["f_rule"] < errors["tokens_alone"]
    assert verdict["by_train_len"]["holds"]


def test_effective_lengths_set_by_tokens_alone_are_not_credited_to_f():
    rows, f_at = runs(lambda f, L, tokens: {1000: 64, 2000: 128, 3000: 192, 4000: 256}[tokens])
    verdict = prediction_verdict(rows, f_at)
    assert verdict["by_seed"]["mean_abs_error"]["tokens_alone"] == 0
    assert not verdict["by_seed"]["holds"] and verdict["holds"] is False
    assert np.isfinite(verdict["by_seed"]["interval_95"]).all()


def test_effective_lengths_set_by_tokens_and_the_cap_alone_are_not_credited_to_f():
    """The review's case: EL = min(g(tokens), L), so f carries nothing beyond tokens and the cap. Against an uncapped
    tokens-alone baseline the capped f rule 'won' (+80 [+16, +137] tokens in the review); against the capped baseline
    and the constant L it must not."""
    g = {1000: 64, 2000: 192, 3000: 320, 4000: 448}
    rows, f_at = runs(lambda f, L, tokens: min(g[tokens], L))
    verdict = prediction_verdict(rows, f_at)
    assert verdict["holds"] is not True and verdict["outcome"] != "holds"
    by_length = verdict["by_train_len"]
    assert by_length["mean_abs_error"]["tokens_alone"] <= by_length["mean_abs_error"]["f_rule"]
    assert by_length["best_baseline"] in ("tokens_alone", "constant_L", "previous_checkpoint")
    assert by_length["outcome"] in ("not shown", "does not hold") and by_length["n"] == 6
    # by hand: held out, L = 256 is predicted from L = 512's 64, 192, 320, 448 capped at 256 (its own values, error
    # 0), and L = 512 from L = 256's 64, 192, 256, 256 (errors 0, 0, 64, 192): 3 x 256 / 24 checkpoints = 32.
    # Uncapped, L = 256's errors would be those of L = 512 again: 64.
    assert by_length["mean_abs_error"]["tokens_alone"] == pytest.approx(32.0)
    held_out = predict_held_out(rows, f_at, "train_len")
    assert max(p["tokens_alone"] for p in held_out if p["train_len"] == 256) == 256


def test_tau_is_fitted_on_the_training_folds_only():
    """Each held-out fold's tau is the one fitted on the other rows (an independent fit_threshold call), not on all
    rows: the held-out checkpoints must not choose the threshold that predicts them."""
    rows, f_at = runs(
        lambda f, L, tokens: threshold_prediction(f, L, 1500.0 if L == 256 else 2500.0)
    )
    everything = fit_threshold(rows, f_at)
    for held in (256, 512):
        fold = fit_threshold([r for r in rows if r["train_len"] != held], f_at)
        assert fold != everything  # the case under test: the two fits differ
        taus = {
            p["tau"] for p in predict_held_out(rows, f_at, "train_len") if p["train_len"] == held
        }
        assert taus == {fold}


def test_a_data_variant_is_held_out_when_there_are_several():
    """The packing experiment's runs: one L, two variants whose f differ at long n (best_fit trains long distances
    twice as often); effective lengths follow the threshold rule, so holding a variant out, f predicts it and
    tokens alone (the same tokens for both variants) cannot."""
    rows, f_of = [], {}
    for variant, boost in (("concat", 1.0), ("best_fit", 2.0)):
        for seed in range(3):
            for k in range(1, 5):
                tokens = 1000 * k
                f = {n: boost * tokens * (512 - n) / 512 + seed for n in LENGTHS}
                eff = threshold_prediction(f, 512, 1500.0)
                rows.append(
                    {
                        "train_len": 512,
                        "seed": seed,
                        "variant": variant,
                        "tokens_trained": tokens,
                        "effective_length": eff,
                        "effective_length_status": "ok" if eff else "none_passed",
                    }
                )
                f_of[(variant, seed, tokens)] = f
    verdict = prediction_verdict(
        rows, lambda r: f_of[(r["variant"], r["seed"], r["tokens_trained"])]
    )
    by_variant = verdict["by_variant"]
    assert (
        by_variant["checkpoints"] == len(rows)
        and by_variant["n"] == 6
        and by_variant["unit"] == "run"
    )
    errors = by_variant["mean_abs_error"]
    assert errors["f_rule"] < errors["tokens_alone"] and by_variant["holds"]
    one = [r for r in rows if r["variant"] == "concat"]
    alone = prediction_verdict(one, lambda r: f_of[("concat", r["seed"], r["tokens_trained"])])
    assert "by_variant" not in alone


def test_f_is_read_at_the_distance_a_pass_needs(tmp_path):
    """A pass at n needs k needles: the k-th nearest needle's distance, the median over n's tests (by hand), not n,
    where Eq. 2 gives f(L) = 0."""
    import json

    from posfreq.analysis.niah.store import length_files
    from posfreq.analysis.verdicts.compare import needed_distances

    tests = {
        256: [[250, 10, 120, 60], [200, 30, 90, 150], [5, 240, 100, 180]],
        128: [[100, 20, 60, 120]],
    }
    for n, distances in tests.items():
        path = length_files(tmp_path, n)[0]
        path.parent.mkdir(exist_ok=True)
        path.write_text(
            "".join(json.dumps({"length": n, "distances": d}) + "\n" for d in distances)
        )
    # 2nd nearest: 60, 90, 100 -> median 90 at 256; 60 at 128. 3rd nearest: 120, 150, 180 -> 150; 100
    assert needed_distances(tmp_path, [128, 256], 2) == {128: 60, 256: 90}
    assert needed_distances(tmp_path, [128, 256], 3) == {128: 100, 256: 150}
    (tmp_path / "tests" / "L000512.jsonl").write_text("")
    with pytest.raises(Exception, match="no test records at length 512"):
        needed_distances(tmp_path, [512], 2)

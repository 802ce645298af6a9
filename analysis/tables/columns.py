"""Every table's columns, in one place: what summary.csv, effective_length.csv and compare's
checkpoints.csv hold, in order, and the names older outputs used."""

from __future__ import annotations

# One model's summary.csv: a row per probed length.
SUMMARY_COLUMNS = (
    "length",
    "prompt_length",
    "n_tests",
    "passed",
    "pass_rate",
    "needle_recall",
    "recall_depth_0_33",
    "recall_depth_33_67",
    "recall_depth_67_100",
    "mean_retrieved",
    "tf_pass_rate",
    "tf_recall",
    "tf_needle_prob",
    "seconds",
    "tests_per_s",
)


# A run's effective_length.csv: a row per checkpoint (then pass_rate_<length> per probed length).
RUN_COLUMNS = (
    "checkpoint",
    "tokens_trained",
    "run_tokens",
    "train_len",
    "positions",
    "effective_length",
    "effective_length_status",
    "effective_length_lo",
    "effective_length_hi",
    "f_effective_length",
    "f_effective_length_lo",
    "f_effective_length_hi",
    "tf_effective_length",
    "tf_effective_length_status",
    "threshold",
    "min_retrieved",
    "scoring",
    "tests_per_length",
)


# One checkpoint's effective length, as the comparison and the demo reports show it.
CHECKPOINT_COLUMNS = (
    "tokens_trained",
    "effective_length",
    "effective_length_lo",
    "effective_length_hi",
    "effective_length_status",
    "f_effective_length",
    "tf_effective_length",
    "tf_effective_length_status",
)


CRITERION_COLUMNS = ("threshold", "min_retrieved", "scoring")
"""What makes a test pass and a length effective: every run compared must share them."""


# compare's checkpoints.csv: every probed checkpoint of every run.
COLUMNS = ("train_len", "seed", "variant", "checkpoint", *CHECKPOINT_COLUMNS, *CRITERION_COLUMNS)


# `posfreq loss-by-distance`'s loss_by_distance.csv: a row per distance bucket (train/run/loss_by_distance.py).
LOSS_BY_DISTANCE_COLUMNS = ("distance_lo", "distance_hi", "tokens", "mean_loss", "f_distance_lo")

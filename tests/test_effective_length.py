"""Effective length from synthetic pass-rate curves, f(effective length) against a naive Eq. 2, the
depth aggregations against hand counts, and the run-table round trip."""

from __future__ import annotations

import numpy as np
import pytest

from analysis.effective_length import (
    RUN_COLUMNS,
    checkpoint_row,
    depth_grid,
    effective_length,
    failure_by_thirds,
    frequency_at,
    load_run,
    read_csv,
    write_effective_length_csv,
)

LENGTHS = [128, 256, 384, 512, 640]


@pytest.mark.parametrize(
    "rates, value, status, first_failure",
    [
        ([1.0, 0.9, 0.6, 0.4, 0.1], 384, "ok", 512),
        ([1.0, 0.4, 0.9, 0.9, 0.9], 128, "ok", 256),  # a later recovery does not count
        ([0.5, 0.5, 0.5, 0.5, 0.5], 640, "all_passed", None),  # exactly the threshold passes
        ([0.49, 1.0, 1.0, 1.0, 1.0], 0, "none_passed", 128),
        ([1.0, 1.0, 1.0, 1.0, 0.0], 512, "ok", 640),
    ],
)
def test_effective_length_on_synthetic_curves(rates, value, status, first_failure):
    eff = effective_length(LENGTHS, rates, threshold=0.5)
    assert (eff.value, eff.status, eff.first_failure) == (value, status, first_failure)


def test_threshold_and_validation():
    assert effective_length(LENGTHS, [1.0, 0.9, 0.8, 0.7, 0.6], threshold=0.75).value == 384
    with pytest.raises(ValueError):
        effective_length([256, 128], [1.0, 1.0])
    with pytest.raises(ValueError):
        effective_length([128], [1.0, 1.0])


def naive_f(hist: np.ndarray, i: int) -> int:
    return sum(int(count) * max(n - i, 0) for n, count in enumerate(hist))


def test_frequency_at_matches_a_naive_loop():
    rng = np.random.default_rng(3)
    train_len = 64
    hist = np.bincount(rng.integers(1, train_len + 1, size=500), minlength=train_len + 1)
    for i in (0, 1, 17, 63, 64, 100):
        assert frequency_at(hist, train_len, i) == naive_f(hist, i)


def record(length, depths, hits):
    return {"length": length, "depths": depths, "hits": hits, "passed": sum(hits) >= 2}


def test_failure_by_thirds_and_depth_grid_count_by_hand():
    records = [
        record(256, [0.1, 0.3, 0.6, 0.9], [False, False, True, True]),
        record(256, [0.2, 0.4, 0.7, 0.8], [False, True, True, True]),
        record(512, [0.05, 0.34, 0.5, 0.99], [False, False, False, True]),
    ]
    rows = {r["length"]: r for r in failure_by_thirds(records)}
    assert rows[256]["missed_0-33.3%"] == 3 and rows[256]["missed_33.3-66.7%"] == 0
    assert rows[256]["miss_rate_0-33.3%"] == 1.0 and rows[256]["peak_failure_depth"] == "0-33.3%"
    # 1 of 1 missed in the first third, 2 of 2 in the second: equal rates, the first third is the peak.
    assert rows[512]["missed_33.3-66.7%"] == 2 and rows[512]["peak_failure_depth"] == "0-33.3%"
    assert rows["all"]["missed_0-33.3%"] == 4 and rows["all"]["missed_33.3-66.7%"] == 2
    lengths, edges, recall = depth_grid(records, bins=4)
    assert lengths == [256, 512] and np.allclose(edges, [0, 0.25, 0.5, 0.75, 1])
    assert recall[0, 0] == 0.0 and recall[1, 0] == 0.5 and recall[2, 0] == 1.0 and recall[3, 0] == 1.0
    assert recall[1, 1] == 0.0 and recall[3, 1] == 1.0 and recall[2, 1] == 0.0


def test_run_table_round_trip_and_figures(tmp_path):
    hist = np.bincount([256, 256, 100, 30], minlength=257)
    summary = [{"length": 128, "pass_rate": 0.9}, {"length": 256, "pass_rate": 0.2}]
    rows = [
        checkpoint_row("tokens-2", 2000, 256, "rope", summary, hist, 0.5, 2, 10),
        checkpoint_row("tokens-1", 1000, 256, "rope", [{"length": 128, "pass_rate": 0.1}], hist, 0.5, 2, 10),
        checkpoint_row("tokens-3", 3000, 256, "rope", [{"length": 128, "pass_rate": 1.0},
                                                       {"length": 256, "pass_rate": 1.0}], hist, 0.5, 2, 10),
    ]
    out = tmp_path / "probe"
    out.mkdir()
    write_effective_length_csv(out / "effective_length.csv", rows)
    table = read_csv(out / "effective_length.csv")
    assert list(table[0]) == list(RUN_COLUMNS) + ["pass_rate_128", "pass_rate_256"]
    assert [r["tokens_seen"] for r in table] == [1000, 2000, 3000]
    assert table[0]["f_effective_length"] is None and table[0]["pass_rate_256"] is None
    assert table[1]["f_effective_length"] == naive_f(hist, 128) and table[2]["f_effective_length"] == 0
    run = load_run(tmp_path)
    assert run.label.startswith(tmp_path.name) and len(run.rows) == 3
    from analysis.effective_length import draw_run_figures

    paths = draw_run_figures([run], tmp_path / "figures")
    assert {p.name for p in paths} >= {"fig2a_effective_length_vs_tokens.png", "fig2b_frequency_vs_effective_length.pdf"}
    with pytest.raises(ValueError):
        checkpoint_row("bad", 1, 128, "rope", summary, hist, 0.5, 2, 10)

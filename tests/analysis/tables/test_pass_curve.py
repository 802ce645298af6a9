"""Effective length from synthetic pass-rate curves, f(effective length) against a naive Eq. 2, the
depth aggregations against hand counts, and the run-table round trip."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from posfreq.analysis.table_files import read_csv
from posfreq.analysis.tables.pass_curve import (
    Analysis,
    bootstrap_interval,
    effective_length,
    frequency_at,
)
from posfreq.analysis.tables.records import depth_grid, failure_by_thirds
from posfreq.analysis.tables.run_table import (
    RUN_COLUMNS,
    ProbedModel,
    checkpoint_row,
    load_run,
    write_effective_length_csv,
)
from posfreq.train.outdir import owner_of

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "demo_probe"

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
    # --threshold -1 reported "512 (all_passed)" with no test passed: a threshold is a pass rate in (0, 1]
    from posfreq.analysis.tables.pass_curve import Analysis

    for bad in (-1.0, 0.0, 1.5):
        with pytest.raises(ValueError, match=r"threshold must be in \(0, 1\]"):
            Analysis(threshold=bad)
    assert Analysis(threshold=1.0).threshold == 1.0


def naive_f(hist: np.ndarray, i: int) -> int:
    return sum(int(count) * max(n - i, 0) for n, count in enumerate(hist))


def test_frequency_at_matches_a_naive_loop():
    rng = np.random.default_rng(3)
    train_len = 64
    hist = np.bincount(rng.integers(1, train_len + 1, size=500), minlength=train_len + 1)
    for i in (0, 1, 17, 63, 64, 100):
        assert frequency_at(hist, train_len, i) == naive_f(hist, i)


def record(length, depths, hits):
    return {"length": length, "depths": depths, "hits_anywhere": hits, "hits_first_line": hits}


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
    assert (
        recall[0, 0] == 0.0 and recall[1, 0] == 0.5 and recall[2, 0] == 1.0 and recall[3, 0] == 1.0
    )
    assert recall[1, 1] == 0.0 and recall[3, 1] == 1.0 and recall[2, 1] == 0.0


@pytest.mark.slow
def test_run_table_round_trip_and_figures(tmp_path):
    hist = np.bincount([256, 256, 100, 30], minlength=257)
    analysis = Analysis(bootstrap=0)

    def row(name, tokens, rates):
        summary = [{"length": 128 * (i + 1), "pass_rate": r} for i, r in enumerate(rates)]
        passed = [[True] * round(10 * r) + [False] * (10 - round(10 * r)) for r in rates]
        model = ProbedModel(name, 256, "rope", hist, tokens, tokens - 500)
        return checkpoint_row(model, summary, passed, analysis, 10)

    rows = [
        row("tokens-2", 2000, [0.9, 0.2]),
        row("tokens-1", 1000, [0.1]),
        row("tokens-3", 3000, [1.0, 1.0]),
    ]
    out = tmp_path / "probe"
    out.mkdir()
    write_effective_length_csv(out / "effective_length.csv", rows)
    table = read_csv(out / "effective_length.csv")
    assert list(table[0]) == list(RUN_COLUMNS) + ["pass_rate_128", "pass_rate_256"]
    assert [r["tokens_trained"] for r in table] == [1000, 2000, 3000]
    assert [r["run_tokens"] for r in table] == [500, 1500, 2500]
    assert table[0]["f_effective_length"] is None and table[0]["pass_rate_256"] is None
    assert (
        table[1]["f_effective_length"] == naive_f(hist, 128) and table[2]["f_effective_length"] == 0
    )
    assert table[1]["effective_length_lo"] is None  # no bootstrap asked for
    run = load_run(tmp_path)
    assert run.label.startswith(tmp_path.name) and len(run.rows) == 3
    from posfreq.analysis.plots.derived import draw_run_figures

    paths = draw_run_figures([run], tmp_path / "figures")
    assert {p.name for p in paths} >= {
        "fig2a_effective_length_vs_tokens.png",
        "fig2b_frequency_vs_effective_length.pdf",
    }
    with pytest.raises(ValueError):
        checkpoint_row(
            ProbedModel("bad", 128, "rope", hist),
            [{"length": 128, "pass_rate": 1.0}],
            [[True]],
            analysis,
            10,
        )


def test_a_length_without_tests_is_refused_not_passed():
    """A NaN pass rate compares as passing (NaN < 0.5 is False): [1, nan, 0] read as 200 'ok'."""
    with pytest.raises(ValueError, match="length 200 is NaN"):
        effective_length([100, 200, 300], [1.0, float("nan"), 0.0])
    with pytest.raises(ValueError, match="length 200 has no tests"):
        bootstrap_interval([100, 200, 300], [[True] * 4, [], [False] * 4], Analysis(bootstrap=50))


def naive_bootstrap(lengths, passed, threshold, n_boot, seed, level):
    """The same percentile bootstrap, one replicate at a time with plain loops."""
    rng = np.random.default_rng(seed)
    draws = [rng.integers(0, len(p), size=(n_boot, len(p))) for p in passed]
    values = []
    for b in range(n_boot):
        rates = [np.mean([p[i] for i in draws[k][b]]) for k, p in enumerate(passed)]
        values.append(effective_length(lengths, rates, threshold).value)
    values.sort()
    tail = (1 - level) / 2
    return values[int(np.ceil(tail * n_boot)) - 1], values[int(np.ceil((1 - tail) * n_boot)) - 1]


def test_bootstrap_interval_is_deterministic_and_matches_a_naive_loop():
    rng = np.random.default_rng(0)
    lengths = [128, 256, 384, 512]
    passed = [list(rng.random(40) < p) for p in (0.95, 0.7, 0.5, 0.2)]
    analysis = Analysis(bootstrap=400, bootstrap_seed=7)
    interval = bootstrap_interval(lengths, passed, analysis)
    assert interval == bootstrap_interval(lengths, passed, analysis)
    assert interval == naive_bootstrap(lengths, passed, 0.5, 400, 7, 0.95)
    lo, hi = interval
    assert (
        lo in [0, *lengths]
        and hi in lengths
        and lo <= effective_length(lengths, [np.mean(p) for p in passed]).value <= hi
    )
    assert lo < hi  # a noisy curve near the threshold gives a real interval
    certain = [[True] * 40, [True] * 40, [False] * 40, [False] * 40]
    assert bootstrap_interval(lengths, certain, analysis) == (256, 256)
    assert bootstrap_interval(lengths, passed, Analysis(bootstrap=0)) is None


@pytest.mark.slow
def test_a_folder_of_a_users_figures_is_refused_untouched(tmp_path):
    """Issue 30: effective-length adopted any folder holding only .png/.pdf files and overwrote a user's figure
    there. Only an older effective-length's own figures, by name, are adopted."""
    from posfreq.scripts.commands import effective_length

    user = tmp_path / "U"
    user.mkdir()
    (user / "fig2a_effective_length_vs_tokens.png").write_bytes(b"my own figure")
    (user / "holiday.pdf").write_bytes(b"%PDF mine")
    before = {p.name: p.read_bytes() for p in user.iterdir()}
    with pytest.raises(SystemExit) as stop:
        effective_length.main([str(FIXTURES / "L256-s0"), "--out", str(user)])
    assert str(stop.value.code) == (
        f"error: --out {user} holds files `posfreq effective-length` did not write "
        "(fig2a_effective_length_vs_tokens.png, holiday.pdf). Fix: pass a new or empty directory "
        "(nothing was changed)"
    )
    assert {p.name: p.read_bytes() for p in user.iterdir()} == before
    older = tmp_path / "older"
    older.mkdir()
    for stem in ("fig2a_effective_length_vs_tokens", "fig2b_frequency_vs_effective_length"):
        for suffix in (".png", ".pdf"):
            (older / f"{stem}{suffix}").write_bytes(b"an older effective-length's figure")
    assert effective_length.main([str(FIXTURES / "L256-s0"), "--out", str(older)]) == 0
    assert owner_of(older) == "effective-length"
    assert (older / "fig2a_effective_length_vs_tokens.png").read_bytes()[:4] == b"\x89PNG"


def test_teacher_forced_effective_length_carries_its_status():
    """A teacher-forced curve that passes every probed length is a lower bound, one that fails the first is 0 by
    convention: the row says so beside the value, as it does for the greedy effective length."""
    hist = np.zeros(257, dtype=np.int64)
    hist[256] = 4

    def tf_row(tf_rates):
        summary = [
            {"length": 128 * (i + 1), "pass_rate": 1.0, "tf_pass_rate": r}
            for i, r in enumerate(tf_rates)
        ]
        passed = [[True] * 10 for _ in tf_rates]
        return checkpoint_row(
            ProbedModel("c", 256, "rope", hist, 1, 1), summary, passed, Analysis(bootstrap=0), 10
        )

    every = tf_row([1.0, 0.9])
    assert (every["tf_effective_length"], every["tf_effective_length_status"]) == (
        256,
        "all_passed",
    )
    none = tf_row([0.0, 1.0])
    assert (none["tf_effective_length"], none["tf_effective_length_status"]) == (0, "none_passed")
    short = tf_row([0.8, 0.1])
    assert (short["tf_effective_length"], short["tf_effective_length_status"]) == (128, "ok")
    unmeasured = checkpoint_row(
        ProbedModel("c", 256, "rope", hist, 1, 1),
        [{"length": 128, "pass_rate": 1.0}],
        [[True]],
        Analysis(bootstrap=0),
        1,
    )
    assert unmeasured["tf_effective_length"] == unmeasured["tf_effective_length_status"] == ""

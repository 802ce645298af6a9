"""The cross-seed verdicts of analysis/compare.py on constructed checkpoints whose answers are known by hand."""

from __future__ import annotations

import numpy as np
import pytest

from posfreq.analysis.verdicts import claims, coincidence, probed_runs
from posfreq.scripts.commands import compare


def rows_on_lines(
    shift_decades: float,
    seeds=(0, 1, 2),
    noise: float = 0.0,
    long_effs: tuple[int, ...] = (48, 64, 80, 112),
) -> list[dict]:
    """Checkpoints of L = 128 and 256 whose log10 f(eff) = 2 + eff / 64 (+ shift for L = 256)."""
    rng = np.random.default_rng(1)
    rows = []
    for train_len, effs in ((128, (32, 48, 64, 80)), (256, long_effs)):
        for seed in seeds:
            for k, eff in enumerate(effs):
                log_f = (
                    2
                    + eff / 64
                    + (shift_decades if train_len == 256 else 0)
                    + noise * rng.standard_normal()
                )
                rows.append(
                    {
                        "train_len": train_len,
                        "seed": seed,
                        "variant": "concat",
                        "checkpoint": f"c{k}",
                        "tokens_trained": 1000 * (k + 1),
                        "effective_length": eff,
                        "effective_length_lo": eff - 16,
                        "effective_length_hi": eff + 16,
                        "effective_length_status": "ok",
                        "f_effective_length": 10**log_f,
                        "pass_rate_32": 1.0,
                        "pass_rate_64": 0.5,
                        f"pass_rate_{train_len}": 0.0,  # probed up to L
                    }
                )
    return rows


def test_curves_on_one_line_coincide_and_shifted_ones_do_not():
    same = coincidence.curves_coincide(rows_on_lines(0.0))
    assert same["holds"] is True and same["D_log10_f"] == pytest.approx(0.0, abs=1e-9)
    # Parallel lines one decade apart: D is the distance between them, exactly, in every resample.
    shifted = coincidence.curves_coincide(rows_on_lines(1.0))
    assert shifted["holds"] is False and shifted["D_log10_f"] == pytest.approx(1.0, abs=1e-9)
    assert shifted["interval_95"] == pytest.approx([1.0, 1.0], abs=1e-9)
    # The longer length reaches much further (64..256 against 32..80): one line pooled over both lengths is
    # tilted by the shift and put D at 1.04; the slope fitted within each length is not tilted.
    apart = coincidence.curves_coincide(rows_on_lines(1.0, long_effs=(64, 128, 192, 256)))
    assert apart["D_log10_f"] == pytest.approx(1.0, abs=1e-9)
    # A small, consistent shift: shown (the interval excludes 0), but well inside the margin: the curves coincide
    # at that margin. Under the old rule any interval excluding 0 said they do not.
    small = coincidence.curves_coincide(rows_on_lines(0.1, noise=0.02))
    assert 0 < small["interval_95"][0] < small["interval_95"][1] < np.log10(2)
    assert small["outcome"] == "holds" and small["holds"] is True
    noisy = coincidence.curves_coincide(rows_on_lines(0.0, noise=0.3))
    assert noisy["interval_95"][0] < noisy["D_log10_f"] < noisy["interval_95"][1]
    assert noisy == coincidence.curves_coincide(rows_on_lines(0.0, noise=0.3))  # deterministic


def test_curves_without_overlap_are_not_testable():
    rows = [
        r
        for r in rows_on_lines(0.0)
        if (r["train_len"] == 128) == (r["effective_length"] < 48)
        or r["train_len"] == 256
        and r["effective_length"] > 80
    ]
    verdict = coincidence.curves_coincide(rows)
    assert verdict["holds"] is None and "overlap" in verdict["reason"]


def test_curves_with_too_few_points_or_seeds_are_not_testable():
    """Two points of one length (one per seed), or the points of fewer than three seeds, are too few to test C2."""
    rows = rows_on_lines(1.0)
    two_points = [
        r for r in rows if r["train_len"] == 256 or r["checkpoint"] == "c1" and r["seed"] < 2
    ]
    verdict = coincidence.curves_coincide(two_points)
    assert (
        verdict["holds"] is None
        and verdict["n_points"]["128"] == 2
        and "fewer than 3" in verdict["reason"]
    )
    one_seed = [r for r in rows if r["train_len"] == 256 or r["seed"] == 0]
    verdict = coincidence.curves_coincide(one_seed)
    assert verdict["holds"] is None and verdict["n_seeds"]["128"] == 1
    two_seeds = coincidence.curves_coincide(
        [r for r in rows if r["train_len"] == 256 or r["seed"] < 2]
    )
    assert (
        two_seeds["holds"] is None and two_seeds["n_seeds"]["128"] == 2
    )  # 8 points, but a bootstrap of 2 seeds
    assert coincidence.curves_coincide(rows)["holds"] is False  # 12 points from 3 seeds: shifted


def test_longer_training_length_and_shortfall_and_emergence():
    rows = rows_on_lines(0.0)
    further = claims.longer_reaches_further(rows)
    assert further["differences"] == [112 - 80] * 3 and further["holds"] is True
    short = claims.shortfall(rows)
    assert short["holds"] is True and {
        x["effective_length"] for x in short["last_checkpoints"]
    } == {80, 112}
    rows[3]["effective_length_hi"] = 128  # L = 128 seed 0, last checkpoint: its interval reaches L
    reaches = claims.shortfall(rows)
    assert (
        reaches["outcome"] == "not shown" and reaches["holds"] is None
    )  # reaching L is not shown either
    assert reaches["reason"].startswith("1 of 6 runs not shown short: L = 128 seed 0")
    rows[3].update(
        effective_length=128, effective_length_lo=128, effective_length_status="all_passed"
    )
    assert claims.shortfall(rows)["outcome"] == "does not hold"  # its whole interval is at L
    for r in rows:
        if r["train_len"] == 128 and r["seed"] == 1 and r["tokens_trained"] < 3000:
            r["effective_length"] = 0
    found = {(e["train_len"], e["seed"]): e for e in claims.emergence(rows)}
    assert found[(128, 1)]["share_of_budget"] == 0.75 and found[(256, 0)]["share_of_budget"] == 0.25


@pytest.mark.slow
def test_figures_are_drawn(tmp_path):
    from posfreq.analysis.plots import effective_length as plots_effective_length

    rows = rows_on_lines(0.3, noise=0.1)
    for draw, stem in (
        (plots_effective_length.plot_fig2a_seed_bands, "a"),
        (plots_effective_length.plot_fig2b_seeds, "b"),
        (plots_effective_length.plot_pass_rate_curves, "c"),
    ):
        paths = draw(rows, tmp_path / stem)
        assert all(p.is_file() and p.stat().st_size > 1000 for p in paths)


def test_variant_effect_at_equal_tokens_and_against_f():
    """Two data variants at one L: best_fit is 16, 32, 48 tokens ahead (seed 0, 1, 2) at every milestone, on the same
    f-curve; the paired mean is 32 with a bootstrap interval inside [16, 48], and against f the curves coincide."""
    rows = []
    for seed, lead in ((0, 16), (1, 32), (2, 48)):
        for k, eff in enumerate((64, 96, 128, 160)):
            for variant, el in (("concat", eff), ("best_fit", eff + lead)):
                rows.append(
                    {
                        "train_len": 256,
                        "seed": seed,
                        "variant": variant,
                        "checkpoint": f"c{k}",
                        "tokens_trained": 1000 * (k + 1),
                        "effective_length": el,
                        "effective_length_lo": el - 8,
                        "effective_length_hi": el + 8,
                        "effective_length_status": "ok",
                        "f_effective_length": 10 ** (2 + el / 64),
                    }
                )
    effect = claims.variant_effect(rows, "concat", "best_fit")
    assert (
        effect["mean_difference_per_seed"] == [16.0, 32.0, 48.0]
        and effect["mean_difference"] == 32.0
    )
    # the t-interval by hand: sd 16 over 3 seeds, t(0.975, 2 df) = 4.302653 from a printed table; the checkpoints'
    # own noise ((16 / 2z)^2 per run) is far below the seeds' spread, so its floor does not bind
    half = 4.302653 * 16 / np.sqrt(3)
    assert effect["interval_95"] == pytest.approx([32 - half, 32 + half], abs=1e-4)
    assert effect["outcome"] == "not shown" and effect["holds"] is None and not effect["differs"]
    assert (
        effect["n"] == 3
        and effect["unit"] == "seed"
        and "t-interval over 3 seeds" in effect["interval_method"]
    )
    assert effect["last_milestone_differences"] == [16, 32, 48]
    steady = [dict(r) for r in rows]
    for r in steady:
        if r["variant"] == "best_fit":
            r["effective_length"] -= (r["seed"] - 1) * 14  # leads 30, 32, 34
    assert claims.variant_effect(steady, "concat", "best_fit")["outcome"] == "holds"
    same_f = coincidence.curves_coincide(rows, group="variant", groups=("concat", "best_fit"))
    assert same_f["holds"] is True and same_f["D_log10_f"] == pytest.approx(0.0, abs=1e-9)
    none = claims.variant_effect(rows, "concat", "padded")
    assert none["holds"] is None


def test_variants_are_compared_within_each_training_length_and_labelled_apart():
    """best_fit is +100 over concat at L = 512 and +0 at L = 256: each length gets its own comparison (pooling
    them would mix the two); a seed with no milestone shared by both variants is left out, not a crash, and
    fewer than 3 seeds are not testable."""
    rows = []
    for train_len, lead in ((256, 0), (512, 100)):
        for seed in (0, 1, 2):
            for k in range(3):
                for variant, el in (("concat", 100 + 10 * k), ("best_fit", 100 + 10 * k + lead)):
                    rows.append(
                        {
                            "train_len": train_len,
                            "seed": seed,
                            "variant": variant,
                            "tokens_trained": 1000 * (k + 1),
                            "effective_length": el,
                            "effective_length_status": "ok",
                            "f_effective_length": 1e6,
                        }
                    )
    rows.append(
        {
            "train_len": 512,
            "seed": 3,
            "variant": "best_fit",
            "tokens_trained": 999,
            "effective_length": 5,
            "effective_length_status": "ok",
            "f_effective_length": 1e6,
        }
    )  # seed 3 has no concat run
    found = {c["train_len"]: c["equal_tokens"] for c in claims.variant_comparisons(rows, "concat")}
    assert found[256]["mean_difference"] == 0.0 and found[512]["mean_difference"] == 100.0
    assert found[512]["seeds"] == [0, 1, 2]
    two_seeds = [r for r in rows if r["train_len"] == 512 and r["seed"] != 2]
    short = claims.variant_effect(two_seeds, "concat", "best_fit")
    assert short["holds"] is None and "2 seeds" in short["reason"]
    with pytest.raises(ValueError, match="one training length"):
        claims.variant_effect(rows, "concat", "best_fit")
    labels = {
        probed_runs.data_variant({"data": d})
        for d in (
            {"packing": "concat"},
            {"packing": "concat", "attention": "row"},
            {"packing": "concat", "length_upsample": {"256-": 2.0}},
            {"packing": "concat", "length_upsample": {"256-": 3}},
            {"packing": "best_fit"},
        )
    }
    assert labels == {
        "concat",
        "concat/row",
        "concat+upsample{256-: 2}",
        "concat+upsample{256-: 3}",
        "best_fit",
    }


def probed_run(run, seed: int, recorded_run: str, status: str = "ok"):
    """A probed run as `posfreq probe --run` leaves it: RUN/checkpoints/*/config.json and RUN/probe/ tables."""
    import json

    from posfreq.analysis.table_files import write_csv

    for k in (1, 2):
        (run / "checkpoints" / f"tokens-{k}").mkdir(parents=True)
        (run / "checkpoints" / f"tokens-{k}" / "config.json").write_text(
            json.dumps({"seed": seed, "data": {}})
        )
    (run / "probe").mkdir()
    (run / "probe" / "probe.json").write_text(json.dumps({"run": recorded_run}))
    rows = [
        {
            "checkpoint": f"tokens-{k}",
            "positions": "rope",
            "train_len": 128,
            "tokens_trained": 1000 * k,
            "effective_length": 0 if status != "ok" else 32 * k,
            "effective_length_lo": "",
            "effective_length_hi": "" if status != "ok" else 32 * k + 16,
            "effective_length_status": status,
            "f_effective_length": "",
            **{f"pass_rate_{n}": float(status == "ok" and n <= 32 * k) for n in (32, 64, 96, 128)},
        }
        for k in (1, 2)
    ]
    write_csv(run / "probe" / "effective_length.csv", rows, list(rows[0]))
    return run / "probe"


def test_a_moved_or_relative_run_keeps_its_seed_and_a_lost_one_is_an_error(tmp_path, capsys):
    moved = [
        probed_run(tmp_path / f"s{s}", s, recorded_run=f"runs/elsewhere/s{s}") for s in (0, 1, 2)
    ]
    rows = probed_runs.load_checkpoints(moved)
    assert sorted({r["seed"] for r in rows}) == [
        0,
        1,
        2,
    ]  # read from the run holding the probe directory
    lost = tmp_path / "copies" / "probe"
    lost.parent.mkdir()
    import shutil

    shutil.copytree(moved[0], lost)
    with pytest.raises(
        probed_runs.CompareError, match="training seed cannot be read .*runs/elsewhere/s0"
    ):
        probed_runs.load_checkpoints([lost])
    with pytest.raises(SystemExit, match="error: .*training seed cannot be read"):
        compare.main([str(lost), "--out", str(tmp_path / "out"), "--no-figures"])
    assert not (tmp_path / "out").exists()


def test_a_run_that_passed_nothing_is_a_stated_caveat_not_a_verdict(tmp_path, capsys):
    dirs = [probed_run(tmp_path / "none", 0, "", status="none_passed")]
    assert compare.main([*map(str, dirs), "--out", str(tmp_path / "out"), "--no-figures"]) == 0
    printed = capsys.readouterr().out
    assert "shortfall: not testable" in printed and "passed no probed length" in printed
    dirs.append(probed_run(tmp_path / "ok", 1, ""))
    verdict = compare.compare(dirs, tmp_path / "out2", figures=False)["shortfall"]
    assert verdict["holds"] is True and "1 of 2 runs passed no probed length" in verdict["caveat"]


def test_compare_writes_only_into_its_own_directory(tmp_path):
    dirs = [probed_run(tmp_path / "r", 0, "")]
    mine = tmp_path / "paper"
    mine.mkdir()
    (mine / "conclusion.json").write_text("my own notes")
    with pytest.raises(SystemExit, match="holds files `posfreq compare` did not write"):
        compare.main([*map(str, dirs), "--out", str(mine), "--no-figures"])
    assert [p.name for p in mine.iterdir()] == ["conclusion.json"] and (
        mine / "conclusion.json"
    ).read_text() == "my own notes"
    older = tmp_path / "older"  # what an older posfreq's compare left: adopted, then replaced
    (older / "figures").mkdir(parents=True)
    (older / "checkpoints.csv").write_text("old\n")
    (older / "conclusion.json").write_text("{}")
    assert compare.main([*map(str, dirs), "--out", str(older), "--no-figures"]) == 0
    assert (older / "checkpoints.csv").read_text() != "old\n"


def test_the_folder_the_results_sit_in_wins_over_the_recorded_path(tmp_path):
    """Results moved with their run, while a new run now sits at the recorded path: the seed is the moved
    run's (the recorded path supplied another run's seed), and the recorded path is only a fallback."""
    stale = probed_run(
        tmp_path / "old", 7, recorded_run="unused"
    )  # a new run at the old path, seed 7
    moved = probed_run(tmp_path / "moved", 3, recorded_run=str(stale.parent))
    assert {r["seed"] for r in probed_runs.load_checkpoints([moved])} == {3}


def test_runs_scored_under_different_criteria_are_refused_by_name(tmp_path):
    """A run re-derived at threshold 0.4 beside runs at 0.5 mixed both without a word."""
    from posfreq.analysis.table_files import read_csv, write_csv

    runs = [probed_run(tmp_path / f"s{s}", s, recorded_run="unused") for s in (0, 1)]
    for run, threshold in zip(runs, (0.5, 0.4)):
        rows = read_csv(run / "effective_length.csv")
        for row in rows:
            row.update(threshold=threshold, min_retrieved=2, scoring="exact")
        write_csv(run / "effective_length.csv", rows, list(rows[0]))
    with pytest.raises(probed_runs.CompareError, match="different pass criteria.*threshold.*0.4"):
        probed_runs.load_checkpoints(runs)
    with pytest.raises(SystemExit, match="error: the runs were scored under different pass"):
        compare.main([*map(str, runs), "--out", str(tmp_path / "out"), "--no-figures"])
    assert not (tmp_path / "out").exists()


def test_two_probes_of_one_run_are_refused_naming_both(tmp_path):
    """A rope and a string probe of one run (or one path given twice) were merged into one run's rows, so which
    checkpoint row a verdict used depended on the order of the arguments."""
    import shutil

    from posfreq.analysis.table_files import read_csv, write_csv

    rope = probed_run(tmp_path / "s0", 0, recorded_run="unused")
    string = rope.parent / "probe-string"
    shutil.copytree(rope, string)
    rows = read_csv(string / "effective_length.csv")
    for row in rows:
        row["positions"] = "string"
    write_csv(string / "effective_length.csv", rows, list(rows[0]))
    other = probed_run(tmp_path / "s1", 1, recorded_run="unused")
    for paths in ([rope, other, string], [string, rope], [rope, rope]):
        with pytest.raises(probed_runs.CompareError, match="are probes of one run") as err:
            probed_runs.load_checkpoints(paths)
        message = str(err.value)
        assert f"{paths[0]} and {paths[-1]} are probes of one run (L = 128, seed 0, " in message
        assert "Fix: pass one probe per run" in message and "\n" not in message
    with pytest.raises(
        SystemExit, match=r"^error: .* are probes of one run .* Fix: pass one probe"
    ):
        compare.main([str(rope), str(string), "--out", str(tmp_path / "out"), "--no-figures"])
    assert not (tmp_path / "out").exists()
    assert (
        len(probed_runs.load_checkpoints([rope, other])) == 4
    )  # one probe per run is compared as before


def test_longer_length_is_compared_at_the_last_tokens_both_runs_of_a_seed_reached():
    """L = 256 runs on past L = 128's last milestone for two seeds: the pair is taken where both are (4000 tokens),
    not at each run's own last checkpoint; with fewer than C2_MIN_SEEDS paired seeds nothing is tested."""
    rows = rows_on_lines(0.0)  # at 4000 tokens: L = 256 at 112, L = 128 at 80, for every seed
    for r in rows:
        if (r["train_len"], r["seed"], r["tokens_trained"]) == (256, 1, 4000):
            r["effective_length_status"] = "all_passed"  # censored where compared
    for seed in (0, 2):  # further on, L = 256 passes every probed length
        rows.append(
            {
                **rows[-1],
                "seed": seed,
                "tokens_trained": 9000,
                "effective_length": 256,
                "effective_length_status": "all_passed",
            }
        )
    rows.append(
        {**rows[0], "seed": 1, "tokens_trained": 7000, "effective_length": 128}
    )  # L = 128 alone
    further = claims.longer_reaches_further(rows)
    # by hand: per seed, the largest tokens both lengths have, and the difference there
    by_run = {}
    for r in rows:
        by_run.setdefault((r["train_len"], r["seed"]), {})[r["tokens_trained"]] = r[
            "effective_length"
        ]
    expected = []
    for seed in (0, 1, 2):
        t = max(set(by_run[(128, seed)]) & set(by_run[(256, seed)]))
        expected.append((t, by_run[(256, seed)][t] - by_run[(128, seed)][t]))
    assert expected == [(4000, 32)] * 3
    assert further["tokens_compared"] == [t for t, _ in expected]
    assert further["differences"] == [d for _, d in expected] and further["holds"] is True
    assert further["censored"] == {"128": 0, "256": 1}
    two_seeds = claims.longer_reaches_further([r for r in rows if r["seed"] != 2])
    assert two_seeds["holds"] is None and two_seeds["seeds"] == [0, 1]
    assert f"needs at least {coincidence.C2_MIN_SEEDS}" in two_seeds["reason"]


def last_checkpoint(seed, train_len, longest, el, hi, status="ok", lo=None):
    """One run's only checkpoint, probed at 32, 64, ... up to `longest`."""
    return {
        "train_len": train_len,
        "seed": seed,
        "variant": "concat",
        "tokens_trained": 1000,
        "effective_length": el,
        "effective_length_lo": lo,
        "effective_length_hi": hi,
        "effective_length_status": status,
        **{f"pass_rate_{n}": float(n <= el) for n in range(32, longest + 1, 32)},
    }


def test_a_run_without_an_interval_end_or_probed_below_l_cannot_decide_the_shortfall():
    """Each run's outcome by hand: short (interval end below L and below its longest probed length), not short
    (its interval's lower end at L), not shown short (probed to L, its interval reaching L from below) or
    untestable (no interval end; probed only below L and not shown short there). One run that is not short
    decides 'does not hold'; else one not shown short leaves it not shown; else an untestable run leaves it not
    testable."""
    short = last_checkpoint(0, 128, 128, 64, 96)
    short_below_ceiling = last_checkpoint(
        1, 256, 128, 32, 64
    )  # fails at 64 of 128 probed: short of 256
    no_interval = last_checkpoint(2, 128, 128, 64, None)  # probed with bootstrap 0
    capped = last_checkpoint(
        3, 256, 128, 128, 128, "all_passed"
    )  # passed all it was asked, up to 128 < 256
    at_ceiling = last_checkpoint(
        4, 256, 128, 96, 128
    )  # its interval reaches the probe's last length
    reaches_l = last_checkpoint(5, 128, 128, 128, 128, "all_passed", lo=128)
    maybe_l = last_checkpoint(
        6, 128, 128, 96, 128, lo=64
    )  # interval [64, 128]: not shown either way
    cases = [
        ([short, short_below_ceiling], "holds", []),
        ([short, at_ceiling], "not testable", [4]),
        ([short, capped], "not testable", [3]),
        ([short, no_interval], "not testable", [2]),
        ([short, no_interval, maybe_l], "not shown", [2]),
        ([short, no_interval, capped, maybe_l, reaches_l], "does not hold", [2, 3]),  # seed 5 at L
    ]
    for runs, expected, untestable in cases:
        verdict = claims.shortfall(runs)
        assert verdict["outcome"] == expected, (runs, verdict)
        assert verdict["holds"] is {"holds": True, "does not hold": False}.get(expected)
        assert verdict["n"] == len(runs) and verdict["unit"] == "run" and "rule" in verdict
        named = [int(u.split(" seed ")[1].split()[0]) for u in verdict.get("untestable", [])]
        assert named == untestable
        if expected == "not testable":
            assert all(f"seed {s} " in verdict["reason"] for s in untestable)
    assert "seed 5" in claims.shortfall([short, maybe_l, reaches_l])["reason"]
    no_interval_why = claims.shortfall([no_interval])["reason"]
    assert "bootstrap 0" in no_interval_why
    assert "probed only up to 128, below L" in claims.shortfall([capped])["reason"]
    assert {
        x["seed"]: x["longest_probed"]
        for x in claims.shortfall([short, capped])["last_checkpoints"]
    } == {
        0: 128,
        3: 128,
    }


def test_sameness_is_an_equivalence_test_and_a_difference_can_be_not_shown():
    """The rules on a 95% interval, with the margin log10(2) written out here. Equivalence: inside +-margin holds
    (the demo's loss D = -0.078 [-0.086, -0.068], which the old rule called 'do not coincide'), wholly outside does
    not hold, straddling the margin is inconclusive (+0.23 [+0.03, +0.45]). Difference: above 0 holds, below 0 does
    not hold, touching or covering 0 is not shown (+43 [0, 128], which the old rule called 'does not hold')."""
    from posfreq.analysis.verdicts.rules import Interval, difference, equivalence, outcome

    margin = np.log10(2)
    assert (
        coincidence.C2_MARGIN_DECADES == pytest.approx(0.30103, abs=1e-5) == pytest.approx(margin)
    )
    same = {
        (-0.086, -0.068): "holds",
        (-0.1, 0.2): "holds",
        (-margin, margin): "holds",
        (0.40, 0.73): "does not hold",
        (-0.9, -0.31): "does not hold",
        (0.03, 0.45): "inconclusive",
        (-0.2, 0.31): "inconclusive",
        (-0.53, 1.22): "inconclusive",
    }
    for (lo, hi), expected in same.items():
        verdict = equivalence(Interval((lo + hi) / 2, lo, hi, 3, "run", "m"), margin, "decades")
        assert verdict["outcome"] == outcome(verdict) == expected, (lo, hi)
        assert verdict["holds"] is {"holds": True, "does not hold": False}.get(expected)
        assert (
            "±0.301 decades" in verdict["rule"] and verdict["n"] == 3 and verdict["unit"] == "run"
        )
    apart = {
        (1, 5): "holds",
        (-5, -1): "does not hold",
        (0, 128): "not shown",
        (-1, 1): "not shown",
    }
    for (lo, hi), expected in apart.items():
        verdict = difference(Interval((lo + hi) / 2, lo, hi, 5, "seed", "m"))
        assert verdict["outcome"] == expected and verdict["rule"].startswith(
            "difference: holds when"
        )
    assert outcome({"holds": None, "reason": "too few points"}) == "not testable"


def test_a_wide_interval_around_a_real_shift_is_inconclusive_not_a_coincidence(
    capsys, tmp_path, monkeypatch
):
    """A true shift of 0.8 decades under noise of 2 decades per point: the interval covers 0 only because it is wide.
    An old rule said the curves coincide; it is inconclusive, and every rendering says so with its rule and n."""
    from posfreq.scripts.miniature.report import verdicts

    noisy = coincidence.curves_coincide(rows_on_lines(0.8, noise=2.0))
    lo, hi = noisy["interval_95"]
    assert lo < 0 < hi and hi > np.log10(2)  # the case under test
    assert noisy["holds"] is None and noisy["outcome"] == "inconclusive" and "reason" not in noisy
    assert (
        noisy["n"] == 6
        and noisy["unit"] == "run"
        and "Welch t-interval over 3 and 3 runs" in noisy["interval_method"]
    )
    precise = coincidence.curves_coincide(rows_on_lines(0.0, noise=0.1))
    assert -np.log10(2) <= precise["interval_95"][0] < 0 < precise["interval_95"][1] <= np.log10(2)
    assert precise["holds"] is True
    untestable = coincidence.curves_coincide(rows_on_lines(0.8, seeds=(0, 1)))
    conclusion = {
        "shortfall": {"claim": "c1", "holds": True},
        "longer_reaches_further": {"claim": "fig2a", "holds": True},
        "curves_coincide": noisy,
    }
    report = "\n".join(verdicts(conclusion, quick=False))
    assert "coincide (the paper's C2)" in report and ": **inconclusive**. Estimate" in report
    assert (
        "Welch t-interval over 3 and 3 runs" in report
        and "Rule: equivalence at ±0.301 decades of f" in report
    )
    assert "not testable" not in report
    conclusion["curves_coincide"] = untestable
    assert ": **not testable**. Fewer than 3" in "\n".join(verdicts(conclusion, quick=False))
    loss = {
        "claim": "loss c2",
        "holds": None,
        "reason": "needs runs of exactly two training lengths",
    }
    best_fit = claims.variant_effect(
        [
            {
                **r,
                "variant": v,
                "effective_length": r["effective_length"] + (r["seed"] if v == "b" else 0),
            }
            for r in rows_on_lines(0.0)
            if r["train_len"] == 128
            for v in ("concat", "b")
        ],
        "concat",
        "b",
    )
    printed = {
        **conclusion,
        "curves_coincide": noisy,
        "loss_curves_coincide": loss,
        "prediction": {"claim": "f predicts", "holds": None, "reason": "no histogram"},
        "recall_curves_coincide": {"claim": "recall c2", "holds": None, "reason": "one length"},
        "shortfall": {"claim": "c1", "holds": True, "n": 6, "unit": "run", "rule": "every run"},
        "variants": [
            {
                "train_len": 128,
                "baseline": "concat",
                "variant": "best_fit",
                "equal_tokens": best_fit,
                "against_f": noisy,
            }
        ],
    }
    from posfreq.scripts.miniature.packing_experiment import verdict_lines

    lines = "\n".join(verdict_lines(printed, False))
    assert "the curves are not shown to coincide or differ (inconclusive)" in lines
    assert "effective length not shown to differ" in lines and "t-interval over 3 seeds" in lines
    monkeypatch.setattr(compare, "compare", lambda *args: printed)
    assert compare.main([str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].startswith("curves_coincide: inconclusive; ")
    assert (
        "Welch t-interval over 3 and 3 runs" in lines[2]
        and "rule: equivalence at ±0.301" in lines[2]
    )
    assert lines[3].startswith("loss_curves_coincide: not testable")
    assert lines[4].startswith("recall_curves_coincide: not testable; one length")
    assert lines[5].startswith("prediction: not testable; no histogram")
    assert lines[0].startswith(
        "shortfall: holds; n = 6 runs; rule: every run"
    )  # its n, though no interval
    # the packing experiment's verdicts, each with its rule and n (they were left out of the printout)
    assert lines[6].startswith("variant best_fit vs concat at L = 128, equal tokens: not shown; ")
    assert "t-interval over 3 seeds" in lines[6] and "rule: difference" in lines[6]
    assert lines[7].startswith("variant best_fit vs concat at L = 128, against f: inconclusive; ")
    assert "rule: equivalence at ±0.301" in lines[7]


def test_run_levels_are_the_run_intercepts_of_a_common_slope_least_squares_fit():
    """On scattered points whose groups overlap partly, split unevenly into runs with offsets of their own: each
    run's level is its intercept in y = b x + a_run fitted by numpy's least squares (one indicator per run) to the
    overlap's points, and D is the mean intercept of the long group's runs minus the short group's."""
    rng = np.random.default_rng(3)
    runs = {}
    for g, (x0, x1, base) in {"s": (0, 6, 1.0), "l": (3, 10, 1.7)}.items():
        for k, size in enumerate((10, 14, 16)):
            x = rng.uniform(x0, x1, size)
            offset = rng.normal(0, 0.3)
            runs[(g, k)] = [
                (g, float(v), float(base + offset + 0.5 * v + rng.normal(0, 0.2))) for v in x
            ]
    every = [p for v in runs.values() for p in v]
    lo = max(min(x for g2, x, _ in every if g2 == g) for g in "sl")
    hi = min(max(x for g2, x, _ in every if g2 == g) for g in "sl")
    names = list(runs)

    def fit(points_of):
        rows = [(x, names.index(r), y) for r in names for _, x, y in points_of(r)]
        design = np.zeros((len(rows), 1 + len(names)))
        for i, (x, r, _) in enumerate(rows):
            design[i, 0], design[i, 1 + r] = x, 1.0
        return np.linalg.lstsq(design, np.array([y for *_, y in rows]), rcond=None)[0]

    coef = fit(lambda r: [p for p in runs[r] if lo <= p[1] <= hi])
    levels = coincidence.run_levels(runs, "s", "l", "overlap")
    expected = {g: [coef[1 + names.index(r)] for r in names if r[0] == g] for g in "sl"}
    assert levels["s"] == pytest.approx(expected["s"], abs=1e-12)
    assert levels["l"] == pytest.approx(expected["l"], abs=1e-12)
    # fitted to every point: the slope of the run indicators' fit to all points; levels still over the overlap
    slope = fit(lambda r: runs[r])[0]
    alone = coincidence.run_levels(runs, "s", "l", "all")
    by_hand = [
        np.mean([y - slope * x for _, x, y in runs[r] if lo <= x <= hi])
        for r in names
        if r[0] == "l"
    ]
    assert alone["l"] == pytest.approx(by_hand, abs=1e-12)
    # in the overlap (1..2) each group sits at one x, a different one: no slope to fit, nothing to compare at
    # equal x
    unfit = {0: [("s", 1, 0), ("s", 1, 1), ("s", 3, 5)], 1: [("l", 0, 0), ("l", 2, 2), ("l", 2, 3)]}
    assert coincidence.run_levels(unfit, "s", "l", "overlap") is None
    # every point at one x: the shift there, whatever the slope
    same_x = coincidence.run_levels(
        {0: [("s", 4, 1), ("s", 4, 2)], 1: [("l", 4, 5), ("l", 4, 6)]}, "s", "l", "all"
    )
    assert same_x["l"][0] - same_x["s"][0] == pytest.approx(4.0)

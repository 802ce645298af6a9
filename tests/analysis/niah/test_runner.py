"""Orchestration with fake models of known answers: per-model results, run-level tables against a naive
Eq. 2, resumability, shards, stale results, and the notebook executed on fixture runs."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.probe import (
    TOKENIZER,
    WindowModel,
    fake_source,
    job,
    make_fake_run,
    probe_fake_run,
    snapshot,
)
from helpers.records import as_older_posfreq

from posfreq.analysis.niah import runner as probe_runner
from posfreq.analysis.niah import settings as probe_settings
from posfreq.analysis.niah import sources as probe_sources
from posfreq.analysis.niah import store
from posfreq.analysis.niah.needles import NiahBuilder, PromptFormat
from posfreq.analysis.table_files import read_csv
from posfreq.analysis.tables.columns import RUN_COLUMNS
from posfreq.analysis.tables.derive import derive_model, derive_run
from posfreq.analysis.tables.pass_curve import Analysis
from posfreq.scripts.commands.probe import derive_probed
from posfreq.train.journal import JOURNAL_FILE
from posfreq.train.outdir import OWNER_FILE, OutputDirError, owner_of

REPO = Path(__file__).resolve().parents[3]


def run_one(tmp_path, model, lengths, tests=6, threshold=0.5, **kw) -> tuple[dict, list[dict]]:
    j = job(lengths, tests, **kw)
    probe_runner.probe_models([fake_source(model)], [tmp_path], j, probe_sources.Builders("noise"))
    (row,) = derive_probed(tmp_path, [tmp_path], Analysis(threshold=threshold), figures=False)
    return row, store.read_records(tmp_path, lengths)


def test_oracle_passes_everything_and_silence_fails_everything(tmp_path):
    row, records = run_one(tmp_path / "oracle", WindowModel(TOKENIZER), [160, 256, 384])
    assert all(all(r["hits_anywhere"]) for r in records) and len(records) == 18
    assert all(
        sum(r["hits_first_line"]) == 1 for r in records
    )  # the old rule: a list scores one needle
    assert row["effective_length"] == 384 and row["effective_length_status"] == "all_passed"
    assert row["effective_length_lo"] == row["effective_length_hi"] == 384
    row, records = run_one(tmp_path / "silent", WindowModel(TOKENIZER, silent=True), [160, 256])
    assert not any(any(r["hits_anywhere"]) for r in records)
    assert row["effective_length"] == 0 and row["effective_length_status"] == "none_passed"
    assert row["f_effective_length"] == ""
    with open(tmp_path / "silent" / "summary.csv") as fh:
        assert [float(r["pass_rate"]) for r in csv.DictReader(fh)] == [0.0, 0.0]


def test_window_model_fails_exactly_for_needles_beyond_k(tmp_path):
    k, lengths, budget = 120, [160, 256, 384, 512, 640], 32
    row, records = run_one(tmp_path, WindowModel(TOKENIZER, k), lengths, tests=10, budget=budget)
    builder = NiahBuilder(TOKENIZER, "noise", PromptFormat(answer_budget=budget))
    expected_rates = []
    for length in lengths:
        tests = builder.make_tests(length, 10, 0)
        mine = [r for r in records if r["length"] == length]
        for test, rec in zip(tests, mine):
            visible = [
                length - budget - p <= k for p in test.positions
            ]  # needle starts within the last k tokens
            assert rec["hits_anywhere"] == visible, (length, test.positions)
        expected_rates.append(
            np.mean([sum(length - budget - p <= k for p in t.positions) >= 2 for t in tests])
        )
    first_fail = next(i for i, r in enumerate(expected_rates) if r < 0.5)
    assert expected_rates[0] == 1.0 and 0 < first_fail
    assert (
        row["effective_length"] == lengths[first_fail - 1]
        and row["effective_length_status"] == "ok"
    )
    for length, rate in zip(lengths, expected_rates):
        assert row[f"pass_rate_{length}"] == pytest.approx(rate)
    # Distance-resolved: a needle is recalled exactly when its distance to the question keeps it in the window.
    with open(tmp_path / "distance.csv") as fh:
        table = list(csv.DictReader(fh))
    assert [int(r["distance_hi"]) for r in table] == lengths
    tail = len(builder._tail)
    for r in table:
        lo, hi = int(r["distance_lo"]), int(r["distance_hi"])
        if r["needle_recall"] == "":
            continue
        if hi + tail <= k:
            assert float(r["needle_recall"]) == 1.0
        if lo + tail > k:
            assert float(r["needle_recall"]) == 0.0


def test_the_attention_backend_is_checked_for_the_probe_it_runs(monkeypatch):
    """On a GPU the probe runs in bf16; a two-pass scheme needs a kernel that returns the log-sum-exp."""
    from posfreq.train.model import attention_kernels

    monkeypatch.setattr(attention_kernels, "kernel_present", lambda name: True)
    gpu = torch.device("cuda")
    job = probe_runner.Job(probe_settings.ProbeSettings(positions="string"), None, 1, gpu)
    assert job.attention.startswith("auto -> varlen (cuda, bfloat16, log-sum-exp")
    with pytest.raises(
        ValueError, match="--attention-backend: attention backend 'xformers' .*log-sum-exp"
    ):
        probe_runner.Job(
            probe_settings.ProbeSettings(positions="string"),
            None,
            1,
            gpu,
            attention_backend="xformers",
        )
    assert probe_runner.Job(
        probe_settings.ProbeSettings(), None, 1, gpu, attention_backend="xformers"
    ).attention.startswith("xformers")
    fp32 = probe_runner.Job(probe_settings.ProbeSettings(precision="float32"), None, 1, gpu)
    assert fp32.attention.startswith("auto -> sdpa")  # FlashAttention kernels refuse float32
    with pytest.raises(ValueError, match="'flash' .*float32"):
        probe_runner.Job(
            probe_settings.ProbeSettings(precision="float32"),
            None,
            1,
            gpu,
            attention_backend="flash",
        )


# ------------------------------------------------------------------ run level


def naive_f(hist: np.ndarray, i: int) -> int:
    """Eq. 2 by a loop over every trained segment: sum of max(n - i, 0)."""
    return sum(int(count) * max(n - i, 0) for n, count in enumerate(hist))


@pytest.mark.slow
def test_run_table_f_matches_naive_eq2_and_resumes(tmp_path, monkeypatch):
    run, out = tmp_path / "run", tmp_path / "run" / "probe"
    names = make_fake_run(run, 512, {40_960: 60, 81_920: 110, 163_840: 10_000})
    lengths = [160, 256, 384, 512]
    calls: list[str] = []
    checks: list[str] = []
    real_check = probe_runner.check_model
    monkeypatch.setattr(
        probe_runner,
        "check_model",
        lambda source, *a: checks.append(source.name) or real_check(source, *a),
    )
    rows = probe_fake_run(run, out, names, lengths, calls, monkeypatch)
    assert calls == sorted(names)
    assert checks == sorted(
        names
    )  # each checkpoint checked once, before the results folder is claimed
    with open(out / "effective_length.csv") as fh:
        table = list(csv.DictReader(fh))
    assert [int(r["tokens_trained"]) for r in table] == [40_960, 81_920, 163_840]
    assert list(table[0])[: len(RUN_COLUMNS)] == list(RUN_COLUMNS)
    assert [c for c in table[0] if c.startswith("pass_rate_")] == [
        f"pass_rate_{n}" for n in lengths
    ]
    for r in table:
        hist = np.load(run / "checkpoints" / r["checkpoint"] / "trained_lengths.npy")
        eff = int(r["effective_length"])
        if r["effective_length_status"] == "none_passed":
            assert r["f_effective_length"] == ""
        else:
            assert int(r["f_effective_length"]) == naive_f(hist, eff)
        if r["effective_length_lo"] not in ("", "0"):
            assert int(r["f_effective_length_lo"]) == naive_f(hist, int(r["effective_length_lo"]))
        assert int(r["effective_length_lo"]) <= eff <= int(r["effective_length_hi"])
        assert int(r["train_len"]) == 512 and r["positions"] == "rope"
    assert (
        int(table[-1]["effective_length"]) == 512
        and table[-1]["effective_length_status"] == "all_passed"
    )
    effective = [int(r["effective_length"]) for r in table]
    assert (
        0 < effective[0] <= effective[1] < effective[2]
        and table[1]["effective_length_status"] == "ok"
    )
    last_hist = np.load(run / "checkpoints" / table[-1]["checkpoint"] / "trained_lengths.npy")
    with open(out / "position_frequency.csv") as fh:
        assert [int(r["f"]) for r in csv.DictReader(fh)][:3] == [
            naive_f(last_hist, i) for i in range(3)
        ]
    with open(out / "distance_by_checkpoint.csv") as fh:
        distance = list(csv.DictReader(fh))
    assert len(distance) == 3 * len(lengths)
    for d in distance:
        hist = np.load(run / "checkpoints" / d["checkpoint"] / "trained_lengths.npy")
        assert int(d["f_distance_lo"]) == naive_f(hist, int(d["distance_lo"]))
    assert rows == derive_run(out, Analysis()).rows

    # Second run: nothing is loaded or decoded again, the per-test files are untouched.
    jsonl = out / sorted(names)[0] / "tests" / "L000160.jsonl"
    stamp = jsonl.stat().st_mtime_ns
    calls.clear()
    probe_fake_run(run, out, names, lengths, calls, monkeypatch)
    assert calls == [] and jsonl.stat().st_mtime_ns == stamp
    # A lost length is redone for its checkpoint only.
    (out / sorted(names)[1] / "tests" / "L000384.json").unlink()
    probe_fake_run(run, out, names, lengths, calls, monkeypatch)
    assert calls == [sorted(names)[1]]
    # More tests extend every checkpoint's results under the same key (each loads its model for test 4 only).
    calls.clear()
    probe_fake_run(run, out, names, lengths, calls, monkeypatch, tests=5)
    assert calls == sorted(names) and len(jsonl.read_text().splitlines()) == 5
    # New settings (another answer budget) are another key: refused in the same directory, redone when asked.
    calls.clear()
    with pytest.raises(probe_settings.ProbeError, match="another key"):
        probe_fake_run(run, out, names, lengths, calls, monkeypatch, budget=24)
    probe_fake_run(run, out, names, lengths, calls, monkeypatch, budget=24, replace_stale=True)
    assert calls == sorted(names)


@pytest.mark.slow
def test_threshold_is_recomputed_from_stored_records_into_out_never_over_them(
    tmp_path, monkeypatch
):
    """Issue 30: `effective-length RUN/probe --threshold 0.4 --out X` rewrote RUN/probe/effective_length.csv and only
    drew the figures into X. The re-derived tables go to X/RUN/probe; the probe's folder stays byte for byte."""
    run, out = tmp_path / "run", tmp_path / "run" / "probe"
    names = make_fake_run(run, 512, {40_960: 150, 81_920: 300})
    probe_fake_run(run, out, names, [160, 256, 384, 512], [], monkeypatch, tests=8)
    before = {r["checkpoint"]: r for r in read_csv(out / "effective_length.csv")}
    source = snapshot(out)
    from posfreq.analysis.tables import pass_curve
    from posfreq.analysis.tables.run_table import find_run_results
    from posfreq.scripts.commands import effective_length

    monkeypatch.setattr(
        probe_sources.ModelSource,
        "load",
        lambda *a, **k: pytest.fail("re-derivation must not load a model"),
    )
    fig = tmp_path / "fig"
    effective_length.main(
        [str(out), "--threshold", "0.99", "--min-retrieved", "1", "--out", str(fig)]
    )
    assert snapshot(out) == source
    derived = fig / "run" / "probe"
    assert (
        find_run_results(fig / "run") == derived
    )  # `posfreq compare FIG/run` reads it as it reads RUN
    after = {r["checkpoint"]: r for r in read_csv(derived / "effective_length.csv")}
    assert sorted(after) == sorted(names)
    for name, row in after.items():
        assert row["threshold"] == 0.99 and row["min_retrieved"] == 1
        rates = [row[f"pass_rate_{n}"] for n in (160, 256, 384, 512)]
        assert rates == sorted(rates, reverse=True) and rates >= [
            before[name][f"pass_rate_{n}"] for n in (160, 256, 384, 512)
        ]
        expected = pass_curve.effective_length([160, 256, 384, 512], rates, 0.99).value
        assert row["effective_length"] == expected
        checkpoint_meta = json.loads((derived / name / "probe.json").read_text())
        assert checkpoint_meta["analysis"]["threshold"] == 0.99
        assert (derived / name / "summary.csv").is_file()
    meta = json.loads((derived / "probe.json").read_text())
    assert meta["derived_from"] == str(out.resolve()) and meta["analysis"]["threshold"] == 0.99
    assert (fig / "fig2a_effective_length_vs_tokens.png").is_file()
    # A re-derivation holds no records: it is not a source, and nothing is written for asking.
    with pytest.raises(
        SystemExit, match=f"error: {derived} is a re-derivation .* Fix: re-derive from {out}"
    ):
        effective_length.main(
            [str(derived), "--threshold", "0.6", "--out", str(tmp_path / "again")]
        )
    assert not (tmp_path / "again").exists()
    # --out in the probe's own folder, or in the run's, is refused before anything is written.
    with pytest.raises(
        SystemExit, match="error: --out: the tables re-derived from .* over its own folder"
    ):
        effective_length.main([str(out), "--threshold", "0.6", "--out", str(out)])
    with pytest.raises(
        SystemExit, match=r"error: --out .* did not write \(checkpoints, probe\)\. Fix"
    ):
        effective_length.main([str(out), "--threshold", "0.6", "--out", str(run)])
    assert snapshot(out) == source


def test_shards_then_merge(tmp_path, monkeypatch):
    run, out = tmp_path / "run", tmp_path / "probe"
    names = make_fake_run(run, 512, {40_960: 150, 81_920: 300, 122_880: 400})
    calls: list[str] = []
    assert (
        len(probe_fake_run(run, out, names, [160, 256], calls, monkeypatch, tests=3, shard=(1, 2)))
        == 1
    )
    assert calls == [sorted(names)[1]]
    probe_fake_run(run, out, names, [160, 256], calls, monkeypatch, tests=3, shard=(0, 2))
    assert not (out / "effective_length.csv").exists()
    calls.clear()
    rows = probe_fake_run(run, out, names, [160, 256], calls, monkeypatch, tests=3, merge_only=True)
    assert calls == [] and len(rows) == 3 and (out / "effective_length.csv").is_file()
    # A checkpoint retrained in place (new weights, same folder): its old results are left out of the merge.
    retrained = run / "checkpoints" / sorted(names)[0] / "state.pt"
    state = torch.load(retrained, weights_only=True)
    state["model"]["norm.weight"][0] += 1.0
    torch.save(state, retrained)
    rows = probe_fake_run(run, out, names, [160, 256], calls, monkeypatch, tests=3, merge_only=True)
    assert [r["checkpoint"] for r in rows] == sorted(names)[1:]
    assert json.loads((out / "probe.json").read_text())["missing"] == [sorted(names)[0]]


def test_replace_stale_deletes_only_the_probes_own_records(tmp_path):
    """A user's files in or beside tests/ are never deleted: a tests/ folder of theirs is refused outright."""
    out = tmp_path / "out"
    (out / "tests").mkdir(parents=True)
    (out / "tests" / "test_x.py").write_text("def test(): pass\n")
    (out / "figures").mkdir()
    (out / "figures" / "mine.png").write_bytes(b"png")
    (out / "notes.md").write_text("mine\n")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    for replace_stale in (False, True):
        with pytest.raises(
            store.StaleResults, match="tests holds files the probe did not write .*test_x.py"
        ):
            store.claim(out, "k2", {"model": "b"}, replace_stale=replace_stale)
        assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    (out / "tests" / "test_x.py").unlink()
    store.claim(out, "k1", {"model": "a"})
    records, marker = store.length_files(out, 128)
    records.write_text("{}\n")
    marker.write_text("{}")
    with pytest.raises(store.StaleResults, match="another key"):
        store.claim(out, "k2", {"model": "b"})
    (out / "summary.csv").write_text("the old model's table\n")
    store.claim(out, "k2", {"model": "b"}, replace_stale=True)
    assert not records.exists() and not marker.exists() and not (out / "summary.csv").exists()
    assert (out / "figures" / "mine.png").read_bytes() == b"png" and (
        out / "notes.md"
    ).read_text() == "mine\n"
    assert json.loads((out / store.KEY_FILE).read_text())["key"] == "k2"


def test_rederivation_refuses_damaged_or_mixed_records_and_writes_only_inside_its_directory(
    tmp_path, monkeypatch
):
    run, out = tmp_path / "run", tmp_path / "run" / "probe"
    names = make_fake_run(run, 512, {40_960: 60})
    probe_fake_run(run, out, names, [160, 256], [], monkeypatch)
    sub = out / next(iter(names))
    jsonl = store.length_files(sub, 256)[0]
    good = jsonl.read_text()
    lines = good.splitlines()

    def rederive_with(text: str, match: str) -> None:
        jsonl.write_text(text)
        with pytest.raises(store.StaleResults, match=match):
            derive_run(out, Analysis())

    rederive_with("\n".join(lines[:1]) + "\n", "1 records, but its marker says 4 tests")
    other_key = [json.loads(x) for x in lines]
    other_key[2]["key"] = "0" * 64
    rederive_with(
        "".join(json.dumps(r) + "\n" for r in other_key), "record 3: made under another key"
    )
    strings = [json.loads(x) for x in lines]
    strings[0]["hits_anywhere"] = ["false", "false", "false", "false"]
    rederive_with(
        "".join(json.dumps(r) + "\n" for r in strings), "hits_anywhere must be a list of true/false"
    )
    jsonl.write_text(good)
    derive_run(out, Analysis())  # the intact records derive again

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    meta = json.loads((out / "probe.json").read_text())
    meta["checkpoints"] = {str(elsewhere): "k"}
    (out / "probe.json").write_text(json.dumps(meta))
    with pytest.raises(store.StaleResults, match="is not a directory name inside"):
        derive_run(out, Analysis())
    assert list(elsewhere.iterdir()) == []


# ------------------------------------------------------------------ output folders: the probe's own or refused


def test_a_users_folder_is_never_a_runs_results_folder(tmp_path, monkeypatch):
    """Issue 30: `probe --run RUN --out U` wrote its tables into a user's folder and merged into a user's
    probe.json. U is refused untouched before any checkpoint is read, however the run is probed."""
    run = tmp_path / "run"
    names = make_fake_run(run, 512, {40_960: 150})
    user = tmp_path / "U"
    user.mkdir()
    (user / "probe.json").write_text('{"mine": true}\n')
    (user / "summary.csv").write_text("mine\n")
    before = snapshot(user)
    calls: list[str] = []
    for how in ({}, {"merge_only": True}, {"shard": (0, 1)}):
        with pytest.raises(
            OutputDirError, match=r"did not write \(probe.json, summary.csv\)\. Fix"
        ):
            probe_fake_run(run, user, names, [160, 256], calls, monkeypatch, **how)
        assert snapshot(user) == before and calls == [], how
    from posfreq.scripts.commands import probe

    monkeypatch.setattr(
        probe_runner, "milestones", lambda *a: pytest.fail("the run was read before --out")
    )
    with pytest.raises(SystemExit) as stop:
        probe.main(["--run", str(run), "--out", str(user), "--quiet"])
    assert str(stop.value.code).startswith(
        f"error: --out {user} holds files `posfreq probe` did not write (probe.json, summary.csv). "
        "Fix: pass a new or empty directory (nothing was changed)"
    )
    assert snapshot(user) == before


@pytest.mark.slow
def test_an_older_probes_results_are_adopted_and_resumed(tmp_path, monkeypatch):
    """Result folders an older posfreq wrote (key.json and its results, no owner record) are still the probe's:
    resumed without decoding again. A file of a user's among them makes the folder a user's, refused untouched."""
    run, out = tmp_path / "run", tmp_path / "run" / "probe"
    names = make_fake_run(run, 512, {40_960: 150, 81_920: 300})
    calls: list[str] = []
    probe_fake_run(run, out, names, [160, 256], calls, monkeypatch, figures=True)
    assert owner_of(out) == "probe" and all(owner_of(out / name) == "probe" for name in names)

    def as_an_older_posfreq_left_it() -> None:
        for record in [*out.rglob(OWNER_FILE), *out.rglob(JOURNAL_FILE)]:
            record.unlink()

    as_an_older_posfreq_left_it()
    calls.clear()
    probe_fake_run(run, out, names, [160, 256], calls, monkeypatch)
    assert calls == [] and owner_of(out) == "probe"
    assert all(owner_of(out / name) == "probe" for name in names)
    for stray in (out / "notes.md", out / sorted(names)[0] / "figures" / "mine.png"):
        as_an_older_posfreq_left_it()
        stray.write_bytes(b"mine")
        before = snapshot(out)
        with pytest.raises(OutputDirError, match="did not write"):
            probe_fake_run(run, out, names, [160, 256], calls, monkeypatch)
        assert snapshot(out) == before and calls == []
        stray.unlink()
    # One model's folder: the same.
    model = WindowModel(TOKENIZER)
    run_one(tmp_path / "one", model, [160])
    decoded = len(model.calls)
    as_older_posfreq(tmp_path / "one")
    run_one(tmp_path / "one", model, [160])
    assert len(model.calls) == decoded and owner_of(tmp_path / "one") == "probe"


# ------------------------------------------------------------------ a killed probe resumes at its batch


class KilledAfter(WindowModel):
    """A WindowModel whose process is killed (KeyboardInterrupt) at its `calls_left + 1`-th batch."""

    def __init__(self, calls_left: int) -> None:
        super().__init__(TOKENIZER, 120)
        self.calls_left = calls_left

    def generate(self, prompt_ids, *args, **kwargs):
        if self.calls_left == 0:
            raise KeyboardInterrupt
        self.calls_left -= 1
        return super().generate(prompt_ids, *args, **kwargs)


def test_a_killed_probe_resumes_at_the_batch_it_was_in(tmp_path):
    _, clean = run_one(tmp_path / "clean", WindowModel(TOKENIZER, 120), [256], tests=7, batch=2)
    out = tmp_path / "killed"
    with pytest.raises(KeyboardInterrupt):
        run_one(out, KilledAfter(2), [256], tests=7, batch=2)
    assert not store.done_lengths(out, json.loads((out / "key.json").read_text())["key"])
    partial = json.loads(store.partial_file(out, 256).read_text())
    assert [r["index"] for r in partial["records"]] == [0, 1, 2, 3] and partial["seconds"] > 0
    resumed = WindowModel(TOKENIZER, 120)
    row, records = run_one(out, resumed, [256], tests=7, batch=2)
    assert len(resumed.calls) == 2  # tests 4-5 and 6, nothing before
    assert records == clean and not store.partial_file(out, 256).exists()
    assert (
        row["effective_length"]
        == run_one(tmp_path / "again", WindowModel(TOKENIZER, 120), [256], tests=7, batch=2)[0][
            "effective_length"
        ]
    )


def test_partial_records_of_another_key_or_other_tests_are_not_resumed(tmp_path):
    out = tmp_path / "p"
    with pytest.raises(KeyboardInterrupt):
        run_one(out, KilledAfter(2), [256], tests=7, batch=2)
    path = store.partial_file(out, 256)
    data = json.loads(path.read_text())
    key = data["key"]
    assert store.load_partial(out, 256, key) == (data["records"], data["seconds"])
    assert store.load_partial(out, 256, "another") == ([], 0.0)
    gap = {**data, "records": [*data["records"][:2], *data["records"][3:]]}  # test 2 missing
    path.write_text(json.dumps(gap))
    assert store.load_partial(out, 256, key) == (data["records"][:2], data["seconds"] * 2 / 3)
    path.write_text(json.dumps(data)[:-40])  # cut mid-write
    assert store.load_partial(out, 256, key) == ([], 0.0)
    resumed = WindowModel(TOKENIZER, 120)
    run_one(out, resumed, [256], tests=7, batch=2)
    assert len(resumed.calls) == 4 and not path.exists()  # probed from the first test


# ------------------------------------------------------------------ more tests extend fewer, fewer read a prefix


def test_more_tests_extend_a_finished_probe_and_fewer_read_its_first_tests(tmp_path):
    """Test i is the same in a probe of any size: asking a finished directory for more tests probes only the
    rest (records equal to a fresh probe of that many), asking for fewer probes nothing and reads the first."""
    _, fresh = run_one(tmp_path / "fresh", WindowModel(TOKENIZER, 120), [160, 256], tests=7)
    out = tmp_path / "grown"
    run_one(out, WindowModel(TOKENIZER, 120), [160, 256], tests=3)
    key = json.loads((out / "key.json").read_text())["key"]
    more = WindowModel(TOKENIZER, 120)
    row, records = run_one(out, more, [160, 256], tests=7, batch=2)
    assert len(more.calls) == 4  # tests 3-4 and 5-6 of each length
    assert records == fresh and json.loads((out / "key.json").read_text())["key"] == key
    assert [s["n_tests"] for s in read_csv(out / "summary.csv")] == [7, 7]
    fewer = WindowModel(TOKENIZER, 120)
    row, _ = run_one(out, fewer, [160, 256], tests=2)
    assert fewer.calls == [] and len(store.read_records(out, [160])) == 7  # nothing probed or cut
    assert [s["n_tests"] for s in read_csv(out / "summary.csv")] == [2, 2]
    assert row["tests_per_length"] == 2
    assert (
        store.finished_records(out, json.loads((out / "probe.json").read_text()))[256][1]
        == [r for r in fresh if r["length"] == 256][:2]
    )


def test_extending_a_probe_resumes_from_whichever_of_its_partial_and_finished_tests_is_longer(
    tmp_path,
):
    out = tmp_path / "p"
    run_one(out, WindowModel(TOKENIZER, 120), [256], tests=3)
    key = json.loads((out / "key.json").read_text())["key"]
    finished = store.read_records(out, [256])
    assert store.load_started(out, 256, key) == (
        finished,
        store.done_lengths(out, key)[256]["seconds"],
    )
    with pytest.raises(KeyboardInterrupt):
        run_one(out, KilledAfter(2), [256], tests=9, batch=2)  # tests 3-4 and 5-6, then killed
    assert not store.done_lengths(out, key, 9) and store.done_lengths(out, key, 3)
    started, _ = store.load_started(out, 256, key)
    assert [r["index"] for r in started] == list(range(7)) and started[:3] == finished
    resumed = WindowModel(TOKENIZER, 120)
    _, records = run_one(out, resumed, [256], tests=9, batch=2)
    assert len(resumed.calls) == 1 and [r["index"] for r in records] == list(range(9))


def test_a_finished_length_with_its_tests_out_of_order_is_refused(tmp_path):
    out = tmp_path / "p"
    run_one(out, WindowModel(TOKENIZER, 120), [256], tests=3)
    jsonl = store.length_files(out, 256)[0]
    lines = jsonl.read_text().splitlines()
    jsonl.write_text("\n".join([lines[1], lines[0], lines[2]]) + "\n")
    with pytest.raises(
        store.StaleResults, match="record 1: test index 1, where the probe writes test 0"
    ):
        derive_model(out, Analysis())


def test_a_partial_probe_of_more_tests_than_asked_is_kept_whole(tmp_path):
    """A 9-test probe killed after 6, then asked for 4: nothing is probed, all 6 tests are kept (a later --tests 9
    probes 3), and the tables read the first 4, at the time per test the 6 took."""
    out = tmp_path / "p"
    with pytest.raises(KeyboardInterrupt):
        run_one(out, KilledAfter(3), [256], tests=9, batch=2)
    key = json.loads((out / "key.json").read_text())["key"]
    seconds = json.loads(store.partial_file(out, 256).read_text())["seconds"]
    fewer = WindowModel(TOKENIZER, 120)
    row, records = run_one(out, fewer, [256], tests=4, batch=2)
    assert fewer.calls == [] and [r["index"] for r in records] == list(range(6))
    assert store.done_lengths(out, key)[256]["n_tests"] == 6
    assert not store.partial_file(out, 256).exists() and row["tests_per_length"] == 4
    summary = read_csv(out / "summary.csv")[0]
    assert summary["n_tests"] == 4 and summary["seconds"] == pytest.approx(
        seconds * 4 / 6, abs=1e-3
    )
    more = WindowModel(TOKENIZER, 120)
    run_one(out, more, [256], tests=9, batch=2)
    assert len(more.calls) == 2 and store.done_lengths(out, key, 9)


def test_a_run_merged_with_more_tests_than_its_checkpoints_hold_lists_them_as_missing(
    tmp_path, monkeypatch
):
    run, out = tmp_path / "run", tmp_path / "run" / "probe"
    names = make_fake_run(run, 512, {40_960: 60, 81_920: 110})
    calls: list[str] = []
    probe_fake_run(run, out, names, [160, 256], calls, monkeypatch, tests=4)
    with pytest.raises(store.StaleResults, match="no checkpoint of the run is fully probed"):
        probe_fake_run(run, out, names, [160, 256], calls, monkeypatch, tests=6, merge_only=True)
    rows = probe_fake_run(run, out, names, [160, 256], calls, monkeypatch, tests=3, merge_only=True)
    assert [r["tests_per_length"] for r in rows] == [3, 3]
    assert all(s["n_tests"] == 3 for name in names for s in read_csv(out / name / "summary.csv"))


def test_a_probe_killed_while_writing_an_extended_length_loses_no_test(tmp_path, monkeypatch):
    out = tmp_path / "p"
    run_one(out, WindowModel(TOKENIZER, 120), [256], tests=3)
    key = json.loads((out / "key.json").read_text())["key"]
    write_length = store.write_length

    def killed_after_the_old_marker_went(out_, length, *args):
        store.length_files(out_, length)[1].unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(store, "write_length", killed_after_the_old_marker_went)
    with pytest.raises(KeyboardInterrupt):
        run_one(out, WindowModel(TOKENIZER, 120), [256], tests=4)  # one batch: tests 3
    assert not store.done_lengths(out, key)
    monkeypatch.setattr(store, "write_length", write_length)
    resumed = WindowModel(TOKENIZER, 120)
    _, records = run_one(out, resumed, [256], tests=4)
    assert resumed.calls == [] and [r["index"] for r in records] == [0, 1, 2, 3]

"""`posfreq table`: Table 1's pass rates and paired differences against hand counts, Table 2's join, and a tiny
model's run end to end (sharded, resumed, refused before anything runs when a setting is wrong)."""

from __future__ import annotations

import csv
import json
import zlib
from pathlib import Path

import numpy as np
import pytest
from helpers.hf import save_tiny_hf

from posfreq.analysis.tables.paper_tables import (
    TABLE1_COLUMNS,
    left_out_note,
    outcomes_by_test,
    table1,
    table1_markdown,
    table2,
)
from posfreq.scripts.commands import table as command

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def outcomes_of(passing: set[int], length: int = 100, tests: int = 10) -> dict:
    return {(length, i): float(i in passing) for i in range(tests)}


def textbook_wilson(passed: int, tests: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """The Wilson score interval as the set of p with |p_hat - p| <= z sqrt(p (1 - p) / n): the roots of
    (1 + z^2/n) p^2 - (2 p_hat + z^2/n) p + p_hat^2 = 0."""
    rate, k = passed / tests, z * z / tests
    roots = np.sort(np.roots([1 + k, -(2 * rate + k), rate * rate]).real)
    return float(roots[0]), float(roots[-1])


def test_pass_rates_and_paired_differences_against_hand_counts() -> None:
    rope = outcomes_of({0, 1, 2, 3, 4})
    string = outcomes_of({0, 1, 2, 3, 4, 5, 6, 7})  # passes every test rope passes, and 3 more
    same = dict(rope)
    rows = {r["scheme"]: r for r in table1({"rope": rope, "string": string, "same": same}, 500)}
    assert rows["rope"]["pass_rate"] == 0.5 and rows["string"]["pass_rate"] == 0.8
    assert rows["rope"]["difference"] == rows["rope"]["baseline"] == ""
    assert rows["string"]["baseline"] == "rope"
    assert rows["string"]["difference"] == pytest.approx(0.3)
    # paired: every per-test difference is 0 or +1, so no resample can go below 0
    assert 0.0 <= rows["string"]["difference_lo"] <= 0.3 <= rows["string"]["difference_hi"] <= 0.7
    assert rows["same"]["difference_lo"] == rows["same"]["difference_hi"] == 0.0
    for scheme, passed in (("rope", 5), ("string", 8)):
        interval = (rows[scheme]["pass_lo"], rows[scheme]["pass_hi"])
        assert interval == pytest.approx(textbook_wilson(passed, 10), abs=1e-12)
    text = table1_markdown(list(rows.values()))
    assert "| scheme | 100 (n = 10) |" in text
    assert "| string | 80.0 [" in text and "<br>+30.0 [" in text


def test_a_pass_rate_of_0_or_100_keeps_a_wilson_interval() -> None:
    """A percentile bootstrap gave 100 of 100 as 1.0 [1.0, 1.0]."""
    every = outcomes_of(set(range(100)), tests=100)
    rows = table1({"rope": outcomes_of(set(), tests=100), "string": every}, 200)
    assert (rows[0]["pass_lo"], rows[0]["pass_hi"]) == pytest.approx(textbook_wilson(0, 100))
    assert (rows[1]["pass_lo"], rows[1]["pass_hi"]) == pytest.approx(textbook_wilson(100, 100))
    assert rows[1]["pass_lo"] == pytest.approx(0.9630, abs=1e-4) and rows[1]["pass_hi"] == 1.0
    assert textbook_wilson(0, 10)[1] == pytest.approx(
        0.2775, abs=1e-4
    )  # the formula's published value
    with pytest.raises(ValueError, match="scores other than 0 and 1"):
        table1({"rope": {(100, 0): 0.5}})


def test_each_cell_resamples_on_its_own_and_pairs_the_baseline() -> None:
    """A scheme's interval is the same whichever other schemes are listed and in what order; its paired
    difference matches a naive loop over draws from SeedSequence(seed, crc32(scheme), length). Only the Holm
    adjustment depends on the other comparisons the table makes, by design."""
    rng = np.random.default_rng(1)
    rope, string, ntk = (
        {(100, i): float(rng.random() < p) for i in range(30)} for p in (0.3, 0.6, 0.5)
    )
    alone = table1({"rope": rope, "string": string}, 300, seed=5)
    listed = table1({"ntk": ntk, "string": string, "rope": rope}, 300, seed=5)
    without_holm = [{k: v for k, v in r.items() if k != "holm_p"} for r in listed]
    assert [r for r in without_holm if r["scheme"] == "string"] == [
        {k: v for k, v in r.items() if k != "holm_p"} for r in alone[1:]
    ]
    assert alone[1]["holm_p"] == alone[1]["mcnemar_p"]  # one comparison: nothing to adjust
    listed_string = next(r for r in listed if r["scheme"] == "string")
    assert listed_string["holm_p"] >= listed_string["mcnemar_p"]
    draws = np.random.default_rng(np.random.SeedSequence([5, zlib.crc32(b"string"), 100]))
    draws = draws.integers(0, 30, size=(300, 30))
    means = sorted(np.mean([string[(100, i)] - rope[(100, i)] for i in row]) for row in draws)
    assert alone[1]["difference_lo"] == pytest.approx(np.quantile(means, 0.025))
    assert alone[1]["difference_hi"] == pytest.approx(np.quantile(means, 0.975))
    with pytest.raises(ValueError, match="n_boot must be >= 1"):
        table1({"rope": rope}, 0)


def test_every_cell_of_a_length_uses_the_tests_every_scheme_has() -> None:
    rope = outcomes_of({0, 1, 2, 3, 4})
    string = outcomes_of(
        {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}, tests=12
    )  # tests 10 and 11 rope lacks
    rows = table1({"rope": rope, "string": string}, 100)
    assert [(r["tests"], r["tests_left_out"]) for r in rows] == [(10, 0), (10, 2)]
    assert rows[1]["pass_rate"] == 1.0 and rows[1]["difference"] == 0.5  # over tests 0-9 only
    assert left_out_note(rows) == (
        "- At 100 every cell uses the 10 tests all its schemes have; tests left out: string 2.\n"
    )
    assert left_out_note(table1({"rope": rope}, 10)) == ""


def test_a_test_passes_on_two_needles_greedy_or_teacher_forced() -> None:
    records = [
        {"length": 100, "index": 0, "hits_anywhere": [True, True, False, False]},
        {"length": 100, "index": 1, "hits_anywhere": [True, False, False, False]},
    ]
    records[0]["tf_token_accuracy"] = [1.0, 0.5, 0.5, 0.0]
    records[1]["tf_token_accuracy"] = [1.0, 1.0, 0.0, 0.0]
    assert outcomes_by_test(records, "greedy") == {(100, 0): 1.0, (100, 1): 0.0}
    assert outcomes_by_test(records, "teacher_forced") == {(100, 0): 0.0, (100, 1): 1.0}
    with pytest.raises(ValueError, match="no teacher-forced score"):
        outcomes_by_test([{**records[0], "tf_token_accuracy": None}], "teacher_forced")


def accuracy_by_test(records: list[dict]) -> dict:
    from posfreq.analysis.tables.measures import TOKEN_ACCURACY, scores_by_test

    return scores_by_test(TOKEN_ACCURACY, records)


def test_the_token_accuracy_of_a_test_is_the_mean_over_its_needles_and_pairs_like_a_pass() -> None:
    def record(index: int, accuracy: list[float]) -> dict:
        return {"length": 100, "index": index, "tf_token_accuracy": accuracy}

    rope = accuracy_by_test([record(0, [0.5, 0.5, 0, 0]), record(1, [1, 1, 0, 0])])
    string = accuracy_by_test([record(0, [1, 0.5, 0.5, 0]), record(1, [1, 1, 1, 1])])
    assert rope == {(100, 0): 0.25, (100, 1): 0.5} and string == {(100, 0): 0.5, (100, 1): 1.0}
    row = table1({"rope": rope, "string": string}, n_boot=200, binary=False)[1]
    assert row["pass_rate"] == 0.75 and row["difference"] == 0.375  # (0.25 + 0.5) / 2
    assert (
        row["difference_lo"] == 0.25 and row["difference_hi"] == 0.5
    )  # the two pairs' differences
    with pytest.raises(ValueError, match="no teacher-forced score"):
        accuracy_by_test([record(0, None)])


def test_table2_joins_each_schemes_scores_by_task_and_length() -> None:
    scores = {
        "rope": [{"task": "vt", "length": "1024", "score": "0.5"}],
        "string": [{"task": "vt", "length": "1024", "score": "0.75"}],
    }
    assert table2(scores) == [{"task": "vt", "length": 1024, "rope": 0.5, "string": 0.75}]


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> Path:
    """A random 1-layer Llama with the bytes tokenizer, trained length 768."""
    return save_tiny_hf(tmp_path_factory.mktemp("hf"))


def test_the_measured_shift_is_the_papers_at_two_thirds_and_keeps_what_the_model_uses() -> None:
    from posfreq.train.positions.string import shift_from_effective_length as shift

    assert shift(3000, 2000) == 1000  # E = 2L/3: the paper's S = L/3
    assert shift(4096, 3072) == 1024  # the largest distance 4095 is seen as 3071 + W
    assert (
        shift(4096, 1000) == 2048
    )  # E < L/2: S = L/2 shows the smallest largest distance (was S = E = 1000)
    assert (
        shift(8192, 2048) == 4096
    )  # the case: the former rule's S = 2048 showed distances to 6271
    assert shift(4096, 0) is None and shift(4096, 4096) is None  # nothing measured, or no shortfall


@pytest.mark.parametrize("train_len", [64, 97, 128])
def test_the_measured_shift_minimises_the_largest_distance_stringss_matrix_shows(
    train_len: int,
) -> None:
    """Against STRING's own L x L distance matrix (the scheme's reference), for every E: the rule's S keeps every
    distance shown below E + W when E >= L/2, and otherwise shows a largest distance within W/2 + 1 of the
    smallest any S can show."""
    from posfreq.train.positions.rotary import RotaryBase
    from posfreq.train.positions.schemes import build_scheme
    from posfreq.train.positions.string import (
        largest_distance_shown,
        shift_from_effective_length,
        string_shift_window,
    )

    rope = RotaryBase(8, 10000.0, None)

    def shown(shift: int) -> int:
        scheme = build_scheme("string", rope, train_len, shift=shift)
        matrix = scheme.distances(train_len)
        largest = int(matrix[np.tril_indices(train_len)].max())
        assert largest == largest_distance_shown(train_len, *string_shift_window(train_len, shift))
        return largest

    every = {s: shown(s) for s in range(2, train_len)}
    for effective in range(1, train_len):
        s = shift_from_effective_length(train_len, effective)
        window = string_shift_window(train_len, s)[1]
        if 2 * effective >= train_len:
            assert every[s] <= effective - 1 + window, (effective, s)
        else:
            assert every[s] <= min(every.values()) + window // 2 + 1, (effective, s)


@pytest.mark.parametrize(
    "status, effective, expected",
    [("ok", 512, 256), ("all_passed", 512, None), ("none_passed", 0, None), ("ok", 700, 68)],
)
def test_the_auto_shift_comes_only_from_a_measured_effective_length(
    tmp_path: Path, status: str, effective: int, expected
) -> None:
    rows = [{"effective_length": effective, "effective_length_status": status}]
    rows[0]["tf_effective_length"] = 0
    (tmp_path / "niah" / "rope").mkdir(parents=True)
    with open(tmp_path / "niah" / "rope" / "effective_length.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    args = command.parse(command.build_parser(), ["--model", "hf:x"])
    assert command.auto_shift(args, tmp_path, 768)[0] == expected


@pytest.mark.slow
def test_a_tiny_model_end_to_end_sharded_then_collected(
    tiny_hf: Path, tmp_path: Path, capsys, monkeypatch
):
    pytest.importorskip("transformers")
    out = tmp_path / "table"
    # a labelled row: DCA with a chunk of its own, probed into its own folder as the scheme dca
    argv = ["--model", f"hf:{tiny_hf}", "--schemes", "rope,dca@c300", "--niah-lengths", "448,768"]
    argv += ["--tests", "3", "--haystack", "noise", "--max-new-tokens", "40", "--out", str(out)]
    argv += ["--position-options", '{"dca@c300": {"chunk_size": 300}}']
    assert command.main([*argv, "--shard", "1/2"]) == 0  # the second share: dca@c300 only
    dca = out / "niah" / "dca@c300"
    assert (dca / "summary.csv").is_file() and not (out / "niah" / "rope").exists()
    assert json.loads((dca / "probe.json").read_text())["settings"]["positions"] == "dca"
    assert not (out / "table1.csv").exists() and "rerun without --shard" in capsys.readouterr().out
    records = sorted(dca.rglob("*.jsonl"))
    stamps = [p.stat().st_mtime_ns for p in records]
    # rope now; dca's results are reused, not probed again. A random model passes nothing (E = 0), so the
    # measured shift is stood in for: STRING then runs with it beside the others
    real_auto_shift = command.auto_shift
    monkeypatch.setattr(command, "auto_shift", lambda args, out, L: (300, "stand-in: S = 300"))
    assert command.main([*argv, "--string-shift", "auto"]) == 0
    assert [p.stat().st_mtime_ns for p in records] == stamps
    rows = list(csv.DictReader(open(out / "table1.csv")))
    assert [(r["scheme"], r["length"], r["tests"]) for r in rows] == [
        ("rope", "448", "3"),
        ("rope", "768", "3"),
        ("dca@c300", "448", "3"),
        ("dca@c300", "768", "3"),
        ("string_auto", "448", "3"),
        ("string_auto", "768", "3"),
    ]
    auto = json.loads((out / "niah" / "string_auto" / "probe.json").read_text())["settings"]
    assert auto["positions"] == "string" and auto["position_options"] == {"shift": 300}
    assert "table: string with the measured shift: stand-in: S = 300" in capsys.readouterr().out
    real = real_auto_shift(command.parse(command.build_parser(), argv), out, 768)
    assert real == (
        None,
        "rope's effective length 0 at L = 768 (greedy, none_passed): nothing to derive S from",
    )
    settings = json.loads((out / "settings.json").read_text())
    assert settings["position_options"]["string_auto"] == {"shift": 300, "window": 128}
    assert settings["position_options"]["dca@c300"] == {
        "chunk_size": 300,
        "local_window": 32,  # the paper's protocol: L' = 2/3 of 768, local window L' // 16
        "protocol": "paper",
    }
    table_md = (out / "table1.md").read_text()
    assert (out / "table1.png").stat().st_size > 0 and "| dca@c300 |" in table_md
    assert "measure: greedy." in table_md  # no answer order: a greedy answer is read in any order
    # ...but the teacher-forced companion table, recorded beside it by default, depends on it
    assert "argmax under teacher forcing (answer order: document)" in table_md


def test_a_row_is_a_scheme_or_a_labelled_second_row_of_one() -> None:
    assert command.chosen_schemes("rope, string,string@half,string@t_1") == [
        "rope",
        "string",
        "string@half",
        "string@t_1",
    ]
    assert [command.scheme_of(r) for r in ("string@half", "self_extend", "string_auto")] == [
        "string",
        "self_extend",
        "string",
    ]
    for bad in (
        "rope,string@",
        "rope,string@../x",
        "rope,string@A",
        "rope,nope@x",
        "rope,string_auto",
    ):
        with pytest.raises(ValueError, match="SCHEME@LABEL"):
            command.chosen_schemes(bad)
    with pytest.raises(ValueError, match="rope included"):
        command.chosen_schemes("rope@x,string")


def test_settings_that_cannot_make_a_table_stop_before_anything_runs(
    tiny_hf: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "never"
    base = ["--model", f"hf:{tiny_hf}", "--out", str(out)]
    assert command.main([*base, "--schemes", "string,dca"]) == 1
    assert "rope included" in capsys.readouterr().err
    assert command.main([*base, "--position-options", '{"dca": {"group": 2}}']) == 1
    assert "dca does not take ['group']" in capsys.readouterr().err
    assert command.main([*base, "--measure", "teacher_forced", "--teacher-forced", "false"]) == 1
    assert "leaves nothing to measure" in capsys.readouterr().err
    assert command.main([*base, "--shard", "2/2"]) == 1
    assert "need 0 <= i < n, e.g. --shard 0/7" in capsys.readouterr().err
    assert command.main([*base, "--bootstrap", "0"]) == 1  # was an IndexError after every probe
    err = capsys.readouterr().err
    assert err.startswith("error: --bootstrap 0:") and "Fix: " in err and err.count("\n") == 1
    assert not out.exists()


@pytest.mark.slow  # lm-eval's import alone takes about 12 s
def test_ruler_settings_that_cannot_make_a_table_stop_before_anything_runs(
    tiny_hf: Path, tmp_path: Path, capsys
) -> None:
    pytest.importorskip("lm_eval")
    out = tmp_path / "never"
    base = ["--model", f"hf:{tiny_hf}", "--out", str(out)]
    ruler = ["--ruler-lengths", "300", "--ruler-tasks", "niah_single_1,cwe,vt"]
    assert command.main([*base, *ruler]) == 1
    err = capsys.readouterr().err  # the byte tokenizer's cwe needs far more than 300 tokens
    assert "nothing was probed" in err and "cwe at 300" in err
    assert "vt's example a fixed budget whatever the length: leave vt out (--tasks)" in err
    assert not out.exists()


def test_the_teacher_forced_table_decodes_nothing_and_counts_the_argmax_needles(
    tiny_hf: Path, tmp_path: Path
) -> None:
    from posfreq.analysis.niah import store
    from posfreq.analysis.tables.derive import derive_model
    from posfreq.analysis.tables.pass_curve import Analysis

    out = tmp_path / "table"
    argv = ["--model", f"hf:{tiny_hf}", "--schemes", "rope", "--niah-lengths", "448"]
    argv += ["--tests", "4", "--haystack", "noise", "--max-new-tokens", "40", "--out", str(out)]
    assert (
        command.main([*argv, "--measure", "teacher_forced", "--answer-order", "nearest_first"]) == 0
    )
    probe_dir = out / "niah" / "rope"
    records = store.read_records(probe_dir, [448])
    assert len(records) == 4 and not any("generated" in r or "hits_anywhere" in r for r in records)
    assert {r["tf_answer_order"] for r in records} == {"nearest_first"}
    assert json.loads((out / "settings.json").read_text())["answer_order"] == "nearest_first"
    decoding = json.loads((probe_dir / "key.json").read_text())["parts"]["decoding"]
    assert decoding["greedy"] is False and decoding["teacher_forced"] is True
    by_hand = sum(sum(a == 1.0 for a in r["tf_token_accuracy"]) >= 2 for r in records) / 4
    (row,) = list(csv.DictReader(open(out / "table1.csv")))
    assert float(row["pass_rate"]) == by_hand
    (accuracy,) = list(csv.DictReader(open(out / "table1_token_accuracy.csv")))
    mean_accuracy = sum(sum(r["tf_token_accuracy"]) / 4 for r in records) / 4
    assert float(accuracy["token_accuracy"]) == pytest.approx(mean_accuracy, abs=1e-12)
    assert "## Teacher-forced needle token accuracy" in (out / "table1.md").read_text()
    assert (
        "measure: teacher_forced (answer order: nearest_first)." in (out / "table1.md").read_text()
    )
    (summary,) = list(csv.DictReader(open(probe_dir / "summary.csv")))
    assert float(summary["pass_rate"]) == float(summary["tf_pass_rate"]) == by_hand
    with pytest.raises(store.StaleResults, match="greedy false.*Fix: --scoring teacher_forced"):
        derive_model(probe_dir, Analysis(), dest=tmp_path / "anywhere")
    jsonl = store.length_files(probe_dir, 448)[0]
    damaged = [json.loads(line) for line in jsonl.read_text().splitlines()]
    damaged[1]["tf_token_accuracy"] = [1.0, 2.0, 0.0, 0.0]
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in damaged))
    with pytest.raises(store.StaleResults, match="record 2: tf_token_accuracy must be a number"):
        derive_model(probe_dir, Analysis(scoring="teacher_forced"), dest=tmp_path / "tf")


@pytest.mark.parametrize("run", ["", "schemes_8k", "nearest_8k"])
def test_the_real_model_page_quotes_the_tables_its_command_wrote(run: str) -> None:
    """docs/real_model.md's Tables 1 are the commands' own table1.md (kept in docs/real_model/, its schemes_8k/
    and nearest_8k/), whose tables are table1_markdown of the CSVs the same run wrote beside it."""
    root = Path(__file__).resolve().parents[3]
    written = root / "docs" / "real_model" / run
    page = (root / "docs" / "real_model.md").read_text()
    table_md = (written / "table1.md").read_text()
    lines = [line for line in table_md.splitlines() if line.startswith("|")]
    assert lines and all(line in page.splitlines() for line in lines)
    for name in ("table1.csv", "table1_token_accuracy.csv"):
        rows = []
        for row in csv.DictReader(open(written / name)):
            values = dict(zip(TABLE1_COLUMNS, row.values()))  # the same places, either CSV
            rows.append(
                {
                    key: v
                    if key in ("scheme", "baseline")
                    else int(v)
                    if key in ("length", "tests", "tests_left_out")
                    else (float(v) if v != "" else "")
                    for key, v in values.items()
                }
            )
        assert table1_markdown(rows) in table_md, name


def test_table1_reports_each_comparisons_mcnemar_and_holm_over_the_table() -> None:
    outcomes = {
        "rope": outcomes_of({0}, tests=10) | outcomes_of(set(), length=200, tests=10),
        "string": outcomes_of(set(range(8)), tests=10) | outcomes_of({1}, length=200, tests=10),
    }
    rows = {(r["scheme"], r["length"]): r for r in table1(outcomes, 50)}
    assert rows[("rope", 100)]["mcnemar_p"] == "" and rows[("rope", 100)]["holm_p"] == ""
    near, far = rows[("string", 100)], rows[("string", 200)]
    assert (near["only_scheme_passed"], near["only_baseline_passed"]) == (7, 0)
    assert near["mcnemar_p"] == pytest.approx(2 / 2**7)
    assert far["mcnemar_p"] == pytest.approx(1.0)
    assert near["holm_p"] == pytest.approx(2 * 2 / 2**7) and far["holm_p"] == pytest.approx(1.0)
    text = table1_markdown(list(rows.values()))
    assert "7:0, p 0.0156, Holm 0.0312" in text
    accuracy = table1(
        {s: {k: v / 2 for k, v in o.items()} for s, o in outcomes.items()}, 50, binary=False
    )
    assert all(r["mcnemar_p"] == "" for r in accuracy)


def test_table2_is_a_row_per_task_and_length_and_a_column_per_scheme() -> None:
    from posfreq.analysis.tables.paper_tables import table2, table2_document

    scores = {
        "rope": [{"task": "vt", "length": 300, "score": 0.5}],
        "string": [{"task": "vt", "length": 300, "score": 0.75}],
    }
    assert table2_document(table2(scores), ["rope", "string"]) == (
        "# Table 2: RULER score by task and position scheme\n\n"
        "| task | length | rope | string |\n|---|---|---|---|\n| vt | 300 | 0.500 | 0.750 |\n"
    )


def test_every_probe_setting_a_row_shares_is_the_probes_own_flag() -> None:
    """table's probe settings are ProbeSettings' fields (help and type from one definition), but for what each
    row sets itself; --tests is a second name of --tests-per-length, with table's default of 100."""
    from dataclasses import fields

    from posfreq.analysis.niah.settings import ProbeSettings
    from posfreq.scripts.commands import probe

    table_flags = {a.dest: a for a in command.build_parser()._actions}
    probe_flags = {a.dest: a for a in probe.build_parser()._actions}
    shared = [f.name for f in fields(ProbeSettings) if f.name not in command.ROW_SET]
    assert {"tests_per_length", "seed", "haystack", "chat_template", "answer_order"} <= set(shared)
    for name in shared:
        assert table_flags[name].help == probe_flags[name].help, name
        assert table_flags[name].choices == probe_flags[name].choices, name
    assert (
        "positions" not in table_flags and "greedy" not in table_flags
    )  # the rows and --measure set them
    for flag in ("--tests", "--tests-per-length"):
        args = command.parse(command.build_parser(), ["--model", "hf:x", flag, "7"])
        assert command.row_settings(args).tests_per_length == 7
    args = command.parse(command.build_parser(), ["--model", "hf:x", "--measure", "teacher_forced"])
    settings = command.row_settings(args)
    assert (settings.tests_per_length, settings.greedy, settings.engine) == (
        100,
        False,
        "transformers",
    )

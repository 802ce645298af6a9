"""Every subcommand meets ordinary mistakes with one `error:` line first, a non-zero exit, no traceback, and no file
written outside its output directory.

The hostile routes of the third review (issue #46) and where each is tested:
- a chat template that outruns the sandbox: tests/train/data/chat_template/ (the in-process checks in test_sandbox.py,
  the child process with hard limits in test_render.py) and tests/analysis/niah/test_sources.py (through a tokenizer);
- a rerun deleting a neighbour's nested results: tests/train/test_journal.py, tests/scripts/commands/
  test_loss_by_distance.py (export-hf end to end), tests/test_concurrent_outputs.py
  (`test_a_rerun_never_deletes_a_neighbours_results_nested_in_its_out`: all ten commands that may hold one);
- NaN or infinite weights and overflowing logits: here (`test_a_nan_weight_*`, `test_a_checkpoint_with_a_nan_*`,
  `test_logits_that_overflow_*`);
- pickled weights through every loader: here (`test_every_loader_refuses_pickled_weights_with_one_line`);
- concurrent consolidations into one --out: tests/train/checkpoint/test_consolidate.py;
- a second writer of one --out for every other command that writes it alone (export-hf, analyze, compare,
  effective-length, loss-by-distance, doctor, demo): tests/test_concurrent_outputs.py;
- huge lengths: here (`test_huge_probe_lengths_*`), tests/scripts/commands/test_loss_by_distance.py,
  tests/scripts/commands/test_analyze.py, tests/train/run/test_config.py;
- a YAML alias bomb and an oversized config: tests/train/run/test_config.py;
- a FIFO, a device link or a huge JSON in a model folder: here (`test_the_auto_map_scan_*`);
- a corpus rewritten under the same size and mtime: tests/scripts/commands/test_analyze.py;
- the demo writing into the checkout: tests/scripts/commands/test_demo.py;
- messages (required flags, missing shards, a linked lock file, a refused state file, a model type transformers does
  not know): here and
  tests/train/checkpoint/test_safe_load.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.cli import outcome

from posfreq.scripts.cli import main as posfreq


@pytest.fixture
def places(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "empty").mkdir()
    (tmp_path / "file.txt").write_text("not a directory\n")
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "bad.yaml").write_text("model: [unclosed\n")
    (tmp_path / "badrun" / "probe").mkdir(parents=True)
    (tmp_path / "badrun" / "probe" / "probe.json").write_text("{not json")
    (tmp_path / "badrun" / "probe" / "effective_length.csv").write_text("checkpoint,train_len\n")
    bad_ckpt = tmp_path / "badckpt"  # a consolidated model whose files are damaged
    bad_ckpt.mkdir()
    (bad_ckpt / "model_config.json").write_text("{not json")
    (bad_ckpt / "tokenizer_spec.json").write_text('{"spec": "bytes"}')
    torn = tmp_path / "torn"
    torn.mkdir()
    (torn / "model_config.json").write_text(
        '{"vocab_size": 258, "d_model": 64, "n_layers": 1, "n_heads": 2, '
        '"n_kv_heads": 1, "ffn_dim": 64}'
    )
    (torn / "tokenizer_spec.json").write_text('{"spec": "bytes"}')
    (torn / "model.safetensors").write_bytes(b'\x10\x00\x00\x00\x00\x00\x00\x00{"a": 1')
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{not json")
    (hf / "tokenizer.json").write_text("{not json")
    return {
        "missing": str(tmp_path / "missing"),
        "empty": str(tmp_path / "empty"),
        "file": str(tmp_path / "file.txt"),
        "json": str(tmp_path / "bad.json"),
        "yaml": str(tmp_path / "bad.yaml"),
        "badrun": str(tmp_path / "badrun"),
        "out": str(tmp_path / "out"),
        "badckpt": str(bad_ckpt),
        "torn": str(torn),
        "hf": str(hf),
    }


CASES = [
    # (subcommand argv with {placeholders}, what it is)
    (["analyze", "--corpus", "{missing}", "--out", "{out}"], "a missing corpus"),
    (["analyze", "--corpus", "{empty}", "--out", "{out}"], "an empty corpus directory"),
    (["analyze", "--config", "{yaml}"], "malformed YAML"),
    (["prepare", "--corpus", "{missing}", "--out", "{out}"], "a missing corpus"),
    (["plan", "--config", "{yaml}", "--devices", "8"], "malformed YAML"),
    (["plan", "--config", "{json}", "--devices", "8"], "malformed JSON"),
    (["pretrain", "--data.dir", "{missing}", "--out", "{out}"], "missing shards"),
    (["pretrain", "--data.dir", "{empty}", "--out", "{out}"], "a directory without shards"),
    (["pretrain", "--data.dir", "{file}", "--out", "{out}"], "a file instead of a directory"),
    (["pretrain", "--global-batch-tokens", "-5"], "a negative size"),
    (["pretrain", "--data.train-len", "0"], "a zero size"),
    (["checkpoint", "list", "--run", "{missing}"], "a missing run"),
    (
        ["checkpoint", "consolidate", "--checkpoint", "{missing}", "--out", "{out}"],
        "a missing checkpoint",
    ),
    (
        ["checkpoint", "consolidate", "--checkpoint", "{empty}", "--out", "{out}"],
        "an empty directory",
    ),
    (["probe", "--checkpoint", "{missing}", "--out", "{out}"], "a missing checkpoint"),
    (["probe", "--checkpoint", "{empty}", "--out", "{out}"], "an empty directory"),
    (["probe", "--model", "hf:{missing}", "--out", "{out}"], "a missing model"),
    (["probe", "--run", "{missing}", "--out", "{out}"], "a missing run"),
    (["probe", "--checkpoint", "{empty}", "--batch-size", "0"], "a zero size"),
    (["effective-length", "{missing}", "--out", "{out}"], "a missing run"),
    (["effective-length", "{empty}", "--out", "{out}"], "an empty directory"),
    (["compare", "{missing}", "--out", "{out}"], "a missing run"),
    (["compare", "{badrun}", "--out", "{out}"], "malformed probe.json"),
    (["export-hf", "--checkpoint", "{missing}", "--out", "{out}"], "a missing checkpoint"),
    (["export-hf", "--checkpoint", "{file}", "--out", "{out}"], "a file instead of a directory"),
    (["doctor", "--out", "{file}"], "a file as the output directory"),
    (["probe", "--checkpoint", "{badckpt}", "--out", "{out}"], "a malformed model_config.json"),
    (["export-hf", "--checkpoint", "{torn}", "--out", "{out}"], "a damaged model.safetensors"),
    (["probe", "--checkpoint", "{torn}", "--out", "{out}"], "a damaged model.safetensors"),
    (
        ["probe", "--model", "hf:{hf}", "--out", "{out}"],
        "a malformed config.json and tokenizer.json",
    ),
    (["demo", "--threads", "0", "--out", "{out}"], "a zero size"),
]
UNKNOWN_FLAG = [
    [name, "--no-such-flag"]
    for name in (
        "analyze",
        "prepare",
        "plan",
        "pretrain",
        "probe",
        "effective-length",
        "compare",
        "export-hf",
        "doctor",
        "demo",
    )
]


def snapshot(root: Path) -> dict:
    return {str(p): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    "argv,what",
    CASES + [(a, "an unknown flag") for a in UNKNOWN_FLAG],
    ids=lambda x: " ".join(x) if isinstance(x, list) else x,
)
def test_one_error_line_and_nothing_written(argv, what, places, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path)
    code, err = outcome([a.format(**places) for a in argv], capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code != 0, f"{what}: exit 0\n{err}"
    assert "Traceback" not in err, f"{what}:\n{err}"
    assert lines and lines[0].startswith("error:"), (
        f"{what}: the first line is not the error\n{err}"
    )
    after = {p: b for p, b in snapshot(tmp_path).items() if not p.startswith(places["out"])}
    assert after == before, f"{what}: wrote {sorted(set(after) - set(before))}"


def test_a_full_disk_reaching_the_dispatcher_is_named_as_such(monkeypatch, capsys):
    import errno

    from posfreq.scripts.commands import doctor

    def no_space(argv):
        raise OSError(errno.ENOSPC, "No space left on device", "/data/run/metrics.jsonl")

    monkeypatch.setattr(doctor, "main", no_space)
    code, err = outcome(["doctor"], capsys)
    assert code == 1 and err.startswith(
        "error: the disk holding /data/run is full (No space left on device). Fix:"
    )


def test_the_probe_refuses_a_model_folder_that_names_its_own_code(tmp_path, capsys):
    """`probe --model hf:DIR` (any engine): an auto_map in the folder's config is refused in one line."""
    import json

    model = tmp_path / "m"
    model.mkdir()
    config = {"model_type": "llama", "auto_map": {"AutoModelForCausalLM": "evil.Model"}}
    (model / "config.json").write_text(json.dumps(config))
    (model / "evil.py").write_text(f"open({str(tmp_path / 'marker')!r}, 'w').write('ran')\n")
    out = tmp_path / "out"
    argv = ["probe", "--model", f"hf:{model}", "--engine", "transformers", "--out", str(out)]
    with pytest.raises(SystemExit) as refused:
        posfreq(argv)
    err = str(refused.value)
    assert err.startswith("error: --model: ") and "config.json: auto_map" in err and "Fix:" in err
    assert not (tmp_path / "marker").exists() and not out.exists()


def test_an_auto_map_key_spelled_with_escapes_is_found_and_files_without_the_key_are_not_parsed(
    tmp_path, monkeypatch
):
    """The check reads a JSON file's bytes and parses only those that could spell "auto_map" (literally or
    with \\u escapes, which json decodes to the same key); a top-level key is refused however it is spelled."""
    import json

    from posfreq.train.model import hf_folder

    folder = tmp_path / "m"
    folder.mkdir()
    # json.dumps writes the control character as \u0001, as in Llama 3's tokenizer.json
    (folder / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"\x01": 0, "b": 1}}}))
    (folder / "nested.json").write_text(json.dumps({"x": {"auto_map": {"A": "e.M"}}}))
    parsed = []
    real_loads = json.loads
    monkeypatch.setattr(hf_folder.json, "loads", lambda s: parsed.append(s) or real_loads(s))
    assert hf_folder.custom_code_declaration(folder) is None
    assert parsed == [(folder / "nested.json").read_text()]  # tokenizer.json was never parsed
    (folder / "config.json").write_text(
        '{"model_type": "llama", "\\u0061uto_map": {"A": "evil.M"}}'
    )
    found = hf_folder.custom_code_declaration(folder)
    assert found is not None and found.startswith(f"{folder / 'config.json'}: auto_map")
    assert "evil.M" in found


def test_make_tests_names_a_length_too_short_in_one_line(tmp_path):
    """`make_tests.py --lengths 256:...` with the bytes tokenizer ended in a traceback; the fix names the minimum."""
    from posfreq.analysis.lm_eval_task import make_tests

    argv = ["--tokenizer", "bytes", "--lengths", "256", "--tests-per-length", "1"]
    with pytest.raises(SystemExit) as refused:
        make_tests.main([*argv, "--max-new-tokens", "128", "--out", str(tmp_path / "t")])
    assert str(refused.value).startswith(
        "error: NIAH length 256 is too short for tokenizer 'bytes'"
    )
    assert "Fix: ask for a length of at least" in str(refused.value)


@pytest.fixture(scope="module")
def damaged_hf_folders(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """A tiny Llama folder damaged four ways: {what: (folder, the file the error must name)}."""
    import json
    import shutil

    pytest.importorskip("transformers")
    from helpers.hf import save_tiny_hf

    root = tmp_path_factory.mktemp("hf")
    good = save_tiny_hf(root / "good")
    config = json.loads((good / "config.json").read_text())
    rope = {**config.get("rope_parameters", {}), "rope_theta": "big"}
    damages = {
        "a list": ("config.json", b"[1]"),
        "a 0xff byte": ("config.json", (good / "config.json").read_bytes()[:-2] + b"\xff}"),
        "rope_theta 'big'": (
            "config.json",
            json.dumps({**config, "rope_theta": "big", "rope_parameters": rope}).encode(),
        ),
        "a truncated model.safetensors": (
            "model.safetensors",
            (good / "model.safetensors").read_bytes()[:5000],
        ),
    }
    folders = {}
    for i, (what, (name, data)) in enumerate(damages.items()):
        folder = shutil.copytree(good, root / f"damaged{i}")
        (folder / name).write_bytes(data)
        folders[what] = (folder, name)
    return folders


@pytest.mark.parametrize(
    "what", ["a list", "a 0xff byte", "rope_theta 'big'", "a truncated model.safetensors"]
)
@pytest.mark.parametrize(
    "command",
    [
        ["probe", "--engine", "posfreq"],
        ["probe", "--engine", "transformers"],
        ["ruler", "--tasks", "niah_single_1", "--samples", "1"],
    ],
    ids=" ".join,
)
def test_a_damaged_hf_model_folder_is_one_line_naming_the_file(
    what, command, damaged_hf_folders, tmp_path, capsys
):
    """config.json `[1]`, a 0xff byte in it, "rope_theta": "big", a truncated model.safetensors: each was a bare
    AttributeError, UnicodeDecodeError, float conversion or SafetensorError; one reader (hf_folder) names the file."""
    folder, name = damaged_hf_folders[what]
    code, err = outcome([*command, "--model", f"hf:{folder}", "--out", str(tmp_path / "o")], capsys)
    first = err.splitlines()[0]
    assert code != 0 and first.startswith(f"error: {folder / name}"), err
    assert "Fix:" in first and "Traceback" not in err


@pytest.mark.parametrize(
    "damage,named",
    [
        ("trainer.json {bad", "trainer.json"),
        ("no tokenizer_spec.json", "tokenizer_spec.json"),
        ("model_config.json [1]", "model_config.json"),
    ],
)
@pytest.mark.parametrize(
    "command", [["checkpoint", "consolidate"], ["export-hf"], ["probe"]], ids=" ".join
)
def test_a_checkpoint_json_file_that_is_damaged_or_missing_is_one_line_naming_it(
    damage, named, command, tmp_path, capsys
):
    """trainer.json `{bad` was a bare JSONDecodeError and a missing tokenizer_spec.json consolidate's bare 'No such
    file or directory'; layout.read_checkpoint_json reads every checkpoint JSON file and names it with the fix."""
    import numpy as np
    from helpers.probe import tiny_model, write_checkpoint

    path = write_checkpoint(tmp_path / "run", 4096, tiny_model(), np.bincount([3], minlength=65))
    if damage.startswith("no "):
        (path / named).unlink()
    else:
        (path / named).write_text(damage.split(" ", 1)[1])
    out = tmp_path / "out"
    code, err = outcome([*command, "--checkpoint", str(path), "--out", str(out)], capsys)
    first = err.splitlines()[0]
    assert code != 0 and first.startswith("error: ") and str(path) in first, err
    assert named in first and "Fix:" in first and "Traceback" not in err
    assert not (out / "model.safetensors").exists()


@pytest.fixture(scope="module")
def probed_run(tmp_path_factory) -> Path:
    """A run probed with a window model (tests/helpers/probe.py): records, marker files and tables."""
    from helpers.probe import make_fake_run, probe_fake_run

    run = tmp_path_factory.mktemp("probed") / "run"
    with pytest.MonkeyPatch.context() as monkeypatch:
        names = make_fake_run(run, 512, {40_960: 150})
        probe_fake_run(run, run / "probe", names, [160, 256], [], monkeypatch, tests=4)
    return run


@pytest.mark.parametrize(
    "file,damage,argv",
    [
        ("probe.json", b"{}", ["effective-length", "{probe}", "--threshold", "0.4"]),
        ("probe.json", b"[]", ["effective-length", "{probe}"]),
        ("probe.json", b"[]", ["compare", "{run}"]),
        ("effective_length.csv", b"garbage,,,\n", ["effective-length", "{probe}"]),
        ("effective_length.csv", b"garbage,,,\n", ["compare", "{run}"]),
        (
            "tokens-000000000040960/tests/L000256.jsonl",
            b"\xff\n",
            ["effective-length", "{probe}", "--threshold", "0.4"],
        ),
    ],
)
def test_damaged_probe_outputs_are_one_line_naming_the_file(
    file, damage, argv, probed_run, tmp_path, capsys
):
    """probe.json {} (KeyError 'settings') or [] (AttributeError), a garbage effective_length.csv line (TypeError) and
    a 0xff byte in a record file (UnicodeDecodeError) reached effective-length and compare as tracebacks' last line."""
    import shutil

    run = Path(shutil.copytree(probed_run, tmp_path / "run"))
    target = run / "probe" / file
    if file.endswith(".csv") or file.endswith(".jsonl"):
        target.write_bytes(target.read_bytes() + damage)
    else:
        target.write_bytes(damage)
    places = {"probe": str(run / "probe"), "run": str(run)}
    argv = [a.format(**places) for a in argv]
    code, err = outcome([*argv, "--out", str(tmp_path / "out")], capsys)
    first = err.splitlines()[0]
    assert code != 0 and first.startswith(f"error: {target}"), err
    assert "Fix:" in first and "Traceback" not in err


@pytest.mark.parametrize(
    "damage", [b"garbage", b"PK\x03\x04truncated", b"\x93NUMPY\x01\x00v\x00{'descr'"]
)
def test_analyze_merge_of_a_damaged_histogram_is_one_line_naming_it(damage, tmp_path, capsys):
    """analyze --merge over a truncated or garbage histogram.npz: BadZipFile or numpy's 'pickled data' ValueError."""
    part = tmp_path / "shard_0"
    part.mkdir()
    (part / "histogram.npz").write_bytes(damage)
    code, err = outcome(["analyze", "--merge", str(part), "--out", str(tmp_path / "out")], capsys)
    first = err.splitlines()[0]
    assert code != 0 and first.startswith(f"error: {part / 'histogram.npz'}: not a readable"), err
    assert "Fix:" in first and "pickled" not in first


@pytest.mark.parametrize(
    "text,expected",
    [
        (b"", "is empty: it sets no option. Fix:"),
        (b"# only a comment\n", "is empty: it sets no option. Fix:"),
        (b"out: r\nout: s\n", ": key out is given twice (lines 1 and 2)"),
        (b"out: \xff\n", ": not UTF-8 text (byte 0xff at offset 5). Fix:"),
        (b"seed: abc\n", ': Parser key "seed"'),
        (b"no_such_key: 1\n", ": Option 'no_such_key' is not accepted. Fix:"),
        (b"? [a, b]\n: 1\n", ": line 1: the key ['a', 'b'] is not a name. Fix:"),
    ],
    ids=[
        "empty",
        "comments only",
        "duplicate key",
        "not UTF-8",
        "wrong type",
        "unknown key",
        "list key",
    ],
)
@pytest.mark.parametrize("command", ["pretrain", "plan", "analyze"])
def test_a_config_file_error_names_the_file(text, expected, command, tmp_path, capsys):
    """An empty --config was 'Unexpected config:', a key given twice silently kept the last, a non-UTF-8 file was a
    UnicodeDecodeError, and type and unknown-key errors never named the file: each is now one line naming it."""
    if command == "analyze" and b"seed" in text:
        text = b"workers: abc\n"
        expected = ': Parser key "workers"'
    config = tmp_path / "run.yaml"
    config.write_bytes(text)
    code, err = outcome([command, "--config", str(config), "--out", str(tmp_path / "o")], capsys)
    first = err.splitlines()[0]
    assert code == 2 and first.startswith(f"error: --config {config}"), err
    assert expected in first and "Fix:" in first


@pytest.mark.parametrize("in_file", ["total_tokens: 1000\n", "seed: 1\n"])
def test_a_flag_of_the_wrong_type_is_not_blamed_on_the_config_file(in_file, tmp_path, capsys):
    """Not even when the file gives the same key: the flag's value is the one parsed, so the flag is wrong."""
    config = tmp_path / "run.yaml"
    config.write_text(in_file)
    code, err = outcome(["pretrain", "--config", str(config), "--seed", "abc"], capsys)
    assert code == 2 and str(config) not in err and 'Parser key "seed"' in err


@pytest.mark.parametrize(
    "argv",
    [
        ["doctor", "--out", "{out}"],
        ["analyze", "--corpus", "{corpus}", "--out", "{out}"],
        ["prepare", "--corpus", "{corpus}", "--out", "{out}"],
    ],
    ids=lambda a: a[0],
)
def test_an_out_that_is_a_dangling_symlink_is_named_with_the_fix(argv, tmp_path, capsys):
    """--out a link to nothing was 'error: File exists: sl/dangling' (mkdir met the link) with no fix."""
    out = tmp_path / "dangling"
    out.symlink_to(tmp_path / "nowhere")
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "a b c"}\n')
    code, err = outcome([a.format(out=out, corpus=corpus) for a in argv], capsys)
    first = err.splitlines()[0]
    assert code != 0 and first.startswith(f"error: --out {out} is a symbolic link to"), err
    assert "Fix:" in first and not (tmp_path / "nowhere").exists()


def test_table_tests_and_ruler_samples_of_zero_are_refused_by_their_own_flag(tmp_path, capsys):
    """`table --tests 0` pointed at `posfreq probe --help` (the probe it runs refused tests_per_length 0, after
    table had claimed --out); `ruler --samples 0` was not refused."""
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    out = tmp_path / "out"
    code, err = outcome(
        ["table", "--model", f"hf:{model}", "--tests", "0", "--out", str(out)], capsys
    )
    assert code != 0 and err.startswith("error: --tests 0: ") and "Fix: --tests 100" in err
    assert "probe --help" not in err and not out.exists()
    code, err = outcome(
        ["ruler", "--model", f"hf:{model}", "--samples", "0", "--out", str(out)], capsys
    )
    assert code == 2 and err.startswith("error: --samples 0: ") and "Fix:" in err
    assert not out.exists()


@pytest.mark.parametrize(
    "argv, want",
    [
        (["loss-by-distance", "--data", "."], "error: the following arguments are required: --out"),
        (["table"], "error: the following arguments are required: --model"),
    ],
)
def test_a_missing_required_option_is_named_with_its_dashes(argv, want, capsys):
    code, err = outcome(argv, capsys)
    assert code == 2 and err.splitlines()[0] == want


def test_a_data_dir_without_shards_names_posfreq_prepare(tmp_path, capsys):
    (tmp_path / "data").mkdir()
    code, err = outcome(
        ["pretrain", "--data.dir", str(tmp_path / "data"), "--out", str(tmp_path / "run")], capsys
    )
    assert (
        code != 0
        and "Fix: run `posfreq prepare --corpus <name or path> --out <this directory>`" in err
    )


def test_a_lock_file_planted_as_a_link_is_refused_by_name(tmp_path, capsys):
    """A symbolic link at OUT/.posfreq-lock gave only "Too many levels of symbolic links"; now one line names it,
    and the file it points to stays untouched."""
    from posfreq.train.outdir import claim_output_dir, release_output_locks

    out = claim_output_dir(tmp_path / "out", "compare")
    release_output_locks()
    target = tmp_path / "thesis.tex"
    target.write_text("keep")
    (out / ".posfreq-lock").unlink()
    (out / ".posfreq-lock").symlink_to(target)
    with pytest.raises(
        Exception,
        match=r"\.posfreq-lock is a symbolic link \(to .*thesis.tex\).*Fix: remove the link",
    ):
        claim_output_dir(out, "compare")
    assert target.read_text() == "keep"


@pytest.fixture
def pickled_only(tmp_path_factory) -> Path:
    """A tiny Llama folder whose weights are only a pickle (pytorch_model.bin) that would leave a marker if run."""
    pytest.importorskip("transformers")
    from helpers.hf import save_tiny_hf

    root = tmp_path_factory.mktemp("pickled")
    model = save_tiny_hf(root / "m")
    (model / "model.safetensors").unlink()
    (model / "pytorch_model.bin").write_bytes(b"\x80\x04not a weight file, never to be unpickled")
    return model


@pytest.mark.parametrize(
    "argv",
    [
        ["probe", "--engine", "transformers", "--lengths", "512"],
        ["probe", "--engine", "posfreq", "--lengths", "512"],
        ["loss-by-distance", "--engine", "transformers", "--data", "."],
        ["ruler", "--lengths", "512"],
    ],
    ids=["probe transformers", "probe posfreq", "loss-by-distance transformers", "ruler"],
)
def test_every_loader_refuses_pickled_weights_with_one_line(pickled_only, argv, tmp_path, capsys):
    """loss-by-distance --engine transformers loaded a folder holding only pytorch_model.bin, where probe and ruler
    refused it: one rule and one line now, before anything is read."""
    command, *rest = argv
    code, err = outcome(
        [command, "--model", f"hf:{pickled_only}", *rest, "--out", str(tmp_path / "o")], capsys
    )
    assert (
        code != 0
        and "holds only pickled weights (pytorch_model.bin), which posfreq never loads" in err
    ), err
    assert "Fix: convert them to safetensors" in err and not (tmp_path / "o").exists()


@pytest.fixture(scope="module")
def unknown_type(tmp_path_factory) -> Path:
    """A tiny Llama folder whose config.json names a model type no transformers release knows."""
    pytest.importorskip("transformers")
    import json

    from helpers.hf import save_tiny_hf

    model = save_tiny_hf(tmp_path_factory.mktemp("unknown") / "m")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "llama9000"}))
    return model


@pytest.mark.parametrize(
    "argv",
    [
        ["probe", "--engine", "transformers", "--lengths", "512"],
        ["loss-by-distance", "--engine", "transformers", "--data", "."],
        ["ruler", "--lengths", "512"],
    ],
    ids=["probe transformers", "loss-by-distance transformers", "ruler"],
)
def test_a_model_type_transformers_does_not_know_is_one_line(unknown_type, argv, tmp_path, capsys):
    """An unknown model_type under the transformers engine printed transformers' three-paragraph advice: one line
    now, naming config.json, the type and the installed release, with the fix, before any weight is read."""
    import transformers

    model = unknown_type
    capsys.readouterr()  # the builder's own progress bar
    command, *rest = argv
    code, err = outcome(
        [command, "--model", f"hf:{model}", *rest, "--out", str(tmp_path / "o")], capsys
    )
    lines = [line for line in err.splitlines() if line.strip()]
    assert code != 0 and len(lines) == 1, err
    assert (
        f"{model / 'config.json'}: model_type 'llama9000' is not an architecture transformers "
        f"{transformers.__version__} knows. Fix: install a transformers release that knows it"
        in lines[0]
    ), err
    assert "pip install" not in err and not (tmp_path / "o").exists()


@pytest.mark.parametrize("kind", ["fifo", "device link", "huge"])
def test_the_auto_map_scan_reads_only_regular_files_of_bounded_size(kind, tmp_path, capsys):
    """extra.json -> /dev/zero grew until memory ran out, and a FIFO named extra.json hung the probe for good: a
    model folder's JSON that is not a regular file of bounded size is refused by name, at once."""
    import os
    import time

    from posfreq.train.model import hf_folder

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    extra = model / "extra.json"
    if kind == "fifo":
        os.mkfifo(extra)
    elif kind == "device link":
        extra.symlink_to("/dev/zero")
    else:
        with open(extra, "wb") as handle:
            handle.truncate(hf_folder.MAX_JSON_BYTES + 1)  # sparse: no disk used
    start = time.perf_counter()
    with pytest.raises(hf_folder.ModelFolderError) as refused:
        hf_folder.refuse_custom_code(model, "--model")
    assert (
        time.perf_counter() - start < 1
        and str(extra) in str(refused.value)
        and "Fix:" in str(refused.value)
    )
    (model / "linked.json").symlink_to(
        model / "config.json"
    )  # a link to a regular file (the hub's layout) is read
    extra.unlink()
    hf_folder.refuse_custom_code(model, "--model")


def _with_weight(folder: Path, name: str, value: float) -> None:
    """Set one element of weight `name` in folder/model.safetensors to `value`."""
    from safetensors.torch import load_file, save_file

    weights = load_file(str(folder / "model.safetensors"))
    weights[name] = weights[name].clone()
    weights[name].view(-1)[0] = value
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("engine", ["posfreq", "transformers"])
def test_a_nan_weight_is_refused_at_load_naming_the_tensor(engine, tmp_path, capsys):
    """One NaN in a q_proj weight gave exit 0 and 'effective length 0 (none_passed)', tf_needle_prob nan: the
    weights are refused at load now, naming the tensor, and nothing is written."""
    pytest.importorskip("transformers")
    from helpers.hf import save_tiny_hf

    model = save_tiny_hf(tmp_path / "m")
    _with_weight(model, "model.layers.0.self_attn.q_proj.weight", float("nan"))
    argv = [
        "probe",
        "--model",
        f"hf:{model}",
        "--engine",
        engine,
        "--lengths",
        "512",
        "--tests-per-length",
        "1",
    ]
    code, err = outcome([*argv, "--out", str(tmp_path / "o")], capsys)
    assert code != 0 and "q_proj.weight holds 1 NaN or infinite value" in err and "Fix: " in err, (
        err
    )
    assert not list((tmp_path / "o").rglob("*.jsonl"))


def test_a_checkpoint_with_a_nan_weight_is_refused_by_probe_and_loss_by_distance(
    data_dir, tmp_path, capsys
):
    from helpers.hf import consolidated_bytes_model

    checkpoint = tmp_path / "ckpt"
    consolidated_bytes_model(checkpoint)
    _with_weight(checkpoint, "layers.0.self_attn.q_proj.weight", float("inf"))
    (checkpoint / "manifest.json").unlink(
        missing_ok=True
    )  # a hand-edited copy: no manifest to check against
    for argv in (
        [
            "probe",
            "--checkpoint",
            str(checkpoint),
            "--lengths",
            "448",
            "--max-new-tokens",
            "40",
            "--haystack",
            "noise",
            "--tests-per-length",
            "1",
        ],
        [
            "loss-by-distance",
            "--checkpoint",
            str(checkpoint),
            "--data",
            str(data_dir),
            "--rows",
            "1",
        ],
    ):
        code, err = outcome([*argv, "--out", str(tmp_path / argv[0])], capsys)
        assert (
            code != 0
            and "weight layers.0.self_attn.q_proj.weight holds 1 NaN or infinite value" in err
        ), err


def test_logits_that_overflow_stop_the_probe_naming_the_length_and_the_tests(tmp_path, capsys):
    """Finite weights whose logits overflow to infinity: argmax made answers of them; the probe stops with one
    line naming the model, the length and the tests."""
    pytest.importorskip("transformers")
    from helpers.hf import save_tiny_hf

    model = save_tiny_hf(tmp_path / "m")
    from safetensors.torch import load_file, save_file

    weights = load_file(str(model / "model.safetensors"))
    head = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
    weights[head] = weights[head].clone().fill_(3e38)
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})
    argv = ["probe", "--model", f"hf:{model}", "--lengths", "512", "--tests-per-length", "2"]
    code, err = outcome([*argv, "--out", str(tmp_path / "o"), "--quiet"], capsys)
    assert code != 0 and "non-finite logits at" in err and "at length 512, tests 0-1" in err, err


def test_huge_probe_lengths_are_refused_before_any_test_is_built(data_dir, tmp_path, capsys):
    """--lengths 2^40 tried to allocate 88 GiB; a range of millions of lengths and a config whose
    max_position_embeddings is 2^40 (8.6e9 default lengths; loss-by-distance's default rows searched for hours)
    are one line each, at once."""
    import json
    import time

    pytest.importorskip("transformers")
    from helpers.hf import save_tiny_hf

    model = save_tiny_hf(tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2**40}))
    cases = [
        (
            ["probe", "--model", f"hf:{model}", "--lengths", "1099511627776"],
            "beyond the longest test the probe",
        ),
        (
            ["probe", "--model", f"hf:{model}", "--lengths", "128:100000000:1"],
            "lengths, more than a probe takes",
        ),
        (["probe", "--model", f"hf:{model}"], "no default lengths up to it. Fix: pass --lengths"),
        (
            ["loss-by-distance", "--model", f"hf:{model}", "--data", str(data_dir)],
            "holds 0 rows of",
        ),
    ]
    for argv, want in cases:
        start = time.perf_counter()
        code, err = outcome([*argv, "--out", str(tmp_path / "o")], capsys)
        assert code != 0 and want in err, (argv, err)
        assert time.perf_counter() - start < 10, argv

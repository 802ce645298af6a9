"""Configs are data: nothing in a YAML file, a flag value or a checkpoint's config.json may import or run code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posfreq.scripts.cli import SUBCOMMANDS
from posfreq.scripts.cli import main as posfreq

ROOT = Path(__file__).resolve().parents[3]


def payload(marker: Path) -> dict:
    """What jsonargparse would instantiate from a free-form mapping: a process that leaves `marker`."""
    return {
        "class_path": "subprocess.Popen",
        "init_args": {"args": f"touch {marker}", "shell": True},
    }


def flow(value) -> str:
    return json.dumps(value)  # JSON is YAML: the form a flag value takes


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_a_class_path_in_any_flag_of_any_command_is_refused_before_parsing(
    command, tmp_path, capsys
):
    marker = tmp_path / "marker"
    with pytest.raises(SystemExit) as stop:
        posfreq([command, "--out", flow({"n_layers": payload(marker)})])
    assert stop.value.code == 2 and not marker.exists()
    assert "--out: key n_layers.class_path asks to import and run code" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["pretrain", "plan"])
@pytest.mark.parametrize("form", ["file", "flag", "inline config", "nested include", "yaml tag"])
def test_run_config_payloads_are_refused_by_name(command, form, tmp_path, capsys):
    marker = tmp_path / "marker"
    evil = {"model": {"overrides": {"n_layers": payload(marker)}}}
    config = tmp_path / "evil.yaml"
    config.write_text(json.dumps(evil))
    argv = {
        "file": ["--config", str(config)],
        "flag": ["--model.overrides", flow({"n_layers": payload(marker)})],
        "inline config": ["--config", flow(evil)],
        "nested include": ["--config", str(tmp_path / "outer.yaml")],
        "yaml tag": ["--config", str(tmp_path / "tag.yaml")],
    }[form]
    (tmp_path / "outer.yaml").write_text(json.dumps({"config": str(config)}))
    (tmp_path / "tag.yaml").write_text(
        f'optim: !!python/object/apply:os.system ["touch {marker}"]\n'
    )
    with pytest.raises(SystemExit) as stop:
        posfreq([command, *argv])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and not marker.exists(), err
    want = {
        "nested include": "key config would include another config file",
        "yaml tag": "YAML tag",
    }.get(form, "n_layers.class_path asks to import and run code")
    assert want in err


def test_a_yaml_alias_bomb_and_an_oversized_config_are_refused_at_once(tmp_path, capsys):
    """Nine levels of ten aliases (10^9 nodes once expanded; it hung past 30 s) and a config over 1 MiB end in one
    line naming the file, the line and the fix, in well under a second, before any walk or parse."""
    import time

    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 10)]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(levels) + "\n")
    big = tmp_path / "big.yaml"
    big.write_text("seed: 1\n" + "# padding\n" * 120_000)
    for config, want in (
        (bomb, f"--config {bomb}, line 1: YAML anchor &a0 refused"),
        (big, "bytes, more than a config holds (at most 1,048,576)"),
    ):
        start = time.perf_counter()
        with pytest.raises(SystemExit) as stop:
            posfreq(["pretrain", "--config", str(config)])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and want in err and "Fix: " in err, err
        assert time.perf_counter() - start < 5
    with pytest.raises(SystemExit):
        posfreq(["pretrain", "--model.overrides", "{a: &x 1, b: *x}"])
    assert "YAML anchor &x refused" in capsys.readouterr().err


def test_probe_position_options_hold_data_only(tmp_path, capsys):
    marker = tmp_path / "marker"
    with pytest.raises(SystemExit):
        posfreq(
            [
                "probe",
                "--checkpoint",
                str(tmp_path),
                "--position-options",
                flow({"shift": payload(marker)}),
            ]
        )
    assert not marker.exists() and "shift.class_path" in capsys.readouterr().err


def test_free_form_mappings_are_typed_as_data_so_the_parser_refuses_classes_too(tmp_path):
    """Defense in depth: without the pre-parse check, the typed fields alone never instantiate."""
    from posfreq.train.run.config import build_parser

    marker = tmp_path / "marker"
    parser = build_parser()
    parser.exit_on_error = False
    for data in (
        {"model": {"overrides": {"n_layers": payload(marker)}}},
        {"resume_override": {"optim.lr": payload(marker)}},
    ):
        with pytest.raises(Exception, match="Does not validate against any of the Union subtypes"):
            parser.parse_object(data)
    assert not marker.exists()


def test_a_checkpoints_config_json_is_checked_too(tmp_path):
    from posfreq.train.run.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError, match="trainer.json: key model.overrides.n_layers.class_path"):
        config_from_dict(
            {"model": {"overrides": {"n_layers": payload(tmp_path / "m")}}}, where="trainer.json"
        )
    assert not (tmp_path / "m").exists()


@pytest.mark.slow
def test_shipped_configs_and_their_printed_round_trip_still_load(tmp_path, capsys):
    from posfreq.train.run.config import parse_args

    for config in sorted((ROOT / "configs").glob("*.yaml")):
        with pytest.raises(SystemExit) as stop:
            parse_args(["--config", str(config), "--print-config"])
        assert stop.value.code == 0
        printed = tmp_path / config.name
        printed.write_text(capsys.readouterr().out)
        assert (
            parse_args(["--config", str(printed)]).to_dict()
            == parse_args(["--config", str(config)]).to_dict()
        )


def test_abbreviations_section_files_and_environment_cannot_carry_code_in(
    tmp_path, capsys, monkeypatch
):
    marker = tmp_path / "marker"
    evil = tmp_path / "evil.yaml"
    evil.write_text(json.dumps({"model": {"overrides": {"n_layers": payload(marker)}}}))
    outer = tmp_path / "outer.yaml"
    outer.write_text(json.dumps({"config": str(evil)}))
    section = tmp_path / "model.yaml"
    section.write_text(json.dumps({"overrides": {"n_layers": payload(marker)}}))
    for argv, said in (
        (
            ["pretrain", "--conf", str(outer)],
            "error: --conf",
        ),  # read by neither the parser nor a scan
        (["pretrain", "--model", str(section)], "--model " + str(section)),
    ):  # a section loaded from a file
        with pytest.raises(SystemExit) as stop:
            posfreq(argv)
        assert stop.value.code == 2 and said in capsys.readouterr().err
    monkeypatch.setenv("JSONARGPARSE_DEFAULT_ENV", "true")
    monkeypatch.setenv("POSFREQ PRETRAIN_CONFIG", str(outer))
    from posfreq.train.run.config import parse_args

    assert (
        parse_args(["--data.dir", "d"]).model.overrides == {}
    )  # the environment is not an option source
    assert not marker.exists()


def test_a_flag_value_that_merely_starts_with_a_tag_mark_is_text(capsys):
    from posfreq.train.command_line import refuse_code_in_args

    refuse_code_in_args(
        ["--run", "!important", "--out", "!x y"]
    )  # not refused: the parser reads them as text


def test_a_train_len_beyond_what_posfreq_plans_is_refused_by_the_config():
    from posfreq.train.run.config import MAX_TRAIN_LEN, DataSection

    DataSection(train_len=MAX_TRAIN_LEN)
    with pytest.raises(
        ValueError, match=r"data.train_len 4,194,305 is beyond .* Fix: a data.train_len up to"
    ):
        DataSection(train_len=MAX_TRAIN_LEN + 1)

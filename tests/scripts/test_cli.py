"""Every `posfreq` subcommand's parser: built without a subprocess, each option described and its default shown.

The table of subcommands is scripts/cli.py's SUBCOMMANDS, so a new subcommand is checked as soon as it is
listed: its module must expose `build_parser() -> ArgumentParser` and `main(argv) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Iterator

import pytest
from helpers.cli import command_parser_of
from jsonargparse import ActionConfigFile
from jsonargparse._actions import _ActionConfigLoad

from posfreq.scripts.cli import SUBCOMMANDS
from posfreq.train.command_line import parse

# Other spellings of the options every command shares (--out, --seed, --workers, --tokenizer, --threads, --run,
# --config): a command must use the shared name.
SYNONYMS = {
    "--out-dir",
    "--outdir",
    "--output",
    "--output-dir",
    "--random-seed",
    "--rng-seed",
    "--num-workers",
    "--n-workers",
    "--jobs",
    "--processes",
    "--tokenizer-spec",
    "--num-threads",
    "--n-threads",
    "--run-dir",
    "--rundir",
    "--config-file",
    "--cfg",
    "--yaml",
}


def parsers(
    parser: argparse.ArgumentParser, name: str
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """`parser` and the parsers of its subcommands, each with the command line that reaches it."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action.choices, dict):
            for sub, subparser in action.choices.items():
                if isinstance(subparser, argparse.ArgumentParser):
                    yield from parsers(subparser, f"{name} {sub}")


def undocumented(parser: argparse.ArgumentParser) -> list[str]:
    """The options of `parser` whose --help entry lacks a description, or a default when the option is optional.

    jsonargparse's help formatter appends "(type: ..., default: ...)", or "required", to each option's help.
    """
    formatter = parser._get_formatter()
    problems = []
    for action in parser._actions:
        if (
            isinstance(action, (argparse._HelpAction, ActionConfigFile, _ActionConfigLoad))
            or action.dest == "print_config"
            or isinstance(action.choices, dict)
        ):
            continue  # --help, --config, a section's --SECTION FILE.yaml, --print-config, the subcommands
        name = "/".join(action.option_strings) or action.dest
        if not (action.help or "").strip() or action.help == argparse.SUPPRESS:
            problems.append(f"{name}: no description")
            continue
        shown = formatter._get_help_string(action)
        if "default:" not in shown and "required" not in shown:
            problems.append(f"{name}: no default shown")
    return problems


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_every_option_has_a_description_and_a_default(name):
    for command, parser in parsers(command_parser_of(name), f"posfreq {name}"):
        assert undocumented(parser) == [], command
        assert parser.description, f"{command}: no description"
        assert parser.format_help(), command  # it renders (a bare % in a help text would raise)


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_shared_options_have_the_shared_names(name):
    for command, parser in parsers(command_parser_of(name), f"posfreq {name}"):
        spelled = {option for action in parser._actions for option in action.option_strings}
        assert not spelled & SYNONYMS, (
            f"{command}: use the shared names, not {sorted(spelled & SYNONYMS)}"
        )


@pytest.mark.parametrize(
    "argv",
    [
        ["probe"],
        ["effective-length"],
        ["compare"],
        ["checkpoint", "consolidate"],
        ["checkpoint", "list"],
        ["demo"],
        ["plan"],
    ],
    ids=" ".join,
)
def test_help_exits_cleanly(argv, capsys):
    module = importlib.import_module(SUBCOMMANDS[argv[0]][0])
    with pytest.raises(SystemExit) as exit_info:
        module.main([*argv[1:], "--help"])
    assert exit_info.value.code == 0
    assert "type:" in capsys.readouterr().out


def test_checkpoint_subcommands_take_the_shared_names():
    parser = command_parser_of("checkpoint")
    args = parse(parser, ["consolidate", "--checkpoint", "c", "--out", "o", "--dtype", "bfloat16"])
    assert (args.command, str(args.consolidate.checkpoint), str(args.consolidate.out)) == (
        "consolidate",
        "c",
        "o",
    )
    assert str(parse(command_parser_of("checkpoint"), ["list", "--run", "r"]).list.run) == "r"


def test_print_config_prints_the_resolved_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse(command_parser_of("probe"), ["--run", "r", "--seed", "3", "--print-config"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "seed: 3" in out and "run: r" in out


def test_dispatch_leaves_sys_argv_alone(monkeypatch):
    """Lightning's launcher re-runs sys.argv[0] for the other local ranks: `posfreq pretrain --devices 2` needs it
    to stay the console script's path, not become a prog name."""
    from posfreq.scripts.cli import main

    monkeypatch.setattr(sys, "argv", ["/venv/bin/posfreq", "plan", "--help"])
    with pytest.raises(SystemExit) as done:
        main(["plan", "--help"])
    assert done.value.code == 0 and sys.argv[0] == "/venv/bin/posfreq"


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_every_hyphenated_flag_takes_its_underscore_spelling_too(name):
    """The YAML key spelling works on every command line, not only on those built from dataclasses."""
    for prog, parser in parsers(command_parser_of(name), f"posfreq {name}"):
        for action in parser._actions:
            for option in (o for o in action.option_strings if o.startswith("--") and "-" in o[2:]):
                underscored = "--" + option[2:].replace("-", "_")
                assert parser._option_string_actions.get(underscored) is action, (
                    f"{prog}: {underscored}"
                )


@pytest.mark.parametrize("name", ["compare", "effective-length"])
def test_runs_are_named_positionally_or_with_run_as_everywhere(name):
    from posfreq.train.command_line import runs_of

    parser = command_parser_of(name)
    both = parse(parser, ["a", "--run", "b", "c"])
    assert [str(p) for p in runs_of(both, parser)] == ["a", "b", "c"]


@pytest.mark.parametrize(
    "typed, meant",
    [("analyse", "analyze"), ("prob", "probe"), ("effective_length", "effective-length")],
)
def test_a_mistyped_subcommand_gets_did_you_mean_in_one_line(typed, meant, capsys):
    from posfreq.scripts.cli import main

    assert main([typed, "--out", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: unknown subcommand")
    assert f"did you mean {meant}?" in err


def test_a_bare_path_is_named_with_the_flag_it_fits(tmp_path, capsys):
    """`posfreq probe RUN_DIR` suggests --run for a run's folder; a single checkpoint gets --checkpoint."""
    from posfreq.scripts.commands import probe

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    with pytest.raises(SystemExit):
        probe.main([str(run)])
    err = capsys.readouterr().err
    assert err.startswith("error:") and f"name it: --run {run}" in err and "--checkpoint" not in err
    missing = tmp_path / "nowhere"
    with pytest.raises(SystemExit):
        probe.main([str(missing)])
    assert f"--run {missing} (a run's folder) or --checkpoint {missing}" in capsys.readouterr().err


@pytest.mark.parametrize("name, resumes", [("probe", True), ("table", True), ("compare", False)])
def test_an_interrupted_command_says_whether_running_it_again_resumes(
    name, resumes, monkeypatch, capsys
):
    from posfreq.scripts import cli

    def interrupted(argv):
        raise KeyboardInterrupt

    module = importlib.import_module(SUBCOMMANDS[name][0])
    monkeypatch.setattr(module, "main", interrupted)
    assert cli.main([name]) == 130
    err = capsys.readouterr().err
    assert err.startswith(f"posfreq {name}: interrupted")
    assert ("the same command again resumes where this one stopped" in err) == resumes

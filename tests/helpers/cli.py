"""A subcommand's parser as `parse` sees it, for the CLI and README tests, and a command's outcome as a user sees it."""

from __future__ import annotations

import importlib

from jsonargparse import ArgumentParser

from posfreq.scripts.cli import SUBCOMMANDS
from posfreq.train.command_line import hyphenate


def command_parser_of(name: str) -> ArgumentParser:
    """The parser of subcommand `name`, as `parse` sees it (hyphenated)."""
    module = importlib.import_module(SUBCOMMANDS[name][0])
    assert callable(getattr(module, "main", None)), f"{module.__name__} has no main(argv)"
    assert callable(getattr(module, "build_parser", None)), (
        f"{module.__name__} has no build_parser()"
    )
    parser = module.build_parser()
    assert isinstance(parser, ArgumentParser), (
        f"{module.__name__}.build_parser() is not a jsonargparse parser"
    )
    hyphenate(parser)
    return parser


def outcome(argv: list[str], capsys) -> tuple[int, str]:
    """(exit code, what the user reads on stderr) of `posfreq ARGV`, in-process: a SystemExit's message is what
    Python would print."""
    from posfreq.scripts.cli import main as posfreq

    try:
        code = posfreq(argv)
    except SystemExit as stop:
        code = stop.code
    err = capsys.readouterr().err
    if isinstance(code, str):
        err, code = err + code + "\n", 1
    return int(code or 0), err

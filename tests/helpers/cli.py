"""A subcommand's parser as `parse` sees it, for the CLI and README tests."""

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

"""What every posfreq command line shares: one jsonargparse parser style, hyphenated flags, shared parsers.

Every subcommand builds its parser with `command_parser` and parses with `parse`: options come from
dataclasses (each field's docstring is its help; its type gives the allowed values; its default is
shown), YAML files load with `--config`, `--section.key` overrides them, and `--print-config` prints
the fully resolved configuration. Flags are spelled with hyphens (`--train-len`, `--data.train-len`);
the underscore spelling of a dataclass key (`--data.train_len`, the YAML key) is accepted too.
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path
from typing import Sequence

from jsonargparse import ActionConfigFile, ArgumentParser, Namespace, set_parsing_settings

REPO = Path(__file__).resolve().parents[1]

set_parsing_settings(docstring_parse_attribute_docstrings=True)


def command_parser(prog: str, description: str, config_file: bool = False) -> ArgumentParser:
    """A parser for one posfreq command; `config_file` adds `--config FILE.yaml` (values the flags override)."""
    parser = ArgumentParser(prog=prog, description=description, print_config="--print-config")
    if config_file:
        parser.add_argument("--config", action=ActionConfigFile,
                            help="A YAML file of options (keys as in --print-config); flags after it override it.")
    return parser


def hyphenate(parser: argparse.ArgumentParser) -> None:
    """Spell every long option with hyphens first (`--out-dir`), keeping the underscore form as an alias."""
    for action in parser._actions:
        dashed = [o.replace("_", "-") for o in action.option_strings if o.startswith("--") and "_" in o]
        for option in dashed:
            parser._option_string_actions.setdefault(option, action)
        if dashed:
            action.option_strings = dashed + [o for o in action.option_strings if o not in dashed]
        for sub in getattr(action, "choices", None) or {}:
            if isinstance(action.choices, dict) and isinstance(action.choices[sub], argparse.ArgumentParser):
                hyphenate(action.choices[sub])


def parse(parser: ArgumentParser, argv: Sequence[str] | None = None) -> Namespace:
    """Parse `argv` (default sys.argv[1:]) with hyphenated option names; errors exit with a short usage."""
    hyphenate(parser)
    return parser.parse_args(None if argv is None else list(argv))


def parse_shard(text: str) -> tuple[int, int]:
    """'i/n' (0-based i, as SLURM_ARRAY_TASK_ID / SLURM_ARRAY_TASK_COUNT) -> (i, n), for argparse."""
    try:
        index, count = (int(x) for x in text.strip().split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard expects i/n such as 3/64 (0-based i), got {text!r}") from None
    if not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"--shard {text}: need 0 <= i < n")
    return index, count


def code_version() -> str:
    """`git describe --always --dirty --tags` of this repository, or 'unknown' outside a git checkout."""
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty", "--tags"], cwd=REPO, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"

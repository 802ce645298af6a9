"""The shared command-line conventions of every posfreq command: one jsonargparse parser style, hyphenated flags.

Every subcommand builds its parser with `command_parser` and parses with `parse`: options come from
dataclasses (each field's docstring is its help; its type gives the allowed values; its default is
shown), YAML files load with `--config`, `--section.key` overrides them, and `--print-config` prints
the fully resolved configuration. Flags are spelled with hyphens (`--train-len`, `--data.train-len`);
the underscore spelling of a dataclass key (`--data.train_len`, the YAML key) is accepted too.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable, NoReturn, Sequence

import yaml
from jsonargparse import ActionConfigFile, ArgumentParser, Namespace, set_parsing_settings

REPO = Path(__file__).resolve().parents[1]

set_parsing_settings(docstring_parse_attribute_docstrings=True)


class CommandParser(ArgumentParser):
    """jsonargparse's parser whose usage errors are the one line that matters first, with close flag names."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        """`error: MESSAGE`, `did you mean ...?` for a misspelt flag, and where the options are listed; exit 2."""
        if not self.exit_on_error:
            super().error(message, ex)
        message = self._dashed_required(message)
        lines = [f"error: {message.strip()}"]
        source = config_source(
            message, getattr(self, "config_files", []), getattr(self, "flag_keys", set())
        )
        if source is not None:  # a key of a --config file: name the file, and how to mend it
            command = self.prog.replace(" [options]", "")
            lines = [
                f"error: --config {source}: {' '.join(message.split())}. Fix: correct or remove that key "
                f"in {source} ({command} --print-config shows every key, its type and default)"
            ]
        unknown = re.findall(r"(--[\w.-]+)", message) if "nrecognized argument" in message else []
        known = [
            o
            for a in self._actions
            for o in a.option_strings
            if o.startswith("--") and "_" not in o
        ]
        for flag in unknown:
            close = difflib.get_close_matches(flag.replace("_", "-"), known, n=3, cutoff=0.6)
            if close:
                lines.append(f"  did you mean {' or '.join(close)} (for {flag})?")
        if (
            "nrecognized argument" in message and not unknown
        ):  # e.g. `probe RUN_DIR`: a path without its flag
            for value in message.split(":", 1)[-1].split():
                hint = path_flag_hint(value, known)
                if hint:
                    lines.append(f"  name it: {hint}")
        lines.append(f"  {self.prog.replace(' [options]', '')} --help lists every option")
        sys.stderr.write("\n".join(lines) + "\n")
        sys.exit(2)

    def _dashed_required(self, message: str) -> str:
        """argparse's 'the following arguments are required: out, model' with each name as its flag (--out), as
        the user types it."""
        found = re.match(r"\s*the following arguments are required: (.+)", message)
        if not found:
            return message
        flags = {o for a in self._actions for o in a.option_strings if o.startswith("--")}
        names = []
        for name in (n.strip() for n in found.group(1).split(",")):
            flag = "--" + name.replace("_", "-")
            names.append(flag if flag in flags or f"--{name}" in flags else name)
        return f"the following arguments are required: {', '.join(names)}"


_KEY_IN_ERROR = re.compile(
    r"""(?:Parser key|Option|Key|key) ["']([\w.-]+)["']|No action for key ["']([\w.-]+)["']"""
)
"""The option a jsonargparse error names: 'Parser key "seed": ...', "Option 'nosuch' is not accepted"."""


def _flat_keys(data: Any, prefix: str = "") -> set[str]:
    """Every key of nested mapping `data`, dotted ('data.train_len'), also spelled with hyphens."""
    keys: set[str] = set()
    if isinstance(data, dict):
        for key, value in data.items():
            dotted = f"{prefix}{key}"
            keys |= {dotted, dotted.replace("_", "-")}
            keys |= _flat_keys(value, f"{dotted}.")
    return keys


def config_source(
    message: str, configs: Sequence[tuple[str, Any]], flags: set[str] = frozenset()
) -> str | None:
    """The --config file (the last of `configs`, (path, parsed YAML) pairs) holding the key a parser error names,
    or None when the error is about a command-line flag (`flags`: the keys the command line gives, hyphenated; a
    flag's value overrides the file's, so it is the flag that is wrong) or names no key."""
    match = _KEY_IN_ERROR.search(message)
    if match is None:
        return None
    key = (match.group(1) or match.group(2)).lstrip("-")
    if key.replace("_", "-") in flags:
        return None
    for path, data in reversed(configs):
        if key in _flat_keys(data) or key.replace("-", "_") in _flat_keys(data):
            return path
    return None


class ConfigFileError(ValueError):
    """A --config file that cannot be an options file: not UTF-8, empty, or a key given twice."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """Safe YAML that refuses a mapping giving one key twice (PyYAML keeps the last, silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if not isinstance(key, (str, int, float, bool)) and key is not None:
                raise ConfigFileError(
                    f"line {line}: the key {key!r} is not a name. Fix: write option names as plain keys"
                )
            if key in seen:
                raise ConfigFileError(
                    f"key {key} is given twice (lines {seen[key]} and {line}); YAML would keep the last "
                    "silently. Fix: keep one of them"
                )
            seen[key] = line
        return super().construct_mapping(node, deep)


def config_files(argv: Sequence[str]) -> list[str]:
    """The files a command line names with --config FILE or --config=FILE (a value that is not a file, such as an
    inline YAML string, is left to the parser)."""
    args = list(argv)
    found = []
    for i, token in enumerate(args):
        if token == "--config" and i + 1 < len(args):
            value = args[i + 1]
        elif token.startswith("--config="):
            value = token.partition("=")[2]
        else:
            continue
        if Path(value).is_file():
            found.append(value)
    return found


def read_config_file(path: str) -> Any:
    """A --config file's YAML, ConfigFileError naming it for bytes that are not UTF-8, a file with no options
    (empty, or comments only: refused rather than run on every default, since an options file that says nothing
    is a wrong or unsaved file far more often than a wish for the defaults, which leaving --config out gives), and
    a key given twice in one mapping. YAML syntax errors are left to the parser, which names the line."""
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigFileError(
            f"--config {path}: not UTF-8 text (byte {err.object[err.start]:#04x} at offset {err.start}). "
            "Fix: save the file as UTF-8"
        ) from None
    except OSError as err:
        raise ConfigFileError(f"--config {path}: cannot be read ({err.strerror or err})") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except ConfigFileError as err:
        raise ConfigFileError(f"--config {path}: {err}") from None
    except yaml.YAMLError:
        return None  # the parser reports where the syntax breaks
    if data is None:
        raise ConfigFileError(
            f"--config {path} is empty: it sets no option. Fix: write the options there (--print-config prints "
            "every key), or leave --config out to run with the defaults"
        )
    return data


def path_flag_hint(value: str, known: list[str]) -> str | None:
    """Which of the command's path flags a bare `value` was probably meant for: --run for a folder holding
    checkpoints/, --checkpoint for anything else (or both, when the command has both and the path is not there)."""
    path = Path(value)
    has_run, has_checkpoint = "--run" in known, "--checkpoint" in known
    if has_run and (path / "checkpoints").is_dir():
        return f"--run {value}"
    if has_run and has_checkpoint and not path.exists():
        return f"--run {value} (a run's folder) or --checkpoint {value} (one checkpoint)"
    if has_checkpoint:
        return f"--checkpoint {value}"
    if has_run:
        return f"--run {value}"
    return None


def summary(doc: str) -> str:
    """A module docstring's first paragraph on one line: a command's --help description (never cut mid-sentence)."""
    return " ".join(doc.strip().split("\n\n")[0].split())


def command_parser(prog: str, description: str, config_file: bool = False) -> ArgumentParser:
    """A parser for one posfreq command; `config_file` adds `--config FILE.yaml` (values the flags override)."""
    # No abbreviations (--conf would load a file unseen by `refuse_code_in_args`), no environment variables.
    parser = CommandParser(
        prog=prog,
        description=description,
        print_config="--print-config",
        allow_abbrev=False,
        default_env=False,
    )
    if config_file:
        parser.add_argument(
            "--config",
            action=ActionConfigFile,
            help="A YAML file of options (keys as in --print-config); flags after it override it.",
        )
    return parser


def hyphenate(parser: argparse.ArgumentParser) -> None:
    """Spell every long option with hyphens first (`--out-dir`), keeping the underscore form as an alias."""
    for action in parser._actions:
        dashed = [
            o.replace("_", "-") for o in action.option_strings if o.startswith("--") and "_" in o
        ]
        for option in dashed:
            parser._option_string_actions.setdefault(option, action)
        if dashed:
            action.option_strings = dashed + [o for o in action.option_strings if o not in dashed]
        # ...and every hyphenated option also under its underscore spelling (the YAML key), in every command
        for option in [o for o in action.option_strings if o.startswith("--") and "-" in o[2:]]:
            underscored = "--" + option[2:].replace("-", "_")
            if underscored not in parser._option_string_actions:
                parser._option_string_actions[underscored] = action
        for sub in getattr(action, "choices", None) or {}:
            if isinstance(action.choices, dict) and isinstance(
                action.choices[sub], argparse.ArgumentParser
            ):
                hyphenate(action.choices[sub])


def add_alias(parser: argparse.ArgumentParser, key: str, alias: str) -> None:
    """Let the flag `alias` (`--tests`) set the option stored under `key` (`tests_per_length`): one command's
    familiar name for a setting whose definition (type, default, help) lives once, in a settings dataclass."""
    (action,) = [a for a in parser._actions if a.dest == key]
    if alias in parser._option_string_actions:
        raise ValueError(f"{alias} already names an option of {parser.prog}")
    action.option_strings.append(alias)
    parser._option_string_actions[alias] = action


def settings_from(cls: type, args: Namespace, skip: Iterable[str] = (), **given: Any) -> Any:
    """An instance of the settings dataclass `cls` from its fields in the parsed `args` (those in `skip` left at
    their defaults, `given` set here); a value its checks refuse raises their ValueError."""
    values = {
        f.name: args[f.name] for f in dataclasses.fields(cls) if f.name not in {*skip, *given}
    }
    return cls(**values, **given)


CODE_KEYS = ("class_path", "init_args", "dict_kwargs", "__path__")
"""jsonargparse's keys that import and instantiate: never accepted from a config (a config is data)."""


class CodeInConfig(ValueError):
    """A config that names code to import or run (or a file to include): refused before anything is parsed."""


MAX_CONFIG_BYTES = 1 << 20
"""The largest config file (YAML or JSON) a command reads: the paper configs are a few kilobytes."""


def refuse_code(value: Any, where: str, path: str = "") -> None:
    """Raise CodeInConfig if `value` (parsed YAML/JSON) holds a key that makes jsonargparse import or instantiate
    something, or a `config` key (an include of another file); `where` names the file or flag, `path` the key."""
    if isinstance(value, dict):
        for key, item in value.items():
            dotted = f"{path}.{key}" if path else str(key)
            if key in CODE_KEYS:
                raise CodeInConfig(
                    f"{where}: key {dotted} asks to import and run code ({item!r:.60}); a config "
                    "holds data only (numbers, strings, lists, mappings). Fix: remove the key"
                )
            if key == "config":
                raise CodeInConfig(
                    f"{where}: key {dotted} would include another config file; includes are not "
                    "followed. Fix: merge that file's keys here, or pass it with its own --config"
                )
            refuse_code(item, where, dotted)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            refuse_code(item, where, f"{path}[{i}]")


def _yaml(text: str, where: str) -> Any:
    """Safe YAML (tags that construct Python objects refused, naming them; anchors and aliases refused before
    anything is built, as nine levels of ten aliases expand to 10^9 nodes); None for text YAML cannot read."""
    try:
        for token in yaml.scan(text):
            if isinstance(token, (yaml.AliasToken, yaml.AnchorToken)):
                line = token.start_mark.line + 1
                raise CodeInConfig(
                    f"{where}, line {line}: YAML {'alias *' if isinstance(token, yaml.AliasToken) else 'anchor &'}"
                    f"{token.value} refused: a config cannot expand references (a few lines of aliases can ask for "
                    "billions of nodes). Fix: write the values out where they are used"
                )
        return yaml.safe_load(text)
    except yaml.constructor.ConstructorError as err:
        if "python/" not in str(err.problem):
            return None  # an unknown tag ('!important'): plain text to the parser, which never constructs it
        raise CodeInConfig(
            f"{where}: YAML tag {err.problem.split()[-1] if err.problem else ''} constructs an object; "
            "a config holds data only. Fix: remove the tag"
        ) from None
    except yaml.YAMLError:
        return None  # not YAML: the parser reports what it expected


def refuse_code_in_args(argv: Sequence[str]) -> None:
    """Check every --config file and every flag value of a command line with `refuse_code`."""
    args = list(argv)
    for i, token in enumerate(args):
        name, eq, inline = token.partition("=") if token.startswith("--") else ("", "", token)
        if token.startswith("--") and not eq:
            continue
        flag = name or (args[i - 1] if i and args[i - 1].startswith("--") else "argument")
        refuse_code(_yaml(inline, flag), flag)
        # a YAML/JSON file any flag may load (--config, and a section such as --model FILE.yaml)
        if Path(inline).suffix.lower() in (".yaml", ".yml", ".json") and Path(inline).is_file():
            where = f"{flag} {inline}"
            if Path(inline).stat().st_size > MAX_CONFIG_BYTES:
                raise CodeInConfig(
                    f"{where}: {Path(inline).stat().st_size:,} bytes, more than a config holds (at most "
                    f"{MAX_CONFIG_BYTES:,}). Fix: pass the config file, not a data file"
                )
            try:
                text = Path(inline).read_text()
            except (OSError, UnicodeDecodeError):
                continue  # unreadable: the parser says so
            refuse_code(_yaml(text, where), where)


def parse(parser: ArgumentParser, argv: Sequence[str] | None = None) -> Namespace:
    """Parse `argv` (default sys.argv[1:]) with hyphenated option names; errors exit with a short usage.

    Configs are data: a key that would make jsonargparse import or instantiate code, a YAML object tag or an
    include, in a --config file or a flag value, is refused (exit 2) before the parser sees it.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        refuse_code_in_args(args)
        parser.config_files = [(path, read_config_file(path)) for path in config_files(args)]
        parser.flag_keys = {
            token[2:].partition("=")[0].replace("_", "-")
            for token in args
            if token.startswith("--")
        }
    except (CodeInConfig, ConfigFileError) as err:
        parser.exit(2, f"error: {err}\n")
    hyphenate(parser)
    forced_env = os.environ.pop(
        "JSONARGPARSE_DEFAULT_ENV", None
    )  # options come from argv and files, never env
    try:
        parser.default_env = False  # (jsonargparse read that variable when the parser was built)
        return parser.parse_args(args)
    finally:
        if forced_env is not None:
            os.environ["JSONARGPARSE_DEFAULT_ENV"] = forced_env


RUNS_HELP = "Probed run directories (posfreq probe --run) or their probe output directories."


def add_runs_argument(parser: ArgumentParser) -> None:
    """Several probed runs, named positionally or with --run (the name every command gives a run)."""
    parser.add_argument("runs", nargs="*", type=Path, help=RUNS_HELP)
    parser.add_argument(
        "--run", nargs="+", type=Path, default=[], help=f"{RUNS_HELP} (the same as positional ones)"
    )


def runs_of(args: Namespace, parser: ArgumentParser) -> list[Path]:
    """The runs given by `add_runs_argument`'s two spellings; a usage error when there are none."""
    runs = [*args.runs, *args.run]
    if not runs:
        parser.error("give at least one run (RUN ... or --run RUN ...)")
    return runs


def parse_shard(text: str) -> tuple[int, int]:
    """'i/n' (0-based i, as SLURM_ARRAY_TASK_ID / SLURM_ARRAY_TASK_COUNT) -> (i, n), for argparse."""
    try:
        index, count = (int(x) for x in text.strip().split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--shard expects i/n such as 3/64 (0-based i), got {text!r}"
        ) from None
    if not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"--shard {text}: need 0 <= i < n")
    return index, count


def code_version() -> str:
    """`git describe --always --dirty --tags` of this repository, or 'unknown' outside a git checkout."""
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--tags"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def describe_error(err: BaseException) -> str:
    """One line for an error that reached a command's top: what failed and where (a disk full named as such)."""
    from posfreq.train.atomic import disk_full

    full = disk_full(err)
    if full:
        return f"{full}. Fix: free space there, then run the command again"
    if isinstance(err, OSError) and err.filename and err.strerror:
        return f"{err.strerror}: {err.filename}"
    text = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
    return f"{type(err).__name__}: {text}" if text else type(err).__name__

"""Every command the README and docs/ quote parses with its command's own parser (flags included), every
repository file they name exists, and every docs page is reachable from the README."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from posfreq.scripts.cli import SUBCOMMANDS

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TEXT = {page.relative_to(ROOT).as_posix(): page.read_text() for page in PAGES}
README = TEXT["README.md"]
TOP = (
    "train",
    "analysis",
    "scripts",
    "configs",
    "slurm",
    "benchmarks",
    "notebooks",
    "tests",
    "docs",
    ".ci",
)


def quoted(text: str) -> list[str]:
    """Inline code spans and the lines of code blocks (indented or fenced), continuation lines joined."""
    spans = re.findall(r"`([^`\n]+)`", text)
    lines, current = [], ""
    for line in text.splitlines():
        if line.startswith("    ") or line.startswith("\t"):
            current += line.strip()
            if current.endswith("\\"):
                current = current[:-1] + " "
                continue
            lines.append(current)
        current = ""
    return spans + lines


def module_command(words: list[str]) -> tuple[str, list[str]] | None:
    """(subcommand, its arguments) for `posfreq SUB ...`, `python FILE.py ...` or `python -m MODULE ...`."""
    modules = {module: name for name, (module, _) in SUBCOMMANDS.items()}
    if words[0] in ("posfreq", ".venv/bin/posfreq") and len(words) > 1 and words[1] in SUBCOMMANDS:
        return words[1], words[2:]
    if words[0] in ("python", "python3", ".venv/bin/python") and len(words) > 1:
        if words[1] == "-m" and len(words) > 2:
            name = modules.get(words[2])
            return (name, words[3:]) if name else None
        if words[1].endswith(".py"):
            module = "posfreq." + words[1].removesuffix(".py").replace("/", ".")
            name = modules.get(module)
            return (name, words[2:]) if name else None
    return None


def commands() -> list[tuple[str, list[str], str]]:
    found = []
    for text in (span for page in TEXT.values() for span in quoted(page)):
        text = re.split(r"\s+#\s", text)[0]
        text = re.sub(r"\[[^\]]*\]", " ", text).replace("...", " ")  # optional parts of a synopsis
        head = text.split()[:2]
        if not head or not (
            {"posfreq", ".venv/bin/posfreq", "python", "python3", ".venv/bin/python"} & set(head)
        ):
            continue
        words = shlex.split(text, posix=True)
        while words and "=" in words[0] and not words[0].startswith("-"):  # VAR=value python ...
            words = words[1:]
        command = module_command(words) if words else None
        if (
            command and command[1] and "--help" not in command[1]
        ):  # not a bare `python FILE.py` reference
            found.append((*command, text))
    return found


COMMANDS = commands()


def test_the_readme_quotes_commands_of_most_subcommands():
    assert len({name for name, _, _ in COMMANDS}) >= 8, COMMANDS


@pytest.mark.parametrize("name,args,text", COMMANDS, ids=[t for _, _, t in COMMANDS])
def test_each_quoted_command_parses(name, args, text):
    from helpers.cli import command_parser_of

    parser = command_parser_of(name)
    parser.exit_on_error = False
    for sub in (
        getattr(parser, "_subcommands_action", None)
        and parser._subcommands_action.choices.values()
        or []
    ):
        sub.exit_on_error = False
    if (
        "--config" in args and not (ROOT / args[args.index("--config") + 1]).exists()
    ):  # a placeholder (configs/X.yaml)
        i = args.index("--config")
        args = args[:i] + args[i + 2 :]
    try:
        parser.parse_args(args)  # raises on an unknown flag or a wrong value
    except Exception as err:
        if not re.search(
            r"arguments are required|to be one of .* but it was not provided", str(err)
        ):
            raise
        # a fragment quoting some options of a command (the prose names the rest): what it quotes parsed


REPO_PATHS = sorted(
    {
        p.rstrip("/.,:")
        for page in TEXT.values()
        for span in re.findall(r"`([^`\n]+)`", page)
        for p in re.findall(r"(?<![\w./-])((?:%s)/[\w./-]+)" % "|".join(map(re.escape, TOP)), span)
        if not re.search(r"[*{<]|\.\.|/[A-Z]+(\.\w+)?$", p)
    }
)  # not a pattern or a placeholder


@pytest.mark.parametrize("path", REPO_PATHS)
def test_each_named_repository_file_exists(path):
    assert (ROOT / path).exists(), f"README or docs/ name {path}, which is not in the repository"


LINKS = sorted(
    {
        (name, target.split("#")[0])
        for name, text in TEXT.items()
        for target in re.findall(r"\]\(([^)\s]+)\)", text)
        if not re.match(r"[a-z]+://", target) and not target.startswith("#")
    }
)


@pytest.mark.parametrize("page,target", LINKS)
def test_each_relative_link_resolves(page, target):
    assert ((ROOT / page).parent / target).exists(), (
        f"{page} links to {target}, which does not exist"
    )


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(ROOT / target).resolve() for page, target in LINKS if page == "README.md"}
    assert set(PAGES[1:]) <= linked, sorted(str(p) for p in set(PAGES[1:]) - linked)


def test_the_readme_is_an_entry_point():
    assert len(README.splitlines()) <= 200

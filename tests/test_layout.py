"""The tree is the map: packages of at most 15 modules, each saying what it is for and what it may import,
imports that flow one way, and tests that mirror the packages (docs/layout.md)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOPS = ("train", "analysis", "scripts")
SCRIPT_PATHS = (  # the mission's documented script paths: two-line files that run a subcommand
    "analysis/position_freq.py",
    "analysis/probe.py",
    "analysis/effective_length.py",
    "analysis/compare.py",
    "analysis/ruler.py",
    "train/pretrain.py",
    "scripts/prepare_data.py",
    "scripts/export_hf.py",
    "scripts/demo.py",
)
TESTED_WITH_THEIR_CALLER = {
    # module: the test file that specifies it, through the command or package that uses it
    "train/command_line.py": "tests/scripts/test_cli.py",
    "train/fingerprint.py": "tests/analysis/test_keys.py",
    "train/run_lock.py": "tests/train/run/test_control.py",
    "train/model/hf_folder.py": "tests/test_bad_inputs.py",
    "analysis/corpus/listed_outputs.py": "tests/scripts/commands/test_analyze.py",
    "analysis/corpus/summary.py": "tests/scripts/commands/test_analyze.py",
    "analysis/plots/derived.py": "tests/analysis/niah/test_runner.py",
    "analysis/plots/effective_length.py": "tests/test_notebook.py",
    "analysis/plots/losses.py": "tests/scripts/commands/test_loss_by_distance.py",
    "analysis/plots/niah.py": "tests/scripts/commands/test_probe.py",
    "analysis/plots/positions.py": "tests/train/positions/test_schemes.py",
    "analysis/tables/derive.py": "tests/analysis/niah/test_runner.py",
    "analysis/tables/rederive.py": "tests/analysis/tables/test_pass_curve.py",
    "analysis/tables/paper_tables.py": "tests/scripts/commands/test_table.py",
    "analysis/ruler_task/evaluate.py": "tests/analysis/ruler_task/test_runner.py",
    "scripts/commands/checkpoint.py": "tests/train/checkpoint/test_consolidate.py",
    "scripts/commands/ruler.py": "tests/analysis/ruler_task/test_runner.py",
    "scripts/commands/compare.py": "tests/analysis/verdicts/test_claims.py",
    "scripts/commands/doctor.py": "tests/train/preflight/test_doctor.py",
    "scripts/commands/effective_length.py": "tests/analysis/tables/test_pass_curve.py",
    "scripts/commands/plan.py": "tests/train/preflight/test_plan.py",
    "scripts/commands/pretrain.py": "tests/train/run/test_trainer.py",
    "scripts/miniature/agreement.py": "tests/scripts/commands/test_demo.py",
    "scripts/miniature/packing_experiment.py": "tests/scripts/commands/test_demo.py",
    "scripts/miniature/report.py": "tests/scripts/commands/test_demo.py",
}


def modules() -> list[Path]:
    return [
        p.relative_to(ROOT)
        for top in TOPS
        for p in sorted((ROOT / top).rglob("*.py"))
        if p.name != "__init__.py" and "__pycache__" not in p.parts
    ]


def packages() -> list[Path]:
    return sorted(
        p.parent.relative_to(ROOT) for top in TOPS for p in (ROOT / top).rglob("__init__.py")
    )


def imported(path: Path) -> set[str]:
    """The posfreq modules `path` imports, `from package import module` named as the module it is."""
    found = set()
    for node in ast.walk(ast.parse((ROOT / path).read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                where = ROOT / Path(*node.module.split(".")[1:]) / alias.name
                is_module = where.with_suffix(".py").is_file() or where.is_dir()
                found.add(f"{node.module}.{alias.name}" if is_module else node.module)
    return {n for n in found if n.startswith("posfreq.")}


def names(test: Path, module: Path) -> bool:
    """Whether a test file imports `module` or names its path."""
    text = (ROOT / test).read_text()
    dotted = "posfreq." + module.with_suffix("").as_posix().replace("/", ".")
    parent, leaf = dotted.rsplit(".", 1)
    return (
        dotted in text
        or str(module) in text
        or re.search(rf"^\s*from {re.escape(parent)} import [^\n]*\b{leaf}\b", text, re.M)
        is not None
    )


@pytest.mark.parametrize("package", packages(), ids=str)
def test_each_package_is_small_and_says_what_it_is_for(package):
    direct = [p for p in (ROOT / package).glob("*.py") if p.name != "__init__.py"]
    assert len(direct) <= 15, f"{package} holds {len(direct)} modules: split it"
    doc = ast.get_docstring(ast.parse((ROOT / package / "__init__.py").read_text()))
    assert doc and len(doc) > 40, f"{package}/__init__.py needs a docstring saying what it is for"
    if package.parent != Path("."):  # the families: what they may import
        assert "May import" in doc, package


def test_imports_flow_one_way():
    """train imports neither analysis nor scripts; analysis imports no scripts (its script paths aside)."""
    for module in modules():
        found = imported(module)
        if module.parts[0] == "train" and str(module) not in SCRIPT_PATHS:
            assert not {
                n for n in found if n.startswith(("posfreq.analysis", "posfreq.scripts"))
            }, module
        if module.parts[0] == "analysis" and str(module) not in SCRIPT_PATHS:
            assert not {n for n in found if n.startswith("posfreq.scripts")}, module


ANALYSIS_ORDER = ("corpus", "niah", "tables", "plots", "verdicts")
"""analysis/'s packages in the order their imports run (docs/layout.md): each imports only those before it."""
STILL_UPHILL: set[tuple[str, str]] = set()
"""Arrows that still run back, each to remove: none now (corpus's CSV writer is analysis/table_files.py, below every
package, and its figures are analysis/plots/corpus.py, passed in by the command)."""


def test_analysis_packages_import_only_the_ones_before_them():
    """Any import of a later package (inside a function or for type checking too) is an arrow running back; the
    set must equal STILL_UPHILL, so a new one fails here and a removed one must leave the list."""
    uphill = set()
    for module in modules():
        if module.parts[0] != "analysis" or module.parts[1] not in ANALYSIS_ORDER:
            continue
        mine = ANALYSIS_ORDER.index(module.parts[1])
        for name in imported(module):
            parts = name.split(".")
            if len(parts) > 2 and parts[1] == "analysis" and parts[2] in ANALYSIS_ORDER:
                if ANALYSIS_ORDER.index(parts[2]) > mine:
                    uphill.add((module.parts[1], parts[2]))
    assert uphill == STILL_UPHILL


def test_script_paths_only_run_their_subcommand():
    for path in SCRIPT_PATHS:
        found = imported(Path(path))
        assert len(found) == 1 and next(iter(found)).startswith("posfreq.scripts.commands."), path


def test_every_module_has_its_tests_where_the_tree_says():
    """tests/<package>/ names each of the package's modules; the others are specified through their caller,
    listed above with the test that does it."""
    missing = []
    for module in modules():
        if str(module) in SCRIPT_PATHS:
            continue
        folder = ROOT / "tests" / module.parent
        mirrored = folder.is_dir() and any(
            names(t.relative_to(ROOT), module) for t in folder.glob("test_*.py")
        )
        caller = TESTED_WITH_THEIR_CALLER.get(str(module))
        if mirrored:
            assert caller is None, (
                f"{module} is tested in tests/{module.parent}: drop it from the list"
            )
        elif caller is None or not (ROOT / caller).is_file():
            missing.append(str(module))
    assert not missing, missing


SHARED = "train's shared modules"
EVERY_TRAIN = "every other train package"
ANYTHING = "anything in posfreq"


def may_import(package: Path) -> tuple[set[str], set[str]]:
    """(dotted names, phrases) of the package's "May import" paragraph (its __init__ docstring)."""
    doc = ast.get_docstring(ast.parse((ROOT / package / "__init__.py").read_text())) or ""
    paragraph = doc[doc.index("May import") :].split("\n\n")[0]
    names = set(re.findall(r"\b(?:train|analysis)(?:\.[a-z_]+)*\b", paragraph))
    phrases = {p for p in (SHARED, EVERY_TRAIN, ANYTHING) if p in paragraph}
    return names, phrases


def allowed(name: str, package: Path, names: set[str], phrases: set[str]) -> bool:
    """Whether module `name` (posfreq.X.Y) is one `package`'s May import line allows (or its own)."""
    dotted = name.removeprefix("posfreq.")
    own = ".".join(package.parts)
    parts = dotted.split(".")
    if ANYTHING in phrases or dotted == own or dotted.startswith(own + "."):
        return True
    if EVERY_TRAIN in phrases and parts[0] == "train":
        return True
    if SHARED in phrases and parts[0] == "train" and (ROOT / "train" / f"{parts[1]}.py").is_file():
        return True
    return any(dotted == n or dotted.startswith(n + ".") for n in names)


@pytest.mark.parametrize(
    "package",
    [p for p in packages() if p.parent != Path(".") and p.parts[0] in ("train", "analysis")],
    ids=str,
)
def test_each_packages_may_import_line_is_true(package):
    """Every posfreq import of a package's modules (those of its subpackages with their own line aside) is one its
    "May import" line allows, and every package that line names is imported: the line is the map, both ways."""
    names, phrases = may_import(package)
    subpackages = {p for p in packages() if p != package and package in p.parents}
    found = set()
    for module in modules():
        if package not in module.parents or any(s in module.parents for s in subpackages):
            continue
        found |= {n.removeprefix("posfreq.") for n in imported(module)}
    wrong = sorted(n for n in found if not allowed("posfreq." + n, package, names, phrases))
    assert not wrong, f"{package}/__init__.py's May import line leaves out {wrong}"
    unused = sorted(n for n in names if not any(f == n or f.startswith(n + ".") for f in found))
    assert not unused, (
        f"{package}/__init__.py's May import line names {unused}, which nothing there imports"
    )


def test_every_package_is_in_the_installed_package_list():
    """pyproject's hand-written package list names every package of the tree and nothing else: a package left out
    installs without its modules, and an installed posfreq fails at import (caught otherwise only by the slow
    wheel-install tests)."""
    try:
        import tomllib
    except (
        ModuleNotFoundError
    ):  # Python 3.10 (requires-python >= 3.10): pytest's own TOML reader there
        import tomli as tomllib

    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    tree = {"posfreq." + ".".join(p.parts) for p in packages()} | {"posfreq.configs"}
    assert listed == tree, (
        f"missing: {sorted(tree - listed)}; not in the tree: {sorted(listed - tree)}"
    )

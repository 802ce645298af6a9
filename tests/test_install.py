"""A non-editable `pip install .` gives a working `posfreq` command, and claims no generic top-level names.

The fresh virtualenv borrows the dependencies of the running environment through a .pth line (no
network, seconds instead of minutes); the project itself is built from a copy of the working tree and
installed as a wheel, and runs from a directory outside the repository.
"""

from __future__ import annotations

import json
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COPIED = ("pyproject.toml", "README.md", "train", "analysis", "scripts", "configs")


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh virtualenv holding a wheel install of posfreq; returns its bin directory."""
    tmp = tmp_path_factory.mktemp("install")
    source = tmp / "source"
    source.mkdir()
    for name in COPIED:
        if (ROOT / name).is_dir():
            shutil.copytree(
                ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
            )
        else:
            shutil.copy2(ROOT / name, source / name)
    venv = tmp / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120
    )
    purelib = Path(
        subprocess.run(
            [
                str(venv / "bin/python"),
                "-c",
                "import sysconfig; print(sysconfig.get_paths()['purelib'])",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    # Dependencies (torch, jsonargparse, ...) from this environment: a path line adds the directory but, unlike
    # site-packages itself, does not run its .pth files, so the editable posfreq of this checkout stays invisible.
    (purelib / "deps.pth").write_text(
        "\n".join([sysconfig.get_paths()["purelib"], *site.getsitepackages()]) + "\n"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(venv / "bin/python"),
            "install",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return venv / "bin"


@pytest.mark.slow  # a subprocess or a training run
def test_wheel_install_has_one_namespace_and_the_posfreq_command(installed, tmp_path):
    python = str(installed / "python")
    where = subprocess.run(
        [
            python,
            "-c",
            "import posfreq.train.model.transformer as m, posfreq.scripts.commands.demo, posfreq.configs;"
            "print(m.__file__)",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert where.returncode == 0, where.stderr[-2000:]
    assert (
        "site-packages/posfreq/train/model/transformer.py" in where.stdout
        and str(ROOT) not in where.stdout
    )
    for generic in ("train", "analysis", "scripts", "configs"):
        found = subprocess.run(
            [python, "-c", f"import {generic}"], capture_output=True, text=True, cwd=tmp_path
        )
        assert found.returncode != 0, f"the install claims the top-level name {generic!r}"
    usage = subprocess.run(
        [str(installed / "posfreq"), "--help"], capture_output=True, text=True, cwd=tmp_path
    )
    assert usage.returncode == 0 and "analyze" in usage.stdout and "pretrain" in usage.stdout, (
        usage.stderr
    )
    config = Path(
        subprocess.run(
            [python, "-c", "import posfreq.configs as c; print(list(c.__path__)[0])"],
            capture_output=True,
            text=True,
            cwd=tmp_path,
        ).stdout.strip()
    )
    assert (config / "pretrain_2k.yaml").is_file() and (config / "demo.yaml").is_file()
    task = subprocess.run(
        [
            python,
            "-c",
            "import posfreq.analysis.lm_eval_task.make_tests as m, pathlib;"
            "print(*sorted(p.name for p in pathlib.Path(m.__file__).parent.glob('*.yaml')))",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert task.returncode == 0 and task.stdout.split(), task.stderr[
        -2000:
    ]  # the lm-eval task ships its YAML


@pytest.mark.slow  # a subprocess or a training run
def test_installed_analyze_runs_end_to_end(installed, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    texts = ["a" * 10, "b" * 40, "c" * 100]
    (corpus / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    proc = subprocess.run(
        [
            str(installed / "posfreq"),
            "analyze",
            "--corpus",
            str(corpus),
            "--tokenizer",
            "bytes",
            "--train-len",
            "64",
            "--out",
            str(tmp_path / "out"),
            "--workers",
            "1",
            "--quiet",
            "--no-cache",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "out/summary.json").read_text())
    out = tmp_path / "out"
    assert sorted(summary["files"]) == sorted(
        str(p.relative_to(out))
        for p in out.rglob("*")
        if p.is_file()
        and p.name
        not in (
            ".posfreq-output.json",
            ".posfreq-files",
            ".posfreq-lock",
        )  # the records (train/journal.py)
    )
    assert summary["all"]["documents"] == len(texts) and summary["all"]["tokens"] == sum(
        len(t) + 1 for t in texts
    )

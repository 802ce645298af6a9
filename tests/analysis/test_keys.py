"""The probe's code fingerprint covers every module that can change an answer, found by import, never by a list
someone must remember to update."""

from __future__ import annotations

import fnmatch
import subprocess
import sys
from pathlib import Path

import pytest

from posfreq.analysis.keys import NOT_ANSWER_DECIDING, probe_code
from posfreq.train import fingerprint
from posfreq.train.fingerprint import REPO, code_sha256

# Modules that decide prompts, decoding or the model's outputs, named independently of the import walk.
ANSWER_DECIDING = (
    "analysis/niah/needles.py",
    "train/model/transformer.py",
    "train/model/attention.py",
    "train/positions/schemes.py",
    "train/positions/rotary.py",
    "train/data/tokenizer.py",
    "train/model/hf.py",
    "train/model/config.py",
)


def test_the_walk_finds_the_modules_that_decide_answers_and_leaves_out_plumbing():
    files = probe_code()
    assert set(ANSWER_DECIDING) <= set(files)
    assert "train/command_line.py" not in files and "train/outdir.py" not in files
    # the command line's text (help, flag wording) is not an answer: editing it must not re-key every result
    assert "scripts/commands/probe.py" not in files
    assert all((REPO / f).is_file() for f in files)


@pytest.mark.slow
def test_every_module_the_probe_loads_at_run_time_is_in_the_fingerprint_or_excluded_by_name():
    """Run the probe's CLI in a fresh interpreter up to reading the model (a missing folder): each posfreq module
    that ends up loaded, at the top or inside a function, is either covered or matches an exclusion."""
    code = (
        "import sys\n"
        "from posfreq.scripts.commands import probe\n"
        "try:\n    probe.main(['--model', 'hf:/nowhere', '--device', 'cpu'])\nexcept SystemExit:\n    pass\n"
        "assert 'posfreq.analysis.niah.runner' in sys.modules, 'the run never reached the runner'\n"
        "print('\\n'.join(m.__file__ for n, m in sys.modules.items() if n.startswith('posfreq.') "
        "and getattr(m, '__file__', None) and not m.__file__.endswith('__init__.py')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    ).stdout
    loaded = {Path(line).resolve().relative_to(REPO).as_posix() for line in out.split()}
    uncovered = {
        f
        for f in loaded - set(probe_code())
        if not any(fnmatch.fnmatch(f, p) for p in NOT_ANSWER_DECIDING)
    }
    assert not uncovered, uncovered


def test_every_exclusion_names_a_file_that_exists():
    for pattern in NOT_ANSWER_DECIDING:
        assert list(REPO.glob(pattern)), (
            f"{pattern} matches no file: remove it from NOT_ANSWER_DECIDING"
        )


def test_an_edit_of_a_covered_module_changes_the_key(tmp_path, monkeypatch):
    (tmp_path / "scripts" / "commands").mkdir(parents=True)
    (tmp_path / "train" / "model").mkdir(parents=True)
    (tmp_path / "scripts" / "commands" / "probe.py").write_text(
        "from posfreq.train.model.transformer import x\n"
    )
    (tmp_path / "train" / "model" / "transformer.py").write_text("x = 1\n")
    (tmp_path / "train" / "cli.py").write_text("y = 1\n")
    monkeypatch.setattr(fingerprint, "REPO", tmp_path)
    fingerprint.import_closure.cache_clear()
    fingerprint.code_sha256.cache_clear()
    try:
        assert probe_code() == ("train/model/transformer.py",)  # the command walked, not hashed
        before = code_sha256(probe_code())
        (tmp_path / "scripts" / "commands" / "probe.py").write_text(
            '"""New help text."""\nfrom posfreq.train.model.transformer import x\n'
        )
        fingerprint.code_sha256.cache_clear()
        assert code_sha256(probe_code()) == before
        (tmp_path / "train" / "model" / "transformer.py").write_text("x = 2\n")
        fingerprint.code_sha256.cache_clear()  # cached per process: the code does not change under a run
        assert code_sha256(probe_code()) != before
    finally:
        fingerprint.import_closure.cache_clear()
        fingerprint.code_sha256.cache_clear()

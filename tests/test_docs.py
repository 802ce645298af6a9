"""Every ```python block of the README and docs/ runs as written.

Each block runs on its own (a fresh namespace, a fresh working directory) with the folders docs/api.md
declares at its top bound to tiny inputs built here: `checkpoint_dir` (the last of two trainer checkpoints
of `run_dir`, random 1-layer models with the bytes tokenizer), `hf_dir` (a random Llama that transformers
itself saved, with the bytes tokenizer's files) and `probe_dir` (a copy of the committed demo probe
tables). A block is compiled under its page's path with its own line numbers, so a traceback points at the
line of the page.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers.hf import save_tiny_hf

from posfreq.train.checkpoint.layout import milestone_name

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```[ \t]*(\S*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
PYTHON = ("python", "py", "python3")
PRELUDE_NAMES = ("checkpoint_dir", "run_dir", "hf_dir", "probe_dir")
PROBE_FIXTURE = ROOT / "tests" / "fixtures" / "demo_probe" / "L512-s0" / "probe"
MILESTONES = (4096, 8192)
"""Tokens of run_dir's two checkpoints; checkpoint_dir is the last."""


def python_blocks(page: Path) -> list[tuple[int, str]]:
    """(first code line, code) of each fenced block whose info string names Python."""
    text = page.read_text()
    return [
        (text.count("\n", 0, match.start(2)) + 1, match.group(2))
        for match in FENCE.finditer(text)
        if match.group(1).lower() in PYTHON
    ]


def imported_modules(code: str) -> set[str]:
    """The top-level package of every `import X` and `from X import` in a block."""
    return set(re.findall(r"^\s*(?:from|import)\s+([A-Za-z_]\w*)", code, re.M))


def block_params() -> list:
    params = []
    for page in PAGES:
        name = page.relative_to(ROOT).as_posix()
        for index, (line, code) in enumerate(python_blocks(page)):
            slow = (
                [pytest.mark.slow] if "import lm_eval" in code else []
            )  # lm-eval's import alone: ~12 s
            params.append(
                pytest.param(name, line, code, id=f"{name}-block{index}-line{line}", marks=slow)
            )
    return params


BLOCKS = block_params()


def write_hf_llama(directory: Path) -> None:
    """A random 1-layer LlamaForCausalLM saved by transformers, with the bytes tokenizer's files."""
    save_tiny_hf(directory, max_position_embeddings=2048)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, one_thread) -> Path:
    """The folders every block may use, built once: copied for each block."""
    from helpers.probe import tiny_model, write_checkpoint

    root = tmp_path_factory.mktemp("doc-inputs")
    rng = np.random.default_rng(0)
    for seed, tokens in enumerate(MILESTONES):  # tiny_model: L = 512, 258 ids (bytes)
        hist = np.bincount(rng.integers(1, 513, size=tokens // 256), minlength=513)
        write_checkpoint(root / "run", tokens, tiny_model(seed), hist, spec="bytes")
    if importlib.util.find_spec("transformers") is not None:
        write_hf_llama(root / "hf")
    shutil.copytree(PROBE_FIXTURE, root / "probe")
    return root


@pytest.fixture
def prelude(inputs: Path, tmp_path: Path, monkeypatch) -> dict:
    """The names docs/api.md declares, bound to a fresh copy of the inputs; the working directory is empty."""
    copy = tmp_path / "inputs"
    shutil.copytree(inputs, copy)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    names = {
        "checkpoint_dir": copy / "run" / "checkpoints" / milestone_name(MILESTONES[-1]),
        "run_dir": copy / "run",
        "hf_dir": copy / "hf",
        "probe_dir": copy / "probe",
    }
    assert tuple(names) == PRELUDE_NAMES
    return names


@pytest.mark.parametrize("page,line,code", BLOCKS)
def test_python_block_runs(page: str, line: int, code: str, prelude: dict) -> None:
    missing = sorted(m for m in imported_modules(code) if importlib.util.find_spec(m) is None)
    if missing:
        pytest.skip(f"{page} line {line} imports {missing}, which are not installed")
    namespace = {"__name__": "__docs__", **prelude}
    # Padded to its own line numbers: a traceback names the page and the line in it.
    exec(compile("\n" * (line - 1) + code, str(ROOT / page), "exec"), namespace)


def test_the_api_page_declares_the_names_the_blocks_get() -> None:
    head = (ROOT / "docs" / "api.md").read_text().split("\n## ")[0]
    assert [name for name in PRELUDE_NAMES if f"`{name}`" not in head] == []


def test_every_python_fence_is_collected() -> None:
    """No block escapes the test through its info string (```Python, ``` py) or an unclosed fence."""
    for page in PAGES:
        text = page.read_text()
        opened = re.findall(r"^```[ \t]*(\S+)", text, re.M)
        pythonish = [lang for lang in opened if lang.lower().startswith("py")]
        assert len(python_blocks(page)) == len(pythonish), page
        assert len(re.findall(r"^```", text, re.M)) % 2 == 0, f"{page}: a fence is not closed"
    assert "docs/api.md" in {param.values[0] for param in BLOCKS}

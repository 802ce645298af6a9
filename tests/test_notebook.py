"""The effective-length notebook runs on the committed fixture runs and draws every figure as an image.

Executed with nbclient (the `dev` / `notebook` extras); each figure must be shown as a PNG output
whose bytes are the file the plotting function saved, so a figure printed as text, or not shown,
fails.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers.probe import make_fake_run, probe_fake_run

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "effective_length_vs_position_frequency.ipynb"
FIXTURES = Path("tests") / "fixtures" / "demo_probe"
FIGURES = (
    "pass_rate_vs_length",
    "fig2a_effective_length_vs_tokens",
    "fig2b_frequency_vs_effective_length",
    "fig3_position_frequency",
)


def execute(repo: Path, monkeypatch, **env: str) -> nbformat.NotebookNode:
    """Run the notebook with its kernel in `repo`/notebooks (as Jupyter opened there would) and the given environment."""
    for name in ("POSFREQ_RUNS", "POSFREQ_FIGURES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(
        notebook,
        timeout=180,
        kernel_name="python3",
        resources={"metadata": {"path": str(repo / "notebooks")}},
    ).execute()
    return notebook


def outputs(notebook: nbformat.NotebookNode) -> tuple[str, list[bytes]]:
    """All text the code cells printed, and every PNG they displayed (decoded)."""
    cells = [o for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    text = "".join(o.get("text", "") for o in cells)
    images = [
        base64.b64decode(o["data"]["image/png"]) for o in cells if "image/png" in o.get("data", {})
    ]
    return text, images


def assert_every_figure_shown(figures: Path, images: list[bytes], extra: tuple = ()) -> None:
    """Each expected figure (FIGURES and `extra`) was saved by matplotlib and displayed as that very PNG, and no
    other was displayed."""
    for stem in (*FIGURES, *extra):
        png = figures / f"{stem}.png"
        assert png.is_file(), stem
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", stem
        assert png.read_bytes() in images, f"{stem} was saved but not displayed"
    assert len(images) == len(FIGURES) + len(extra)


def add_losses(run: Path) -> None:
    """Give a fake run what a validated training run has: metrics.jsonl, and a loss by distance in every
    milestone (a loss that falls with distance)."""
    from posfreq.train.checkpoint.layout import (
        LOSS_BY_DISTANCE_FILE,
        checkpoint_root,
        list_checkpoints,
    )
    from posfreq.train.run.loss_by_distance import LossByDistance

    rows = [{"step": 1, "tokens": 1024, "loss": 5.0}, {"step": 2, "tokens": 2048, "loss": 4.5}]
    rows.append({"step": 2, "tokens": 2048, "val_loss": 4.7})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for milestone, _ in list_checkpoints(run):
        table = LossByDistance.empty(511)
        table.tokens[:] = 50
        table.loss_sum[:] = 50 * (5.0 - 0.1 * np.log1p(table.edges[:-1]))
        (checkpoint_root(run) / milestone.name / LOSS_BY_DISTANCE_FILE).write_text(
            json.dumps(table.to_dict())
        )


def write_fixture_runs(root: Path, monkeypatch) -> list[Path]:
    """Two fake runs (L = 256 and 512) probed by the real pipeline with window models; returns their dirs."""
    runs = []
    for train_len, ks in (
        (256, {20_480: 40, 40_960: 70, 81_920: 1000}),
        (512, {20_480: 60, 40_960: 130, 81_920: 1000}),
    ):
        run = root / f"L{train_len}"
        names = make_fake_run(run, train_len, ks, seed=train_len)
        probe_fake_run(
            run,
            run / "probe",
            names,
            [160, *range(256, train_len + 1, 128)],
            [],
            monkeypatch,
            tests=4,
            figures=train_len == 256,
        )
        runs.append(run)
    return runs


@pytest.mark.slow  # a child process, a notebook kernel or a deliberate timeout
def test_fresh_probe_outputs_and_relative_runs_are_drawn(tmp_path: Path, monkeypatch) -> None:
    """A run the probe just wrote (given by its run directory) and a committed run given relative to the
    repository root (the kernel runs in notebooks/) are both read, and every figure is shown."""
    fresh = write_fixture_runs(tmp_path / "runs", monkeypatch)
    assert (fresh[0] / "probe" / "figures" / "fig2a_effective_length_vs_tokens.png").is_file()
    add_losses(fresh[1])
    runs = os.pathsep.join([str(FIXTURES / "L256-s0" / "probe"), str(fresh[1])])
    notebook = execute(
        REPO, monkeypatch, POSFREQ_RUNS=runs, POSFREQ_FIGURES=str(tmp_path / "figures")
    )
    text, images = outputs(notebook)
    assert "L256-s0 (L = 256): 8 checkpoints" in text and "L512 (L = 512)" in text
    assert "skipping" not in text and "no loss by distance" not in text
    losses = ("loss_curves", "loss_by_distance_L512", "loss_vs_frequency")
    assert_every_figure_shown(tmp_path / "figures", images, losses)


@pytest.mark.slow  # a child process, a notebook kernel or a deliberate timeout
def test_fixture_runs_are_drawn_when_there_is_no_demo(tmp_path: Path, monkeypatch) -> None:
    """In a checkout without runs/demo the notebook says it draws the committed fixtures, and draws them."""
    repo = tmp_path / "repo"
    (repo / "notebooks").mkdir(parents=True)
    (repo / "pyproject.toml").write_text("")
    shutil.copytree(REPO / FIXTURES, repo / FIXTURES)
    notebook = execute(repo, monkeypatch)
    text, images = outputs(notebook)
    assert "drawing the committed fixture runs" in text and "no loss by distance" in text
    assert "L256-s0 (L = 256): 8 checkpoints" in text and "L512-s0 (L = 512): 8 checkpoints" in text
    assert_every_figure_shown(repo / "runs" / "notebook_figures", images)

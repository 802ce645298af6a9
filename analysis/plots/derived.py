"""The figures of a derivation (analysis/tables/derive.py): one model's NIAH heatmap and failures by thirds, and a
run's Fig. 2a/2b, each as .png and .pdf under the names analysis/niah/store.py lists."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from posfreq.analysis.niah import store
from posfreq.analysis.plots import effective_length as plots_effective_length
from posfreq.analysis.plots import niah as plots_niah
from posfreq.analysis.tables.derive import DerivedModel, DerivedRun
from posfreq.analysis.tables.records import depth_grid
from posfreq.analysis.tables.run_table import RunResults, load_run


def draw_model(derived: DerivedModel) -> list[Path]:
    """One model's figures into its derivation's figures/."""
    figures = derived.dest / store.FIGURES_DIR
    heatmap, thirds = store.MODEL_FIGURES
    grid = depth_grid(derived.records, analysis=derived.analysis)  # only where figures are drawn
    paths = plots_niah.plot_niah_heatmap(*grid, figures / heatmap, title=derived.title)
    paths += plots_niah.plot_failure_by_thirds(
        derived.thirds, figures / thirds, title=derived.title
    )
    return paths


def draw_run(derived: DerivedRun) -> list[Path]:
    """Every derived checkpoint's figures, then the run's Fig. 2a/2b into its figures/."""
    paths = [p for model in derived.models for p in draw_model(model)]
    return paths + draw_run_figures([load_run(derived.dest)], derived.dest / store.FIGURES_DIR)


def draw_run_figures(runs: Sequence[RunResults], out: Path) -> list[Path]:
    """Fig. 2a (effective length vs tokens seen) and Fig. 2b (f(effective length) vs effective length)."""
    curves = {
        r.label: (
            [row["tokens_trained"] for row in r.rows],
            [row["effective_length"] for row in r.rows],
            [row["effective_length_status"] for row in r.rows],
            [row["f_effective_length"] for row in r.rows],
        )
        for r in runs
    }
    intervals = {
        r.label: (
            [row.get("effective_length_lo") for row in r.rows],
            [row.get("effective_length_hi") for row in r.rows],
        )
        for r in runs
    }
    fig2a, fig2b = store.RUN_FIGURES
    paths = plots_effective_length.plot_fig2a_effective_length_vs_tokens(
        {k: (t, e, s) for k, (t, e, s, _) in curves.items()},
        out / fig2a,
        intervals,
    )
    paths += plots_effective_length.plot_fig2b_frequency_vs_effective_length(
        {k: (e, f, s) for k, (_, e, s, f) in curves.items()},
        out / fig2b,
        intervals,
    )
    return paths

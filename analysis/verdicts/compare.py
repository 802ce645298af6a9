"""Effective length across training lengths and seeds: the tables, figures and computed verdicts that
`posfreq compare` writes."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from posfreq.analysis.niah import store
from posfreq.analysis.table_files import read_csv, write_csv
from posfreq.analysis.tables.columns import COLUMNS
from posfreq.analysis.tables.pass_curve import frequency_at
from posfreq.analysis.tables.run_table import find_run_results, probed_lengths
from posfreq.analysis.verdicts.claims import (
    baseline_variant,
    emergence,
    longer_reaches_further,
    shortfall,
    variant_comparisons,
)
from posfreq.analysis.verdicts.coincidence import curves_coincide
from posfreq.analysis.verdicts.loss_frequency import LossCurve, loss_curves_coincide
from posfreq.analysis.verdicts.prediction import prediction_verdict
from posfreq.analysis.verdicts.probed_runs import (
    CompareError,
    load_checkpoints,
    run_directory,
    run_identity,
    run_loss_by_distance,
    run_metrics,
)
from posfreq.analysis.verdicts.recall_frequency import recall_curves_coincide
from posfreq.analysis.verdicts.rules import not_testable
from posfreq.train.atomic import write_json_atomic
from posfreq.train.checkpoint.layout import LENGTHS_FILE, checkpoint_root, load_trained_lengths
from posfreq.train.outdir import claim_output_dir, entry_names

DISTANCE_TABLE = store.DISTANCE_BY_CHECKPOINT_FILE
"""A probed run's needle recall by distance bin at every milestone (written by analysis/tables/derive.py)."""


def compare(paths: Sequence[Path], out: Path, figures: bool = True) -> dict:
    """Load the runs, write checkpoints.csv, conclusion.json and the figures; return the conclusion."""
    rows = load_checkpoints(paths)
    # each run's probe folder and identity, resolved once for everything below
    runs = {path: find_run_results(path) for path in paths}
    identities = {path: run_identity(directory) for path, directory in runs.items()}
    claim_output_dir(
        out,
        "compare",
        written_before=lambda path: (
            {"checkpoints.csv", "conclusion.json"}
            <= entry_names(path)
            <= {"checkpoints.csv", "conclusion.json", "figures"}
        ),
    )
    pass_cols = sorted(
        {k for r in rows for k in r if k.startswith("pass_rate_")},
        key=lambda k: int(k.split("_")[-1]),
    )
    write_csv(out / "checkpoints.csv", rows, list(COLUMNS) + pass_cols)
    baseline = baseline_variant(rows)
    same_data = [
        r for r in rows if r["variant"] == baseline
    ]  # the claims across L compare like with like
    conclusion = {
        "runs": [str(p) for p in paths],
        "shortfall": shortfall(rows),
        "longer_reaches_further": longer_reaches_further(same_data),
        "curves_coincide": curves_coincide(same_data),
        "emergence": emergence(rows),
        "baseline_variant": baseline,
        "variants": variant_comparisons(rows, baseline),
        "prediction": predict_from_f(runs, identities, rows),
    }
    losses = {identities[path]: run_loss_by_distance(d) for path, d in runs.items()}
    last = [
        LossCurve.of(L, s, *tables[-1])
        for (L, s, variant), tables in losses.items()
        if variant == baseline and tables
    ]
    conclusion["loss_curves_coincide"] = loss_curves_coincide(last)
    conclusion["recall_curves_coincide"] = recall_curves_coincide(
        {
            (identities[path][0], identities[path][1]): read_csv(directory / DISTANCE_TABLE)
            for path, directory in runs.items()
            if identities[path][2] == baseline and (directory / DISTANCE_TABLE).is_file()
        }
    )
    write_json_atomic(out / "conclusion.json", conclusion, indent=1)
    if figures:
        from posfreq.analysis.plots import effective_length as plots_effective_length

        plots_effective_length.plot_fig2a_seed_bands(
            rows, out / "figures" / "fig2a_effective_length_vs_tokens"
        )
        plots_effective_length.plot_fig2b_seeds(
            rows, out / "figures" / "fig2b_frequency_vs_effective_length"
        )
        plots_effective_length.plot_pass_rate_curves(rows, out / "figures" / "pass_rate_vs_length")
        draw_loss_figures(runs, identities, losses, baseline, out / "figures")
    return conclusion


def draw_loss_figures(
    runs: Mapping[Path, Path],
    identities: Mapping[Path, tuple],
    losses: dict[tuple, list],
    baseline: str,
    figures: Path,
) -> None:
    """Every run's training and validation loss (`runs`: each path's probe folder, `identities` its run identity);
    where milestones stored their loss by distance (`losses`, by identity), each run's by milestone and every run's
    last against f(i). Runs without those files add nothing."""
    from posfreq.analysis.plots.losses import (
        plot_loss_by_distance,
        plot_loss_curves,
        plot_loss_vs_frequency,
    )

    curves, against_f = {}, {}
    for path, directory in runs.items():
        train_len, seed, variant = identities[path]
        label = f"L={train_len} s{seed}" + ("" if variant == baseline else f" {variant}")
        curves[label] = run_metrics(directory)
        tables = losses.get((train_len, seed, variant))
        if tables:
            by_milestone = {f"{tokens:,} tokens": (t.edges, t.mean()) for tokens, t, _ in tables}
            name = f"loss_by_distance_L{train_len}-s{seed}" + (
                "" if variant == baseline else f"-{variant}"
            )
            plot_loss_by_distance(by_milestone, figures / name, title=label)
            last = LossCurve.of(train_len, seed, *tables[-1])
            against_f[label] = (last.f, last.loss)
    if any(curves.values()):
        plot_loss_curves(curves, figures / "loss_curves")
    if against_f:
        plot_loss_vs_frequency(against_f, figures / "loss_vs_frequency")


def predict_from_f(
    found: Mapping[Path, Path], identities: Mapping[Path, tuple], rows: Sequence[dict]
) -> dict:
    """The prediction verdict (analysis/verdicts/prediction.py) on these runs (`found`: each path's probe folder):
    each checkpoint's f, from the trained-length histogram it stored, at the distance a pass at each probed length
    needs (`needed_distances`); not testable when a checkpoint's histogram cannot be read."""
    runs = {identities[path]: run_directory(directory) for path, directory in found.items()}
    probes = {identities[path]: directory for path, directory in found.items()}
    needed: dict[tuple, dict[int, int]] = {}
    f_of: dict[tuple, dict[int, float]] = {}
    for r in rows:
        identity = (r["train_len"], r["seed"], r["variant"])
        run = runs.get(identity)
        checkpoint = checkpoint_root(run) / str(r["checkpoint"]) if run is not None else None
        if checkpoint is None or not (checkpoint / LENGTHS_FILE).is_file():
            return not_testable(f"no trained-length histogram for {r['checkpoint']}")
        if identity not in needed:  # a run's tests are the same at every checkpoint
            needed[identity] = needed_distances(
                records_dir(probes[identity]) / str(r["checkpoint"]),
                probed_lengths(r),
                int(r["min_retrieved"]),
            )
        hist = load_trained_lengths(checkpoint)
        f_of[_row_key(r)] = {
            n: float(frequency_at(hist, r["train_len"], d)) for n, d in needed[identity].items()
        }
    return prediction_verdict(rows, lambda r: f_of[_row_key(r)])


def records_dir(probe_dir: Path) -> Path:
    """Where a run's per-test records are: its probe folder, or the folder a re-derivation elsewhere was derived
    from (its probe.json says which; a re-derivation writes tables only)."""
    source = store.read_json(probe_dir / store.META_FILE).get(store.DERIVED_FROM)
    return Path(source) if isinstance(source, str) and source else probe_dir


def needed_distances(results: Path, lengths: Sequence[int], needles: int) -> dict[int, int]:
    """Per probed length, the distance a pass there needs the model to recall: the median over the length's tests
    of the `needles`-th nearest needle's distance from the question (a pass needs that many needles, and the
    nearest are the easiest). f(n) itself is 0 at n = L (Eq. 2), where a test's needles are all nearer than L."""
    out = {}
    for n in lengths:
        distances = [sorted(r["distances"])[needles - 1] for r in store.read_records(results, [n])]
        if not distances:
            raise CompareError(
                f"{results}: no test records at length {n}, so the distance a pass there needs is unknown. Fix: "
                "probe the run again (posfreq probe --run RUN)"
            )
        out[n] = int(np.median(distances))
    return out


def _row_key(row: dict) -> tuple:
    return (row["train_len"], row["seed"], row["variant"], row["tokens_trained"])

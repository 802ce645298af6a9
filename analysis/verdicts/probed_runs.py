"""The probed runs that `posfreq compare` reads: each run's identity (training length, training seed, data
variant, from its checkpoints' config.json) and every probed checkpoint's row of effective_length.csv with it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from posfreq.analysis.niah import store
from posfreq.analysis.table_files import read_csv
from posfreq.analysis.tables.columns import COLUMNS, CRITERION_COLUMNS
from posfreq.analysis.tables.run_table import find_run_results
from posfreq.train.checkpoint.layout import (
    CONFIG_FILE,
    LENGTHS_FILE,
    LOSS_BY_DISTANCE_FILE,
    checkpoint_root,
    load_trained_lengths,
)
from posfreq.train.run.loss_by_distance import LossByDistance


def data_variant(config: Mapping) -> str:
    """How a run's rows were made, as a label that tells every setting apart: the packing strategy, `/row` for
    whole-row attention, and `+upsample{...}` with the length weights, e.g. `concat+upsample{256-: 2.0}`."""
    data = config.get("data", {})
    packing = data.get("packing") or ("concat" if data.get("mix_documents", True) else "padded")
    row = "/row" if data.get("attention") == "row" else ""
    weights = data.get("length_upsample") or {}
    upsample = (
        "+upsample{" + ", ".join(f"{k}: {float(weights[k]):g}" for k in sorted(weights)) + "}"
        if weights
        else ""
    )
    return packing + row + upsample


class CompareError(ValueError):
    """A run whose identity (training seed, data) cannot be read; the message names what was tried and the fix."""


def run_config(probe_dir: Path, checkpoint: str) -> dict:
    """The config.json of `checkpoint` of the run that `probe_dir` probed: at the run directory holding `probe_dir`
    (the default layout RUN/probe-*/, also after the run was moved), else at the run path probe.json records, a
    hint only (a re-derivation's folder sits elsewhere; a new run at the old path must not supply the seed)."""
    tried = [checkpoint_root(run) / checkpoint / CONFIG_FILE for run in _candidate_runs(probe_dir)]
    for config_file in tried:
        if config_file.is_file():
            config = json.loads(config_file.read_text())
            if isinstance(config, dict) and config.get("seed") is not None:
                return config
    raise CompareError(
        f"{probe_dir}: the run's training seed cannot be read (tried {', '.join(map(str, tried))}); "
        "without it seeds could not be paired. Fix: pass the probe directory inside its run "
        "(RUN/probe-*), or re-probe the run where it now lives (posfreq probe --run RUN)"
    )


def _candidate_runs(probe_dir: Path) -> list[Path]:
    """Where the run `probe_dir` probed may be: the folder holding it, then the path probe.json records (a hint)."""
    meta = store.read_json(probe_dir / store.META_FILE)
    run = meta.get("run")
    return [probe_dir.resolve().parent, *([Path(run)] if isinstance(run, str) and run else [])]


def run_directory(probe_dir: Path) -> Path | None:
    """The run folder `probe_dir` probed: the first candidate (`_candidate_runs`) holding its first checkpoint."""
    rows = read_csv(probe_dir / store.EFFECTIVE_LENGTH_FILE)
    for run in _candidate_runs(probe_dir):
        if rows and (checkpoint_root(run) / str(rows[0]["checkpoint"])).is_dir():
            return run
    return None


def run_loss_by_distance(probe_dir: Path) -> list[tuple[int, LossByDistance, np.ndarray]]:
    """(tokens trained, loss by distance, trained-length histogram) of each probed milestone of the run that stored
    its validation's loss by distance (train/run/loss_by_distance.py), oldest first; [] for a run without."""
    run = run_directory(probe_dir)
    found = []
    for row in read_csv(probe_dir / store.EFFECTIVE_LENGTH_FILE) if run is not None else []:
        checkpoint = checkpoint_root(run) / str(row["checkpoint"])
        table = checkpoint / LOSS_BY_DISTANCE_FILE
        if table.is_file() and (checkpoint / LENGTHS_FILE).is_file():
            loss = LossByDistance.from_dict(json.loads(table.read_text()))
            found.append((int(row["tokens_trained"]), loss, load_trained_lengths(checkpoint)))
    return sorted(found, key=lambda item: item[0])


def run_metrics(probe_dir: Path) -> list[dict]:
    """The metrics.jsonl rows of the run `probe_dir` probed (found as `run_config` finds its config), [] if none:
    each readable line a row (a torn last line is left out)."""
    run = run_directory(probe_dir)
    path = run / "metrics.jsonl" if run is not None else None
    if path is None or not path.is_file():
        return []
    metrics = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            metrics.append(json.loads(line))
        except ValueError:
            continue
    return [m for m in metrics if isinstance(m, dict)]


def run_identity(probe_dir: Path) -> tuple[int, int, str]:
    """(training length, training seed, data variant) of a probed run, from its first checkpoint's config.json."""
    rows = read_csv(probe_dir / store.EFFECTIVE_LENGTH_FILE)
    if not rows:
        raise CompareError(
            f"{probe_dir / 'effective_length.csv'}: no checkpoint rows. Fix: probe the run first"
        )
    config = run_config(probe_dir, str(rows[0]["checkpoint"]))
    return int(rows[0]["train_len"]), int(config["seed"]), data_variant(config)


def load_checkpoints(paths: Sequence[Path]) -> list[dict]:
    """Every probed checkpoint of the given runs, with its run's training length, seed and data variant;
    CompareError when two paths are probes of one run (their checkpoints would merge, and which row a verdict
    used would depend on the order given) or when the runs were scored under different pass criteria (their
    verdicts would mix them)."""
    rows, criteria, probes = [], {}, {}
    for path in paths:
        directory = find_run_results(path)
        identity = run_identity(directory)
        table = read_csv(directory / store.EFFECTIVE_LENGTH_FILE)
        positions = table[0].get("positions")  # run_identity refused an empty table
        if identity in probes:
            first, first_positions = probes[identity]
            raise CompareError(
                f"{first} and {directory} are probes of one run (L = {identity[0]}, seed {identity[1]}, "
                f"{identity[2]}; positions {first_positions} and {positions}): compare would merge their "
                "checkpoints, and its verdicts would depend on the order they are given in. Fix: pass one "
                "probe per run (compare the probes of other positions in a call of their own)"
            )
        probes[identity] = directory, positions
        train_len, seed, variant = identity
        for row in table:
            criterion = tuple(row.get(c) for c in CRITERION_COLUMNS)
            criteria.setdefault(criterion, []).append(str(directory))
            rows.append(
                {
                    **{c: row.get(c) for c in COLUMNS},
                    "train_len": train_len,
                    "seed": seed,
                    "variant": variant,
                    **{k: v for k, v in row.items() if k.startswith("pass_rate_")},
                }
            )
    if len(criteria) > 1:
        found = "; ".join(
            f"{dict(zip(CRITERION_COLUMNS, c))} in {', '.join(sorted(set(d)))}"
            for c, d in criteria.items()
        )
        raise CompareError(
            f"the runs were scored under different pass criteria ({found}): their verdicts would mix "
            "them. Fix: re-derive them under one (posfreq effective-length RESULTS --threshold T "
            "--min-retrieved K --out DIR) and compare those"
        )
    return rows

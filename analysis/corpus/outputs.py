"""`posfreq analyze`'s output files: histogram.npz, lengths.csv, position_frequency_L{L}.csv and
position_frequency.npz (the corpus f, each packing strategy's trained f, each source's f), the figures and
summary.json, which lists them (analysis/corpus/listed_outputs.py); a shard writes its partial histogram only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np

from posfreq.analysis.corpus.frequency import position_frequency, scale_to_budget
from posfreq.analysis.corpus.histogram import HISTOGRAM_FILE, LengthHistogram, save_histogram
from posfreq.analysis.corpus.listed_outputs import replace_outputs, write_summary
from posfreq.analysis.corpus.packing_prediction import PackingSettings, Predictions, predict_packing
from posfreq.analysis.corpus.summary import summarize
from posfreq.analysis.table_files import write_csv
from posfreq.train.atomic import atomic_open

ANALYZE = "analyze"
"""The command that owns these outputs' directory (train/outdir.py)."""
FigureWriter = Callable[[Path, np.ndarray, Mapping[str, dict], Predictions, float], list[Path]]
"""Draws the figures into a folder from (histogram counts, summary's by_train_len, predictions, total tokens)
and returns their files: analysis/plots/corpus.py's write_figures (plots come after corpus, so it is passed in)."""
SHARD_PARTS = "shard_*"
"""Folders of a sharded count that may sit under the merged output (slurm/position_freq.sh's layout)."""


def write_outputs(
    out: Path,
    histogram: LengthHistogram,
    meta: dict,
    train_lens: Sequence[int],
    total_tokens: float,
    packing: PackingSettings = PackingSettings(),
    figures: FigureWriter | None = None,
) -> dict:
    """Write histogram (npz, CSV), the corpus f and each strategy's trained f per L (npz, CSV), the figures
    `figures` draws (none without it) and summary.json; return the summary."""
    predictions = predict_packing(histogram, train_lens, packing)
    replace_outputs(out, ANALYZE, SHARD_PARTS)
    written = [
        save_histogram(out / HISTOGRAM_FILE, histogram, meta),
        _write_length_csv(out / "lengths.csv", histogram),
    ]
    arrays = {}
    for L in train_lens:
        columns = {"f": position_frequency(histogram.counts(), L)}
        columns[f"f_after_{total_tokens:.3g}_tokens"] = scale_to_budget(columns["f"], total_tokens)
        for strategy, prediction in predictions[L].items():
            columns[f"f_trained_{strategy}"] = position_frequency(prediction.histogram, L)
        for source in histogram.sources:
            columns[f"f_{source}"] = position_frequency(histogram.counts(source), L)
        written.append(_write_columns_csv(out / f"position_frequency_L{L}.csv", columns))
        arrays.update({f"L{L}/{name}": values for name, values in columns.items()})
    with atomic_open(out / "position_frequency.npz", "wb") as fh:
        np.savez_compressed(fh, **arrays)
    written.append(out / "position_frequency.npz")
    summary = summarize(histogram, train_lens, total_tokens, predictions, packing)
    if figures is not None:
        written += figures(
            out / "figures",
            histogram.counts(),
            summary["all"]["by_train_len"],
            predictions,
            total_tokens,
        )
    write_summary(out, written, {"meta": meta, **summary})
    return summary


def write_partial(out: Path, histogram: LengthHistogram, meta: dict) -> Path:
    """A shard's outputs: its partial histogram (for --merge) and a summary.json of its metadata; returns the .npz."""
    replace_outputs(out, ANALYZE, SHARD_PARTS)
    path = save_histogram(out / HISTOGRAM_FILE, histogram, meta)
    write_summary(out, [path], {"meta": meta})
    return path


def _write_length_csv(path: Path, histogram: LengthHistogram) -> Path:
    """lengths.csv: every length that occurs, with its count overall and per source."""
    total = histogram.counts()
    per_source = {f"documents_{s}": histogram.counts(s) for s in histogram.sources}
    rows = [
        {
            "length": int(n),
            "documents": int(total[n]),
            **{name: int(h[n]) if n < h.size else 0 for name, h in per_source.items()},
        }
        for n in np.flatnonzero(total)
    ]
    return write_csv(path, rows, ["length", "documents", *per_source])


def _write_columns_csv(path: Path, columns: dict[str, np.ndarray]) -> Path:
    """A CSV with an index column i and one column per array."""
    rows = [
        {
            "i": i,
            **{name: v.item() if isinstance(v, np.generic) else v for name, v in zip(columns, row)},
        }
        for i, row in enumerate(zip(*columns.values()))
    ]
    return write_csv(path, rows, ["i", *columns])

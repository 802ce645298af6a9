"""summary.json's statistics of a corpus (lengths; positions per L, per source and per packing strategy) and
their one-screen text form, as `posfreq analyze` prints it.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from posfreq.analysis.corpus.frequency import frequency_stats, length_stats
from posfreq.analysis.corpus.histogram import LengthHistogram
from posfreq.analysis.corpus.packing_prediction import PackingSettings, Predictions, packing_stats
from posfreq.train.data.records import MAX_ERRORS_KEPT, lost_files_report
from posfreq.train.run.log import human


def summarize(
    histogram: LengthHistogram,
    train_lens: Sequence[int],
    total_tokens: float,
    predictions: Predictions,
    packing: PackingSettings,
) -> dict:
    """summary.json's statistics: length stats and per-L position stats, for the whole corpus and per source, and
    for the whole corpus per packing strategy (``by_train_len[L]["packing"][strategy]``, `packing_stats`)."""

    def one(hist: np.ndarray) -> dict:
        """Length and position statistics of one histogram."""
        out = length_stats(hist)
        out["by_train_len"] = {str(L): frequency_stats(hist, L, total_tokens) for L in train_lens}
        return out

    total = one(histogram.counts())
    for L in train_lens:
        total["by_train_len"][str(L)]["packing"] = {
            strategy: packing_stats(prediction, L, packing.global_batch_tokens)
            for strategy, prediction in predictions[L].items()
        }
    return {
        "all": total,
        "by_source": {s: one(histogram.counts(s)) for s in histogram.sources},
        "packing_settings": packing.as_dict(),
    }


def format_summary(summary: dict, meta: dict) -> str:
    """A one-screen text summary of summary.json."""
    total = summary["all"]
    read = meta.get("read", {})
    percentiles = ", ".join(f"{k} {v}" for k, v in total["percentiles"].items())
    lines = [
        f"corpus {meta.get('corpus')}: {meta.get('files')} files, {total['documents']:,} documents, "
        f"{total['tokens']:,} tokens (tokenizer {meta['settings']['tokenizer']}, length = tokens + EOS)",
        f"  lengths: mean {total['mean_length']:.1f}, median {total['median_length']}, {percentiles}, "
        f"max {total['max_length']}",
    ]
    if read.get("filtered") or read.get("skipped"):
        lines.append(
            f"  filtered by source: {read.get('filtered', 0):,}; "
            f"skipped bad items: {read.get('skipped', 0):,} (the first {MAX_ERRORS_KEPT} in summary.json "
            "meta.read.errors)"
        )
    lines += lost_files_report(read.get("lost_files", []), "summary.json meta.read.lost_files")
    lines.append(f"  {'source':<26}{'docs':>12}{'L':>7}{'at L':>8}{'i<=L/2':>9}{'i>=3L/4':>9}")
    rows = [("all", total)]
    if len(summary["by_source"]) > 1:
        rows += sorted(summary["by_source"].items())
    for name, stats in rows:
        for L, fs in stats["by_train_len"].items():
            lines.append(
                f"  {name[:25]:<26}{stats['documents']:>12,}{L:>7}{fs['share_pieces_at_L']:>8.1%}"
                f"{fs['share_positions_le_half_L']:>9.1%}{fs['share_positions_ge_three_quarter_L']:>9.1%}"
            )
    packing = summary["packing_settings"]
    lines.append(
        f"  trained in one epoch, per packing (seed {packing['seed']}, length_upsample "
        f"{packing['length_upsample']}, {packing['global_batch_tokens']:,} tokens per step):"
    )
    lines.append(
        f"  {'packing':<26}{'rows/epoch':>12}{'L':>7}{'at L':>8}{'i<=L/2':>9}{'i>=3L/4':>9}"
        f"{'padding':>9}{'lost/step':>11}"
    )
    for L, fs in total["by_train_len"].items():
        for strategy, ps in fs["packing"].items():
            lines.append(
                f"  {strategy:<26}{ps['rows_per_epoch']:>12,}{L:>7}{ps['share_segments_at_L']:>8.1%}"
                f"{ps['share_positions_le_half_L']:>9.1%}{ps['share_positions_ge_three_quarter_L']:>9.1%}"
                f"{ps['padding_share']:>9.1%}{human(ps['tokens_lost_per_step']):>11}"
            )
    return "\n".join(lines)

"""Tables derived from one model's stored per-test records under an `Analysis`: a summary.csv row per length,
recall and pass rate by needle distance (joined with f), recall by depth (Fig. 4) and failures by third (Table 4).

A test's distance is that of its k-th nearest needle (k = min_retrieved), the farthest it must reach to pass.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import numpy as np

from posfreq.analysis.corpus.frequency import position_frequency
from posfreq.analysis.tables.columns import SUMMARY_COLUMNS
from posfreq.analysis.tables.measures import (
    MEASURES,
    NEEDLE_RECALL,
    TF_NEEDLE_PROB,
    TF_RECALL,
    mean_of,
)
from posfreq.analysis.tables.pass_curve import Analysis

THIRDS = ("0-33.3%", "33.3-66.7%", "66.7-100%")


def _third(depth: float) -> int:
    """0, 1 or 2: the third of the document a depth in [0, 1) falls in."""
    return min(int(depth * 3), 2)


def _mean(values: Sequence[float]) -> float | str:
    return float(np.mean(values)) if len(values) else ""


def summarize_length(
    records: Sequence[Mapping], seconds: float, analysis: Analysis = Analysis()
) -> dict:
    """One summary.csv row from the scored tests of one length."""
    hits = np.array([analysis.hits(r) for r in records], dtype=bool)
    thirds = np.array([[_third(d) for d in r["depths"]] for r in records])
    row = {
        "length": int(records[0]["length"]),
        "prompt_length": records[0].get("prompt_length", ""),
        "n_tests": len(records),
        "passed": sum(analysis.passed(r) for r in records),
        "mean_retrieved": float(hits.sum(axis=1).mean()),
        "seconds": round(seconds, 3),
        "tests_per_s": round(len(records) / seconds, 3) if seconds > 0 else "",
        # every registered measure that is a summary column (teacher-forced ones empty where not measured)
        **{c: mean_of(m, records, analysis) for c, m in MEASURES.items() if c in SUMMARY_COLUMNS},
    }
    for k, name in enumerate(("recall_depth_0_33", "recall_depth_33_67", "recall_depth_67_100")):
        in_third = thirds == k
        row[name] = float(hits[in_third].mean()) if in_third.any() else ""
    return {c: row[c] for c in SUMMARY_COLUMNS}


def distance_rows(
    records: Sequence[Mapping],
    edges: Sequence[int],
    analysis: Analysis = Analysis(),
    length_hist: np.ndarray | None = None,
    train_len: int | None = None,
) -> list[dict]:
    """Needle recall, teacher-forced score and pass rate per distance bin (lo, hi], joined with f(lo).

    A needle's distance is from its first token to the question's; a test sits in the bin of its
    `min_retrieved`-th nearest needle. f is Eq. 2 on the trained-length histogram (empty without one).
    """
    edges = [int(e) for e in edges]
    needles = [[] for _ in edges[1:]]
    tests = [[] for _ in edges[1:]]

    def bin_of(distance: int) -> int | None:
        k = int(np.searchsorted(edges, distance, side="left")) - 1
        return k if 0 <= k < len(edges) - 1 else None

    for r in records:
        hits = NEEDLE_RECALL.value(r, analysis)
        tf_recall = TF_RECALL.value(r, analysis) or [None] * len(hits)
        tf_prob = TF_NEEDLE_PROB.value(r, analysis) or [None] * len(hits)
        for d, hit, recalled, prob in zip(r["distances"], hits, tf_recall, tf_prob):
            if (k := bin_of(int(d))) is not None:
                needles[k].append((hit, recalled, prob))
        kth = sorted(int(d) for d in r["distances"])[analysis.min_retrieved - 1]
        if (k := bin_of(kth)) is not None:
            tests[k].append(analysis.passed(r))
    f = (
        position_frequency(length_hist, train_len)
        if length_hist is not None and train_len
        else None
    )
    rows = []
    for k, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
        tf = [(recalled, prob) for _, recalled, prob in needles[k] if recalled is not None]
        rows.append(
            {
                "distance_lo": lo,
                "distance_hi": hi,
                "needles": len(needles[k]),
                "needle_recall": _mean([h for h, _, _ in needles[k]]),
                "tf_recall": _mean([recalled for recalled, _ in tf]),
                "tf_needle_prob": _mean([prob for _, prob in tf]),
                "tests": len(tests[k]),
                "pass_rate": _mean(tests[k]),
                "f_distance_lo": "" if f is None else (int(f[lo]) if lo < len(f) else 0),
            }
        )
    return rows


def depth_grid(
    records: Iterable[Mapping], bins: int = 10, analysis: Analysis = Analysis()
) -> tuple[list[int], np.ndarray, np.ndarray]:
    """Needle recall per (depth bin, length) for a Fig. 4 heatmap: (lengths, bin edges, recall or NaN)."""
    by_length: dict[int, list[Mapping]] = {}
    for r in records:
        by_length.setdefault(int(r["length"]), []).append(r)
    lengths = sorted(by_length)
    hit_sum = np.zeros((bins, len(lengths)))
    count = np.zeros((bins, len(lengths)))
    for j, length in enumerate(lengths):
        for r in by_length[length]:
            for depth, hit in zip(r["depths"], analysis.hits(r)):
                b = min(int(depth * bins), bins - 1)
                hit_sum[b, j] += bool(hit)
                count[b, j] += 1
    with np.errstate(invalid="ignore", divide="ignore"):
        recall = np.where(count > 0, hit_sum / np.maximum(count, 1), np.nan)
    return lengths, np.linspace(0.0, 1.0, bins + 1), recall


def failure_by_thirds(records: Iterable[Mapping], analysis: Analysis = Analysis()) -> list[dict]:
    """Table 4 style: missed needles per document third, per length and overall; peak = highest miss rate (first on ties)."""
    misses: dict[object, np.ndarray] = {}
    needles: dict[object, np.ndarray] = {}
    for r in records:
        for key in (int(r["length"]), "all"):
            misses.setdefault(key, np.zeros(3, dtype=np.int64))
            needles.setdefault(key, np.zeros(3, dtype=np.int64))
            for depth, hit in zip(r["depths"], analysis.hits(r)):
                needles[key][_third(depth)] += 1
                misses[key][_third(depth)] += not hit
    rows = []
    for key in sorted((k for k in misses if k != "all"), key=int) + (["all"] if misses else []):
        m, n = misses[key], needles[key]
        row: dict = {"length": key}
        for k, third in enumerate(THIRDS):
            row[f"missed_{third}"] = int(m[k])
            row[f"miss_rate_{third}"] = float(m[k] / n[k]) if n[k] else 0.0
        rates = m / np.maximum(
            n, 1
        )  # rates, not counts: the thirds hold different numbers of needles
        row["peak_failure_depth"] = THIRDS[int(np.argmax(rates))] if m.any() else "none"
        rows.append(row)
    return rows

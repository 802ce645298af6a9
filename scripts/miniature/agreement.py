"""Does a demo run reproduce another? Effective lengths against the other run's intervals, and the verdicts.

The miniature's claim is only a result if it survives another machine or thread setting: this compares two
demo output directories checkpoint by checkpoint (same training length, seed and tokens) and verdict by verdict.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from posfreq.analysis.table_files import read_csv
from posfreq.analysis.verdicts.rules import outcome
from posfreq.scripts.miniature.pipeline import DemoError

VERDICTS = ("shortfall", "longer_reaches_further", "curves_coincide")


def checkpoints_of(compare: Path) -> dict[tuple, dict]:
    """A comparison's checkpoints.csv, keyed by (train_len, seed, variant, tokens_trained)."""
    path = compare / "checkpoints.csv"
    if not path.is_file():
        raise DemoError(
            f"demo: {path} is missing: the reference must be the output directory of a finished "
            "`python scripts/demo.py` of this version (its comparison stages write that table)"
        )
    return {
        (r["train_len"], r["seed"], r["variant"], r["tokens_trained"]): r for r in read_csv(path)
    }


def _interval(row: dict) -> tuple[float, float]:
    """A checkpoint's 95% interval; without one (no bootstrap ran), the effective length itself."""
    lo, hi = row["effective_length_lo"], row["effective_length_hi"]
    if all(isinstance(x, (int, float)) for x in (lo, hi)):
        return lo, hi
    return row["effective_length"], row["effective_length"]


def agreement(out: Path, reference: Path, criterion: str, compare: Path) -> dict:
    """Per shared checkpoint of the comparison at `compare` (relative to both output directories): this run's
    effective length, the reference's and its 95% interval; per milestone, this run's seeds against the reference's
    run range and its median over seeds against the range of the reference's seeds; and the verdicts.

    Seeds do not pair across machines (their trajectories part within a few hundred steps), so the interval a
    second machine's run should land in is a milestone's run range: from the lowest to the highest end of the
    reference seeds' 95% intervals, training and test noise both. `runs_within` counts this run's checkpoints inside
    it. `within` counts them inside the same seed's interval, which resamples tests only; `overlap` counts
    intervals that meet; `milestones_within` counts milestones whose seed median lies inside the reference's seed
    range.
    """
    ours, theirs = checkpoints_of(out / compare), checkpoints_of(reference / compare)
    rows = []
    for key in sorted(ours.keys() & theirs.keys()):
        a, b = ours[key], theirs[key]
        (lo, hi), (our_lo, our_hi) = _interval(b), _interval(a)
        rows.append(
            {
                "train_len": key[0],
                "seed": key[1],
                "variant": key[2],
                "tokens_trained": key[3],
                "effective_length": a["effective_length"],
                "reference": b["effective_length"],
                "reference_lo": lo,
                "reference_hi": hi,
                "within": lo <= a["effective_length"] <= hi,
                "overlap": our_lo <= hi and lo <= our_hi,
            }
        )
    milestones: dict[tuple, list[dict]] = {}
    for r in rows:
        milestones.setdefault((r["train_len"], r["variant"], r["tokens_trained"]), []).append(r)
    milestone_rows = []
    for (train_len, variant, tokens), seeds in sorted(milestones.items()):
        median = statistics.median(r["effective_length"] for r in seeds)
        reference_seeds = sorted(r["reference"] for r in seeds)
        run_range = [min(r["reference_lo"] for r in seeds), max(r["reference_hi"] for r in seeds)]
        milestone_rows.append(
            {
                "train_len": train_len,
                "variant": variant,
                "tokens_trained": tokens,
                "seed_median": median,
                "seeds": sorted(r["effective_length"] for r in seeds),
                "reference_seeds": reference_seeds,
                "reference_run_range": run_range,
                "runs_within": sum(
                    run_range[0] <= r["effective_length"] <= run_range[1] for r in seeds
                ),
                "within": reference_seeds[0] <= median <= reference_seeds[-1],
            }
        )
    conclusions = [
        json.loads((d / compare / "conclusion.json").read_text()) for d in (out, reference)
    ]
    verdicts = {
        name: {
            "this_run": outcome(conclusions[0][name]),
            "reference": outcome(conclusions[1][name]),
        }
        for name in VERDICTS
    }
    return {
        "reference": str(reference),
        "criterion": criterion,
        "comparison": str(compare),
        "checkpoints": rows,
        "shared_checkpoints": len(rows),
        "only_in_one": len(ours.keys() ^ theirs.keys()),
        "runs_within": sum(m["runs_within"] for m in milestone_rows),
        "within": sum(r["within"] for r in rows),
        "overlap": sum(r["overlap"] for r in rows),
        "milestones": milestone_rows,
        "milestones_within": sum(r["within"] for r in milestone_rows),
        "verdicts": verdicts,
        "same_verdicts": all(v["this_run"] == v["reference"] for v in verdicts.values()),
    }


def agreement_lines(result: dict) -> list[str]:
    """REPORT.md's section on the comparison with a reference run."""
    outside = [r for r in result["checkpoints"] if not r["within"]]
    lines = [
        f"## Agreement with the reference run `{result['reference']}` ({result['criterion']} criterion, "
        f"{result['comparison']})",
        "",
        f"- Shared checkpoints: {result['shared_checkpoints']} ({result['only_in_one']} in one run only).",
        f"- This run's effective length lies inside the reference's run range of its milestone (lowest to highest "
        f"end of the reference seeds' 95% intervals: training and test noise) at {result['runs_within']} of "
        f"{result['shared_checkpoints']}.",
        f"- Inside the same seed's 95% interval at {result['within']} of {result['shared_checkpoints']}; the two "
        f"intervals meet at {result['overlap']}. Those intervals resample tests, not training, and a seed's "
        "trajectory is not the same on two machines.",
        f"- Per milestone, this run's median over seeds lies inside the range of the reference's seeds at "
        f"{result['milestones_within']} of {len(result['milestones'])}.",
        "- Verdicts (this run / reference): "
        + "; ".join(
            f"{name} {v['this_run']} / {v['reference']}" for name, v in result["verdicts"].items()
        )
        + (" (the same)." if result["same_verdicts"] else " (**they differ**)."),
        "",
    ]
    lines += [
        "| L | tokens | this run's seeds | reference's seeds | reference run range | inside |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {m['train_len']} | {m['tokens_trained']} | {m['seeds']} | {m['reference_seeds']} | "
        f"[{m['reference_run_range'][0]}, {m['reference_run_range'][1]}] | {m['runs_within']} of "
        f"{len(m['seeds'])} |"
        for m in result["milestones"]
    ]
    lines.append("")
    if outside:
        lines += [
            "Checkpoints outside the reference's interval:",
            "",
            "| L | seed | tokens | this run | reference [interval] |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['train_len']} | {r['seed']} | {r['tokens_trained']} | {r['effective_length']} | "
            f"{r['reference']} [{r['reference_lo']}, {r['reference_hi']}] |"
            for r in outside
        ]
        lines.append("")
    return lines

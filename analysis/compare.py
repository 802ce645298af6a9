"""Effective length across training lengths and seeds, and a computed verdict on the paper's claims.

    python analysis/compare.py RUN_OR_PROBE_DIR [...] --out DIR [--bootstrap 2000] [--bootstrap-seed 0]

Each argument is a probed run (see analysis/probe.py --run); its training length and seed are
read from its checkpoints' config.json. Writes

    DIR/checkpoints.csv     every probed checkpoint: train_len, seed, tokens, effective length and
                            its bootstrap interval, status, f(effective length)
    DIR/conclusion.json     the tests below with their numbers
    DIR/figures/            Fig. 2a and 2b with seed bands; pass rate vs length of every milestone

The claims, tested on checkpoints whose effective length is defined (status ok):

- C1 (effective length falls short): for every run, the last checkpoint's upper interval end is
  below its training length.
- Fig. 2a: at the last checkpoint, the longer training length reaches a larger effective length;
  the paired difference (same seed) with a percentile bootstrap interval over seeds.
- C2 (curves coincide against f): points (effective length, log10 f) of both lengths are fitted
  by one line; D = mean residual of the longer length minus that of the shorter, over the range
  of effective lengths both reach. Seeds are resampled with replacement within each length
  (bootstrap); the curves coincide when the interval of D holds 0. D is the shift in decades
  of f at equal effective length between the two lengths.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
from jsonargparse import ArgumentParser

if __package__ in (
    None,
    "",
):  # run as a file: import the installed posfreq package, never this folder's files by bare name
    sys.path.pop(0)

from posfreq.analysis.effective_length import (
    STATUS_ALL_PASSED,
    STATUS_NONE_PASSED,
    STATUS_OK,
    find_run_results,
    read_csv,
    write_csv,
)
from posfreq.train.cli import add_runs_argument, command_parser, parse, runs_of
from posfreq.train.outdir import OutputDirError, claim_output_dir, entry_names

COLUMNS = (
    "train_len",
    "seed",
    "variant",
    "checkpoint",
    "tokens_seen",
    "effective_length",
    "effective_length_lo",
    "effective_length_hi",
    "effective_length_status",
    "f_effective_length",
    "tf_effective_length",
)


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
    """The config.json of `checkpoint` of the run that `probe_dir` probed: at the run path probe.json records, else
    at the run directory holding `probe_dir` (the default layout RUN/probe-*/, also after the run was moved)."""
    meta = json.loads((probe_dir / "probe.json").read_text())
    runs = [Path(meta["run"])] if meta.get("run") else []
    runs.append(probe_dir.resolve().parent)
    tried = [run / "checkpoints" / checkpoint / "config.json" for run in runs]
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


def run_identity(probe_dir: Path) -> tuple[int, int, str]:
    """(training length, training seed, data variant) of a probed run, from its first checkpoint's config.json."""
    rows = read_csv(probe_dir / "effective_length.csv")
    if not rows:
        raise CompareError(
            f"{probe_dir / 'effective_length.csv'}: no checkpoint rows. Fix: probe the run first"
        )
    config = run_config(probe_dir, str(rows[0]["checkpoint"]))
    return int(rows[0]["train_len"]), int(config["seed"]), data_variant(config)


def load_checkpoints(paths: Sequence[Path]) -> list[dict]:
    """Every probed checkpoint of the given runs, with its run's training length, seed and data variant."""
    rows = []
    for path in paths:
        directory = find_run_results(path)
        train_len, seed, variant = run_identity(directory)
        for row in read_csv(directory / "effective_length.csv"):
            rows.append(
                {
                    **{c: row.get(c) for c in COLUMNS},
                    "train_len": train_len,
                    "seed": seed,
                    "variant": variant,
                    **{k: v for k, v in row.items() if k.startswith("pass_rate_")},
                }
            )
    return rows


def _percentile(values: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    tail = (1 - level) / 2
    lo, hi = np.quantile(np.asarray(values, dtype=float), [tail, 1 - tail])
    return float(lo), float(hi)


def shortfall(rows: Sequence[Mapping]) -> dict:
    """C1: each run's last checkpoint, its effective length interval against its training length."""
    runs = {}
    for r in rows:
        key = (r["train_len"], r["variant"], r["seed"])
        if key not in runs or r["tokens_seen"] > runs[key]["tokens_seen"]:
            runs[key] = r
    last = [
        {
            "train_len": L,
            "variant": v,
            "seed": s,
            "effective_length": r["effective_length"],
            "effective_length_hi": r["effective_length_hi"],
            "status": r["effective_length_status"],
        }
        for (L, v, s), r in sorted(runs.items(), key=lambda kv: (kv[0][0], kv[0][1], str(kv[0][2])))
    ]
    claim = "the effective length of every run's last checkpoint falls short of its training length"
    undefined = [x for x in last if x["status"] == STATUS_NONE_PASSED]
    tested = [x for x in last if x["status"] != STATUS_NONE_PASSED]
    verdict = {"claim": claim, "last_checkpoints": last}
    if undefined:
        verdict["caveat"] = (
            f"{len(undefined)} of {len(last)} runs passed no probed length at their last checkpoint "
            "(effective length undefined): left out of the test"
        )
    if not tested:
        return {
            **verdict,
            "holds": None,
            "reason": "no run has a defined effective length at its last checkpoint",
        }
    holds = all(
        x["status"] == STATUS_OK
        and x["effective_length_hi"] is not None
        and x["effective_length_hi"] < x["train_len"]
        for x in tested
    )
    return {**verdict, "holds": holds}


def longer_reaches_further(rows: Sequence[Mapping], n_boot: int, seed: int) -> dict:
    """Fig. 2a: paired (same seed) difference of last-checkpoint effective lengths, longer minus shorter L."""
    lengths = sorted({r["train_len"] for r in rows})
    if len(lengths) != 2:
        return {"claim": "needs exactly two training lengths", "holds": None}
    last: dict[tuple, int] = {}
    tokens: dict[tuple, int] = {}
    censored: dict[tuple, bool] = {}
    for r in rows:
        key = (r["train_len"], r["seed"])
        if key not in tokens or r["tokens_seen"] > tokens[key]:
            tokens[key], last[key] = r["tokens_seen"], int(r["effective_length"])
            censored[key] = r["effective_length_status"] == STATUS_ALL_PASSED
    seeds = sorted(
        {s for L, s in last if (lengths[0], s) in last and (lengths[1], s) in last}, key=str
    )
    if not seeds:
        return {"claim": "needs the same seeds at both lengths", "holds": None}
    diffs = np.array([last[(lengths[1], s)] - last[(lengths[0], s)] for s in seeds], dtype=float)
    rng = np.random.default_rng(seed)
    boots = diffs[rng.integers(0, len(diffs), size=(n_boot, len(diffs)))].mean(axis=1)
    lo, hi = _percentile(boots)
    return {
        "claim": f"at the last checkpoint (equal tokens), L = {lengths[1]} reaches a larger effective length "
        f"than L = {lengths[0]} (paired by seed)",
        "seeds": seeds,
        "differences": diffs.tolist(),
        "mean_difference": float(diffs.mean()),
        "interval_95": [lo, hi],
        "holds": bool(lo > 0),
        "test": "percentile bootstrap over seeds",
        "censored": {str(L): sum(censored[(L, s)] for s in seeds) for L in lengths},
        "note": "a run whose every probed length passed (all_passed) has an effective length that is only a "
        "lower bound: its training length caps it",
    }


C2_MIN_POINTS = 3
C2_MIN_SEEDS = 3
"""C2 is tested only with at least this many uncensored points, from this many seeds, per length: with fewer points
D rests on one or two checkpoints, and two seeds give the seed bootstrap 3 distinct resamples per length, so its
"95% interval" is the spread of a handful of values (an emulated AVX2 CPU's demo run: D = +0.46 [0.45, 0.47] from 4
points of 2 seeds, where the committed run had 1 point and no test)."""


def _residual_shift(
    points: Sequence[tuple[object, float, float]], short: object, long: object
) -> float | None:
    """D for (group, effective length, log10 f) points: mean residual (long) - mean residual (short) in the overlap."""
    by_len = {L: [(x, y) for LL, x, y in points if LL == L] for L in (short, long)}
    if any(len(v) < 2 for v in by_len.values()):
        return None
    lo = max(min(x for x, _ in v) for v in by_len.values())
    hi = min(max(x for x, _ in v) for v in by_len.values())
    overlap = {L: [(x, y) for x, y in v if lo <= x <= hi] for L, v in by_len.items()}
    if any(not v for v in overlap.values()):
        return None
    xs = np.array([x for v in by_len.values() for x, _ in v], dtype=float)
    ys = np.array([y for v in by_len.values() for _, y in v], dtype=float)
    slope, intercept = np.polyfit(xs, ys, 1) if np.ptp(xs) > 0 else (0.0, float(ys.mean()))
    mean_res = {L: np.mean([y - (slope * x + intercept) for x, y in v]) for L, v in overlap.items()}
    return float(mean_res[long] - mean_res[short])


def curves_coincide(
    rows: Sequence[Mapping],
    n_boot: int,
    seed: int,
    group: str = "train_len",
    groups: Sequence | None = None,
) -> dict:
    """C2: do the f(effective length) vs effective length curves of two groups coincide? By default the groups are
    the two training lengths (the paper's C2); `group="variant", groups=(baseline, other)` compares data variants."""
    lengths = list(groups) if groups is not None else sorted({r[group] for r in rows})
    if len(lengths) != 2:
        return {"claim": f"needs exactly two values of {group}", "holds": None}
    short, long = lengths
    points = {}
    for r in rows:
        f = r["f_effective_length"]
        if (
            r[group] in lengths
            and r["effective_length_status"] == STATUS_OK
            and f not in (None, "")
            and float(f) > 0
        ):
            points.setdefault((r[group], r["seed"]), []).append(
                (r[group], int(r["effective_length"]), float(np.log10(float(f))))
            )
    names = f"L = {short} and L = {long}" if group == "train_len" else f"{short} and {long}"
    claim = (
        f"f(effective length) vs effective length of {names} coincide (the paper's C2): "
        "the interval of D, the shift in log10 f at equal effective length, holds 0"
    )
    n_points = {L: sum(len(v) for (LL, _), v in points.items() if LL == L) for L in lengths}
    n_seeds = {L: sum(1 for LL, _ in points if LL == L) for L in lengths}
    enough = all(n_points[L] >= C2_MIN_POINTS and n_seeds[L] >= C2_MIN_SEEDS for L in lengths)
    observed = (
        _residual_shift([p for v in points.values() for p in v], short, long) if enough else None
    )
    if observed is None:
        return {
            "claim": claim,
            "holds": None,
            "n_points": {str(L): n for L, n in n_points.items()},
            "n_seeds": {str(L): n for L, n in n_seeds.items()},
            "reason": f"fewer than {C2_MIN_POINTS} defined, uncensored points from {C2_MIN_SEEDS} seeds per "
            "length, or their effective lengths do not overlap",
        }
    seeds = {L: sorted({s for LL, s in points if LL == L}, key=str) for L in lengths}
    rng = np.random.default_rng(seed)
    boots = []
    for _ in range(n_boot):
        chosen = [
            p
            for L in lengths
            for i in rng.integers(0, len(seeds[L]), size=len(seeds[L]))
            for p in points[(L, seeds[L][i])]
        ]
        d = _residual_shift(chosen, short, long)
        if d is not None:
            boots.append(d)
    lo, hi = _percentile(boots)
    return {
        "claim": claim,
        "D_log10_f": observed,
        "interval_95": [lo, hi],
        "holds": bool(lo <= 0 <= hi),
        "n_points": {str(L): sum(len(points[(L, s)]) for s in seeds[L]) for L in lengths},
        "seeds": {str(L): seeds[L] for L in lengths},
        "bootstrap_replicates_used": len(boots),
        "test": "one line fitted to (effective length, log10 f) of both lengths; D = mean residual of the longer "
        "length minus the shorter over the effective lengths both reach; seeds resampled within each "
        "length (percentile bootstrap)",
    }


def variant_effect(
    rows: Sequence[Mapping], baseline: str, other: str, n_boot: int, seed: int
) -> dict:
    """At equal tokens, does data variant `other` reach a larger effective length than `baseline`? (Rows of one
    training length.)

    Per seed: the mean over the milestones both runs reached of EL(other) - EL(baseline) (0 before retrieval
    counts), then a percentile bootstrap over seeds; also the difference at the last shared milestone. A seed
    whose two runs share no milestone is left out.
    """
    if len({r["train_len"] for r in rows}) > 1:
        raise ValueError(
            "variant_effect compares variants at one training length; filter the rows by train_len"
        )
    el = {
        (r["variant"], r["seed"], int(r["tokens_seen"])): int(r["effective_length"]) for r in rows
    }
    claim = f"at equal tokens, {other} reaches a larger effective length than {baseline} (paired by seed)"
    shared = {
        s: sorted(
            {t for v, ss, t in el if ss == s and v == baseline}
            & {t for v, ss, t in el if ss == s and v == other}
        )
        for s in {s for _, s, _ in el}
    }
    seeds = sorted((s for s, tokens in shared.items() if tokens), key=str)
    if not seeds:
        return {
            "claim": claim,
            "holds": None,
            "reason": "no seed has milestones of both variants at equal tokens",
        }
    means, last = [], []
    for s in seeds:
        diffs = [el[(other, s, t)] - el[(baseline, s, t)] for t in shared[s]]
        means.append(float(np.mean(diffs)))
        last.append(diffs[-1])
    rng = np.random.default_rng(seed)
    boots = [float(np.mean(rng.choice(means, size=len(means)))) for _ in range(n_boot)]
    lo, hi = _percentile(boots)
    return {
        "claim": claim,
        "seeds": seeds,
        "mean_difference_per_seed": means,
        "mean_difference": float(np.mean(means)),
        "interval_95": [lo, hi],
        "last_milestone_differences": last,
        "holds": bool(lo > 0),
        "differs": not lo <= 0 <= hi,
        "test": "per seed, mean over shared milestones of the effective-length difference; percentile bootstrap "
        "over seeds",
    }


def baseline_variant(rows: Sequence[Mapping]) -> str:
    """The data variant others are compared with: plain concat when present, else the first label."""
    variants = sorted({r["variant"] for r in rows})
    return "concat" if "concat" in variants else variants[0]


def variant_comparisons(
    rows: Sequence[Mapping], baseline: str, n_boot: int, seed: int
) -> list[dict]:
    """Per training length, every other data variant against the baseline: at equal tokens and against f."""
    out = []
    for L in sorted({r["train_len"] for r in rows}):
        at_L = [r for r in rows if r["train_len"] == L]
        for other in sorted({r["variant"] for r in at_L} - {baseline}):
            out.append(
                {
                    "train_len": L,
                    "baseline": baseline,
                    "variant": other,
                    "equal_tokens": variant_effect(at_L, baseline, other, n_boot, seed),
                    "against_f": curves_coincide(at_L, n_boot, seed, "variant", (baseline, other)),
                }
            )
    return out


def emergence(rows: Sequence[Mapping]) -> list[dict]:
    """Per run: the first checkpoint with a non-zero effective length, as a share of the run's tokens."""
    out = []
    runs = {(r["train_len"], r["variant"], r["seed"]) for r in rows}
    for L, v, s in sorted(runs, key=lambda k: (k[0], k[1], str(k[2]))):
        mine = sorted(
            (r for r in rows if (r["train_len"], r["variant"], r["seed"]) == (L, v, s)),
            key=lambda r: r["tokens_seen"],
        )
        first = next((r for r in mine if int(r["effective_length"]) > 0), None)
        share = None if first is None else first["tokens_seen"] / mine[-1]["tokens_seen"]
        out.append(
            {
                "train_len": L,
                "variant": v,
                "seed": s,
                "checkpoints": len(mine),
                "first_retrieval_tokens": None if first is None else first["tokens_seen"],
                "share_of_budget": share,
            }
        )
    return out


def compare(
    paths: Sequence[Path], out: Path, n_boot: int = 2000, seed: int = 0, figures: bool = True
) -> dict:
    """Load the runs, write checkpoints.csv, conclusion.json and the figures; return the conclusion."""
    rows = load_checkpoints(paths)
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
        "longer_reaches_further": longer_reaches_further(same_data, n_boot, seed),
        "curves_coincide": curves_coincide(same_data, n_boot, seed),
        "emergence": emergence(rows),
        "baseline_variant": baseline,
        "variants": variant_comparisons(rows, baseline, n_boot, seed),
    }
    (out / "conclusion.json").write_text(json.dumps(conclusion, indent=1) + "\n")
    if figures:
        from posfreq.analysis import plots

        plots.plot_fig2a_seed_bands(rows, out / "figures" / "fig2a_effective_length_vs_tokens")
        plots.plot_fig2b_seeds(rows, out / "figures" / "fig2b_frequency_vs_effective_length")
        plots.plot_pass_rate_curves(rows, out / "figures" / "pass_rate_vs_length")
    return conclusion


def build_parser() -> ArgumentParser:
    """`posfreq compare`: the probed runs, where the outputs go, and the bootstrap over seeds."""
    parser = command_parser(
        "posfreq compare",
        "Effective length across training lengths and seeds, and computed verdicts on the paper's claims "
        "(shortfall, longer L reaches further, C2: curves coincide against f). Each run's training length and seed "
        "are read from its checkpoints' config.json.",
    )
    add_runs_argument(parser)
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("runs/compare"),
        help="Directory for checkpoints.csv, conclusion.json and figures/.",
    )
    parser.add_argument(
        "--bootstrap", type=int, default=2000, help="Bootstrap replicates over seeds."
    )
    parser.add_argument(
        "--bootstrap-seed", type=int, default=0, help="Seed of the bootstrap resampling."
    )
    parser.add_argument("--no-figures", action="store_true", help="Skip the figures.")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Compare the runs, print each verdict and where the outputs are."""
    parser = build_parser()
    args = parse(parser, argv)
    runs = runs_of(args, parser)
    try:
        conclusion = compare(
            runs, args.out, args.bootstrap, args.bootstrap_seed, not args.no_figures
        )
    except (CompareError, FileNotFoundError, OutputDirError) as err:
        sys.exit(f"error: {err}")
    for name in ("shortfall", "longer_reaches_further", "curves_coincide"):
        c = conclusion[name]
        caveat = "".join(f"; {c[k]}" for k in ("reason", "caveat") if c.get(k))
        print(f"{name}: holds={c['holds']}  {c.get('interval_95', '')}  ({c['claim']}{caveat})")
    print(f"outputs in {args.out}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())

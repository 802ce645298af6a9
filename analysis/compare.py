"""Effective length across training lengths and seeds, and a computed verdict on the paper's claims.

    python analysis/compare.py RUN_OR_PROBE_DIR [...] --out DIR [--bootstrap 2000] [--bootstrap-seed 0]

Each argument is a probed run (see analysis/probe.py --run); its training length and seed are
read from its checkpoints' config.json. Writes

    DIR/checkpoints.csv     every probed checkpoint: train_len, seed, tokens, effective length and
                            its bootstrap interval, status, f(effective length)
    DIR/conclusion.json     the tests below with their numbers
    DIR/figures/            Fig. 2a and 2b with seed bands; pass rate vs length of every milestone

The claims (analysis/claims.py), tested on checkpoints whose effective length is defined (status ok):

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

import sys
from pathlib import Path
from typing import Sequence

from jsonargparse import ArgumentParser

if __package__ in (
    None,
    "",
):  # run as a file: import the installed posfreq package, never this folder's files by bare name
    sys.path.pop(0)

from posfreq.analysis.claims import (
    baseline_variant,
    curves_coincide,
    emergence,
    longer_reaches_further,
    shortfall,
    variant_comparisons,
)
from posfreq.analysis.probed_runs import COLUMNS, CompareError, load_checkpoints
from posfreq.analysis.tables import write_csv
from posfreq.train.atomic import write_json_atomic
from posfreq.train.command_line import add_runs_argument, command_parser, parse, runs_of
from posfreq.train.outdir import OutputDirError, claim_output_dir, entry_names


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
    write_json_atomic(out / "conclusion.json", conclusion, indent=1)
    if figures:
        from posfreq.analysis import plots_effective_length

        plots_effective_length.plot_fig2a_seed_bands(
            rows, out / "figures" / "fig2a_effective_length_vs_tokens"
        )
        plots_effective_length.plot_fig2b_seeds(
            rows, out / "figures" / "fig2b_frequency_vs_effective_length"
        )
        plots_effective_length.plot_pass_rate_curves(rows, out / "figures" / "pass_rate_vs_length")
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

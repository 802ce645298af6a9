"""Effective length across training lengths and seeds, and a computed verdict on the paper's claims.

    python analysis/compare.py RUN_OR_PROBE_DIR [...] --out DIR [--bootstrap 2000] [--bootstrap-seed 0]

Each argument is a probed run (see analysis/probe.py --run); its training length and seed are
read from its checkpoints' config.json. Writes

    DIR/checkpoints.csv     every probed checkpoint: train_len, seed, tokens, effective length and
                            its bootstrap interval, status, f(effective length)
    DIR/conclusion.json     the tests below with their numbers
    DIR/figures/            Fig. 2a and 2b with seed bands; pass rate vs length of every milestone

The claims (analysis/verdicts/claims.py); each holds, does not hold, is inconclusive (C2 only) or
is not testable (with the reason):

- C1 (effective length falls short), on every run's last checkpoint, whatever its status: a run
  that passed no probed length is left out (a caveat says so); a run is short when its status is
  ok and its upper interval end is below its training length L and its longest probed length,
  and not short when, probed up to L, it is not shown short (every length passed included). A run
  without an interval end (probed with bootstrap 0), or probed only below L and not shown short,
  cannot be judged: then the verdict is not testable, unless another run is not short.
- Fig. 2a: the longer training length reaches a larger effective length, compared per seed at the
  largest tokens both runs of the seed reached, on checkpoints of any status (all passed: a lower
  bound, counted as censored); the paired difference with a percentile bootstrap interval over
  seeds, from at least 3 seeds.
- C2 (curves coincide against f), on the checkpoints whose effective length is defined and
  uncensored (status ok), at least 3 from 3 seeds per length: points (effective length, log10 f)
  of both lengths are fitted by lines of one slope (the slope fitted within each length, so the shift
  does not tilt it), one intercept per length; D = mean residual of the longer length minus that of
  the shorter, over the range of effective lengths both reach. Seeds are resampled with replacement within each length
  (bootstrap). D is the shift in decades of f at equal effective length between the two
  lengths. The curves coincide when D's 95% interval covers 0 and lies within +-log10(2) = 0.301
  decades (a factor of 2 in f, `C2_MARGIN_DECADES`); they do not when it excludes 0; an interval
  that covers 0 but reaches past the margin is inconclusive (holds null, not "not testable").
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

from jsonargparse import ArgumentParser

from posfreq.analysis.niah.results import StaleResults
from posfreq.analysis.tables.formats import DamagedTable
from posfreq.analysis.verdicts.claims import outcome
from posfreq.analysis.verdicts.compare import compare
from posfreq.analysis.verdicts.probed_runs import CompareError
from posfreq.train.command_line import add_runs_argument, command_parser, parse, runs_of
from posfreq.train.outdir import OutputDirError


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
        "--bootstrap", type=int, default=2000, help="Bootstrap replicates over seeds (at least 1)."
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
    if args.bootstrap < 1:  # an interval needs replicates: 0 left nothing to take percentiles of
        parser.error(f"--bootstrap must be >= 1, got {args.bootstrap}")
    try:
        conclusion = compare(
            runs, args.out, args.bootstrap, args.bootstrap_seed, not args.no_figures
        )
    except (CompareError, StaleResults, DamagedTable, FileNotFoundError, OutputDirError) as err:
        sys.exit(f"error: {err}")
    loss = conclusion["loss_curves_coincide"]
    named = [(n, conclusion[n]) for n in ("shortfall", "longer_reaches_further", "curves_coincide")]
    named += [("loss_curves_coincide", loss)]
    named += (
        [("loss_at_equal_distance", loss["at_equal_distance"])]
        if "at_equal_distance" in loss
        else []
    )
    for name, c in named:
        caveat = "".join(f"; {c[k]}" for k in ("reason", "caveat", "inconclusive") if c.get(k))
        print(f"{name}: {outcome(c)}  {c.get('interval_95', '')}  ({c['claim']}{caveat})")
    print(f"outputs in {args.out}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())

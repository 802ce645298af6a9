"""Effective length across training lengths and seeds, and a computed verdict on the paper's claims.

    python analysis/compare.py RUN_OR_PROBE_DIR [...] --out DIR

Each argument is a probed run (see analysis/probe.py --run); its training length and seed are
read from its checkpoints' config.json. Writes

    DIR/checkpoints.csv     every probed checkpoint: train_len, seed, tokens, effective length and
                            its bootstrap interval, status, f(effective length)
    DIR/conclusion.json     the tests below with their numbers
    DIR/figures/            Fig. 2a and 2b with seed bands; pass rate vs length of every milestone

The claims (analysis/verdicts/claims.py), each judged by the rule of its kind (analysis/verdicts/rules.py) on a
95% t-interval over independent units (seeds or runs), and printed with its rule, unit and n:

- a claim of equivalence (C2: curves coincide) holds when the interval lies inside +-margin, does not hold when it
  lies wholly outside, and is inconclusive otherwise;
- a claim of difference (Fig. 2a: the longer length reaches further; a data variant reaches further; f predicts
  better) holds when the interval lies above 0, does not hold when it lies below 0, and is not shown when it
  covers 0;
- either is not testable, with the reason, when there is too little to test.

- C1 (effective length falls short), on every run's last checkpoint, whatever its status: a run
  that passed no probed length is left out (a caveat says so); a run is short when its status is
  ok and its upper interval end (over tests) is below its training length L and its longest probed
  length, and not short when its interval's lower end is L or more; otherwise not shown short. One
  run not short makes the claim not hold; else one not shown short makes it not shown; a run
  without an interval end (probed with bootstrap 0), or probed only below L and not shown short,
  cannot be judged (not testable).
- Fig. 2a: the longer training length reaches a larger effective length, compared per seed at the
  largest tokens both runs of the seed reached, on checkpoints of any status (all passed: a lower
  bound, counted as censored); the paired difference with a t-interval over at least 3 seeds, its
  variance floored at the checkpoints' own noise over tests.
- C2 (curves coincide against f), on the checkpoints whose effective length is defined and
  uncensored (status ok), at least 3 from 3 seeds per length: points (effective length, log10 f)
  of both lengths on lines of one slope (fitted within each run, so no shift tilts it);
  each run's level is its mean residual over the effective lengths both lengths reach, and D, the
  shift in decades of f at equal effective length, is the longer length's mean level minus the
  shorter's, with a Welch t-interval over runs. The margin is +-log10(2) = 0.301 decades (a factor
  of 2 in f, `C2_MARGIN_DECADES`).
- The prediction: f's threshold rule against the best of tokens alone (capped at L), the constant L
  and the previous checkpoint, on held-out seeds, lengths and variants, over runs.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

from jsonargparse import ArgumentParser

from posfreq.analysis.niah.store import StaleResults
from posfreq.analysis.table_files import DamagedTable
from posfreq.analysis.verdicts.compare import compare
from posfreq.analysis.verdicts.probed_runs import CompareError
from posfreq.analysis.verdicts.rules import verdict_line
from posfreq.train.command_line import add_runs_argument, command_parser, parse, runs_of
from posfreq.train.outdir import OutputDirError


def build_parser() -> ArgumentParser:
    """`posfreq compare`: the probed runs and where the outputs go."""
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
    parser.add_argument("--no-figures", action="store_true", help="Skip the figures.")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Compare the runs, print each verdict and where the outputs are."""
    parser = build_parser()
    args = parse(parser, argv)
    runs = runs_of(args, parser)
    try:
        conclusion = compare(runs, args.out, not args.no_figures)
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
    recall = conclusion["recall_curves_coincide"]
    named += [("recall_curves_coincide", recall)]
    named += (
        [("recall_at_equal_tokens", recall["at_equal_tokens"])]
        if "at_equal_tokens" in recall
        else []
    )
    named += [("prediction", conclusion["prediction"])]
    for v in conclusion["variants"]:  # the data variants (the packing experiment): both tests each
        label = f"variant {v['variant']} vs {v['baseline']} at L = {v['train_len']}"
        named += [(f"{label}, equal tokens", v["equal_tokens"])]
        named += [(f"{label}, against f", v["against_f"])]
    for name, c in named:
        print(f"{name}: {verdict_line(c)}")
    print(f"outputs in {args.out}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`posfreq effective-length`: effective context length from NIAH pass-rate curves, joined with f(i), across runs.

Definition (the paper's, made exact; analysis/tables/pass_curve.py): the pass-rate curve is probed at increasing lengths
l_1 < l_2 < ...; the effective length is the largest probed length before the first length
whose pass rate falls strictly below the threshold (default 0.5). The whole curve is kept in
every output so any other definition can be recomputed. Two edge cases carry a status:

- ``none_passed``: the first probed length already fails; the effective length is written as 0
  and f(effective length) is left empty (undefined).
- ``all_passed``: no probed length fails; the effective length is the largest probed length,
  a lower bound (censored).

f(effective length) is Eq. 2 (`analysis.corpus.frequency.position_frequency`) applied to the
checkpoint's histogram of trained segment lengths, evaluated at i = effective length, as in the
paper ("f(1280) = 100B"); for i >= L it is 0, since no trained segment is longer than L.

Every figure here is derived from the probe's stored per-test records under an `Analysis`
(threshold, needles a pass needs, scoring rule, bootstrap), so any of them can be changed and
recomputed without decoding again (`--threshold` etc. below). Beside the pass-rate curve:
- a bootstrap interval of the effective length (tests resampled within each length, 95%);
- needle recall and the teacher-forced needle score by distance to the question, joined with f
  at every distance (`distance.csv`, analysis/tables/records.py); a test's distance is that of its
  k-th nearest needle (k = min_retrieved), the farthest it must reach to pass.

The run-level table `effective_length.csv` (analysis/tables/run_table.py) has one row per checkpoint (see
`RUN_COLUMNS`, then one ``pass_rate_<length>`` column per probed length). Comparing runs:

    python analysis/effective_length.py runs/L2048/probe runs/L4096/probe --out runs/fig2
    python analysis/effective_length.py runs/L2048/probe --threshold 0.4 --out runs/t04   # re-derive first

Everything goes to --out, never into the probe's folders: a derived table must not overwrite its source. With
an analysis option, each results folder RUN/probe is re-derived into OUT/RUN/probe (its probe.json names the
source as ``derived_from``; `posfreq compare OUT/RUN` reads it) and the figures are drawn from those tables;
without one, the figures are drawn from the probe's own tables. --out must be new, empty, or effective-length's
own (an older one's folder of its figures alone is adopted); any other folder is refused before any work.
"""

from __future__ import annotations

import sys
from dataclasses import fields
from pathlib import Path
from typing import Sequence

from jsonargparse import ArgumentParser

from posfreq.analysis.niah.store import StaleResults
from posfreq.analysis.plots.derived import draw_model, draw_run, draw_run_figures
from posfreq.analysis.table_files import DamagedTable
from posfreq.analysis.tables.derive import derive_model, derive_run
from posfreq.analysis.tables.pass_curve import Analysis
from posfreq.analysis.tables.rederive import (
    COMMAND,
    RederiveError,
    earlier_figures,
    plan_rederivations,
)
from posfreq.analysis.tables.run_table import find_run_results, load_run
from posfreq.train.command_line import add_runs_argument, command_parser, parse, runs_of
from posfreq.train.outdir import OutputDirError, claim_output_dir

"""The figures this command draws into --out (Fig. 3 only for several runs with f)."""


def build_parser() -> ArgumentParser:
    """`posfreq effective-length`: the runs, the figures' directory and the `Analysis` options to re-derive with."""
    parser = command_parser(
        "posfreq effective-length",
        "Draw Fig. 2a / 2b (and Fig. 3 from the runs' f(i)) for several probed runs on shared axes. An analysis "
        "option given here re-derives every table from the stored per-test records first (no decoding); one left "
        "unset (null) keeps the value the tables were derived with.",
    )
    add_runs_argument(parser)
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("runs/effective_length"),
        help="Directory for the figures and, with an analysis option, the re-derived tables (OUT/RUN/probe for "
        "RUN/probe); new, empty or effective-length's own. The probe's folders are never written.",
    )
    parser.add_class_arguments(Analysis, nested_key=None, as_group=True)
    parser.set_defaults({f.name: None for f in fields(Analysis)})
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Draw Fig. 2a/2b (and Fig. 3 from the runs' f(i)) for several runs on shared axes, re-deriving them first if asked."""
    parser = build_parser()
    args = parse(parser, argv)
    args.runs = runs_of(args, parser)
    try:
        return _main(args)
    except (
        StaleResults,
        DamagedTable,
        FileNotFoundError,
        OutputDirError,
        RederiveError,
    ) as err:
        raise SystemExit(f"error: {err}") from None


def _main(args) -> int:
    """`main` once the arguments are parsed: every check, then the claim of --out, then the writes there."""
    options = {f.name: args[f.name] for f in fields(Analysis) if args[f.name] is not None}
    sources = [find_run_results(run) for run in args.runs]
    plans = plan_rederivations(sources, args.out, options) if options else []
    claim_output_dir(args.out, COMMAND, written_before=earlier_figures)
    for plan in plans:  # every folder claimed before any table is written
        claim_output_dir(plan.dest, COMMAND, flag="--out's re-derivation folder")
    for plan in plans:
        if plan.run:
            draw_run(derive_run(plan.source, plan.analysis, dest=plan.dest))
        else:
            draw_model(derive_model(plan.source, plan.analysis, dest=plan.dest))
        print(
            f"{plan.source}: tables re-derived from the stored records with {options} into {plan.dest}"
        )
    runs = [load_run(directory) for directory in ([p.dest for p in plans] or sources)]
    paths = draw_run_figures(runs, args.out)
    with_f = [r for r in runs if r.frequency.size and r.frequency[0] > 0]
    if len(with_f) > 1:
        from posfreq.analysis.corpus.frequency import scale_to_budget
        from posfreq.analysis.plots import frequency as plots

        budget = min(float(r.frequency[0]) for r in with_f)
        curves = {r.train_len: scale_to_budget(r.frequency, budget) for r in with_f}
        paths += plots.plot_fig3_budget_comparison(
            curves, budget, args.out / "fig3_position_frequency"
        )
    for run in runs:
        last = run.rows[-1] if run.rows else {}
        print(
            f"{run.label}: {len(run.rows)} checkpoints; last effective length "
            f"{last.get('effective_length')} ({last.get('effective_length_status')})"
        )
    print("figures: " + ", ".join(str(p) for p in paths if p.suffix == ".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

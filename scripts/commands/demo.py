"""The main job in miniature: the paper's probing experiment on a 2-core CPU, over three seeds.

    python scripts/demo.py            # full (times: docs/performance.md)
    python scripts/demo.py --quick    # every stage at toy scale (CI runs it)

Stages, each one of the project's own commands (REPORT.md lists them exactly):
1. the demo tokenizer and corpora (scripts/miniature/corpus.py): a warm-up corpus of copy drills and
   a main corpus of NIAH-format documents on half of the Paul Graham essays, with skewed
   lengths; the probe uses the other half and needle numbers kept out of training;
2. the main corpus's length histogram and f(i) at both training lengths (Fig. 1 / Fig. 3 analogues);
3. token shards (scripts/prepare_data.py);
4. per seed, a warm-up run on the copy drills at L = 128 (an induction circuit must exist before
   retrieval can be learnt), then two models continued from it at L = 256 and L = 512 with the
   same data, model and token budget (train/pretrain.py --model.init-from); the seed sets the
   model init and the data order. Two single-thread lanes run the trainings (every warm-up first,
   then the continued runs, longest first). Milestone checkpoints carry trained-length histograms;
5. the NIAH probe of every milestone with rope (and with string for the first seed): a test of
   length n is an (n - 18)-token prompt and at most 18 new tokens (the 16-token answer and EOS fit);
6. analysis/compare.py over all runs: Fig. 2a / 2b with seed bands, pass-rate curves of every
   milestone, and the computed verdicts (shortfall, longer L reaches further, the paper's C2);
   the same verdicts under a stricter pass criterion (3 of 4 needles instead of the paper's 2),
   re-derived from the stored per-test records of copies of the probe directories (no decoding);
   a Table 1-style comparison of position schemes at the training length; REPORT.md.
"""

from __future__ import annotations

import functools
import json
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Literal, Optional

from jsonargparse import ArgumentParser

from posfreq.scripts.miniature.agreement import agreement, agreement_lines, checkpoints_of
from posfreq.scripts.miniature.pipeline import (
    DemoError,
    Pipeline,
    prepare_inputs,
    strict_comparison,
    table1,
    train_and_probe,
    warm_ups,
)
from posfreq.scripts.miniature.report import (
    DemoOutcome,
    collect_figures,
    publish_figures,
    validate,
    verdicts,
    write_report,
)
from posfreq.scripts.miniature.settings import EXPERIMENT_SETTINGS, FULL, QUICK, DemoSettings
from posfreq.train.atomic import write_json_atomic
from posfreq.train.command_line import command_parser, parse
from posfreq.train.outdir import OutputDirError, claim_output_dir, entry_names


def build_parser() -> ArgumentParser:
    """`posfreq demo`: full or quick mode, and where everything goes."""
    parser = command_parser(
        "posfreq demo",
        "The CPU miniature of the whole study, over three seeds: demo corpora and tokenizer, length histogram and "
        "f(i), token shards, warm-up and continued training at two lengths, the NIAH probe of every milestone, "
        "the comparison with computed verdicts, and OUT/REPORT.md listing every command it ran. Finished training "
        "and probing are reused on a rerun.",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="Every stage at toy scale, about a minute: checks that each stage runs and writes its "
        "outputs (its verdicts mean nothing).",
    )
    parser.add_argument(
        "--experiment",
        type=Literal["demo", "packing", "lengths"],
        default="demo",
        help="demo: the paper's probing experiment at L = 256 and 512; packing: at L = 512, concat vs "
        "best_fit vs length upsampling, same budget and seeds (scripts/miniature/packing_experiment.py); "
        "lengths: the demo's stages at L = 512 and 1024 with 1.5x the tokens (settings.LENGTHS), where "
        "a shortfall can show under the paper's criterion.",
    )
    parser.add_argument(
        "--out",
        type=Optional[Path],
        default=None,
        help="Output directory; null: runs/<experiment>, or runs/<experiment>-quick with --quick "
        "(under the current directory). The demo writes nothing outside it unless --publish-figures.",
    )
    parser.add_argument(
        "--publish-figures",
        action="store_true",
        help="After a full demo, copy its figures into this checkout's docs/figures (the README's), each "
        "replacing only the file of its name (`make figures`: a rerun reuses every finished stage).",
    )
    parser.add_argument(
        "--seeds",
        type=Optional[int],
        default=None,
        help="Training seeds 0..N-1 (null: the experiment's, 3 for the full demo, 5 for the packing experiment, 1 "
        "quick). The verdicts' t-intervals over seeds narrow with more (docs/demo.md); a rerun with more seeds "
        "into the same --out trains and probes only the new ones.",
    )
    parser.add_argument(
        "--lanes",
        type=Literal[1, 2],
        default=2,
        help="Trainings and probes run side by side (demo experiment).",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="Torch threads per lane (OMP_NUM_THREADS of every command; demo experiment). "
        "`--lanes 1 --threads 2` repeats the demo under another thread setting.",
    )
    parser.add_argument(
        "--reference",
        type=Optional[Path],
        default=None,
        help="Another finished demo's output directory (for example runs/demo): REPORT.md and "
        "agreement.json then say whether this run's effective lengths lie inside its intervals and "
        "whether the verdicts are the same.",
    )
    return parser


DEMO_ENTRIES = {
    "REPORT.md",
    "agreement.json",
    "compare",
    "corpus",
    "data",
    "figures",
    "logs",
    "position_freq",
}


def _earlier_demo(out: Path) -> bool:
    """Whether an older posfreq's demo or packing experiment wrote `out` (before output owners were recorded)."""
    return all(
        name in DEMO_ENTRIES or re.fullmatch(r"strict-\dof4|.+-s\d+", name)
        for name in entry_names(out)
    )


def main(argv: list[str] | None = None) -> int:
    """Run every stage and write OUT/REPORT.md (with --publish-figures, also copy the figures to docs/figures); a
    failed stage or check ends the command with its message."""
    try:
        return run_demo(parse(build_parser(), argv))
    except DemoError as err:
        raise SystemExit(str(err)) from None


def demo_settings(args) -> DemoSettings:
    """The experiment's settings (quick or full) with --seeds applied; refuses flags the experiment cannot take."""
    full, quick = EXPERIMENT_SETTINGS.get(args.experiment, (FULL, QUICK))
    settings = quick if args.quick else full
    if args.publish_figures and (args.quick or args.experiment != "demo"):
        raise SystemExit(
            "error: --publish-figures replaces the README's figures with a full demo's (its figures mean nothing in "
            "quick mode, and the other experiments draw others). Fix: drop --publish-figures, or run the full demo"
        )
    if args.seeds is not None:
        if args.seeds < 1:
            raise SystemExit(
                f"error: --seeds {args.seeds}: give at least one training seed. Fix: --seeds 3 (the default) or more"
            )
        settings = replace(settings, seeds=tuple(range(args.seeds)))
    return settings


def run_demo(args) -> int:
    """`main` once the arguments are parsed."""
    settings = demo_settings(args)
    out = (
        args.out or Path("runs") / (args.experiment + ("-quick" if args.quick else ""))
    ).resolve()
    try:
        claim_output_dir(out, "demo", written_before=_earlier_demo)
    except OutputDirError as err:
        raise SystemExit(f"error: {err}") from None
    if args.experiment == "packing":
        from posfreq.scripts.miniature.packing_experiment import run_experiment

        start = time.perf_counter()
        report = run_experiment(out, args.quick, args.seeds)
        print(
            f"\npacking experiment finished in {time.perf_counter() - start:.0f} s; report: {report}"
        )
        return 0
    if args.threads < 1:
        raise SystemExit(f"demo: --threads {args.threads}: give at least one torch thread per lane")
    if args.reference:
        checkpoints_of(
            args.reference / "compare"
        )  # a wrong --reference stops now, before any training
    p = Pipeline(out, args.lanes, args.threads)
    start = time.perf_counter()
    outcome = run_stages(p, settings, out, args.lanes)
    if args.reference:
        references = compare_with_reference(out, args.reference, outcome.strict_dir)
        outcome = replace(outcome, references=references)
    report = write_report(out, settings, args.quick, p, outcome, args.experiment)
    if args.quick:
        validate(out, outcome.runs, settings)
    elif args.publish_figures:
        for path in publish_figures(out):
            print(f"published {path}")
    print(f"\n{args.experiment} finished in {time.perf_counter() - start:.0f} s; report: {report}")
    if args.quick:
        print("\n" + verdicts(outcome.conclusion, quick=True)[0])  # what these numbers are worth
    print(
        "\nverdicts (the paper's criterion, 2 of 4 needles):\n"
        + "\n".join(verdicts(outcome.conclusion, quick=False))
    )
    print(
        f"\nunder {settings.strict_min_retrieved} of 4 needles:\n"
        + "\n".join(verdicts(outcome.strict, quick=False, with_loss=False))
    )
    return 0


def run_stages(p: Pipeline, settings: DemoSettings, out: Path, lanes: int) -> DemoOutcome:
    """Prepare the inputs, train and probe every (seed, length) on `lanes` lanes, compare the runs, make the Table 1
    analogue and the strict comparison, and collect the figures."""
    corpus = prepare_inputs(p, settings)
    # The lanes: every seed's warm-up is queued first, then each seed's continued runs, longest first; a
    # continued run waits for its own warm-up, which is queued before it, so none can starve.
    with ThreadPoolExecutor(max_workers=lanes) as pool:
        warm = warm_ups(p, settings, pool)
        jobs = {
            f"L{n}-s{s}": pool.submit(
                train_and_probe, p, settings, corpus, out / "data" / "main", warm[s], s, n
            )
            for s in settings.seeds
            for n in sorted(settings.train_lens, reverse=True)
        }
        runs = {
            name: job.result()
            for name, job in sorted(jobs.items(), key=lambda kv: (len(kv[0]), kv[0]))
        }
    p.run(
        "compare runs: Fig. 2a / 2b, verdicts",
        "analysis/compare.py",
        *[run / "probe" for run in runs.values()],
        "--out",
        out / "compare",
    )
    conclusion = json.loads((out / "compare" / "conclusion.json").read_text())
    first = settings.seeds[0]
    table = p.parallel(
        {
            n: functools.partial(table1, p, settings, corpus, runs[f"L{n}-s{first}"], n)
            for n in settings.train_lens
        }
    )
    strict_dir, strict = strict_comparison(p, settings, runs)
    collect_figures(out, runs, first, {"strict": strict_dir / "figures"})
    return DemoOutcome(runs, table, conclusion, strict, strict_dir)


def compare_with_reference(out: Path, reference: Path, strict_dir: Path) -> list[dict]:
    """How this demo's comparisons (the paper's criterion and the strict one) agree with a reference demo's, printed
    and written to OUT/agreement.json; a comparison the reference lacks (an older demo) is named and left out."""
    comparisons = {"paper": Path("compare"), "strict": strict_dir.relative_to(out)}
    missing = [
        path
        for path in comparisons.values()
        if not (reference / path / "checkpoints.csv").is_file()
    ]
    if missing:
        print(
            f"demo: the reference {reference} has no {', '.join(map(str, missing))} (an older demo): "
            "those comparisons are left out"
        )
    references = [
        agreement(out, reference.resolve(), criterion, path)
        for criterion, path in comparisons.items()
        if path not in missing
    ]
    write_json_atomic(out / "agreement.json", references, indent=1)
    print("\n".join(line for reference in references for line in agreement_lines(reference)))
    return references


if __name__ == "__main__":
    sys.exit(main())

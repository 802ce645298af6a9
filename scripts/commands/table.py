"""`posfreq table`: the paper's Table 1 (4-needle NIAH per position scheme and length) and Table 2 (RULER per task
and scheme) for one model, with 95% intervals and each scheme's paired difference from rope.

    posfreq table --model hf:DIR --niah-lengths 4096,8192 --tests 500 [--ruler-lengths 8192] --out DIR
    posfreq table --model RUN/checkpoints/tokens-... --schemes rope,string --tests 100 --out DIR
    posfreq table ... --shard 0/7          # one share of the schemes (slurm/table.sh runs them as an array)

Every scheme is probed with the same tests (`posfreq probe`'s runner and settings, one seed) into OUT/niah/<scheme>,
and RULER runs into OUT/ruler/<scheme> (`posfreq ruler`'s runner); both keep what they finished, so a rerun resumes.
The probe settings every row shares are ProbeSettings' flags (--tests is --tests-per-length). Then it writes
table1.csv, table1.md (a row per scheme, a column per length), table2.csv/.md, table1.png/.pdf and settings.json
(every scheme's options as it ran, defaults included). The baselines follow the paper's protocol unless their
options say otherwise: they assume a training length of 2/3 of the true one and a scale of 3/2
(train/positions/schemes.py).
"""

from __future__ import annotations

import os
import sys
from argparse import ArgumentTypeError
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Literal, Optional, Sequence, Union

from posfreq.analysis.niah import store
from posfreq.analysis.niah.settings import (
    CPU_BATCH_TOKENS,
    CPU_PREFILL_TOKENS,
    PROBE_BATCH_SIZE,
    ProbeSettings,
    parse_lengths,
)
from posfreq.analysis.niah.store import StaleResults
from posfreq.analysis.table_files import read_csv, write_csv
from posfreq.analysis.tables.measures import TOKEN_ACCURACY, scores_by_test
from posfreq.analysis.tables.paper_tables import (
    AUTO,
    PAPER_ORDER,
    TABLE1_COLUMNS,
    TABLE1_MEASURES,
    TOKEN_ACCURACY_COLUMNS,
    chosen_schemes,
    outcomes_by_test,
    scheme_of,
    table1,
    table1_document,
    table2,
    table2_document,
)
from posfreq.train.atomic import write_json_atomic, write_text_atomic
from posfreq.train.command_line import (
    add_alias,
    command_parser,
    parse,
    parse_shard,
    settings_from,
    summary,
)
from posfreq.train.outdir import OutputDirError, claim_output_dir
from posfreq.train.positions.names import SCHEMES
from posfreq.train.run_lock import RunLockError

if TYPE_CHECKING:  # what only running needs is imported there: the parser stays quick
    import torch

    from posfreq.analysis.niah.runner import Job

COMMAND = "table"

ROW_SET = frozenset({"positions", "position_options", "greedy", "engine"})
"""ProbeSettings' fields the table sets itself: each row's scheme and options, greedy from --measure, and the
engine from --engine (whose auto picks by model)."""

Options = dict[str, dict[str, Union[bool, int, float, str, None]]]


def build_parser():
    """The command line: the model, the schemes and their options, the tests, RULER, sharding, outputs."""
    parser = command_parser(f"posfreq {COMMAND}", summary(__doc__))
    parser.add_argument(
        "--model", type=str, required=True, help="hf:DIR (a transformers model) or a checkpoint"
    )
    parser.add_argument(
        "--schemes",
        type=str,
        default=",".join(PAPER_ORDER),
        help=f"comma list of rows, each a scheme ({', '.join(SCHEMES)}) or SCHEME@LABEL for a second row of "
        "a scheme with options of its own (string@half); rope must be one (the differences are from it)",
    )
    parser.add_argument(
        "--position-options",
        type=Options,
        default={},
        help='each row\'s options as JSON, e.g. \'{"string": {"shift": 2000}, "string@half": {"shift": '
        "4096}}'; defaults: the paper's",
    )
    parser.add_argument(
        "--engine",
        type=Literal["auto", "posfreq", "transformers"],
        default="auto",
        help="auto: transformers for hf:DIR (any architecture), posfreq for a checkpoint",
    )
    parser.add_argument(
        "--string-shift",
        type=Literal["paper", "auto"],
        default="paper",
        help="auto: also run STRING with S from rope's measured effective length E, S = min(L - E, L // 2) "
        "(docs/string.md), as the row string_auto beside the paper's S = L / 3",
    )
    parser.add_argument(
        "--niah-lengths",
        type=Optional[str],
        default=None,
        help="NIAH lengths, as the probe's --lengths (default: the probe's, multiples of 128 up to the training "
        "length L, from the shortest test the prompt allows)",
    )
    parser.add_argument(
        "--measure",
        type=Literal[tuple(TABLE1_MEASURES)],
        default="greedy",
        help="greedy: the answer holds 2 of 4 needles (the paper's); teacher_forced: 2 of 4 needles have every "
        "scored token as the argmax under teacher forcing (no decoding; paired and cheap on a CPU; --answer-order says "
        "which tokens are scored)",
    )
    # every row's probe settings, defined once by ProbeSettings (the rows set positions and their options, and
    # --measure and --engine set greedy and the engine)
    parser.add_class_arguments(ProbeSettings, nested_key=None, as_group=True, skip=ROW_SET)
    parser.set_defaults(tests_per_length=100)
    add_alias(parser, "tests_per_length", "--tests")
    parser.add_argument(
        "--ruler-lengths",
        type=Optional[str],
        default=None,
        help="RULER lengths for Table 2 (none: no Table 2)",
    )
    parser.add_argument("--ruler-samples", type=int, default=500, help="RULER samples per task")
    parser.add_argument("--ruler-tasks", type=str, default="all", help="RULER tasks")
    parser.add_argument("--device", type=str, default="auto", help="auto, cpu, cuda, cuda:1, ...")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    parser.add_argument(
        "--shard",
        type=Optional[str],
        default=None,
        help="I/N: run only schemes I, I+N, ... (a SLURM array task); a run without it writes the tables",
    )
    parser.add_argument(
        "--bootstrap",
        type=int,
        default=2000,
        help="bootstrap resamples (>= 1) of the paired differences and of the token accuracy",
    )
    parser.add_argument(
        "--out", type=Optional[str], default=None, help="default runs/table/<model>"
    )
    return parser


class TableError(ValueError):
    """A setting the tables cannot be made with, or a stage that failed; the message says which."""


def my_share(schemes: list[str], shard: str | None) -> list[str]:
    """The schemes shard I/N runs (all of them without --shard)."""
    if shard is None:
        return schemes
    try:
        index, count = parse_shard(shard)
    except ArgumentTypeError as err:
        raise TableError(f"{err}, e.g. --shard 0/7") from None
    return schemes[index::count]


def engine_of(args) -> str:
    """The engine --engine names, `auto` resolved: transformers for hf:DIR, posfreq for a checkpoint."""
    if args.engine != "auto":
        return args.engine
    return "transformers" if args.model.startswith("hf:") else "posfreq"


def row_settings(args) -> ProbeSettings:
    """The probe settings every row shares (each row then sets its scheme and options): ProbeSettings' flags,
    with --measure (teacher_forced decodes nothing) and --engine resolved."""
    try:  # positions and their options stay at the defaults here: each row sets its own
        return settings_from(
            ProbeSettings, args, ROW_SET, greedy=args.measure == "greedy", engine=engine_of(args)
        )
    except ValueError as err:
        raise TableError(str(err)) from None


def probe_job(args, settings: ProbeSettings, device: torch.device) -> Job:
    """The probe job of one row: its settings, --niah-lengths, and the probe's default batching on `device`."""
    from posfreq.analysis.niah.runner import Job, token_budget

    lengths = parse_lengths(args.niah_lengths) if args.niah_lengths else None
    return Job(
        settings=settings,
        lengths=lengths,
        batch_size=PROBE_BATCH_SIZE,
        device=device,
        batch_tokens=token_budget("auto", device, CPU_BATCH_TOKENS),
        prefill_tokens=token_budget("auto", device, CPU_PREFILL_TOKENS),
    )


def resolved_options(args, schemes: list[str]) -> tuple[int, dict[str, dict], Callable]:
    """(the model's training length L, every scheme's options as it runs them (defaults included), the resolver),
    from the model's config; refuses a bad option before anything is probed."""
    from posfreq.analysis.niah.sources import scheme_resolver

    unknown = sorted(set(args.position_options) - set(schemes))
    if unknown:
        raise TableError(f"--position-options names rows not in --schemes: {unknown}")
    train_len, resolve = scheme_resolver(args.model, engine_of(args))
    try:
        options = {
            s: resolve(scheme_of(s), dict(args.position_options.get(s, {}))) for s in schemes
        }
    except ValueError as err:
        raise TableError(f"--position-options: {err}") from None
    return train_len, options, resolve


def auto_shift(args, out: Path, train_len: int) -> tuple[int | None, str]:
    """(STRING's S from rope's measured effective length, how it was found): train/positions/string.py's
    shift_from_effective_length on the rope probe's effective length under --measure (None: no S to derive)."""
    from posfreq.train.positions.string import shift_from_effective_length

    # rope's probe scored its tests under --measure (run_probe), so its effective length is that measure's
    rows = read_csv(out / "niah" / "rope" / store.EFFECTIVE_LENGTH_FILE)
    effective = int(rows[-1]["effective_length"] or 0)
    status = rows[-1]["effective_length_status"]
    how = f"rope's effective length {effective} at L = {train_len} ({args.measure}, {status})"
    if (
        status != "ok"
    ):  # none passed, or every probed length passed: a lower bound, not a measurement
        return None, how + ": nothing to derive S from"
    shift = shift_from_effective_length(train_len, effective)
    return shift, how + (f": S = {shift}" if shift else ": nothing to derive S from")


def check_ruler_fits(args) -> None:
    """Every RULER task fits every --ruler-lengths length with the model's tokenizer, checked before anything
    is probed (RULER runs after the probes)."""
    from posfreq.analysis.ruler_task.evaluate import RulerError
    from posfreq.analysis.ruler_task.runner import OFFLINE_ENV, chosen_tasks, refuse_misfits

    os.environ.update(OFFLINE_ENV)  # before transformers imports the hub client
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        args.model.removeprefix("hf:"), trust_remote_code=False
    )
    try:
        refuse_misfits(tokenizer, chosen_tasks(args.ruler_tasks), parse_lengths(args.ruler_lengths))
    except RulerError as err:
        raise TableError(f"RULER at --ruler-lengths: {err}; nothing was probed") from None


def run_probe(args, row: str, job: Job, out: Path) -> None:
    """Probe one row (its scheme, `scheme_of`, with the row's options) into `out` with the tests every row shares,
    and derive its tables under --measure (no figures): the runner and the derivation `posfreq probe` uses."""
    from posfreq.analysis.niah.runner import probe_models
    from posfreq.analysis.niah.sources import Builders, model_source
    from posfreq.analysis.tables.derive import derive_model, effective_length_line
    from posfreq.analysis.tables.pass_curve import Analysis

    settings = replace(
        job.settings,
        positions=scheme_of(row),
        position_options=dict(args.position_options.get(row, {})),
    )
    try:
        row_job = replace(job, settings=settings)
    except ValueError as err:
        raise TableError(f"{row}: {err}") from None
    probe_models([model_source(args.model, settings)], [out], row_job, Builders(settings.haystack))
    scoring = "teacher_forced" if args.measure == "teacher_forced" else Analysis().scoring
    derived = derive_model(out, Analysis(scoring=scoring))
    print(f"table: {row}: {effective_length_line(derived.row)}", flush=True)


def run_ruler(args, row: str, out: Path) -> None:
    """RULER on one row (hf:DIR models only): the runner `posfreq ruler` calls, with the row's scheme and options."""
    from posfreq.analysis.ruler_task.evaluate import RulerError
    from posfreq.analysis.ruler_task.runner import run
    from posfreq.analysis.ruler_task.settings import RulerSettings

    settings = RulerSettings(
        model=args.model,
        positions=scheme_of(row),
        position_options=dict(args.position_options.get(row, {})),
        lengths=args.ruler_lengths,
        tasks=args.ruler_tasks,
        samples=args.ruler_samples,
        chat_template=args.chat_template,
        device=args.device,
        threads=args.threads,
        out=str(out),
    )
    try:
        run(settings)
    except RulerError as err:
        raise TableError(f"RULER of {row}: {err}") from None


def scheme_records(out: Path) -> list[dict]:
    """The checked records of a scheme's finished probe directory, every length, the tests it asked for."""
    finished = store.finished_records(out, store.read_json(out / store.META_FILE))
    return [r for _, records in finished.values() for r in records]


def write_tables(args, out: Path, schemes: list[str], options: dict[str, dict]) -> str:
    """Table 1 (and Table 2 when RULER ran) from the finished probe and RULER outputs; returns Table 1's Markdown."""
    from posfreq.analysis.plots.niah import plot_scheme_pass_rates

    records = {scheme: scheme_records(out / "niah" / scheme) for scheme in schemes}
    outcomes = {scheme: outcomes_by_test(records[scheme], args.measure) for scheme in schemes}
    rows = table1(outcomes, args.bootstrap)  # rope is the baseline (chosen_schemes)
    write_csv(out / "table1.csv", rows, list(TABLE1_COLUMNS))
    accuracy = []
    if all(r.get("tf_token_accuracy") is not None for s in schemes for r in records[s]):
        scores = {s: scores_by_test(TOKEN_ACCURACY, records[s]) for s in schemes}
        accuracy = table1(scores, args.bootstrap, binary=False)
        renamed = [{TOKEN_ACCURACY_COLUMNS.get(k, k): v for k, v in r.items()} for r in accuracy]
        columns = [TOKEN_ACCURACY_COLUMNS.get(c, c) for c in TABLE1_COLUMNS]
        write_csv(out / "table1_token_accuracy.csv", renamed, columns)
    settings = {
        "model": args.model,
        "tests_per_length": args.tests_per_length,
        "seed": args.seed,
        "measure": args.measure,
        "answer_order": args.answer_order,
        "engine": engine_of(args),
        "precision": args.precision,
        "position_options": options,
        "bootstrap": args.bootstrap,
    }
    write_json_atomic(out / "settings.json", settings, indent=1)
    text = table1_document(
        rows,
        accuracy,
        model=args.model,
        tests=args.tests_per_length,
        measure=args.measure,
        answer_order=args.answer_order,
        bootstrap=args.bootstrap,
        options=options,
    )
    write_text_atomic(out / "table1.md", text + "\n")
    plot_scheme_pass_rates(rows, out / "table1")
    if args.ruler_lengths:  # the measured-shift row is a NIAH row only
        ruled = [s for s in schemes if s != AUTO]
        scores = {s: read_csv(out / "ruler" / s / "scores.csv") for s in ruled}
        joined = table2(scores)
        write_csv(out / "table2.csv", joined, ["task", "length", *ruled])
        write_text_atomic(out / "table2.md", table2_document(joined, ruled))
    return text


def checked_settings(args) -> ProbeSettings:
    """The probe settings the rows share, after every flag a table needs is checked: refused here, before
    anything is probed, not by a probe or RULER run later."""
    if args.bootstrap < 1:
        raise TableError(
            f"--bootstrap {args.bootstrap}: the paired differences need at least one resample. "
            "Fix: --bootstrap 2000 (the default), or any number >= 1"
        )
    for flag, value, usual in (
        ("--tests", args.tests_per_length, 100),
        ("--ruler-samples", args.ruler_samples, 500),
    ):
        if value < 1:
            raise TableError(
                f"{flag} {value}: every length needs at least one test. Fix: {flag} {usual} (the default), "
                "or any number >= 1"
            )
    if args.measure == "teacher_forced" and not args.teacher_forced:
        raise TableError(
            "--measure teacher_forced --teacher-forced false leaves nothing to measure. Fix: drop "
            "--teacher-forced false, or use --measure greedy"
        )
    if args.ruler_lengths and not args.model.startswith("hf:"):
        raise TableError("--ruler-lengths: RULER runs a transformers model; pass --model hf:DIR")
    return row_settings(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Probe (and run RULER on) every scheme of this share, then, unsharded, write the tables."""
    args = parse(build_parser(), argv)
    try:
        settings = checked_settings(args)
        schemes = chosen_schemes(args.schemes)
        mine = my_share(schemes, args.shard)
        train_len, options, resolve = resolved_options(args, schemes)
        if args.ruler_lengths:
            check_ruler_fits(args)
        import torch

        from posfreq.train.devices import resolve_device

        job = probe_job(args, settings, resolve_device(args.device))
        torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
        name = Path(args.model.removeprefix("hf:")).resolve().name
        out = claim_output_dir(args.out or f"runs/table/{name}", COMMAND, shared=True)
        for scheme in mine:
            print(f"table: {scheme} ({mine.index(scheme) + 1} of {len(mine)})", flush=True)
            run_probe(args, scheme, job, out / "niah" / scheme)
            if args.ruler_lengths:
                run_ruler(args, scheme, out / "ruler" / scheme)
        if args.shard is not None:
            print(f"table: shard {args.shard} done; rerun without --shard to write the tables")
            return 0
        if args.string_shift == "auto":
            shift, how = auto_shift(args, out, train_len)
            print(f"table: string with the measured shift: {how}", flush=True)
            if shift is not None:
                given = {**args.position_options.get("string", {}), "shift": shift}
                args.position_options[AUTO] = given
                options[AUTO] = resolve("string", given)
                run_probe(args, AUTO, job, out / "niah" / AUTO)
                schemes = [*schemes, AUTO]
        print(write_tables(args, out, schemes, options))
        print(f"wrote {out}")
    except (TableError, StaleResults, OutputDirError, RunLockError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Effective context length by 4-needle NIAH, for one checkpoint, a whole run, or a HF model.

    python analysis/probe.py --checkpoint DIR | --run RUNDIR | --model hf:DIR  [options; --help lists them]

For each length n (default 128, 256, ... up to the training length) the same seeded tests
(`analysis.niah.needles`) are built as prompts of n - B tokens, B the answer budget (`--max-new-tokens`,
default 128, as the official script), so no answer token sits at a position >= n. They are
decoded greedily with the KV cache, a batch of equal-length prompts at a time, each row stopping
at EOS, once all four needles appeared, or after B tokens, and scored by the needles found
anywhere in the answer (the stricter first-line rule is stored beside it). A teacher-forced
score comes from one forward pass over prompt + reference answer: per needle, the log-probability
of its tokens and the share of them that are the model's argmax. Precision: `auto` is bf16
autocast on GPU and float32 on CPU.

Prompts: `--bos auto` follows how the model saw text in training: for our checkpoints, as the
trainer's shards hold it (no BOS), for Hugging Face models as their tokenizer's post-processor
or `add_bos_token` says; with `--chat-template true` the template frames the prompt as one user turn
(the answer prefix opens the assistant's turn) and no BOS is added beyond what it renders.

Results are keyed by content (`analysis.niah.store`): the model's weight and config files, the
prompts' ingredients (tokenizer files, haystack, frame), every decoding setting (scheme and its
options included) and the source of the code that decides answers. A length already probed
under the same key is never decoded again; results under another key are never reused. Default
outputs: runs/probe/<name>-<key> for one model, RUNDIR/probe-<scheme>-<key> for a run (one
directory per checkpoint inside, then the run tables: effective_length.csv with bootstrap
intervals and f, distance_by_checkpoint.csv, position_frequency.csv, Fig. 2a/2b). An output directory
must be new, empty or the probe's own (train/outdir.py's owner record, or an older probe's key.json
with only its files): any other folder is refused untouched before a model is read. Threshold,
needles per pass and scoring rule only enter the derived tables: change them with
`analysis/effective_length.py RESULTS --threshold ... --out DIR` without probing again (the re-derived
tables go to DIR; the probe's own stay as they are).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Optional, Sequence, Union

from jsonargparse import ArgumentParser, Namespace

from posfreq.analysis.niah.settings import (
    CPU_BATCH_TOKENS,
    CPU_PREFILL_TOKENS,
    PROBE_BATCH_SIZE,
    ProbeError,
    ProbeSettings,
    parse_lengths,
)
from posfreq.analysis.niah.store import StaleResults, check_results_dir
from posfreq.analysis.tables.pass_curve import Analysis
from posfreq.train.command_line import command_parser, parse, parse_shard, settings_from
from posfreq.train.model.backend_names import BACKENDS
from posfreq.train.outdir import OutputDirError
from posfreq.train.run_lock import RunLockError

if TYPE_CHECKING:
    from posfreq.analysis.niah.runner import Job

# What only probing needs (torch, the model, matplotlib) is imported once the flags are parsed, so that a usage
# error or --help stays instant.

AttentionBackend = Literal[BACKENDS]


def build_parser() -> ArgumentParser:
    """`posfreq probe`: the model source, `ProbeSettings`, `Analysis` and how the job runs."""
    parser = command_parser(
        "posfreq probe",
        "4-needle NIAH probe of one checkpoint, of every milestone of a run, or of a Hugging Face model: pass rate "
        "per test length, effective length with a bootstrap interval, f(effective length), teacher-forced needle "
        "scores. Results are keyed by the content of the model, prompts, settings and code: a length already "
        "probed under the same key is never decoded again.",
        config_file=True,
    )
    source = parser.add_argument_group("The model(s) to probe: exactly one of")
    source.add_argument(
        "--checkpoint",
        type=Optional[Path],
        default=None,
        help="One trainer checkpoint or consolidated model directory.",
    )
    source.add_argument(
        "--run",
        type=Optional[Path],
        default=None,
        help="A training run directory: probe every complete milestone RUN/checkpoints/tokens-*/.",
    )
    source.add_argument(
        "--model",
        type=Optional[str],
        default=None,
        help="hf:DIR, a Hugging Face Llama-family model directory.",
    )
    parser.add_argument(
        "--lengths",
        type=Optional[str],
        default=None,
        help="Test lengths n (prompt + answer budget): START:STOP:STEP (STOP included) or a comma "
        "list; null: 128, 256, ... up to the model's training length.",
    )
    parser.add_argument(
        "--out",
        type=Optional[Path],
        default=None,
        help="Output directory: new, empty or the probe's own (a folder holding anything else is refused "
        "untouched); null: runs/probe/<model>-<key> for one model, RUN/probe-<positions>-<key> for --run "
        "(key: a hash of model, prompts, settings and code).",
    )
    parser.add_argument(
        "--replace-stale",
        action="store_true",
        help="Delete results in --out made by other weights, prompts, settings or code (else refuse).",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=PROBE_BATCH_SIZE,
        help="Prompts decoded together, at most.",
    )
    parser.add_argument(
        "--batch-tokens",
        type=Union[int, Literal["auto"], None],
        default="auto",
        help="At most this many test tokens decoded together, so long tests go in smaller batches; "
        f"null: batch-size at every length; auto: {CPU_BATCH_TOKENS} on a CPU (8 tests of 1K, 2 of "
        "4K, 1 beyond: larger batches of long tests gain little and hold more KV caches; "
        "docs/performance.md) and no cap on a GPU.",
    )
    parser.add_argument(
        "--prefill-tokens",
        type=Union[int, Literal["auto"], None],
        default="auto",
        help="At most this many prompt tokens in one forward pass (whole prompts, one at least); "
        f"null: a batch at once; auto: {CPU_PREFILL_TOKENS} on a CPU (smaller activations stay in "
        "cache; docs/performance.md) and null on a GPU.",
    )
    parser.add_argument(
        "--device",
        type=str,
        default="auto",
        help="cpu, cuda, cuda:1, ...; auto: cuda when a GPU is available, else cpu.",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="CPU threads for torch (0: one per core available to this process).",
    )
    parser.add_argument(
        "--attention-backend",
        type=AttentionBackend,
        default="auto",
        help="Varlen attention backend (posfreq.train.model.attention); auto picks by device and what is "
        "installed.",
    )
    parser.add_argument(
        "--shard",
        type=Optional[str],
        default=None,
        help="With --run: probe checkpoints i, i+n, ... only, as i/n (0-based, e.g. "
        "$SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT), and write no run tables.",
    )
    parser.add_argument(
        "--merge-only",
        action="store_true",
        help="With --run: only write the run tables and figures from the stored results.",
    )
    parser.add_argument("--no-figures", action="store_true", help="Skip the PNG/PDF figures.")
    parser.add_argument("--quiet", action="store_true", help="No progress bar.")
    parser.add_class_arguments(ProbeSettings, nested_key=None, as_group=True)
    parser.add_class_arguments(Analysis, nested_key=None, as_group=True)
    return parser


def from_args(cls: type, args: Namespace, parser: ArgumentParser) -> Any:
    """An instance of the dataclass `cls` from its fields in `args`; a value its checks refuse is a usage error."""
    try:
        return settings_from(cls, args)
    except ValueError as err:
        parser.error(str(err))


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments, probe, print the effective length(s)."""
    parser = build_parser()
    args = parse(parser, argv)
    if sum(x is not None for x in (args.checkpoint, args.run, args.model)) != 1:
        parser.error("give exactly one of --checkpoint, --run, --model")
    if (args.shard or args.merge_only) and not args.run:
        parser.error("--shard and --merge-only need --run")
    if args.threads < 0:
        parser.error(f"--threads must be >= 0, got {args.threads}")
    try:
        lengths = parse_lengths(args.lengths) if args.lengths else None
        shard = parse_shard(args.shard) if args.shard else None
    except argparse.ArgumentTypeError as err:
        parser.error(str(err))
    import torch

    from posfreq.analysis.niah.runner import Job, token_budget
    from posfreq.analysis.tables.derive import effective_length_line
    from posfreq.train.devices import resolve_device

    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    try:
        device = resolve_device(args.device)
        settings = from_args(ProbeSettings, args, parser)
        analysis = from_args(Analysis, args, parser)
        if not settings.greedy and analysis.scoring != "teacher_forced":
            raise ValueError(
                f"--greedy false decodes no answer for scoring {analysis.scoring} to read; "
                "Fix: add --scoring teacher_forced"
            )
        job = Job(
            settings=settings,
            lengths=lengths,
            batch_size=args.batch_size,
            device=device,
            attention_backend=args.attention_backend,
            show_progress=not args.quiet,
            replace_stale=args.replace_stale,
            batch_tokens=token_budget(args.batch_tokens, device, CPU_BATCH_TOKENS),
            prefill_tokens=token_budget(args.prefill_tokens, device, CPU_PREFILL_TOKENS),
        )
    except ValueError as err:
        parser.error(str(err))
    try:
        out, rows = _probe(args, job, shard, analysis)
    except (ProbeError, StaleResults, OutputDirError, RunLockError) as err:
        raise SystemExit(f"error: {err}") from None
    for row in rows:
        print(f"{row['checkpoint']}: {effective_length_line(row)}")
    print(f"outputs in {out}/")
    return 0


def _probe(
    args: Namespace, job: Job, shard: tuple[int, int] | None, analysis: Analysis
) -> tuple[Path, list[dict]]:
    """Probe what the arguments name into their output directory, then derive its tables (and figures unless
    --no-figures): (that directory, effective_length rows). A shard of a run derives only its checkpoints; the
    run tables come from the run without --shard (or --merge-only)."""
    from posfreq.analysis.keys import probe_result_key
    from posfreq.analysis.niah.runner import probe_models, probe_run
    from posfreq.analysis.niah.sources import Builders, checkpoint_source, hf_source
    from posfreq.train.data.tokenizer import hf_dir

    settings = job.settings
    figures = not args.no_figures
    if args.run:
        out, probed = probe_run(args.run, args.out, job, shard, args.merge_only)
        return out, derive_probed(out, probed if shard is not None else None, analysis, figures)
    if args.out is not None:  # a user's folder is refused before the model is read
        check_results_dir(args.out)
    builders = Builders(settings.haystack)
    if args.checkpoint:
        source = checkpoint_source(args.checkpoint, settings)
    else:
        directory = hf_dir(args.model)
        if directory is None:
            raise ProbeError(
                f"--model expects hf:DIR, got {args.model!r} (use --checkpoint for our checkpoints)"
            )
        source = hf_source(directory, settings)
    out = args.out
    if out is None:
        key, _ = probe_result_key(source, builders.for_source(source, settings), settings)
        out = Path("runs/probe") / f"{source.name}-{key}"
    probe_models([source], [out], job, builders)
    return out, derive_probed(out, [out], analysis, figures)


def derive_probed(
    out: Path, models: Sequence[Path] | None, analysis: Analysis, figures: bool
) -> list[dict]:
    """The tables (and figures) of what a probe wrote: each of `models`' result directories, or with None the run
    tables of the run result directory `out` (every checkpoint's, then the run's). Returns the effective_length
    rows."""
    from posfreq.analysis.plots.derived import draw_model, draw_run
    from posfreq.analysis.tables.derive import derive_model, derive_run

    if models is None:
        derived = derive_run(out, analysis)
        if figures:
            draw_run(derived)
        return derived.rows
    rows = []
    for model in models:
        derived = derive_model(model, analysis)
        if figures:
            draw_model(derived)
        rows.append(derived.row)
    return rows


if __name__ == "__main__":
    sys.exit(main())

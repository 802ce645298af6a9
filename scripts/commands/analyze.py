"""`posfreq analyze`: a corpus's document-length histogram and its position frequency f(i) (Eq. 2), written out.

The maths is in analysis/corpus/frequency.py, the counting job in analysis/corpus/histogram.py; this module is the
command line. What it writes (analysis/corpus/outputs.py): histogram.npz, lengths.csv,
position_frequency_L{L}.csv and position_frequency.npz, the figures (analysis/plots/corpus.py: Fig. 1a/1b/1c
and f per packing strategy per L, Fig. 3 across L) and summary.json (analysis/corpus/summary.py).

The corpus f is Eq. 2 over the pieces (documents cut every L tokens). What a trainer trains depends on
its packing (train/data/packing_schedule.py): for each --packing strategy, the same plan the trainer's sampler
runs lays out one epoch's rows from the document lengths alone (no tokens), and Eq. 2 over the
attention segments of those rows is the trained f (the f_trained_<strategy> columns;
analysis/corpus/packing_prediction.py). best_fit and padded train exactly the corpus f (with their padding);
concat cuts the pieces again at every row boundary; stream cuts documents only at row boundaries. A histogram has no document order, so the documents
are laid out in a seeded random order: the prediction is exact in distribution, not row by row.

An output directory never contradicts itself (analysis/corpus/listed_outputs.py): summary.json's ``files`` lists
exactly the files the run wrote there (summary.json included). A rerun into the same --out first removes
what the previous run listed (never anything else), so outputs of training lengths no longer asked for do
not linger; summary.json is removed first and written last, so a directory without one is an unfinished run.

    python analysis/position_freq.py --corpus slimpajama --data-dir DIR --out runs/pf
    python analysis/position_freq.py --corpus pg-essays --train-len 256 512 --out runs/pf_pg
    python analysis/position_freq.py --corpus pg-essays --packing best_fit --length-upsample "{4096-: 2.0}" --seed 1
    python analysis/position_freq.py --corpus slimpajama --hf-dataset cerebras/SlimPajama-627B --out runs/pf
    python analysis/position_freq.py --corpus slimpajama --exclude-sources github --shard 3/64 --out runs/pf/shard_3
    python analysis/position_freq.py --merge runs/pf/shard_* --out runs/pf
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Optional, Sequence

from jsonargparse import ArgumentParser, Namespace

from posfreq.analysis.corpus.histogram import (
    CountSettings,
    LengthHistogram,
    cached_count,
    default_workers,
    merge_partials,
)
from posfreq.analysis.corpus.listed_outputs import earlier_run
from posfreq.analysis.corpus.outputs import ANALYZE, SHARD_PARTS, write_outputs, write_partial
from posfreq.analysis.corpus.packing_prediction import PackingSettings
from posfreq.analysis.corpus.summary import format_summary
from posfreq.train.command_line import command_parser, parse
from posfreq.train.data.corpora import Corpus, check_out_apart, unmatched_sources_warning
from posfreq.train.data.corpus_cli import add_corpus_arguments, corpus_from_args, shard_from_args
from posfreq.train.data.packing_strategies import STRATEGIES, Strategy
from posfreq.train.data.records import CorpusError, lost_files_report
from posfreq.train.data.upsample import LengthUpsample
from posfreq.train.outdir import OutputDirError, check_output_dir
from posfreq.train.run.config import MAX_TRAIN_LEN, DataSection, TrainConfig

DEFAULT_OUT = Path("runs/position_freq")


def build_parser() -> ArgumentParser:
    """The command line of `posfreq analyze` (flags shared with `posfreq prepare` come from train/data/corpus_cli.py)."""
    parser = command_parser(
        "posfreq analyze",
        "Document-length histogram of a corpus and the position frequency f(i) (Eq. 2): CSV, npz, figures and "
        "summary.json in --out. With --shard i/n, count files i, i+n, ... into a partial histogram; --merge sums "
        "the partial histograms of every shard.",
        config_file=True,
    )
    add_corpus_arguments(parser, default_corpus="slimpajama", default_workers=default_workers())
    parser.add_argument(
        "--train-len",
        type=int,
        nargs="+",
        default=[2048, 4096],
        help="training lengths L (each >= 2), e.g. --train-len 2048 4096",
    )
    parser.add_argument(
        "--total-tokens",
        "--budget-tokens",  # its name before the trainer's `total_tokens` became the one name
        type=float,
        default=1e12,
        help="token budget at which f is compared across L and packing strategies (Fig. 3, "
        "fig_packing, f_after_* columns); a trainer's tokens are steps x tokens per step, "
        "padding included",
    )
    parser.add_argument(
        "--packing",
        type=Strategy,
        nargs="+",
        default=list(STRATEGIES),
        help="packing strategies (the trainer's data.packing) whose trained f of one epoch is "
        "predicted from the document lengths: f_trained_<strategy> columns, summary.json "
        "by_train_len[L].packing, Fig. 3 panels, fig_packing_L{L}",
    )
    parser.add_argument(
        "--length-upsample",
        type=dict[str, float],
        default={},
        help="expected copies per epoch of a document by its length, as the trainer's "
        'data.length_upsample, e.g. "{0-1024: 0.5, 4096-: 2.0}"; SOURCE:LO-HI keys weight one '
        "source (the corpus f stays Eq. 2 over every document once)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the run's seed: the order of the documents (a histogram has none) and the packing "
        "plan's shuffles",
    )
    parser.add_argument(
        "--shuffle-block",
        type=int,
        default=DataSection.shuffle_block,
        help="documents per shuffle block, as the trainer's data.shuffle_block (best_fit packs "
        "within a block)",
    )
    parser.add_argument(
        "--global-batch-tokens",
        type=int,
        default=TrainConfig.global_batch_tokens,
        help="tokens per optimizer step, padding included (the paper: 4M): tokens lost per step "
        "= padding share x this",
    )
    parser.add_argument(
        "--max-docs",
        type=Optional[int],
        default=None,
        help="quick estimate: about this many documents, spread over the files (null: all)",
    )
    parser.add_argument(
        "--sample-files",
        type=Optional[int],
        default=None,
        help="quick estimate: this many evenly spaced files (null: all)",
    )
    parser.add_argument(
        "--merge",
        type=str,
        nargs="+",
        default=None,
        help="sum these partial histograms (shard output directories or their histogram.npz) "
        "instead of counting",
    )
    parser.add_argument(
        "--out",
        type=Optional[Path],
        default=None,
        help=f"output directory (null: {DEFAULT_OUT}/<corpus name>, or {DEFAULT_OUT}/shard_<i> "
        "with --shard)",
    )
    parser.add_argument(
        "--no-cache",
        action="store_true",
        help="recount even when a cached histogram matches (the cache is keyed by each file's path, inode, size, "
        "mtime and change time, not its bytes: a rewrite always moves the change time)",
    )
    parser.add_argument("--no-figures", action="store_true", help="skip the PNG/PDF figures")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def _check(parser: ArgumentParser, args: Namespace) -> None:
    """Refuse out-of-range numbers with a usage error naming the option."""
    limits = {
        "--train-len": (args.train_len, 2),
        "--workers": ([args.workers], 1),
        "--max-docs": ([args.max_docs], 1),
        "--sample-files": ([args.sample_files], 1),
        "--seed": ([args.seed], 0),
        "--shuffle-block": ([args.shuffle_block], 1),
        "--global-batch-tokens": ([args.global_batch_tokens], 1),
    }
    for flag, (values, minimum) in limits.items():
        bad = [v for v in values if v is not None and v < minimum]
        if bad:
            parser.error(f"{flag} must be >= {minimum}, got {bad}")
    too_long = [L for L in args.train_len if L > MAX_TRAIN_LEN]
    if too_long:
        parser.error(
            f"--train-len {too_long[0]:,} is beyond the longest training length posfreq plans ({MAX_TRAIN_LEN:,} "
            "tokens): its f and packing plan would take memory to match. Fix: a --train-len up to that"
        )
    if not (math.isfinite(args.total_tokens) and 1 <= args.total_tokens <= 2**53):
        parser.error(
            f"--total-tokens must be a finite token count from 1 to 2^53, got {args.total_tokens:g}"
        )
    if not args.packing:
        parser.error(f"--packing needs at least one of {list(STRATEGIES)}")
    try:
        LengthUpsample.parse(args.length_upsample, where="--length-upsample")
    except ValueError as err:
        parser.error(str(err))


def main(argv: Sequence[str] | None = None) -> int:
    """Count (or merge), then write outputs and print the summary."""
    parser = build_parser()
    args = parse(parser, argv)
    _check(parser, args)
    try:
        corpus = None if args.merge else corpus_from_args(args)  # resolved once: listing it is I/O
        out = None if corpus is None else Path(args.out or _default_out(args, corpus))
        if out is not None:  # before counting (hours on a full corpus), not only when writing
            check_out_apart(corpus, out)
            check_output_dir(
                out,
                ANALYZE,
                written_before=earlier_run(ANALYZE, SHARD_PARTS),
                parts=SHARD_PARTS,
            )
        histogram, meta = (
            merge_partials(map(Path, args.merge)) if corpus is None else _count(args, corpus)
        )
        warning = unmatched_sources_warning(
            meta["settings"].get("sources") or [], meta.get("read", {}).get("sources") or {}
        )
        if "sources" not in meta.get("read", {}):  # an older cache did not count them
            warning = None
        if meta.get("shard"):
            index, count = meta["shard"]
            path = write_partial(out, histogram, meta)
            if warning:
                print(warning, file=sys.stderr)
            print(
                f"shard {index}/{count}: {meta['read']['documents']:,} documents from {meta['files']} files "
                f"({meta['read']['skipped']:,} bad items skipped) -> {path}"
            )
            for line in lost_files_report(
                meta["read"]["lost_files"], f"{path} meta.read.lost_files"
            ):
                print(line)
            return 0
        if not histogram.counts().any():
            read = meta.get("read", {})
            raise CorpusError(
                f"corpus {meta['corpus']}: no documents ({meta['files']} files; {read.get('filtered', 0)} "
                f"filtered by source, {read.get('skipped', 0)} bad items skipped). Check --sources/--split."
            )
        if warning:  # after the refusal above, whose error line comes first
            print(warning, file=sys.stderr)
        if out is None:  # a merge: named by the merged corpus
            out = Path(args.out or DEFAULT_OUT / Path(meta["corpus"]).name)
        packing = PackingSettings(
            tuple(dict.fromkeys(args.packing)),
            args.length_upsample,
            args.seed,
            args.shuffle_block,
            args.global_batch_tokens,
        )
        figures = None
        if not args.no_figures:  # matplotlib is imported only when figures are drawn
            from posfreq.analysis.plots.corpus import write_figures as figures
        summary = write_outputs(
            out,
            histogram,
            meta,
            args.train_len,
            args.total_tokens,
            packing,
            figures=figures,
        )
    except (CorpusError, OutputDirError) as err:
        raise SystemExit(f"error: {err}") from None
    print(format_summary(summary, meta))
    print(
        f"outputs in {out}/ (summary.json lists them: histogram.npz, lengths.csv, position_frequency*, figures/)"
    )
    return 0


def _default_out(args: Namespace, corpus: Corpus) -> Path:
    """Where the outputs go without --out: DEFAULT_OUT/shard_<i> for a shard, else DEFAULT_OUT/<corpus name>."""
    shard = shard_from_args(args)
    if shard:
        return DEFAULT_OUT / f"shard_{shard[0]}"
    return DEFAULT_OUT / Path(corpus.name).name


def _count(args: Namespace, corpus: Corpus) -> tuple[LengthHistogram, dict]:
    """Count (or load from the cache) the histogram of `corpus`, as the arguments sample and shard it."""
    corpus = corpus.sample_files(args.sample_files)
    shard = shard_from_args(args)
    if shard:
        corpus = corpus.shard(*shard)
    per_file = (
        None if args.max_docs is None else max(1, -(-args.max_docs // max(1, len(corpus.files))))
    )
    settings = CountSettings(
        args.tokenizer,
        args.text_field,
        corpus.sources,
        corpus.default_source,
        per_file,
        args.on_error,
    )
    histogram, meta = cached_count(
        corpus, settings, args.workers, not args.no_cache, not args.quiet
    )
    if shard:
        meta["shard"] = list(shard)
    return histogram, meta


if __name__ == "__main__":
    sys.exit(main())

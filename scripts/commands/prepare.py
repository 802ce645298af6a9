"""`posfreq prepare`: tokenize a corpus into memory-mapped token shards, one shard per input file.

    python scripts/prepare_data.py --corpus pg-essays --out data/pg
    python scripts/prepare_data.py --corpus slimpajama --data-dir /data/SlimPajama-627B \\
        --exclude-sources github --out /data/tokens/slimpajama --workers 16 --shard 3/64
    python scripts/prepare_data.py --corpus slimpajama --hf-dataset cerebras/SlimPajama-627B --out DIR

How shards are named, resumed and validated: train/data/tokens/prepare.py.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

from jsonargparse import ArgumentParser

from posfreq.train.command_line import command_parser, parse
from posfreq.train.data.corpora import unmatched_sources_warning
from posfreq.train.data.corpus_cli import add_corpus_arguments, corpus_from_args, shard_from_args
from posfreq.train.data.records import CorpusError
from posfreq.train.data.tokenizer import Tokenizer, absolute_spec
from posfreq.train.data.tokens.prepare import prepare, skip_report
from posfreq.train.data.tokens.rerun import VAL_DIR
from posfreq.train.outdir import OutputDirError

_worker_tokenizer: Tokenizer | None = None


def build_parser() -> ArgumentParser:
    """The command line of `posfreq prepare` (the corpus options are shared with `posfreq analyze`)."""
    parser = command_parser(
        "posfreq prepare",
        "Tokenize a corpus into token shards (one per input file; each document's tokens then EOS) for "
        "pretraining. Restartable: a rerun skips complete shards. --shard i/n takes files i, i+n, ... (0-based).",
        config_file=True,
    )
    add_corpus_arguments(parser, default_corpus="pg-essays", default_workers=1)
    parser.add_argument("--out", type=str, required=True, help="output directory of token shards")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument(
        "--val-fraction",
        type=float,
        default=0.0,
        help="hold out this fraction of documents (chosen by a hash of their text) as validation "
        "shards in OUT/val, for the trainer's data.val_dir; 0: none",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Tokenize this shard's files of the corpus and print what was written (and skipped)."""
    parser = build_parser()
    args = parse(parser, argv)
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    if not 0 <= args.val_fraction < 1:
        parser.error(f"--val-fraction must be in [0, 1), got {args.val_fraction}")
    try:
        shard = shard_from_args(args) or (0, 1)
        out = Path(args.out)
        corpus = corpus_from_args(args)
        totals = prepare(
            corpus,
            out,
            args.tokenizer,
            args.workers,
            shard,
            args.on_error,
            progress=not args.quiet,
            val_fraction=args.val_fraction,
        )
    except (CorpusError, OutputDirError) as err:
        raise SystemExit(f"error: {err}") from None
    print(
        f"{out}: {totals.files} files in shard {shard[0]}/{shard[1]} "
        f"({totals.skipped_complete} already complete); wrote {totals.docs:,} documents, "
        f"{totals.tokens:,} tokens"
        + (
            f"; held out {totals.val_docs:,} documents in {out / VAL_DIR} (data.val_dir)"
            if args.val_fraction
            else ""
        )
    )
    for line in skip_report(totals, out):
        print(line)
    if totals.relabelled:
        print(
            f"{len(totals.relabelled)} complete shards (held-out ones included) had recorded these tokenizer "
            f"files at another path (the same files by content: the folder moved); they now record "
            f"{absolute_spec(args.tokenizer)}"
        )
    if totals.docs_in_out == 0:  # a --shard task of a corpus whose other tasks may have some
        print(
            f"warning: shard {shard[0]}/{shard[1]} has no documents ({totals.filtered_items:,} removed by the "
            "source filter, "
            f"{totals.skipped_items:,} bad records skipped)",
            file=sys.stderr,
        )
    warning = (
        None
        if totals.source_counts is None
        else unmatched_sources_warning(corpus.sources, totals.source_counts)
    )
    if warning:
        print(warning, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

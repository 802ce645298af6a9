"""The command-line options of every job that reads and tokenizes a corpus (`posfreq analyze`, `posfreq prepare`).

One definition, so the same thing has the same flag, help and parsing in both jobs: ``--corpus``,
``--data-dir``, ``--hf-dataset``, ``--split``, ``--text-field``, ``--sources``, ``--exclude-sources``,
``--tokenizer``, ``--workers``, ``--shard i/n`` and ``--on-error``. Source lists are a comma list
(``--sources arxiv,book``) or a YAML list (``--sources "[arxiv, book]"``, or ``sources: [arxiv, book]``
in a ``--config`` file).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Literal, Optional, Sequence, Union

from jsonargparse import ArgumentParser, Namespace

from posfreq.train.command_line import parse_shard
from posfreq.train.data.corpora import Corpus, resolve_corpus
from posfreq.train.data.formats import SUFFIXES
from posfreq.train.data.records import CorpusError

SourceList = Union[list[str], str]
"""A YAML list of source names, or one string of comma-separated names."""


def add_corpus_arguments(parser: ArgumentParser, default_corpus: str, default_workers: int) -> None:
    """Add the corpus, source, tokenizer, worker, shard and bad-input options to a command's parser."""
    parser.add_argument(
        "--corpus",
        type=str,
        default=default_corpus,
        help=f"slimpajama, pg-essays, or a local {'/'.join(SUFFIXES)} file or a directory of them",
    )
    parser.add_argument(
        "--data-dir",
        type=Optional[Path],
        default=None,
        help="SlimPajama root holding <split>/chunk1..chunk10/ (null: $SLIMPAJAMA_DIR, else "
        "<cache>/SlimPajama-627B)",
    )
    parser.add_argument(
        "--hf-dataset",
        type=Optional[str],
        default=None,
        help="with no local SlimPajama, stream this dataset with `datasets`, e.g. "
        "cerebras/SlimPajama-627B (null: $SLIMPAJAMA_HF, else the hub is not tried)",
    )
    parser.add_argument(
        "--split",
        type=Literal["train", "validation", "test"],
        default="train",
        help="SlimPajama split",
    )
    parser.add_argument(
        "--text-field", type=str, default="text", help="JSON key or Parquet column holding the text"
    )
    parser.add_argument(
        "--sources",
        type=SourceList,
        default=[],
        help="keep only these sources: a comma list (arxiv,book) or a YAML list; case and the "
        "RedPajama prefix are optional; empty: every source",
    )
    parser.add_argument(
        "--exclude-sources",
        type=SourceList,
        default=[],
        help="drop these sources, same syntax as --sources (e.g. github, as TinyLlama did)",
    )
    parser.add_argument(
        "--tokenizer",
        type=str,
        default="llama3",
        help="llama3 (exact Llama-3 ids), bytes, or hf:<dir> (a tokenizer.json directory)",
    )
    parser.add_argument(
        "--workers", type=int, default=default_workers, help="processes reading files in parallel"
    )
    parser.add_argument(
        "--shard",
        type=Optional[str],
        default=None,
        help="i/n: only files i, i+n, i+2n, ... (0-based, e.g. a SLURM array task); null: all files",
    )
    parser.add_argument(
        "--on-error",
        type=Literal["raise", "skip"],
        default="raise",
        help="bad input: stop with an error naming the file and line (raise), or count and skip it",
    )


def source_names(value: str | Sequence[str] | None) -> list[str]:
    """Source names from a comma list ('arxiv,book') or a list; a '-' or '!' prefix is refused (use the exclude
    option), so there is one way to drop a source."""
    items = value.split(",") if isinstance(value, str) else list(value or [])
    names = [str(item).strip() for item in items if str(item).strip()]
    prefixed = [name for name in names if name.startswith(("-", "!"))]
    if prefixed:
        raise CorpusError(
            f"source names {prefixed} start with '-' or '!'. Fix: list sources to drop with "
            f"--exclude-sources {','.join(n[1:] for n in prefixed)}"
        )
    return names


def corpus_from_args(args: Namespace) -> Corpus:
    """The corpus the parsed options name (all of it: `shard_from_args` says which part a job takes)."""
    sources = source_names(args.sources) + [
        f"-{name}" for name in source_names(args.exclude_sources)
    ]
    return resolve_corpus(
        args.corpus, args.data_dir, args.split, args.text_field, sources, args.hf_dataset
    )


def shard_from_args(args: Namespace) -> tuple[int, int] | None:
    """``--shard i/n`` as (i, n), or None when not given; a malformed value raises CorpusError."""
    if args.shard is None:
        return None
    try:
        return parse_shard(args.shard)
    except argparse.ArgumentTypeError as err:
        raise CorpusError(str(err)) from None

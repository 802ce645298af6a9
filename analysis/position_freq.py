"""`posfreq analyze`: a corpus's document-length histogram and its position frequency f(i) (Eq. 2), written out.

The maths is in analysis/frequency.py, the counting job in analysis/histogram.py; this module is the
command line and its writers: histogram.npz, lengths.csv, position_frequency_L{L}.csv and
position_frequency.npz, the figures (Fig. 1a/1b/1c per L, Fig. 3 across L) and summary.json.

An output directory never contradicts itself: summary.json's ``files`` lists exactly the files the
run wrote there (summary.json included). A rerun into the same --out first removes what the previous
run listed (never anything else), so outputs of training lengths no longer asked for do not linger;
summary.json is removed first and written last, so a directory without one is an unfinished run.

    python analysis/position_freq.py --corpus slimpajama --data-dir DIR --out runs/pf
    python analysis/position_freq.py --corpus pg-essays --train-len 256 512 --out runs/pf_pg
    python analysis/position_freq.py --corpus slimpajama --hf-dataset cerebras/SlimPajama-627B --out runs/pf
    python analysis/position_freq.py --corpus slimpajama --exclude-sources github --shard 3/64 --out runs/pf/shard_3
    python analysis/position_freq.py --merge runs/pf/shard_* --out runs/pf
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

if __package__ in (None, ""):  # run as a file: import the installed posfreq package, never this folder's files by bare name
    sys.path.pop(0)

from jsonargparse import ArgumentParser, Namespace

from posfreq.analysis.frequency import (
    concatenated_histogram,
    frequency_stats,
    length_stats,
    piece_histogram,
    position_frequency,
    scale_to_budget,
    uniform_length_histogram,
)
from posfreq.analysis.histogram import (
    HISTOGRAM_FILE,
    CountSettings,
    LengthHistogram,
    cached_count,
    default_workers,
    merge_partials,
    save_histogram,
)
from posfreq.train.atomic import atomic_open, write_json_atomic
from posfreq.train.cli import command_parser, parse
from posfreq.train.corpora import MAX_ERRORS_KEPT, CorpusError, lost_files_report
from posfreq.train.corpus_cli import add_corpus_arguments, corpus_from_args, shard_from_args

SUMMARY_FILE = "summary.json"
DEFAULT_OUT = Path("runs/position_freq")


class OutputDirError(ValueError):
    """An --out directory whose earlier outputs cannot be told apart from files this job did not write."""


# ----------------------------------------------------------------------------------- summary


def summarize(histogram: LengthHistogram, train_lens: Sequence[int], budget_tokens: float) -> dict:
    """summary.json's statistics: length stats and per-L position stats, for the whole corpus and per source."""

    def one(hist: np.ndarray) -> dict:
        """Length and position statistics of one histogram."""
        out = length_stats(hist)
        out["by_train_len"] = {str(L): frequency_stats(hist, L, budget_tokens) for L in train_lens}
        return out

    return {"all": one(histogram.counts()), "by_source": {s: one(histogram.counts(s)) for s in histogram.sources}}


def format_summary(summary: dict, meta: dict) -> str:
    """A one-screen text summary of summary.json."""
    total = summary["all"]
    read = meta.get("read", {})
    percentiles = ", ".join(f"{k} {v}" for k, v in total["percentiles"].items())
    lines = [
        f"corpus {meta.get('corpus')}: {meta.get('files')} files, {total['documents']:,} documents, "
        f"{total['tokens']:,} tokens (tokenizer {meta['settings']['tokenizer']}, length = tokens + EOS)",
        f"  lengths: mean {total['mean_length']:.1f}, median {total['median_length']}, {percentiles}, "
        f"max {total['max_length']}",
    ]
    if read.get("filtered") or read.get("skipped"):
        lines.append(f"  filtered by source: {read.get('filtered', 0):,}; "
                     f"skipped bad items: {read.get('skipped', 0):,} (the first {MAX_ERRORS_KEPT} in summary.json "
                     "meta.read.errors)")
    lines += lost_files_report(read.get("lost_files", []), "summary.json meta.read.lost_files")
    lines.append(f"  {'source':<26}{'docs':>12}{'L':>7}{'at L':>8}{'i<=L/2':>9}{'i>=3L/4':>9}")
    rows = [("all", total)]
    if len(summary["by_source"]) > 1:
        rows += sorted(summary["by_source"].items())
    for name, stats in rows:
        for L, fs in stats["by_train_len"].items():
            lines.append(
                f"  {name[:25]:<26}{stats['documents']:>12,}{L:>7}{fs['share_pieces_at_L']:>8.1%}"
                f"{fs['share_positions_le_half_L']:>9.1%}{fs['share_positions_ge_three_quarter_L']:>9.1%}"
            )
    return "\n".join(lines)


# ------------------------------------------------------------------------ the output directory


def previous_outputs(out: Path) -> list[Path]:
    """The files the previous run wrote into `out`, as its summary.json lists them (none without a summary.json).

    Raises OutputDirError when a summary.json is there but lists no files (an older version, or another job,
    wrote it), or lists a path outside `out` or a folder: nothing is deleted then.
    """
    path = out / SUMMARY_FILE
    if not path.is_file():
        return []
    fix = f"Fix: remove the old outputs in {out}, or write to another --out."
    try:
        listed = json.loads(path.read_text()).get("files")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        listed = None
    if not isinstance(listed, list) or not all(isinstance(name, str) for name in listed):
        raise OutputDirError(f"{path} does not list the files of the run that wrote it, so this job cannot tell "
                             f"its own outputs from other files there. {fix}")
    root = out.resolve()
    files = [out / name for name in listed]
    outside = [name for name, file in zip(listed, files) if root not in file.resolve().parents]
    if outside:
        raise OutputDirError(f"{path} lists files outside {out}: {outside}. {fix}")
    folders = [name for name, file in zip(listed, files) if file.is_dir()]
    if folders:
        raise OutputDirError(f"{path} lists folders, not files: {folders}. {fix}")
    return files


def remove_outputs(out: Path, files: Sequence[Path]) -> None:
    """Delete the listed files of a previous run (summary.json first) and the folders they leave empty."""
    for file in sorted(files, key=lambda f: f.name != SUMMARY_FILE):
        file.unlink(missing_ok=True)
    for folder in sorted({f.parent for f in files if f.parent != out}, key=lambda d: -len(d.parts)):
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()


def write_summary(out: Path, written: Sequence[Path], content: dict) -> None:
    """Write summary.json last: `content` plus ``files``, the sorted paths (relative to `out`) of every file written."""
    names = {str(path.relative_to(out)) for path in written} | {SUMMARY_FILE}
    write_json_atomic(out / SUMMARY_FILE, {**content, "files": sorted(names)}, indent=2)


def replace_outputs(out: Path) -> None:
    """Make `out` ready for a new run: create it, and remove what the previous run there wrote."""
    previous = previous_outputs(out)
    out.mkdir(parents=True, exist_ok=True)
    remove_outputs(out, previous)


# ----------------------------------------------------------------------------------- writers


def write_outputs(
    out: Path, histogram: LengthHistogram, meta: dict, train_lens: Sequence[int], budget_tokens: float,
    figures: bool = True,
) -> dict:
    """Write histogram (npz, CSV), f(i) per L (npz, CSV), figures and summary.json; return the summary."""
    replace_outputs(out)
    written = [save_histogram(out / HISTOGRAM_FILE, histogram, meta),
               _write_length_csv(out / "lengths.csv", histogram)]
    arrays = {}
    for L in train_lens:
        columns = {"f": position_frequency(histogram.counts(), L)}
        columns[f"f_after_{budget_tokens:.3g}_tokens"] = scale_to_budget(columns["f"], budget_tokens)
        for source in histogram.sources:
            columns[f"f_{source}"] = position_frequency(histogram.counts(source), L)
        written.append(_write_columns_csv(out / f"position_frequency_L{L}.csv", columns))
        arrays.update({f"L{L}/{name}": values for name, values in columns.items()})
    with atomic_open(out / "position_frequency.npz", "wb") as fh:
        np.savez_compressed(fh, **arrays)
    written.append(out / "position_frequency.npz")
    if figures:
        written += _write_figures(out / "figures", histogram.counts(), train_lens, budget_tokens)
    summary = summarize(histogram, train_lens, budget_tokens)
    write_summary(out, written, {"meta": meta, **summary})
    return summary


def write_partial(out: Path, histogram: LengthHistogram, meta: dict) -> Path:
    """A shard's outputs: its partial histogram (for --merge) and a summary.json of its metadata; returns the .npz."""
    replace_outputs(out)
    path = save_histogram(out / HISTOGRAM_FILE, histogram, meta)
    write_summary(out, [path], {"meta": meta})
    return path


def _write_length_csv(path: Path, histogram: LengthHistogram) -> Path:
    """lengths.csv: every length that occurs, with its count overall and per source."""
    total = histogram.counts()
    per_source = {s: histogram.counts(s) for s in histogram.sources}
    with atomic_open(path, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["length", "documents"] + [f"documents_{s}" for s in per_source])
        for n in np.flatnonzero(total):
            writer.writerow([int(n), int(total[n])] + [int(h[n]) if n < h.size else 0 for h in per_source.values()])
    return path


def _write_columns_csv(path: Path, columns: dict[str, np.ndarray]) -> Path:
    """A CSV with an index column i and one column per array."""
    with atomic_open(path, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["i", *columns])
        for i, row in enumerate(zip(*columns.values())):
            writer.writerow([i, *(v.item() if isinstance(v, np.generic) else v for v in row)])
    return path


def _write_figures(directory: Path, hist: np.ndarray, train_lens: Sequence[int], budget_tokens: float) -> list[Path]:
    """Fig. 1a/1b/1c for every L and Fig. 3 comparing all L at the same token budget; returns the files."""
    from posfreq.analysis import plots

    paths = []
    for L in train_lens:
        f = position_frequency(hist, L)
        paths += plots.plot_fig1a_length_and_frequency(piece_histogram(hist, L), f, L, directory / f"fig1a_L{L}")
        tokens = int(f[0])
        uniform = position_frequency(uniform_length_histogram(L), L)
        paths += plots.plot_fig1b_uniform_lengths(scale_to_budget(uniform, tokens), L, directory / f"fig1b_L{L}")
        full = position_frequency(concatenated_histogram(1, L), L)
        paths += plots.plot_fig1c_concatenated(scale_to_budget(full, tokens), L, directory / f"fig1c_L{L}")
    if len(train_lens) > 1:
        curves = {L: scale_to_budget(position_frequency(hist, L), budget_tokens) for L in train_lens}
        name = "fig3_" + "_vs_".join(f"L{L}" for L in train_lens)
        paths += plots.plot_fig3_budget_comparison(curves, budget_tokens, directory / name)
    return paths


# -------------------------------------------------------------------------------------- CLI


def build_parser() -> ArgumentParser:
    """The command line of `posfreq analyze` (flags shared with `posfreq prepare` come from train/corpus_cli.py)."""
    parser = command_parser(
        "posfreq analyze",
        "Document-length histogram of a corpus and the position frequency f(i) (Eq. 2): CSV, npz, figures and "
        "summary.json in --out. With --shard i/n, count files i, i+n, ... into a partial histogram; --merge sums "
        "the partial histograms of every shard.",
        config_file=True,
    )
    add_corpus_arguments(parser, default_corpus="slimpajama", default_workers=default_workers())
    parser.add_argument("--train-len", type=int, nargs="+", default=[2048, 4096],
                        help="training lengths L (each >= 2), e.g. --train-len 2048 4096")
    parser.add_argument("--budget-tokens", type=float, default=1e12,
                        help="token budget at which f is compared across L (Fig. 3, f_after_* columns)")
    parser.add_argument("--max-docs", type=Optional[int], default=None,
                        help="quick estimate: about this many documents, spread over the files (null: all)")
    parser.add_argument("--sample-files", type=Optional[int], default=None,
                        help="quick estimate: this many evenly spaced files (null: all)")
    parser.add_argument("--merge", type=str, nargs="+", default=None,
                        help="sum these partial histograms (shard output directories or their histogram.npz) "
                             "instead of counting")
    parser.add_argument("--out", type=Optional[Path], default=None,
                        help=f"output directory (null: {DEFAULT_OUT}/<corpus name>, or {DEFAULT_OUT}/shard_<i> "
                             "with --shard)")
    parser.add_argument("--no-cache", action="store_true", help="recount even when a cached histogram matches")
    parser.add_argument("--no-figures", action="store_true", help="skip the PNG/PDF figures")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def _check(parser: ArgumentParser, args: Namespace) -> None:
    """Refuse out-of-range numbers with a usage error naming the option."""
    limits = {"--train-len": (args.train_len, 2), "--workers": ([args.workers], 1),
              "--max-docs": ([args.max_docs], 1), "--sample-files": ([args.sample_files], 1)}
    for flag, (values, minimum) in limits.items():
        bad = [v for v in values if v is not None and v < minimum]
        if bad:
            parser.error(f"{flag} must be >= {minimum}, got {bad}")


def main(argv: Sequence[str] | None = None) -> int:
    """Count (or merge), then write outputs and print the summary."""
    parser = build_parser()
    args = parse(parser, argv)
    _check(parser, args)
    try:
        histogram, meta = merge_partials(map(Path, args.merge)) if args.merge else _count(args)
        if meta.get("shard"):
            index, count = meta["shard"]
            out = args.out or DEFAULT_OUT / f"shard_{index}"
            path = write_partial(out, histogram, meta)
            print(f"shard {index}/{count}: {meta['read']['documents']:,} documents from {meta['files']} files "
                  f"({meta['read']['skipped']:,} bad items skipped) -> {path}")
            for line in lost_files_report(meta["read"]["lost_files"], f"{path} meta.read.lost_files"):
                print(line)
            return 0
        if not histogram.counts().any():
            read = meta.get("read", {})
            raise CorpusError(
                f"corpus {meta['corpus']}: no documents ({meta['files']} files; {read.get('filtered', 0)} "
                f"filtered by source, {read.get('skipped', 0)} bad items skipped). Check --sources/--split."
            )
        out = args.out or DEFAULT_OUT / Path(meta["corpus"]).name
        summary = write_outputs(out, histogram, meta, args.train_len, args.budget_tokens, figures=not args.no_figures)
    except (CorpusError, OutputDirError) as err:
        raise SystemExit(f"error: {err}") from None
    print(format_summary(summary, meta))
    print(f"outputs in {out}/ (summary.json lists them: histogram.npz, lengths.csv, position_frequency*, figures/)")
    return 0


def _count(args: Namespace) -> tuple[LengthHistogram, dict]:
    """Resolve the corpus from the arguments and count (or load from the cache) its histogram."""
    corpus = corpus_from_args(args).sample_files(args.sample_files)
    shard = shard_from_args(args)
    if shard:
        corpus = corpus.shard(*shard)
    per_file = None if args.max_docs is None else max(1, -(-args.max_docs // max(1, len(corpus.files))))
    settings = CountSettings(args.tokenizer, args.text_field, corpus.sources, corpus.default_source,
                             per_file, args.on_error)
    histogram, meta = cached_count(corpus, settings, args.workers, not args.no_cache, not args.quiet)
    if shard:
        meta["shard"] = list(shard)
    return histogram, meta


if __name__ == "__main__":
    sys.exit(main())

"""`posfreq analyze`: a corpus's document-length histogram and its position frequency f(i) (Eq. 2), written out.

The maths is in analysis/frequency.py, the counting job in analysis/histogram.py; this module is the
command line and its writers: histogram.npz, lengths.csv, position_frequency_L{L}.csv and
position_frequency.npz, the figures (Fig. 1a/1b/1c and f per packing strategy per L, Fig. 3 across L)
and summary.json.

The corpus f is Eq. 2 over the pieces (documents cut every L tokens). What a trainer trains depends on
its packing (train/packing_plan.py): for each --packing strategy, the same plan the trainer's sampler
runs lays out one epoch's rows from the document lengths alone (no tokens), and Eq. 2 over the
attention segments of those rows is the trained f (the f_trained_<strategy> columns). best_fit and
padded train exactly the corpus f (with their padding); concat cuts the pieces again at every row
boundary. A histogram has no document order, so the documents are laid out in a seeded random order:
the prediction is exact in distribution, not row by row.

An output directory never contradicts itself: summary.json's ``files`` lists exactly the files the
run wrote there (summary.json included). A rerun into the same --out first removes what the previous
run listed (never anything else), so outputs of training lengths no longer asked for do not linger;
summary.json is removed first and written last, so a directory without one is an unfinished run.

    python analysis/position_freq.py --corpus slimpajama --data-dir DIR --out runs/pf
    python analysis/position_freq.py --corpus pg-essays --train-len 256 512 --out runs/pf_pg
    python analysis/position_freq.py --corpus pg-essays --packing best_fit --length-upsample "{4096-: 2.0}" --seed 1
    python analysis/position_freq.py --corpus slimpajama --hf-dataset cerebras/SlimPajama-627B --out runs/pf
    python analysis/position_freq.py --corpus slimpajama --exclude-sources github --shard 3/64 --out runs/pf/shard_3
    python analysis/position_freq.py --merge runs/pf/shard_* --out runs/pf
"""

from __future__ import annotations

import csv
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Sequence

import numpy as np

if __package__ in (
    None,
    "",
):  # run as a file: import the installed posfreq package, never this folder's files by bare name
    sys.path.pop(0)

from jsonargparse import ArgumentParser, Namespace

from posfreq.analysis.frequency import (
    concatenated_histogram,
    first_split,
    frequency_stats,
    length_stats,
    piece_histogram,
    position_frequency,
    position_shares,
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
from posfreq.train.packing_plan import (
    STRATEGIES,
    Documents,
    EpochPrediction,
    Strategy,
    predict_trained_histogram,
)
from posfreq.train.run_config import DataSection, TrainConfig
from posfreq.train.run_log import human
from posfreq.train.upsample import LengthUpsample

SUMMARY_FILE = "summary.json"
DEFAULT_OUT = Path("runs/position_freq")


class OutputDirError(ValueError):
    """An --out directory whose earlier outputs cannot be told apart from files this job did not write."""


# ----------------------------------------------------------------------- trained f per packing

SPLIT_TOLERANCE = 0.05
"""Fig. 3's notes: two curves are apart where they differ by more than this share of the larger."""


@dataclass(frozen=True)
class PackingSettings:
    """The trainer's settings that decide what one epoch trains (its `data.*` keys, `seed`, `global_batch_tokens`)."""

    strategies: tuple[str, ...] = STRATEGIES
    """Packing strategies to predict (data.packing)."""
    length_upsample: Mapping[str, float] = field(default_factory=dict)
    """Expected copies per epoch of a document by its length (and source), as data.length_upsample."""
    seed: int = 0
    """The run's seed: the documents' order (a histogram has none) and the plan's shuffles."""
    shuffle_block: int = DataSection.shuffle_block
    """Documents per shuffle block (data.shuffle_block; best_fit's packing buffer)."""
    global_batch_tokens: int = TrainConfig.global_batch_tokens
    """Tokens per optimizer step, padding included: tokens lost per step = padding share x this."""

    def as_dict(self) -> dict:
        """The settings as summary.json records them."""
        return {
            "strategies": list(self.strategies),
            "length_upsample": dict(self.length_upsample),
            "seed": self.seed,
            "shuffle_block": self.shuffle_block,
            "global_batch_tokens": self.global_batch_tokens,
        }


Predictions = Mapping[int, Mapping[str, EpochPrediction]]
"""One epoch's trained-length histogram per training length L and packing strategy."""


def predict_packing(
    histogram: LengthHistogram, train_lens: Sequence[int], settings: PackingSettings
) -> Predictions:
    """One epoch's trained-length histogram per L and strategy: the trainer's packing plan over the corpus's
    document lengths, laid out in a seeded random order (exact in distribution; module docstring)."""
    upsample = LengthUpsample.parse(settings.length_upsample, where="--length-upsample")
    missing = sorted(set(upsample.sources) - set(histogram.sources))
    if missing:
        raise CorpusError(
            f"--length-upsample names sources this corpus does not have: {missing} (its sources: "
            f"{histogram.sources})"
        )
    documents = Documents.from_histogram(
        histogram.by_source if upsample.sources else histogram.counts(), seed=settings.seed
    )
    return {
        L: {
            strategy: predict_trained_histogram(
                documents,
                L,
                strategy,
                seed=settings.seed,
                shuffle_block=settings.shuffle_block,
                upsample=upsample,
            )
            for strategy in settings.strategies
        }
        for L in train_lens
    }


def packing_stats(prediction: EpochPrediction, train_len: int, global_batch_tokens: int) -> dict:
    """One strategy's numbers at one L: where its trained position occurrences sit and what its padding costs."""
    segments = prediction.histogram
    return {
        **position_shares(position_frequency(segments, train_len)),
        "share_segments_at_L": float(segments[train_len] / segments.sum()),
        "padding_share": prediction.padding_share,
        "tokens_lost_per_step": prediction.padding_share * global_batch_tokens,
        "rows_per_epoch": prediction.rows,
        "tokens_per_epoch": prediction.tokens,
    }


def trained_at_budget(
    prediction: EpochPrediction, train_len: int, budget_tokens: float
) -> np.ndarray:
    """A strategy's trained f after `budget_tokens` training tokens (steps x tokens per step, padding included)."""
    return scale_to_budget(
        position_frequency(prediction.histogram, train_len),
        budget_tokens,
        positions=prediction.rows * train_len,
    )


def fig3_note(
    curves: Mapping[int, np.ndarray],
    corpus_stats: Mapping[int, dict],
    padding: Mapping[int, float] | None = None,
    concat: bool = False,
) -> str:
    """Fig. 3's note on one panel: are the shortest and the longest L's curves apart at i = 0 (padding), from which
    i do their shapes f/f(0) part, and why, when that is before i = L/2 (the paper, SlimPajama at 2K vs 4K: close up
    to i = 1024). `corpus_stats[L]` is `frequency_stats` of the corpus."""
    short, long = min(curves), max(curves)
    a, b = curves[short], curves[long]
    tolerance = f"{SPLIT_TOLERANCE:.0%}"
    parts = []
    if padding and first_split(a[:1], b[:1], SPLIT_TOLERANCE) == 0:
        parts.append(
            f"Apart from i = 0: padding fills {padding[short]:.1%} of the L = {short} rows and "
            f"{padding[long]:.1%} of the L = {long} rows, and padding counts in the budget but trains no "
            "position."
        )
    split = first_split(a / a[0], b / b[0], SPLIT_TOLERANCE)
    if split is None:
        parts.append(f"f/f(0) within {tolerance} at every i < {short}.")
    elif split >= short // 2:
        parts.append(f"f/f(0) within {tolerance} up to i = {split - 1}.")
    else:
        share = corpus_stats[short]["share_tokens_in_documents_longer_than_L"]
        parts.append(
            f"f/f(0) more than {tolerance} apart from i = {split} (the paper, SlimPajama at 2K vs 4K: close up to "
            f"i = 1024): {share:.0%} of the tokens are in documents longer than {short}, cut every {short} tokens at "
            f"L = {short} but every {long} at L = {long}"
            + (", and concat cuts again at every row boundary" if concat else "")
            + "; a cut removes every relative position "
            "across it."
        )
    return " ".join(parts)


# ----------------------------------------------------------------------------------- summary


def summarize(
    histogram: LengthHistogram,
    train_lens: Sequence[int],
    budget_tokens: float,
    predictions: Predictions,
    packing: PackingSettings,
) -> dict:
    """summary.json's statistics: length stats and per-L position stats, for the whole corpus and per source, and
    for the whole corpus per packing strategy (``by_train_len[L]["packing"][strategy]``, `packing_stats`)."""

    def one(hist: np.ndarray) -> dict:
        """Length and position statistics of one histogram."""
        out = length_stats(hist)
        out["by_train_len"] = {str(L): frequency_stats(hist, L, budget_tokens) for L in train_lens}
        return out

    total = one(histogram.counts())
    for L in train_lens:
        total["by_train_len"][str(L)]["packing"] = {
            strategy: packing_stats(prediction, L, packing.global_batch_tokens)
            for strategy, prediction in predictions[L].items()
        }
    return {
        "all": total,
        "by_source": {s: one(histogram.counts(s)) for s in histogram.sources},
        "packing_settings": packing.as_dict(),
    }


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
        lines.append(
            f"  filtered by source: {read.get('filtered', 0):,}; "
            f"skipped bad items: {read.get('skipped', 0):,} (the first {MAX_ERRORS_KEPT} in summary.json "
            "meta.read.errors)"
        )
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
    packing = summary["packing_settings"]
    lines.append(
        f"  trained in one epoch, per packing (seed {packing['seed']}, length_upsample "
        f"{packing['length_upsample']}, {packing['global_batch_tokens']:,} tokens per step):"
    )
    lines.append(
        f"  {'packing':<26}{'rows/epoch':>12}{'L':>7}{'at L':>8}{'i<=L/2':>9}{'i>=3L/4':>9}"
        f"{'padding':>9}{'lost/step':>11}"
    )
    for L, fs in total["by_train_len"].items():
        for strategy, ps in fs["packing"].items():
            lines.append(
                f"  {strategy:<26}{ps['rows_per_epoch']:>12,}{L:>7}{ps['share_segments_at_L']:>8.1%}"
                f"{ps['share_positions_le_half_L']:>9.1%}{ps['share_positions_ge_three_quarter_L']:>9.1%}"
                f"{ps['padding_share']:>9.1%}{human(ps['tokens_lost_per_step']):>11}"
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
        raise OutputDirError(
            f"{path} does not list the files of the run that wrote it, so this job cannot tell "
            f"its own outputs from other files there. {fix}"
        )
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
    out: Path,
    histogram: LengthHistogram,
    meta: dict,
    train_lens: Sequence[int],
    budget_tokens: float,
    packing: PackingSettings = PackingSettings(),
    figures: bool = True,
) -> dict:
    """Write histogram (npz, CSV), the corpus f and each strategy's trained f per L (npz, CSV), figures and
    summary.json; return the summary."""
    predictions = predict_packing(histogram, train_lens, packing)
    replace_outputs(out)
    written = [
        save_histogram(out / HISTOGRAM_FILE, histogram, meta),
        _write_length_csv(out / "lengths.csv", histogram),
    ]
    arrays = {}
    for L in train_lens:
        columns = {"f": position_frequency(histogram.counts(), L)}
        columns[f"f_after_{budget_tokens:.3g}_tokens"] = scale_to_budget(
            columns["f"], budget_tokens
        )
        for strategy, prediction in predictions[L].items():
            columns[f"f_trained_{strategy}"] = position_frequency(prediction.histogram, L)
        for source in histogram.sources:
            columns[f"f_{source}"] = position_frequency(histogram.counts(source), L)
        written.append(_write_columns_csv(out / f"position_frequency_L{L}.csv", columns))
        arrays.update({f"L{L}/{name}": values for name, values in columns.items()})
    with atomic_open(out / "position_frequency.npz", "wb") as fh:
        np.savez_compressed(fh, **arrays)
    written.append(out / "position_frequency.npz")
    summary = summarize(histogram, train_lens, budget_tokens, predictions, packing)
    if figures:
        written += _write_figures(
            out / "figures",
            histogram.counts(),
            summary["all"]["by_train_len"],
            predictions,
            budget_tokens,
        )
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
            writer.writerow(
                [int(n), int(total[n])]
                + [int(h[n]) if n < h.size else 0 for h in per_source.values()]
            )
    return path


def _write_columns_csv(path: Path, columns: dict[str, np.ndarray]) -> Path:
    """A CSV with an index column i and one column per array."""
    with atomic_open(path, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["i", *columns])
        for i, row in enumerate(zip(*columns.values())):
            writer.writerow([i, *(v.item() if isinstance(v, np.generic) else v for v in row)])
    return path


def _write_figures(
    directory: Path,
    hist: np.ndarray,
    stats: Mapping[str, dict],
    predictions: Predictions,
    budget_tokens: float,
) -> list[Path]:
    """Fig. 1a/1b/1c and f per packing strategy for every L, and Fig. 3 (corpus f and each strategy's trained f)
    comparing all L at the same token budget; `stats` is summary.json's ``all.by_train_len``. Returns the files."""
    from posfreq.analysis import plots

    paths = []
    corpus = {L: scale_to_budget(position_frequency(hist, L), budget_tokens) for L in predictions}
    for L, by_strategy in predictions.items():
        f = position_frequency(hist, L)
        paths += plots.plot_fig1a_length_and_frequency(
            piece_histogram(hist, L), f, L, directory / f"fig1a_L{L}"
        )
        tokens = int(f[0])
        uniform = position_frequency(uniform_length_histogram(L), L)
        paths += plots.plot_fig1b_uniform_lengths(
            scale_to_budget(uniform, tokens), L, directory / f"fig1b_L{L}"
        )
        full = position_frequency(concatenated_histogram(1, L), L)
        paths += plots.plot_fig1c_concatenated(
            scale_to_budget(full, tokens), L, directory / f"fig1c_L{L}"
        )
        fs = stats[str(L)]
        curves = {"corpus": corpus[L]}
        labels = {"corpus": f"corpus f, Eq. 2 over the pieces: {_shares_label(fs)}"}
        for strategy, prediction in by_strategy.items():
            ps = fs["packing"][strategy]
            curves[strategy] = trained_at_budget(prediction, L, budget_tokens)
            labels[strategy] = (
                f"{strategy}, trained: {_shares_label(ps)}, padding {ps['padding_share']:.1%}"
            )
        paths += plots.plot_packing_frequency(
            curves, labels, L, budget_tokens, directory / f"fig_packing_L{L}"
        )
    if len(predictions) > 1:
        corpus_stats = {L: stats[str(L)] for L in predictions}
        panels = {
            "corpus f: Eq. 2 over the pieces (the paper's Fig. 3)": (
                corpus,
                fig3_note(corpus, corpus_stats),
            )
        }
        for strategy in next(iter(predictions.values())):
            curves = {
                L: trained_at_budget(by_strategy[strategy], L, budget_tokens)
                for L, by_strategy in predictions.items()
            }
            padding = {
                L: by_strategy[strategy].padding_share for L, by_strategy in predictions.items()
            }
            panels[f"{strategy}: trained f"] = (
                curves,
                fig3_note(curves, corpus_stats, padding, concat=strategy == "concat"),
            )
        name = "fig3_" + "_vs_".join(f"L{L}" for L in predictions)
        paths += plots.plot_fig3_by_packing(panels, budget_tokens, directory / name)
    return paths


def _shares_label(stats: Mapping) -> str:
    """'i<=L/2 75.4%, i>=3L/4 6.3%' from a stats dict holding the two shares."""
    return (
        f"i<=L/2 {stats['share_positions_le_half_L']:.1%}, "
        f"i>=3L/4 {stats['share_positions_ge_three_quarter_L']:.1%}"
    )


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
    parser.add_argument(
        "--train-len",
        type=int,
        nargs="+",
        default=[2048, 4096],
        help="training lengths L (each >= 2), e.g. --train-len 2048 4096",
    )
    parser.add_argument(
        "--budget-tokens",
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
        "--no-cache", action="store_true", help="recount even when a cached histogram matches"
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
        histogram, meta = merge_partials(map(Path, args.merge)) if args.merge else _count(args)
        if meta.get("shard"):
            index, count = meta["shard"]
            out = args.out or DEFAULT_OUT / f"shard_{index}"
            path = write_partial(out, histogram, meta)
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
        out = args.out or DEFAULT_OUT / Path(meta["corpus"]).name
        packing = PackingSettings(
            tuple(dict.fromkeys(args.packing)),
            args.length_upsample,
            args.seed,
            args.shuffle_block,
            args.global_batch_tokens,
        )
        summary = write_outputs(
            out,
            histogram,
            meta,
            args.train_len,
            args.budget_tokens,
            packing,
            figures=not args.no_figures,
        )
    except (CorpusError, OutputDirError) as err:
        raise SystemExit(f"error: {err}") from None
    print(format_summary(summary, meta))
    print(
        f"outputs in {out}/ (summary.json lists them: histogram.npz, lengths.csv, position_frequency*, figures/)"
    )
    return 0


def _count(args: Namespace) -> tuple[LengthHistogram, dict]:
    """Resolve the corpus from the arguments and count (or load from the cache) its histogram."""
    corpus = corpus_from_args(args).sample_files(args.sample_files)
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

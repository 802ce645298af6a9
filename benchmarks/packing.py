"""Benchmark: rows/s of each packing strategy and its padding share, against the rows/s the trainer consumes.

    python benchmarks/packing.py [--docs 20000] [--train-lens 2048 4096] [--shuffle-block N] [--tokens-per-gpu 30000]
                                 [--gpus 8]

Generates a corpus with SlimPajama-like document lengths (log-normal, median about 400 tokens and
a long tail: cut into pieces of L = 2048 about 20% of the pieces are exactly L), writes it as
token shards in a temporary directory, and measures on one core, per L and strategy, over one epoch (then
prints each strategy's trained f over Eq. 2's f of the same documents at a few distances: how far a packing
departs from the corpus f the paper plots):

- plan: rows/s of the packing plan alone (document lengths only, no tokens): what every rank
  computes for the global stream, and what `predict_trained_histogram` runs;
- batches: rows/s of the sampler's batches of --rows-per-batch rows with tokens read from the
  shards and targets, position ids and cu_seqlens built (everything a rank does per micro-batch).

Each rate is printed next to its ratio to what one node trains: --tokens-per-gpu x --gpus tokens/s
as rows of L (one core is conservative: a rank assembles only its own 1/gpus of the rows). Goal:
packing never the bottleneck, a ratio >= 10 for both. The padding share is the epoch's share of
positions that hold no document token (concat: none).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from posfreq.analysis.corpus.frequency import position_frequency
from posfreq.train.data.packing import PackedSampler
from posfreq.train.data.packing_schedule import EpochPrediction, PackingSchedule, RowPacking
from posfreq.train.data.packing_strategies import STRATEGIES
from posfreq.train.data.tokens.shard_files import ShardWriter
from posfreq.train.data.tokens.shards import TokenDataset

GOAL = 10.0  # packing should run at least this many times faster than the trainer consumes rows


def slimpajama_like_lengths(n_docs: int, seed: int = 0) -> np.ndarray:
    """Document lengths (EOS included): log-normal, median ~400 tokens, mean ~1,100, a long tail."""
    rng = np.random.default_rng(seed)
    return np.maximum(rng.lognormal(mean=6.0, sigma=1.4, size=n_docs).astype(np.int64), 1) + 1


def write_corpus(directory: Path, lengths: np.ndarray, docs_per_shard: int = 5000) -> TokenDataset:
    """Random tokens (a 32k vocabulary) for documents of these lengths, EOS last, in shards."""
    rng = np.random.default_rng(1)
    eos = 32000
    for s, first in enumerate(range(0, len(lengths), docs_per_shard)):
        with ShardWriter(
            directory, f"bench{s:03d}", tokenizer="bench", vocab_size=eos + 1, eos_id=eos
        ) as writer:
            for n in lengths[first : first + docs_per_shard]:
                writer.add(np.append(rng.integers(0, eos, int(n) - 1), eos))
    return TokenDataset(directory)


def full_piece_share(lengths: np.ndarray, L: int) -> float:
    """Share of the pieces (documents cut every L tokens) that are exactly L long."""
    full, partial = int((lengths // L).sum()), int(np.count_nonzero(lengths % L))
    return full / (full + partial)


def plan_rate(
    dataset: TokenDataset, L: int, packing: str, block: int
) -> tuple[float, EpochPrediction]:
    """(rows/s, the epoch's prediction) of planning one epoch from the document lengths alone."""
    start = time.perf_counter()
    prediction = PackingSchedule(
        dataset, L, packing=RowPacking(strategy=packing, shuffle_block=block)
    ).predict_epoch(0)
    return prediction.rows / (time.perf_counter() - start), prediction


def f_against_eq2(trained: np.ndarray, lengths: np.ndarray, L: int, at: list[int]) -> list[float]:
    """An epoch's trained f over Eq. 2's f of the corpus's pieces (the same documents, once each), at distances
    `at`: 1 where the strategy trains the corpus f (best_fit, padded)."""
    corpus = position_frequency(np.bincount(lengths), L)
    return [float(position_frequency(trained, L)[i] / corpus[i]) for i in at]


def batch_rate(
    dataset: TokenDataset, L: int, packing: str, block: int, rows_per_batch: int, rows: int
) -> float:
    """Rows/s of the sampler's batches (plan + tokens + targets/positions/cu_seqlens) over `rows` rows."""
    sampler = PackedSampler(
        dataset, L, rows_per_batch, packing=RowPacking(strategy=packing, shuffle_block=block)
    )
    start = time.perf_counter()
    for _ in range(-(-rows // rows_per_batch)):
        next(sampler)
    return sampler.next_row / (time.perf_counter() - start)


def main() -> None:
    """Print, per L and strategy, the padding share and the plan and batch rates with their ratios to the need."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=20000)
    parser.add_argument("--train-lens", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument(
        "--rows-per-batch",
        type=int,
        default=8,
        help="rows per micro-batch (the trainer's micro_batch_rows)",
    )
    parser.add_argument(
        "--shuffle-block",
        type=int,
        default=1 << 20,
        help="documents per shuffle block (best_fit's buffer; the trainer's data.shuffle_block)",
    )
    parser.add_argument("--tokens-per-gpu", type=float, default=30000.0)
    parser.add_argument("--gpus", type=int, default=8, help="GPUs per node")
    args = parser.parse_args()

    lengths = slimpajama_like_lengths(args.docs)
    need_tokens = args.tokens_per_gpu * args.gpus
    with tempfile.TemporaryDirectory() as tmp:
        dataset = write_corpus(Path(tmp), lengths)
        shares = ", ".join(
            f"{100 * full_piece_share(lengths, L):.0f}% at L={L}" for L in args.train_lens
        )
        print(
            f"corpus: {len(lengths):,} docs, {int(lengths.sum()) / 1e6:.1f}M tokens, median {int(np.median(lengths))} "
            f"tokens; pieces exactly L long: {shares}"
        )
        print(
            f"need: {args.tokens_per_gpu / 1e3:.0f}k tokens/s per GPU x {args.gpus} GPUs = "
            f"{need_tokens / 1e3:.0f}k tokens/s per node; goal >= {GOAL:.0f}x on one core\n"
        )
        print(
            f"{'L':>5} {'packing':>9} {'padding':>8} {'plan rows/s':>12} {'x need':>7} "
            f"{'batch rows/s':>13} {'x need':>7} {'vs concat':>10} {'goal':>5}"
        )
        trained = {}
        for L in args.train_lens:
            need_rows = need_tokens / L
            concat = None
            for packing in STRATEGIES:
                plan, prediction = plan_rate(dataset, L, packing, args.shuffle_block)
                padding, rows = prediction.padding_share, prediction.rows
                trained[(L, packing)] = prediction.histogram
                batches = batch_rate(
                    dataset, L, packing, args.shuffle_block, args.rows_per_batch, rows
                )
                concat = concat or batches
                ok = min(plan, batches) / need_rows >= GOAL
                print(
                    f"{L:>5} {packing:>9} {100 * padding:>7.3f}% {plan:>12,.0f} {plan / need_rows:>6.0f}x "
                    f"{batches:>13,.0f} {batches / need_rows:>6.0f}x {batches / concat:>9.2f}x "
                    f"{'met' if ok else 'MISS':>5}"
                )
        print("\ntrained f over Eq. 2's f of the same documents, one epoch (1: the corpus f)")
        for L in args.train_lens:
            at = [L // 4, L // 2, 3 * L // 4, L - 48]
            print(f"{'L':>5} {'packing':>9} " + " ".join(f"{'i=' + str(i):>8}" for i in at))
            for packing in STRATEGIES:
                ratios = f_against_eq2(trained[(L, packing)], lengths, L, at)
                print(f"{L:>5} {packing:>9} " + " ".join(f"{r:>8.3f}" for r in ratios))


if __name__ == "__main__":
    main()

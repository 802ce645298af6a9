"""Benchmark: the length-histogram job vs the raw tokenizer on the same texts, per worker count; and the
trained-f prediction per packing strategy vs the histogram job.

Generates a small SlimPajama-layout corpus (.jsonl.zst, mixed sources) in a temporary directory,
measures the raw throughput of `tokenizer.encode_batch` over its texts in one process (the
limit), then runs the histogram job end to end (read, decompress, parse JSON, tokenize, count)
with 1..N worker processes. Goal: >= 80% of the raw throughput per core, scaling with cores.

Then it times `predict_packing` (one epoch of the packing plan per L and strategy, from the
lengths alone) on the counted histogram with every count multiplied by --predict-copies (a
corpus that size), in corpus tokens per second on one core, next to the histogram job's rate with
one worker. Goal: the prediction adds under 10% to the counting job's time.

    python benchmarks/position_freq.py [--docs 12000] [--files 8] [--tokenizer llama3] [--predict-copies 200]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from posfreq.analysis.corpus.histogram import (  # noqa: E402
    BATCH_CHARS,
    CountSettings,
    LengthHistogram,
    count_lengths,
)
from posfreq.analysis.corpus.packing_prediction import PackingSettings, predict_packing  # noqa: E402
from posfreq.train.data.corpora import resolve_corpus  # noqa: E402
from posfreq.train.data.formats import write_jsonl  # noqa: E402
from posfreq.train.data.tokenizer import get_tokenizer  # noqa: E402

SOURCES = ("RedPajamaCommonCrawl", "RedPajamaC4", "RedPajamaGithub", "RedPajamaArXiv")
PREDICTION_GOAL = 0.1  # the prediction may add at most this share to the histogram job's time
SLIMPAJAMA_TOKENS = 627e9


def synthetic_texts(n_docs: int, seed: int = 0) -> list[str]:
    """English-like documents with a long-tailed length distribution (log-normal, median ~ 300 words)."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    weights = np.linspace(2.0, 0.1, letters.size)
    vocab = [
        "".join(rng.choice(letters, size=int(rng.integers(1, 10)), p=weights / weights.sum()))
        for _ in range(5000)
    ]
    vocab += [",", ".", "\n", "the", "of", "and", "2024", "(", ")"] * 50
    lengths = np.minimum(rng.lognormal(mean=5.7, sigma=1.0, size=n_docs).astype(int) + 1, 20000)
    return [" ".join(rng.choice(vocab, size=n)) for n in lengths]


def raw_throughput(texts: list[str], tokenizer_spec: str) -> tuple[float, int]:
    """Tokens/s of encode_batch over the texts in this process, batched like the histogram job."""
    tokenizer = get_tokenizer(tokenizer_spec)
    tokenizer.encode_batch(texts[:10])  # warm up
    start, tokens, batch, chars = time.perf_counter(), 0, [], 0
    for text in texts:
        batch.append(text)
        chars += len(text)
        if chars >= BATCH_CHARS:
            tokens += sum(len(ids) for ids in tokenizer.encode_batch(batch))
            batch, chars = [], 0
    tokens += sum(len(ids) for ids in tokenizer.encode_batch(batch))
    return tokens / (time.perf_counter() - start), tokens


def main() -> None:
    """Print raw and end-to-end throughput and their ratio per worker count."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=12000)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--tokenizer", default="llama3")
    parser.add_argument("--max-workers", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument(
        "--predict-copies",
        type=int,
        default=200,
        help="time the packing prediction on the counted histogram with every count times this",
    )
    parser.add_argument(
        "--train-lens",
        type=int,
        nargs="+",
        default=[2048, 4096],
        help="training lengths of the packing prediction",
    )
    args = parser.parse_args()

    texts = synthetic_texts(args.docs)
    mb = sum(len(t.encode()) for t in texts) / 1e6
    with tempfile.TemporaryDirectory() as tmp:
        per_file = -(-len(texts) // args.files)
        for k in range(args.files):
            chunk = texts[k * per_file : (k + 1) * per_file]
            records = [
                {"text": t, "meta": {"redpajama_set_name": SOURCES[j % len(SOURCES)]}}
                for j, t in enumerate(chunk)
            ]
            write_jsonl(
                Path(tmp) / "train" / f"chunk{k % 3 + 1}" / f"example_train_{k}.jsonl.zst", records
            )
        corpus = resolve_corpus("slimpajama", data_dir=tmp)
        raw, tokens = raw_throughput(texts, args.tokenizer)
        print(
            f"corpus: {len(texts):,} docs, {tokens:,} tokens, {mb:.1f} MB of text "
            f"in {len(corpus.files)} .jsonl.zst files"
        )
        print(f"raw tokenizer ({args.tokenizer}, 1 process): {raw / 1e6:.2f} M tokens/s")
        print(f"{'workers':>8}{'docs/s':>12}{'M tokens/s':>12}{'vs raw x workers':>18}")
        settings = CountSettings(tokenizer=args.tokenizer, default_source=corpus.default_source)
        for workers in range(1, max(1, args.max_workers) + 1):
            start = time.perf_counter()
            histogram, stats = count_lengths(
                corpus.files, settings, workers=workers, progress=False
            )
            elapsed = time.perf_counter() - start
            counted = (
                int((histogram.counts() * np.arange(histogram.counts().size)).sum())
                - stats.documents
            )
            assert counted == tokens and stats.documents == len(texts), (
                "histogram disagrees with raw count"
            )
            ratio = (tokens / elapsed) / (raw * workers)
            print(
                f"{workers:>8}{stats.documents / elapsed:>12,.0f}{tokens / elapsed / 1e6:>12.2f}{ratio:>17.0%}"
            )
            if workers == 1:
                job_rate = tokens / elapsed
    print(
        "(end to end includes process start-up, zstd, JSON and the tokenizer load in each worker)"
    )
    prediction_rate(histogram, args.predict_copies, args.train_lens, job_rate)


def prediction_rate(
    histogram: LengthHistogram, copies: int, train_lens: list[int], job_rate: float
) -> None:
    """Time `predict_packing` (every strategy, each L) on `histogram` with its counts times `copies`, and print its
    corpus tokens/s against the histogram job's `job_rate` (tokens/s, one worker)."""
    scaled = LengthHistogram(
        {source: counts * copies for source, counts in histogram.by_source.items()}
    )
    total = scaled.counts()
    tokens = int(total @ np.arange(total.size))
    settings = PackingSettings()
    start = time.perf_counter()
    predictions = predict_packing(scaled, train_lens, settings)
    elapsed = time.perf_counter() - start
    rate = tokens / elapsed
    share = job_rate / rate  # prediction time / counting time, for the same corpus on one core each
    print(
        f"\npacking prediction, {len(train_lens)} L x {len(settings.strategies)} strategies, one core, on "
        f"{int(total.sum()):,} docs / {tokens / 1e6:,.0f}M tokens ({copies} copies of the corpus above):"
    )
    for L, by_strategy in predictions.items():
        print(
            f"  L={L}: "
            + ", ".join(
                f"{name} {p.rows:,} rows, padding {p.padding_share:.1%}"
                for name, p in by_strategy.items()
            )
        )
    print(
        f"  {rate / 1e6:,.0f}M corpus tokens/s = {share:.2%} of the histogram job's time (1 worker; goal < "
        f"{PREDICTION_GOAL:.0%}: {'met' if share < PREDICTION_GOAL else 'MISS'}); SlimPajama's "
        f"{SLIMPAJAMA_TOKENS / 1e9:.0f}B tokens: about {SLIMPAJAMA_TOKENS / rate / 60:.0f} min"
    )


if __name__ == "__main__":
    main()

"""What the corpus-analysis tests share: Eq. 2 by its definition, and a small SlimPajama-layout corpus."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from posfreq.train.data.formats import write_jsonl


def naive_frequency(length_hist, train_len):
    """Eq. 2 by definition: cut every document into pieces of <= L, then a double loop."""
    f = [0] * train_len
    for length, count in enumerate(length_hist):
        pieces = [train_len] * (length // train_len) + (
            [length % train_len] if length % train_len else []
        )
        for piece in pieces:
            for i in range(train_len):
                f[i] += count * max(piece - i, 0)
    return np.array(f, dtype=np.int64)


SOURCES = ("RedPajamaC4", "RedPajamaGithub", "RedPajamaBook")


def write_slimpajama(tmp_path: Path) -> tuple[Path, list[dict]]:
    """A small SlimPajama-layout corpus (3 chunk dirs, .jsonl.zst, mixed sources) and its records."""
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "δέλτα", "\n", "1234", "::", "x"]
    records = []
    for chunk in (1, 2, 10):
        for n in range(2):
            recs = [
                {
                    "text": " ".join(rng.choice(words, size=int(rng.integers(0, 300)))),
                    "meta": {"redpajama_set_name": SOURCES[int(rng.integers(0, 3))]},
                }
                for _ in range(15)
            ]
            write_jsonl(
                tmp_path / "sp" / "train" / f"chunk{chunk}" / f"example_train_{n}.jsonl.zst", recs
            )
            records.extend(recs)
    return tmp_path / "sp", records


def record(text: str, source: str = "RedPajamaC4") -> dict:
    return {"text": text, "meta": {"redpajama_set_name": source}}


def make_slimpajama(root, split="train", chunks=(1, 2, 10), files_per_chunk=2):
    """A tiny corpus in SlimPajama's published layout; returns every record in natural file order."""
    written = []
    for chunk in chunks:
        for n in (0, 1, 10)[:files_per_chunk]:
            recs = [
                record(
                    f"{split} chunk {chunk} file {n} doc {k}",
                    ("RedPajamaC4", "RedPajamaGithub")[k % 2],
                )
                for k in range(3)
            ]
            write_jsonl(root / split / f"chunk{chunk}" / f"example_{split}_{n}.jsonl.zst", recs)
            written.extend(recs)
    return written

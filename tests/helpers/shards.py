"""The unique-token dataset: token values are their global positions, so each token names its document and
offset (the shard and packing tests use it)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from posfreq.train.data.tokens.shard_files import ShardWriter


def unique_dataset(
    directory: Path, lengths_per_shard: list[list[int]], tokenizer: str = "unique"
) -> np.ndarray:
    """Write shards whose tokens are their global positions; returns global doc offsets."""
    total = sum(map(sum, lengths_per_shard))
    start, offsets = 0, [0]
    for s, lengths in enumerate(lengths_per_shard):
        with ShardWriter(
            directory, f"shard{s:02d}", tokenizer=tokenizer, vocab_size=total + 1, eos_id=total
        ) as w:
            for n in lengths:
                w.add(np.arange(start, start + n))
                start += n
                offsets.append(start)
    return np.array(offsets)


LENGTHS = [
    [1, 5, 40, 3, 17],
    [2, 33, 9, 11],
    [],
    [64, 1, 1, 7, 25, 8],
]  # some > L, some 1 token, an empty shard

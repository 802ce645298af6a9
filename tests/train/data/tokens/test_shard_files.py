"""train/data/tokens/shard_files.py: one shard's files as written (permissions, nothing published by a writer that failed)
and as checked (`check_shard` against offsets and metadata damaged by hand)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import numpy as np
import pytest
from helpers.shards import unique_dataset

from posfreq.train.data.tokens.shard_files import (
    DamagedShard,
    ShardWriter,
    check_shard,
    shard_is_complete,
)


def test_shard_files_are_world_readable(tmp_path: Path) -> None:
    """Data directories are shared between users: every shard file is 0644 under the usual umask 022."""
    old = os.umask(0o022)
    try:
        unique_dataset(tmp_path, [[2, 3]])
    finally:
        os.umask(old)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["shard00.json", "shard00.offsets.npy", "shard00.tokens.bin"]
    assert {stat.S_IMODE((tmp_path / n).stat().st_mode) for n in names} == {0o644}


def test_interrupted_writer_leaves_no_shard(tmp_path: Path) -> None:
    unique_dataset(tmp_path, [[2]])
    with pytest.raises(RuntimeError):
        with ShardWriter(tmp_path, "broken", tokenizer="unique", vocab_size=3, eos_id=2) as w:
            w.add([0, 1])
            raise RuntimeError("killed")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "shard00.json",
        "shard00.offsets.npy",
        "shard00.tokens.bin",
    ]


def test_check_shard_names_the_file_that_contradicts_the_others(tmp_path: Path) -> None:
    """Each file checked against the others: a missing file, offsets that do not end at the token count, and
    metadata whose counts are impossible; `shard_is_complete` answers None for each instead of raising."""
    unique_dataset(tmp_path / "ok", [[3, 4]])
    assert check_shard(tmp_path / "ok", "shard00").meta["num_docs"] == 2
    assert shard_is_complete(tmp_path / "ok", "shard00")["num_tokens"] == 7

    unique_dataset(tmp_path / "gone", [[3]])
    (tmp_path / "gone" / "shard00.offsets.npy").unlink()
    with pytest.raises(FileNotFoundError, match="shard00.offsets.npy is missing"):
        check_shard(tmp_path / "gone", "shard00")
    assert shard_is_complete(tmp_path / "gone", "shard00") is None

    unique_dataset(tmp_path / "short", [[3, 4]])
    np.save(tmp_path / "short" / "shard00.offsets.npy", np.array([0, 4, 8], dtype=np.int64))
    with pytest.raises(
        ValueError, match="offsets inconsistent with shard00.tokens.bin \\(7 tokens\\)"
    ):
        check_shard(tmp_path / "short", "shard00")

    unique_dataset(tmp_path / "meta", [[3]])
    meta_file = tmp_path / "meta" / "shard00.json"
    meta = json.loads(meta_file.read_text())
    meta_file.write_text(json.dumps({**meta, "eos_id": meta["vocab_size"], "num_docs": True}))
    with pytest.raises(DamagedShard, match="num_docs is True, not an integer") as raised:
        check_shard(tmp_path / "meta", "shard00")
    assert str(meta_file) in str(raised.value)
    assert shard_is_complete(tmp_path / "meta", "shard00") is None

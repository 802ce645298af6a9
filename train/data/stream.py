"""Datasets streamed with Hugging Face `datasets`, split into `StreamShard` pseudo-files.

A shard stands in for a file of a corpus, so worker processes, ``--shard`` and
``--sample-files`` split a stream as they split files.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from posfreq.train.data.records import BadItem


@dataclass(frozen=True)
class StreamShard:
    """Shard `index` of `count` of a split streamed with `datasets` (a hub id or a local directory).

    It stands in for a file in `Corpus.files`, so worker processes, ``--shard`` and
    ``--sample-files`` split a stream as they split files. `revision` pins the content: the hub
    commit, or for a local directory a hash of its files' paths, sizes and mtimes.
    """

    dataset: str
    split: str
    index: int
    count: int
    revision: str

    def __str__(self) -> str:
        return f"{self.dataset}:{self.split}[shard {self.index} of {self.count}]"

    @property
    def shard_name(self) -> str:
        """A stable output name for this shard, e.g. ``train__shard_00042_of_59166``."""
        return f"{self.split}__shard_{self.index:0{len(str(self.count - 1))}d}_of_{self.count}"

    def records(self) -> Iterator[dict]:
        """This shard's raw records, streamed (the dataset is opened once per process)."""
        return iter(
            _open_stream(self.dataset, self.split, self.revision).shard(self.count, self.index)
        )


_STREAMS: dict[tuple[str, str, str], Any] = {}


def _is_local_dataset(dataset: str) -> bool:
    """Whether `datasets` will read this name as a local directory rather than a hub id."""
    return Path(dataset).expanduser().is_dir()


def _load_stream(dataset: str, split: str, revision: str | None = None) -> Any:
    """`datasets.load_dataset(dataset, split=split, streaming=True)`, at a hub revision when given."""
    import datasets

    hub_revision = None if _is_local_dataset(dataset) else revision
    return datasets.load_dataset(dataset, split=split, streaming=True, revision=hub_revision)


def _open_stream(dataset: str, split: str, revision: str) -> Any:
    """The stream of a resolved revision, opened once per process (workers reuse it for every shard)."""
    key = (dataset, split, revision)
    if key not in _STREAMS:
        _STREAMS[key] = _load_stream(dataset, split, revision)
    return _STREAMS[key]


def stream_shards(dataset: str, split: str = "train") -> tuple[StreamShard, ...]:
    """One `StreamShard` per shard (data file) of a split streamed with `datasets`; raises when it cannot load."""
    stream = _load_stream(dataset, split)
    if _is_local_dataset(dataset):
        files = sorted(p for p in Path(dataset).expanduser().rglob("*") if p.is_file())
        stamp = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
        revision = "local-" + hashlib.sha256(json.dumps(stamp).encode()).hexdigest()[:24]
    else:
        from huggingface_hub import HfApi

        revision = HfApi().dataset_info(dataset).sha
    _STREAMS[(dataset, split, revision)] = stream
    return tuple(
        StreamShard(dataset, split, k, stream.n_shards, revision) for k in range(stream.n_shards)
    )


def stream_records(shard: StreamShard) -> Iterator[tuple[str, object]]:
    """The raw records of a stream shard; a failing stream (network, bad data) ends the shard."""
    index = 0
    try:
        for record in shard.records():
            yield f"record {index}", record
            index += 1
    except Exception as err:  # datasets/fsspec/network errors have no common base class
        reason = " ".join(f"{type(err).__name__}: {err}".split())
        yield (
            f"record {index}",
            BadItem(f"stream failed ({reason}); the rest of this shard is unreadable", True),
        )

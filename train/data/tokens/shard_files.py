"""One token shard's three files: writing them (`ShardWriter`) and checking that they agree (`check_shard`).

A shard is ``NAME.tokens.bin`` (uint32 tokens of all documents, each already ending in EOS), ``NAME.offsets.npy``
(int64 document start offsets, ``num_docs + 1`` entries, first 0, last the token count) and ``NAME.json``
(metadata; written last, so its presence marks a complete shard). Each file is published atomically
(`train.atomic`), so a crash never leaves a file that looks whole and is not. A data directory of shards is read
as one dataset by train/data/tokens/shards.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from posfreq.train.atomic import AtomicFile, atomic_open, write_json_atomic

FORMAT = "posfreq-tokens-v1"
TOKENS_SUFFIX = ".tokens.bin"
OFFSETS_SUFFIX = ".offsets.npy"
META_SUFFIX = ".json"


class DamagedShard(ValueError):
    """A shard whose contents contradict its metadata, found while reading it; the message names the file."""


class ShardWriter:
    """Writes one shard under temporary names and renames it into place on `finish()`.

    Documents are stored exactly as given (the caller appends EOS). The metadata file is
    renamed last, so a crash never leaves a shard that `TokenDataset` takes for complete.
    """

    def __init__(
        self,
        directory: str | Path,
        name: str,
        *,
        tokenizer: str,
        vocab_size: int,
        eos_id: int,
        extra: dict | None = None,
    ) -> None:
        if vocab_size > 2**32:
            raise ValueError(f"vocab_size={vocab_size} does not fit the uint32 token format")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.meta = {
            "format": FORMAT,
            "name": name,
            "tokenizer": tokenizer,
            "vocab_size": int(vocab_size),
            "eos_id": int(eos_id),
            **(extra or {}),
        }
        self._tokens = AtomicFile(self.directory / f"{name}{TOKENS_SUFFIX}", "wb")
        self._lengths: list[int] = []

    def add(self, tokens: np.ndarray | list[int]) -> None:
        """Append one document (its tokens, EOS included)."""
        array = np.asarray(tokens, dtype=np.int64)
        if array.size and (array.min() < 0 or array.max() >= self.meta["vocab_size"]):
            raise ValueError(f"shard {self.name}: token ids outside [0, {self.meta['vocab_size']})")
        self._tokens.file.write(array.astype(np.uint32).tobytes())
        self._lengths.append(int(array.size))

    def add_many(self, documents: Iterable[np.ndarray | list[int]]) -> None:
        """Append several documents."""
        for doc in documents:
            self.add(doc)

    def finish(self) -> dict:
        """Publish the tokens, then the offsets, then the metadata (each atomically); returns the metadata."""
        offsets = np.zeros(len(self._lengths) + 1, dtype=np.int64)
        np.cumsum(self._lengths, out=offsets[1:])
        self.meta.update(num_docs=len(self._lengths), num_tokens=int(offsets[-1]))
        self._tokens.commit()
        with atomic_open(self.directory / f"{self.name}{OFFSETS_SUFFIX}", "wb") as f:
            np.save(f, offsets)
        write_shard_meta(self.directory, self.name, self.meta)
        return self.meta

    def abort(self) -> None:
        """Close and delete the temporary token file; nothing of the shard is published."""
        self._tokens.discard()

    def __enter__(self) -> "ShardWriter":
        """The writer itself; leaving the block finishes the shard, or aborts it on an error."""
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finish()
        else:
            self.abort()


def write_shard_meta(directory: Path, name: str, meta: dict) -> None:
    """Publish shard `name`'s metadata file, atomically: the last of its three files (`ShardWriter.finish`)."""
    write_json_atomic(directory / f"{name}{META_SUFFIX}", meta, indent=1, sort_keys=True)


def shard_is_complete(directory: str | Path, name: str) -> dict | None:
    """The metadata of shard `name` if all three of its files exist and agree (`check_shard`: a damaged one is
    redone by a rerun, as its error says), else None."""
    try:
        return check_shard(Path(directory), name).meta
    except (ValueError, OSError):
        return None


@dataclass(frozen=True)
class Shard:
    """One validated shard: its name, metadata and files (memory-mapped only when read)."""

    name: str
    meta: dict
    tokens_path: Path
    offsets_path: Path


def check_shard(base: Path, name: str, listed: set[str] | None = None) -> Shard:
    """Check that the three files of a shard exist and agree: its metadata, its offsets (read whole) and its tokens'
    size. `listed`: the directory's files, from one listing (no stat per file: a cluster's shared filesystem
    answers each metadata request over the network, for tens of thousands of shards on every rank)."""
    shard = Shard(name, {}, base / f"{name}{TOKENS_SUFFIX}", base / f"{name}{OFFSETS_SUFFIX}")
    meta_path = base / f"{name}{META_SUFFIX}"
    rerun = (
        "Fix: rerun scripts/prepare_data.py (posfreq prepare) with the same --out; it redoes incomplete and "
        "damaged shards (or delete this shard's files)."
    )
    for path in (shard.tokens_path, shard.offsets_path, meta_path):
        present = path.name in listed if listed is not None else path.is_file()
        if not present:
            raise FileNotFoundError(
                f"incomplete shard {base / name}: {path.name} is missing. {rerun}"
            )
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{meta_path}: not valid JSON ({err}). {rerun}") from err
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(
            f"{meta_path}: format {found!r}, expected {FORMAT!r}; is this a token shard? {rerun}"
        )
    check_meta(meta, meta_path, rerun)
    size = shard.tokens_path.stat().st_size
    if size % 4:
        raise ValueError(
            f"{shard.tokens_path}: {size} bytes is not a whole number of uint32 tokens. {rerun}"
        )
    try:
        offsets = np.load(shard.offsets_path)  # every value is checked below: one read, no map
    except (ValueError, OSError, EOFError) as err:  # not an .npy file, a cut one, a pickle
        reason = " ".join(f"{type(err).__name__}: {err}".split())
        raise DamagedShard(
            f"{shard.offsets_path}: not a readable .npy array of document offsets ({reason}). {rerun}"
        ) from None
    n_tokens = size // 4
    if (
        offsets.dtype != np.int64
        or offsets.ndim != 1
        or len(offsets) != meta["num_docs"] + 1
        or offsets[0] != 0
        or offsets[-1] != n_tokens
        or n_tokens != meta["num_tokens"]
    ):
        raise ValueError(
            f"{shard.offsets_path}: offsets inconsistent with {shard.tokens_path.name} ({n_tokens} tokens) "
            f"and {meta_path.name} ({meta['num_docs']} docs, {meta['num_tokens']} tokens): need int64, "
            f"num_docs+1 entries, first 0, last the token count. {rerun}"
        )
    backwards = np.flatnonzero(np.diff(offsets) < 0)
    if backwards.size:
        i = int(backwards[0])
        raise ValueError(
            f"{shard.offsets_path}: document offsets go backwards at document {i} ({offsets[i]} -> "
            f"{offsets[i + 1]}): the shard is damaged. {rerun}"
        )
    return replace(shard, meta=meta)


def check_meta(meta: dict, meta_path: Path, rerun: str) -> None:
    """Refuse a shard's metadata whose counts or token ids are missing, not integers, or impossible (an EOS
    outside the vocabulary is only found mid-training otherwise: an IndexError, a device-side assert on a GPU)."""
    problems = (
        [] if isinstance(meta.get("tokenizer"), str) else ["tokenizer is missing or not a string"]
    )
    for key, low in (("vocab_size", 1), ("eos_id", 0), ("num_docs", 0), ("num_tokens", 0)):
        value = meta.get(key)
        if key not in meta:
            problems.append(f"{key} is missing")
        elif not isinstance(value, int) or isinstance(value, bool):
            problems.append(f"{key} is {value!r}, not an integer")
        elif value < low:
            problems.append(f"{key} is {value}, below {low}")
    if not problems and meta["vocab_size"] > 2**32:
        problems.append(f"vocab_size {meta['vocab_size']} does not fit the uint32 token format")
    if not problems and meta["eos_id"] >= meta["vocab_size"]:
        problems.append(
            f"eos_id {meta['eos_id']} is outside the vocabulary [0, {meta['vocab_size']})"
        )
    if problems:
        raise DamagedShard(f"{meta_path}: damaged shard metadata: {'; '.join(problems)}. {rerun}")

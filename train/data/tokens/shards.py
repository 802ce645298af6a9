"""A data directory of token shards as one list of documents (`TokenDataset`), and its manifest.

`TokenDataset` memory-maps every shard (train/data/tokens/shard_files.py: its three files, written by `posfreq prepare`) in
sorted name order: documents are numbered globally in that order. A manifest, written once every shard is complete,
lets a rank start from one read instead of three per shard. How documents become training rows is
train/data/packing.py.
"""

from __future__ import annotations

import hashlib
import json
import os
from functools import lru_cache
from pathlib import Path

import numpy as np

from posfreq.train.atomic import write_json_atomic
from posfreq.train.data.tokenizer import absolute_spec, built_in_identity, hf_dir
from posfreq.train.data.tokens.shard_files import (
    META_SUFFIX,
    OFFSETS_SUFFIX,
    TOKENS_SUFFIX,
    DamagedShard,
    Shard,
    check_shard,
)

MANIFEST_FILE = "manifest.json"
"""A prepared data folder's index: every shard's name, file sizes and metadata, and the data's fingerprint,
written by `posfreq prepare` once every shard is complete, so a rank reads one file at start instead of three
per shard (SlimPajama: ~59k shards, on a shared file system, on every rank)."""
MANIFEST_FORMAT = "posfreq-shards-manifest-v1"
PREPARE_HINT = "Fix: run `posfreq prepare --corpus <name or path> --out <this directory>` (python scripts/prepare_data.py)"


def concat_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, s + n) for each (s, n), without a Python loop."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    run_starts = np.cumsum(lengths) - lengths
    return np.repeat(np.asarray(starts, dtype=np.int64) - run_starts, lengths) + np.arange(total)


def raise_open_file_limit(needed: int) -> None:
    """Raise this process's soft limit of open files to its hard limit when fewer than `needed` plus a margin for
    everything else (CUDA, NCCL, loggers) are allowed: clusters often start jobs at 1,024, and a run's cached shards,
    its validation shards and the rest can pass that days into a run."""
    try:
        import resource
    except ImportError:  # not on this platform
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = needed + 1024
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return
    target = wanted if hard == resource.RLIM_INFINITY else min(hard, max(wanted, soft))
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


class TokenDataset:
    """All shards of a data directory as one list of documents (EOS included), memory-mapped.

    Shards are validated on opening and memory-mapped on first use; at most `max_open`
    shards stay mapped at once (SlimPajama has ~59k shards, more than the kernel's default
    limit of memory maps per process).
    """

    def __init__(
        self, directory: str | Path, tokenizer: str | None = None, max_open: int = 256
    ) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise FileNotFoundError(
                f"data directory {self.directory} does not exist. {PREPARE_HINT}"
            )
        with os.scandir(self.directory) as entries:  # one listing; no stat but for links
            listed = {e.name for e in entries if not e.name.startswith(".") and e.is_file()}
        suffixes = (TOKENS_SUFFIX, OFFSETS_SUFFIX, META_SUFFIX)
        names = sorted(
            {n[: -len(x)] for n in listed - {MANIFEST_FILE} for x in suffixes if n.endswith(x)}
        )
        if not names:
            raise FileNotFoundError(
                f"data directory {self.directory} holds no token shards "
                f"(*{TOKENS_SUFFIX} + *{OFFSETS_SUFFIX} + *{META_SUFFIX}). {PREPARE_HINT}"
            )
        self._manifest = _read_manifest(self.directory, names) if MANIFEST_FILE in listed else None
        self.shards = (
            [
                Shard(
                    e["name"],
                    e["meta"],
                    self.directory / f"{e['name']}{TOKENS_SUFFIX}",
                    self.directory / f"{e['name']}{OFFSETS_SUFFIX}",
                )
                for e in self._manifest["shards"]
            ]
            if self._manifest is not None
            else [check_shard(self.directory, name, listed) for name in names]
        )
        first = self.shards[0]
        for shard in self.shards[1:]:
            for key in ("tokenizer", "vocab_size", "eos_id"):
                if not (
                    share_tokenizer(shard.meta, first.meta)
                    if key == "tokenizer"
                    else shard.meta[key] == first.meta[key]
                ):
                    raise ValueError(
                        f"{self.directory}: shard {shard.name} has {key}={shard.meta[key]!r} but shard "
                        f"{first.name} has {first.meta[key]!r}; all shards of a directory must share one "
                        "tokenizer. Fix: re-tokenize into a fresh --out with a single --tokenizer."
                    )
        recorded = first.meta["tokenizer"]
        if tokenizer is not None and not share_tokenizer(first.meta, {"tokenizer": tokenizer}):
            moved = (
                f" If the data and {recorded!r} moved to {tokenizer!r}, rerun posfreq prepare with the same "
                "corpus, flags (--val-fraction, source filters) and --out (for held-out shards, the folder above "
                f"them) and --tokenizer {tokenizer}: it keeps the shards and records the new folder."
                if hf_dir(recorded) is not None and hf_dir(tokenizer) is not None
                else ""
            )
            raise ValueError(
                f"{self.directory} was tokenized with {recorded!r}, not {tokenizer!r}. Fix: point to data "
                f"tokenized with {tokenizer!r} (posfreq prepare --tokenizer) or change the tokenizer setting."
                + moved
            )
        self.tokenizer: str = recorded
        self.vocab_size: int = int(first.meta["vocab_size"])
        self.eos_id: int = int(first.meta["eos_id"])
        docs = np.array([s.meta["num_docs"] for s in self.shards], dtype=np.int64)
        toks = np.array([s.meta["num_tokens"] for s in self.shards], dtype=np.int64)
        self._doc_starts = np.concatenate([[0], np.cumsum(docs)])  # first global doc id per shard
        self._tok_starts = np.concatenate([[0], np.cumsum(toks)])  # first global token per shard
        self.num_docs = int(self._doc_starts[-1])
        self.num_tokens = int(self._tok_starts[-1])
        raise_open_file_limit(max_open)
        self._maps = lru_cache(maxsize=max_open)(self._open)

    def _open(self, s: int) -> tuple[np.ndarray, np.ndarray]:
        """Shard s: its uint32 tokens memory-mapped, its int64 offsets read whole (a few bytes per document). A
        memory map holds a file descriptor while it lives, so only the tokens keep one: one per cached shard."""
        shard = self.shards[s]
        if (
            self._manifest is not None
        ):  # trusted at start from the manifest: checked now, when first read
            check_shard(self.directory, shard.name)
        tokens = (
            np.memmap(shard.tokens_path, dtype=np.uint32, mode="r")
            if shard.meta["num_tokens"]
            else np.zeros(0, dtype=np.uint32)
        )
        return tokens, np.load(shard.offsets_path)

    def __len__(self) -> int:
        """The number of documents."""
        return self.num_docs

    def fingerprint(self) -> str:
        """sha256 over each shard's name, file sizes and document offsets: which documents these are, wherever
        the directory lives (token contents are not read: they are the bulk of the data); the manifest's, computed
        the same way when `posfreq prepare` wrote it."""
        if self._manifest is not None:
            return self._manifest["fingerprint"]
        return self.scanned_fingerprint()

    def scanned_fingerprint(self) -> str:
        """`fingerprint` from the shard files themselves (two stats and one offsets read per shard)."""
        digest = hashlib.sha256()
        for shard in self.shards:
            sizes = (shard.tokens_path.stat().st_size, shard.offsets_path.stat().st_size)
            digest.update(f"{shard.name}\0{sizes[0]}\0{sizes[1]}\n".encode())
            digest.update(np.load(shard.offsets_path, mmap_mode="r"))
        return digest.hexdigest()

    def __repr__(self) -> str:
        return (
            f"TokenDataset({str(self.directory)!r}: {len(self.shards)} shards, {self.num_docs} docs, "
            f"{self.num_tokens} tokens, tokenizer={self.tokenizer})"
        )

    def document(self, i: int) -> np.ndarray:
        """The tokens of document i (global numbering, EOS included), as int64."""
        if not 0 <= i < self.num_docs:
            raise IndexError(f"document {i} out of range [0, {self.num_docs})")
        s = int(np.searchsorted(self._doc_starts, i, side="right") - 1)
        tokens, offsets = self._maps(s)
        local = i - int(self._doc_starts[s])
        document = np.asarray(tokens[offsets[local] : offsets[local + 1]], dtype=np.int64)
        self._check_ids(document, s)
        return document

    def doc_lengths(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Lengths (EOS included) of documents [start, stop), as int64."""
        stop = self.num_docs if stop is None else stop
        parts = [np.zeros(0, dtype=np.int64)]
        first = max(int(np.searchsorted(self._doc_starts, start, side="right")) - 1, 0)
        for s in range(first, len(self.shards)):
            if self._doc_starts[s] >= stop:
                break
            lo = max(start - int(self._doc_starts[s]), 0)
            hi = min(stop - int(self._doc_starts[s]), self.shards[s].meta["num_docs"])
            if lo < hi:
                parts.append(np.diff(np.asarray(self._maps(s)[1][lo : hi + 1])))
        return np.concatenate(parts).astype(np.int64)

    def token_offsets(self, docs: np.ndarray) -> np.ndarray:
        """Global token offset of the first token of each document in `docs`."""
        docs = np.asarray(docs, dtype=np.int64)
        shard_of = np.searchsorted(self._doc_starts, docs, side="right") - 1
        out = np.empty(len(docs), dtype=np.int64)
        for s in np.unique(shard_of):
            sel = shard_of == s
            out[sel] = self._tok_starts[s] + self._maps(int(s))[1][docs[sel] - self._doc_starts[s]]
        return out

    def read_runs(self, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Concatenated tokens of runs [start, start + length) in global token coordinates, as int64.

        A run must not cross a shard boundary (runs inside one document never do).
        """
        starts, lengths = np.asarray(starts, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
        out = np.empty(int(lengths.sum()), dtype=np.int64)
        dest = np.cumsum(lengths) - lengths
        shard_of = np.searchsorted(self._tok_starts, starts, side="right") - 1
        for s in np.unique(shard_of[lengths > 0]):
            sel = (shard_of == s) & (lengths > 0)
            src = concat_ranges(starts[sel] - self._tok_starts[s], lengths[sel])
            tokens = self._maps(int(s))[0][src]
            self._check_ids(tokens, int(s))
            out[concat_ranges(dest[sel], lengths[sel])] = tokens
        return out

    def _check_ids(self, tokens: np.ndarray, s: int) -> None:
        """Refuse token ids outside the vocabulary (a damaged shard), naming the shard: checked as tokens are read,
        since scanning a whole corpus at open would read every token."""
        if tokens.size and int(tokens.max()) >= self.vocab_size:
            raise DamagedShard(
                f"{self.shards[s].tokens_path}: token id {int(tokens.max())} >= vocab_size "
                f"{self.vocab_size}: the shard is damaged. Fix: rerun posfreq prepare for it"
            )


def _read_manifest(directory: Path, names: list[str]) -> dict | None:
    """The manifest of `directory` when it is one and lists exactly the shards the listing found, else None (the
    shards are then scanned: a manifest left from an earlier preparation is never trusted for other files)."""
    try:
        manifest = json.loads((directory / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        return None
    shards = manifest.get("shards")
    if (
        not isinstance(shards, list)
        or [e.get("name") for e in shards if isinstance(e, dict)] != names
    ):
        return None
    return manifest


def share_tokenizer(a: dict, b: dict) -> bool:
    """Whether two shards' metadata name one tokenizer: by the content fingerprint where both recorded one (a moved
    folder's spec changes, its files do not, and prepare's array tasks relabel their shards one at a time), else by
    the spec, an hf:DIR by its absolute path (an older shard's relative one and the rerun's relabel of it agree)."""
    recorded, other = a.get("tokenizer_fingerprint"), b.get("tokenizer_fingerprint")
    if recorded and other:  # a built-in under any version of its package is itself
        return built_in_identity(recorded) == built_in_identity(other)
    # a relative hf:DIR resolves against this process's directory, maybe not prepare's: the ids must agree too
    ids = all(
        a.get(k) is None or b.get(k) is None or a[k] == b[k] for k in ("vocab_size", "eos_id")
    )
    return ids and absolute_spec(str(a["tokenizer"])) == absolute_spec(str(b["tokenizer"]))


def write_manifest(directory: str | Path) -> Path:
    """Write `directory`'s manifest from its shards, every one checked (`TokenDataset` without a manifest): their
    names, sizes and metadata, and the fingerprint. Written atomically; processes that finish at once write the
    same content."""
    directory = Path(directory)
    (directory / MANIFEST_FILE).unlink(
        missing_ok=True
    )  # a scan, not an older manifest, describes the files
    dataset = TokenDataset(directory)
    manifest = {
        "format": MANIFEST_FORMAT,
        "shards": [
            {
                "name": shard.name,
                "tokens_bytes": shard.tokens_path.stat().st_size,
                "offsets_bytes": shard.offsets_path.stat().st_size,
                "meta": shard.meta,
            }
            for shard in dataset.shards
        ],
        "num_docs": dataset.num_docs,
        "num_tokens": dataset.num_tokens,
        "fingerprint": dataset.scanned_fingerprint(),
    }
    write_json_atomic(directory / MANIFEST_FILE, manifest)
    return directory / MANIFEST_FILE

"""The checkpoint layout: the one module that knows a checkpoint's file names and formats.

Layout of one checkpoint (``OUT/checkpoints/tokens-{tokens:015d}/`` for milestones, named by
tokens seen, and ``OUT/checkpoints/latest/`` for the rolling resume point):

    state/                 torch.distributed.checkpoint shards (model + optimizer), sharded saves
    state.pt               or: one full state file {"model", "optimizer"} (checkpoint.sharded=false)
    rng/rank-00000.pt      python / numpy / torch (/ cuda) RNG states of each rank
    trained_lengths.npy    int64 bincount (length L + 1) of every segment length trained so far
    loss_by_distance.json  the validation loss by distance at this step, when validation data is set
                           (train/run/loss_by_distance.py: edges, tokens and loss sums per bucket)
    model_config.json      ModelConfig.to_dict()
    tokenizer_spec.json    {"spec", "vocab_size", "bos_id", "eos_id"}; train.data.tokenizer.get_tokenizer(spec)
    config.json            the full run config (TrainConfig.to_dict())
    manifest.json          {"files": {relative path: {"size", "sha256"}}} of every file above
    trainer.json           step, tokens seen, sampler state, schedule, the manifest's sha256; written last

Every checkpoint is written (train/checkpoint/save.py) under ``NAME.tmp`` and published by
`atomic.publish_dir` (fsynced, renamed; ``NAME`` or ``NAME.old`` is complete at every instant).
What a kill or power loss can still do (a file flushed short, a disk error) is caught by the
manifest: `--resume auto` takes the newest resumable checkpoint whose files all have their
recorded size and sha256, and says which newer ones it skipped and why. Checkpoints written before manifests (no ``manifest_sha256`` in
trainer.json) are resumed unverified.

Older milestones may be reduced to weights only (train/checkpoint/retention.py): ``model.safetensors``,
``trained_lengths.npy``, the three config files, a manifest of exactly those, and trainer.json
with ``"resumable": false``. A consolidated model (scripts/commands/checkpoint.py) is a directory with
``model.safetensors``, ``model_config.json``, ``tokenizer_spec.json``, ``trained_lengths.npy`` and
``meta.json``. train/checkpoint/load.py reads a model out of any of these forms through
train/checkpoint/safe_load.py (safetensors, ``torch.load(weights_only=True)``, a whitelisting unpickler for DCP's
metadata); `verify_resume_files` gives a resume the same guarantee before Fabric reads the checkpoint.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from posfreq.train.checkpoint.rng_state import restore_rng
from posfreq.train.checkpoint.safe_load import (
    CheckpointError,
    contained_file,
    load_array,
    load_pickled,
    read_dcp_metadata,
)
from posfreq.train.fingerprint import file_sha256
from posfreq.train.json_file import read_json_object
from posfreq.train.model.config import ModelConfig

CHECKPOINTS = "checkpoints"
LATEST = "latest"
MILESTONE_PREFIX = "tokens-"
STATE_DIR = "state"
STATE_FILE = "state.pt"
RNG_DIR = "rng"
LENGTHS_FILE = "trained_lengths.npy"
LOSS_BY_DISTANCE_FILE = "loss_by_distance.json"
MODEL_CONFIG_FILE = "model_config.json"
TOKENIZER_FILE = "tokenizer_spec.json"
CONFIG_FILE = "config.json"
MANIFEST_FILE = "manifest.json"
TRAINER_FILE = "trainer.json"
META_FILE = "meta.json"  # a consolidated model's trainer.json
CONSOLIDATED_WEIGHTS = "model.safetensors"
WEIGHTS_ONLY_FILES = (LENGTHS_FILE, MODEL_CONFIG_FILE, TOKENIZER_FILE, CONFIG_FILE)
MEASUREMENT_FILES = (LOSS_BY_DISTANCE_FILE,)
"""Kept wherever a checkpoint's weights go (reduced milestones, consolidated models), when the checkpoint has them."""
FORMAT = "posfreq-pretrain-v1"


def checkpoint_root(out_dir: str | Path) -> Path:
    """OUT/checkpoints."""
    return Path(out_dir) / CHECKPOINTS


def milestone_name(tokens: int) -> str:
    """Directory name of the milestone at `tokens` tokens seen (zero-padded so names sort)."""
    return f"{MILESTONE_PREFIX}{tokens:015d}"


def state_path(directory: Path, sharded: bool) -> Path:
    """Where a checkpoint's model and optimizer state lie: DCP shards, or one full file."""
    return directory / (STATE_DIR if sharded else STATE_FILE)


def with_token_names(meta: dict) -> dict:
    """trainer.json (or meta.json) with today's token counts: `run_tokens` (this run's) and `tokens_trained`
    (every token the weights saw, warm-up included). Files written before the rename hold the run's count as
    `tokens_seen` and the warm-up's as `tokens_before`."""
    if "run_tokens" in meta or "tokens_seen" not in meta:
        return meta
    meta = dict(meta)
    run_tokens = int(meta.pop("tokens_seen"))
    before = int(meta.pop("tokens_before", 0))
    return {**meta, "run_tokens": run_tokens, "tokens_trained": run_tokens + before}


def read_trainer_state(path: str | Path) -> dict | None:
    """trainer.json of a complete checkpoint directory, or None if it is not one."""
    path = Path(path)
    if path.name.endswith(".tmp") or not path.is_dir():
        return None
    try:
        meta = json.loads((path / TRAINER_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        return None
    has_state = any(
        (path / name).is_file()
        for name in (f"{STATE_DIR}/.metadata", STATE_FILE, CONSOLIDATED_WEIGHTS)
    )
    return with_token_names(meta) if has_state else None


def list_checkpoints(out_dir: str | Path) -> list[tuple[Path, dict]]:
    """Complete checkpoints under OUT/checkpoints (never a .tmp), oldest first by tokens seen."""
    root = checkpoint_root(out_dir)
    found = []
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        meta = read_trainer_state(path)
        if meta is not None:
            found.append((path, meta))
    return sorted(found, key=lambda item: (item[1]["run_tokens"], item[1].get("resumable", False)))


def _manifest_entries(path: Path, meta: dict) -> dict[str, dict]:
    """The files manifest.json lists, after checking it is the manifest trainer.json recorded."""
    manifest = path / MANIFEST_FILE
    if not manifest.is_file():
        raise CheckpointError(f"{manifest} is missing (trainer.json records one)")
    if file_sha256(manifest) != meta["manifest_sha256"]:
        raise CheckpointError(f"{manifest} differs from the one trainer.json records (damaged)")
    try:
        entries = json.loads(manifest.read_text())["files"]
        return {
            name: {"size": int(e["size"]), "sha256": str(e["sha256"])}
            for name, e in entries.items()
        }
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(
            f"{manifest}: not a manifest this code wrote ({type(err).__name__}: {err})"
        ) from None


HASH_THREADS = min(8, os.cpu_count() or 1)
"""Files of one checkpoint hashed at once by `verify_checkpoint`."""


def verify_checkpoint(path: Path, meta: dict, hashes: bool = True) -> None:
    """Check every file in the checkpoint's manifest has its recorded size, then (with `hashes`) its sha256; raise
    naming the first that does not. Sizes first: a file truncated by a crash is found without reading the others."""
    if "manifest_sha256" not in meta:
        return  # written before manifests: nothing to check against
    entries = _manifest_entries(path, meta)
    files = {name: contained_file(path, name, str(path / MANIFEST_FILE)) for name in entries}
    for name, entry in entries.items():
        if not files[name].is_file():
            raise CheckpointError(f"{files[name]} is missing (listed in {MANIFEST_FILE})")
        size = files[name].stat().st_size
        if size != entry["size"]:
            raise CheckpointError(
                f"{files[name]} has {size} bytes, {MANIFEST_FILE} records {entry['size']} "
                "(truncated or not flushed before a crash)"
            )
    if not hashes:
        return
    # Files hashed at once (hashlib releases the GIL): a multi-GB sharded checkpoint is read at the disk's
    # speed, not one core's. Checked in the manifest's order, the first damaged or unreadable file is the one
    # named, as a CheckpointError (so --resume auto falls back to an older checkpoint), and the hashing of
    # the files queued after it is cancelled.
    pool = ThreadPoolExecutor(max_workers=HASH_THREADS)
    try:
        futures = {name: pool.submit(file_sha256, files[name]) for name in entries}
        for name, entry in entries.items():
            try:
                digest = futures[name].result()
            except OSError as err:
                raise CheckpointError(
                    f"{files[name]} cannot be read ({err.strerror or err}): damaged on disk"
                ) from err
            if digest != entry["sha256"]:
                raise CheckpointError(
                    f"{files[name]}: its sha256 differs from {MANIFEST_FILE}'s (damaged on disk)"
                )
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _incomplete_directories(out_dir: str | Path) -> list[Path]:
    """Directories under OUT/checkpoints (never a .tmp) that are not complete checkpoints."""
    root = checkpoint_root(out_dir)
    found = sorted(root.iterdir()) if root.is_dir() else []
    return [
        p
        for p in found
        if p.is_dir() and not p.name.endswith(".tmp") and read_trainer_state(p) is None
    ]


def choose_resume_checkpoint(
    out_dir: str | Path, hashes: bool = True
) -> tuple[Path | None, list[str]]:
    """The newest resumable checkpoint whose files verify (sizes, and checksums with `hashes`), or None; and why each
    other candidate was skipped."""
    skipped = [
        f"{p}: not a complete checkpoint (no readable {TRAINER_FILE}, or no {STATE_DIR}/.metadata or {STATE_FILE})"
        for p in _incomplete_directories(out_dir)
    ]
    for path, meta in reversed(list_checkpoints(out_dir)):
        if not meta.get("resumable"):
            continue
        try:
            verify_checkpoint(path, meta, hashes)
        except CheckpointError as err:
            skipped.append(f"{path}: {err}")
            continue
        return path, skipped
    return None, skipped


def find_resume_checkpoint(out_dir: str | Path, hashes: bool = True) -> Path | None:
    """The newest complete, resumable checkpoint (most tokens seen) whose files verify, or None."""
    return choose_resume_checkpoint(out_dir, hashes)[0]


def rng_file(directory: Path, rank: int) -> Path:
    return directory / RNG_DIR / f"rank-{rank:05d}.pt"


def load_training_state(fabric: Any, path: Path, objects: dict, sharded: bool) -> None:
    """Load model and optimizer (`objects`) through Fabric; call after `verify_resume_files`."""
    fabric.load(state_path(path, sharded), objects, weights_only=True)


def restore_rank_rng(path: Path, rank: int) -> None:
    """Restore the RNG states rank `rank` saved in checkpoint `path` (none saved: left as they are)."""
    rng = rng_file(path, rank)
    if rng.is_file():
        restore_rng(load_pickled(rng))


def verify_resume_files(path: Path) -> None:
    """Load every pickled file a resume reads as tensors and plain data, before Fabric unpickles them.

    Fabric resumes through DCP's own reader, whose `.metadata` is a plain `pickle.load` and whose
    non-tensor items load with weights_only=False: a crafted checkpoint would run code there.
    """
    state = path / STATE_DIR
    if (state / ".metadata").is_file():
        read_dcp_metadata(state)
        if (state / "meta.pt").is_file():  # Fabric's non-module state, beside the shards
            load_pickled(state / "meta.pt")
    else:
        load_pickled(path / STATE_FILE, mmap=True)
    for rng in sorted((path / RNG_DIR).glob("*.pt")):
        load_pickled(rng)
    load_trained_lengths(path)


DAMAGED_FIX = "Fix: use another checkpoint of the run (posfreq checkpoint list RUN) or restore this one from a copy"


def read_checkpoint_json(path: Path, what: str) -> dict:
    """A checkpoint's JSON file (model_config.json, tokenizer_spec.json, trainer.json, meta.json) as a dict: the
    one reader of them, so a missing, unreadable or damaged file is one CheckpointError naming it and the fix."""
    if not path.parent.is_dir():
        raise CheckpointError(
            f"{path.parent} is not a directory. Fix: pass RUN/{CHECKPOINTS}/{MILESTONE_PREFIX}*/ (or {LATEST}/) "
            "or a consolidated model directory"
        )
    if not path.is_file():
        raise CheckpointError(
            f"{path.parent}: no {path.name} ({what}): not a complete posfreq checkpoint or consolidated "
            f"model directory. {DAMAGED_FIX}"
        )
    return read_json_object(path, CheckpointError, DAMAGED_FIX, what)


def load_model_config(checkpoint_dir: str | Path) -> ModelConfig:
    """The ModelConfig a checkpoint or consolidated directory was written with (its model_config.json)."""
    return ModelConfig.from_dict(
        read_checkpoint_json(Path(checkpoint_dir) / MODEL_CONFIG_FILE, "model config")
    )


def load_trained_lengths(checkpoint_dir: str | Path) -> np.ndarray:
    """The trained-segment-length histogram (int64, length L + 1) saved with a checkpoint."""
    return load_array(Path(checkpoint_dir) / LENGTHS_FILE)

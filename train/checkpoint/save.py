"""Writing checkpoints in the layout train/checkpoint/layout.py names: files, manifest, trainer.json last, published
atomically; weights as safetensors; leftovers of interrupted writes removed.
"""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from posfreq.train import atomic
from posfreq.train.atomic import atomic_open, fsync_path, write_json_atomic
from posfreq.train.checkpoint.layout import (
    CONFIG_FILE,
    FORMAT,
    HASH_THREADS,
    LENGTHS_FILE,
    LOSS_BY_DISTANCE_FILE,
    MANIFEST_FILE,
    META_FILE,
    MODEL_CONFIG_FILE,
    RNG_DIR,
    TOKENIZER_FILE,
    TRAINER_FILE,
    checkpoint_root,
    rng_file,
    state_path,
)
from posfreq.train.checkpoint.rng_state import capture_rng
from posfreq.train.fingerprint import file_sha256
from posfreq.train.journal import is_record, record_written
from posfreq.train.model.config import ModelConfig


def file_entries(directory: Path, paths: list[Path]) -> dict[str, dict]:
    """{path relative to `directory`: {size, sha256}} of `paths`, HASH_THREADS files at a time (hashlib releases
    the GIL, so a multi-GB checkpoint hashes at the disk's speed rather than one core's)."""
    with ThreadPoolExecutor(max_workers=HASH_THREADS) as pool:
        digests = list(pool.map(file_sha256, paths))
    return {
        path.relative_to(directory).as_posix(): {"size": path.stat().st_size, "sha256": digest}
        for path, digest in zip(paths, digests)
    }


def own_files(directory: Path, rank: int) -> list[Path]:
    """The files of a checkpoint being written that `rank` wrote itself: its DCP shards (torch's FileSystemWriter
    names them __RANK_N.distcp) and its RNG states. Each rank hashes these, on the node whose page cache holds
    them, so rank 0 does not read the whole checkpoint back alone while the others wait."""
    shards = sorted(state_path(directory, True).glob(f"__{rank}_*.distcp"))
    rng = rng_file(directory, rank)
    return shards + ([rng] if rng.is_file() else [])


def write_manifest(directory: Path, known: dict[str, dict] | None = None) -> str:
    """Record every file's relative path, size and sha256 in manifest.json, taking the entries in `known` as they
    are (hashed by the ranks that wrote them) and hashing the rest; returns the manifest's sha256. The files are
    those listed here and those the ranks reported: on a shared file system one node's listing can lag another
    node's writes by seconds, and a file missing from it must still be in the manifest."""
    known = known or {}
    listed = {p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file()}
    names = sorted(listed | set(known))
    # the files that record the manifest come after it; an output folder's own records change as it is written
    names = [
        n
        for n in names
        if n not in (MANIFEST_FILE, TRAINER_FILE, META_FILE) and not is_record(Path(n).name)
    ]
    entries = file_entries(directory, [directory / n for n in names if n not in known])
    entries |= {n: known[n] for n in names if n in known}
    _write_file(directory / MANIFEST_FILE, {"files": entries})  # written with sorted keys
    return file_sha256(directory / MANIFEST_FILE)


def _gathered_entries(fabric: Any, entries: dict[str, dict]) -> dict[str, dict]:
    """Every rank's `entries`, merged (on every rank)."""
    if fabric.world_size == 1:
        return entries
    import torch.distributed as dist

    parts: list = [None] * fabric.world_size
    dist.all_gather_object(parts, entries)
    return {name: entry for part in parts for name, entry in part.items()}


def _write_file(path: Path, content: Any) -> None:
    """Write one checkpoint file atomically: a numpy array as .npy, anything else as sorted, indented JSON."""
    if isinstance(content, np.ndarray):
        with atomic_open(path, "wb") as f:
            np.save(f, content, allow_pickle=False)
    else:
        write_json_atomic(path, content, indent=1, sort_keys=True, default=int)


def seal(directory: Path, trainer_state: dict, known: dict[str, dict] | None = None) -> None:
    """Write the manifest of every file in `directory` (`known`: entries hashed already), then trainer.json
    recording it: last, as it marks the checkpoint complete."""
    manifest = write_manifest(directory, known)
    _write_file(
        directory / TRAINER_FILE,
        {**trainer_state, "format": FORMAT, "manifest_sha256": manifest},
    )


@dataclass(frozen=True)
class RunRecords:
    """What rank 0 writes beside the weights: the trained-length histogram, this step's loss by distance (when
    validation ran), the model config, the tokenizer spec and the run's config."""

    trained_lengths: np.ndarray
    model_config: ModelConfig
    tokenizer_spec: dict
    run_config: dict
    loss_by_distance: dict | None = None

    def files(self) -> dict[str, object]:
        """File name -> content, in the order they are written."""
        return {
            LENGTHS_FILE: self.trained_lengths,
            **(
                {LOSS_BY_DISTANCE_FILE: self.loss_by_distance}
                if self.loss_by_distance is not None
                else {}
            ),
            MODEL_CONFIG_FILE: self.model_config.to_dict(),
            TOKENIZER_FILE: self.tokenizer_spec,
            CONFIG_FILE: self.run_config,
        }


def save_checkpoint(
    fabric: Any, final: Path, objects: dict, trainer_state: dict, sharded: bool, records: RunRecords
) -> Path:
    """Write a checkpoint atomically; call on every rank.

    `objects` (model, optimizer) go through Fabric (sharded DCP or one full file); each rank writes its RNG states;
    rank 0 writes the `records`, the manifest of them all, then trainer.json (`trainer_state`) last, and publishes
    ``final.tmp`` as `final`.
    """
    tmp = atomic.temporary(final)
    if fabric.global_rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        (tmp / RNG_DIR).mkdir(parents=True)
    fabric.barrier()
    fabric.save(state_path(tmp, sharded), objects)
    torch.save(capture_rng(), rng_file(tmp, fabric.global_rank))
    # on its own node: rank 0's fsync reaches only its own writes
    fsync_path(rng_file(tmp, fabric.global_rank))
    fabric.barrier()
    hashed = _gathered_entries(fabric, file_entries(tmp, own_files(tmp, fabric.global_rank)))
    if fabric.global_rank == 0:
        for name, content in records.files().items():
            _write_file(tmp / name, content)
        seal(tmp, trainer_state, hashed)
        atomic.publish_dir(tmp, final)
    fabric.barrier()
    return final


def write_weights(
    state: dict[str, torch.Tensor], file: Path, dtype: torch.dtype | None = None
) -> None:
    """Save a state_dict as safetensors, each tensor its own contiguous copy (safetensors refuses shared storage,
    e.g. tied embeddings), floating tensors cast to `dtype` if given."""
    from safetensors.torch import save_file

    tensors = {
        k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).contiguous().clone()
        for k, v in state.items()
    }
    record_written(file)
    save_file(tensors, str(file), metadata={"format": "pt"})


def remove_stale_temporaries(out_dir: str | Path) -> list[Path]:
    """Delete leftovers of interrupted saves (*.tmp); returns what was removed."""
    root = checkpoint_root(out_dir)
    stale = [p for p in root.glob("*.tmp")] if root.is_dir() else []
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale

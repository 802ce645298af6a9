"""Writing checkpoints in the layout train/checkpoint/layout.py names: files, manifest, trainer.json last, published
atomically; weights as safetensors; leftovers of interrupted writes removed.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from posfreq.train import atomic
from posfreq.train.atomic import atomic_open, fsync_path, write_json_atomic
from posfreq.train.checkpoint.layout import (
    CONFIG_FILE,
    FORMAT,
    LENGTHS_FILE,
    LOSS_BY_DISTANCE_FILE,
    MANIFEST_FILE,
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
from posfreq.train.journal import record_written
from posfreq.train.model.config import ModelConfig


def write_manifest(directory: Path) -> str:
    """Record every file's relative path, size and sha256 in manifest.json; returns the manifest's sha256."""
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    entries = {}
    for path in files:
        name = path.relative_to(directory).as_posix()
        if name not in (MANIFEST_FILE, TRAINER_FILE):
            entries[name] = {"size": path.stat().st_size, "sha256": file_sha256(path)}
    _write_file(directory / MANIFEST_FILE, {"files": entries})
    return file_sha256(directory / MANIFEST_FILE)


def _write_file(path: Path, content: Any) -> None:
    """Write one checkpoint file atomically: a numpy array as .npy, anything else as sorted, indented JSON."""
    if isinstance(content, np.ndarray):
        with atomic_open(path, "wb") as f:
            np.save(f, content, allow_pickle=False)
    else:
        write_json_atomic(path, content, indent=1, sort_keys=True, default=int)


def seal(directory: Path, trainer_state: dict) -> None:
    """Write the manifest of every file in `directory`, then trainer.json recording it: last, as it marks the
    checkpoint complete."""
    manifest = write_manifest(directory)
    _write_file(
        directory / TRAINER_FILE,
        {**trainer_state, "format": FORMAT, "manifest_sha256": manifest},
    )


def save_checkpoint(
    fabric: Any,
    final: Path,
    objects: dict,
    trainer_state: dict,
    sharded: bool,
    *,
    trained_lengths: np.ndarray,
    loss_by_distance: dict | None = None,
    model_config: ModelConfig,
    tokenizer_spec: dict,
    run_config: dict,
) -> Path:
    """Write a checkpoint atomically; call on every rank.

    `objects` (model, optimizer) go through Fabric (sharded DCP or one full file); each rank
    writes its RNG states; rank 0 writes the histogram (and the loss by distance of this step's validation, if it
    ran), the three config files, the manifest
    of them all, then trainer.json (`trainer_state`) last, and publishes ``final.tmp`` as `final`.
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
    if fabric.global_rank == 0:
        files = {
            LENGTHS_FILE: trained_lengths,
            **({LOSS_BY_DISTANCE_FILE: loss_by_distance} if loss_by_distance is not None else {}),
            MODEL_CONFIG_FILE: model_config.to_dict(),
            TOKENIZER_FILE: tokenizer_spec,
            CONFIG_FILE: run_config,
        }
        for name, content in files.items():
            _write_file(tmp / name, content)
        seal(tmp, trainer_state)
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

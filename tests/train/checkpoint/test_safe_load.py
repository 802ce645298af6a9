"""Crafted checkpoint files never run code: every pickled file a resume or a load reads is refused unless it
holds tensors and plain data, and no item may point outside its directory."""

from __future__ import annotations

import io
import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.trainer import (
    tiny,
)

from posfreq.scripts.commands import pretrain
from posfreq.train.checkpoint import layout as ckpt
from posfreq.train.checkpoint import safe_load
from posfreq.train.checkpoint import save as checkpoint_save
from posfreq.train.checkpoint.load import load_model
from posfreq.train.checkpoint.safe_load import CheckpointError

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


class Payload:
    """Unpickling this creates `marker`: it stands in for any code a crafted checkpoint would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def reseal(checkpoint: Path) -> None:
    """Rewrite the manifest (and trainer.json's record of it) to match the files as they are: a crafted checkpoint
    would come with a matching manifest, so the unpickling checks must hold without it."""
    meta = json.loads((checkpoint / ckpt.TRAINER_FILE).read_text())
    meta["manifest_sha256"] = checkpoint_save.write_manifest(checkpoint)
    (checkpoint / ckpt.TRAINER_FILE).write_text(json.dumps(meta))


def plant_pickle(file: Path, payload: Payload) -> None:
    file.write_bytes(pickle.dumps(payload))


def plant_torch(file: Path, payload: Payload) -> None:
    torch.save({"x": torch.zeros(2), "y": payload}, file)


def plant_object_array(file: Path, payload: Payload) -> None:
    np.save(file, np.array([payload], dtype=object), allow_pickle=True)


def plant_byte_item(file: Path, payload: Payload) -> None:
    """Append a crafted optimizer param_groups item to a .distcp file and point the metadata at it."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    with open(file.parent / ".metadata", "rb") as f:
        metadata = safe_load._MetadataUnpickler(f).load()
    blob = io.BytesIO()
    torch.save(payload, blob)
    offset = file.stat().st_size
    with open(file, "ab") as f:
        f.write(blob.getvalue())
    index = next(i for i in metadata.storage_data if i.fqn == "optimizer.param_groups.0.lr")
    metadata.storage_data[index] = _StorageInfo(file.name, offset, len(blob.getvalue()))
    with open(file.parent / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind, name, plant",
    [
        ("sharded", "state/.metadata", plant_pickle),
        ("sharded", "state/__0_0.distcp", plant_byte_item),
        ("sharded", "state/meta.pt", plant_torch),
        ("sharded", "rng/rank-00000.pt", plant_torch),
        ("sharded", "trained_lengths.npy", plant_object_array),
        ("full", "state.pt", plant_torch),
        ("full", "rng/rank-00000.pt", plant_pickle),
    ],
)
def test_resume_never_runs_code_from_checkpoint_files(
    resumable, data_dir, tmp_path, kind, name, plant
):
    out = tmp_path / "run"
    shutil.copytree(resumable[kind], out)
    latest = out / "checkpoints" / ckpt.LATEST
    marker = tmp_path / "payload-ran"
    plant(latest / name, Payload(marker))
    reseal(latest)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(tiny(data_dir, out, **{"checkpoint.sharded": kind == "sharded"})))
    with pytest.raises(SystemExit) as exit_info:
        pretrain.main(["--config", str(config)])
    message = str(exit_info.value.code)
    assert message.startswith(f"error: {latest / name}") and "refusing to load" in message, message
    assert "Fix: use another checkpoint (pretrain --resume PATH" in message
    if name.endswith(".distcp"):  # loading the weights for evaluation checks the same items
        with pytest.raises(CheckpointError, match="optimizer.param_groups.0.lr"):
            load_model(latest)
    assert not marker.exists()


def test_checkpoint_item_outside_its_directory_is_refused(resumable, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(resumable["sharded"], out)
    state = out / "checkpoints" / ckpt.LATEST / "state"
    with open(state / ".metadata", "rb") as f:
        metadata = safe_load._MetadataUnpickler(f).load()
    index = next(iter(metadata.storage_data))
    metadata.storage_data[index].relative_path = "../../../../outside.distcp"
    with open(state / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(CheckpointError, match=r"\.metadata: file name '\.\./.*' points outside"):
        ckpt.verify_resume_files(state.parent)

"""Trainer checkpoints: atomic save, `--resume auto` discovery, model loading and consolidation.

Layout of one checkpoint (``OUT/checkpoints/tokens-{tokens:015d}/`` for milestones, named by
tokens seen, and ``OUT/checkpoints/latest/`` for the rolling resume point):

    state/                 torch.distributed.checkpoint shards (model + optimizer), sharded saves
    state.pt               or: one full state file {"model", "optimizer"} (checkpoint.sharded=false)
    rng/rank-00000.pt      python / numpy / torch (/ cuda) RNG states of each rank
    trained_lengths.npy    int64 bincount (length L + 1) of every segment length trained so far
    model_config.json      ModelConfig.to_dict()
    tokenizer_spec.json    {"spec", "vocab_size", "bos_id", "eos_id"}; train.tokenizer.get_tokenizer(spec)
    config.json            the full run config (TrainConfig.to_dict())
    manifest.json          {"files": {relative path: {"size", "sha256"}}} of every file above
    trainer.json           step, tokens seen, sampler state, schedule, the manifest's sha256; written last

Every checkpoint is written under ``NAME.tmp``, fsynced (files, then directories) and renamed into
place when complete. Replacing an existing directory goes ``NAME -> NAME.old``, ``NAME.tmp -> NAME``,
``NAME.old -> NAME.old.tmp`` (then deleted); a left-over ``NAME.old`` is deleted only while a
whole ``NAME`` exists, so ``NAME`` or ``NAME.old`` is complete at every instant, and a directory
being deleted is always named ``*.tmp`` first. What a kill or power loss can still do (a file
flushed short, a disk error) is caught by the manifest: `--resume auto` takes the newest resumable
checkpoint whose files all have their recorded size and sha256, and says which newer ones it
skipped and why. Checkpoints written before manifests (no ``manifest_sha256`` in trainer.json)
are resumed unverified.

With ``checkpoint.keep_full: N`` only the newest N milestones keep the layout above; older ones
are reduced to weights only (`reduce_to_weights`): ``model.safetensors``, ``trained_lengths.npy``,
the three config files, a manifest of exactly those, and trainer.json with ``"resumable": false``.
The reduced copy is built in ``NAME.tmp`` and published like a save, so ``NAME`` (or ``NAME.old``)
is whole at every instant; `load_model` reads either form, and resume never picks a reduced one.

A consolidated model (``posfreq checkpoint consolidate --checkpoint CKPT --out DIR``) is a directory with
``model.safetensors`` (our state_dict, plain tensors), ``model_config.json``,
``tokenizer_spec.json``, ``trained_lengths.npy`` and ``meta.json``. `load_model` reads it or
any trainer checkpoint, using only safetensors, ``torch.load(weights_only=True)`` and a
whitelisting unpickler for torch.distributed.checkpoint's metadata. `verify_resume_files` gives a
resume the same guarantee before Lightning Fabric reads the checkpoint with DCP's own reader.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import random
import re
import shutil
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import IO, Any, Literal, Optional

import numpy as np
import torch
from jsonargparse import ArgumentParser

from posfreq.train.atomic import atomic_open, fsync_path, write_json_atomic
from posfreq.train.cli import command_parser, parse
from posfreq.train.config import DTYPE_ALIASES, DTYPES, ModelConfig
from posfreq.train.fingerprint import file_sha256
from posfreq.train.model import Transformer
from posfreq.train.outdir import OutputDirError, check_output_dir, claim_output_dir, entry_names

CHECKPOINTS = "checkpoints"
LATEST = "latest"
MILESTONE_PREFIX = "tokens-"
TRAINER_FILE = "trainer.json"
MANIFEST_FILE = "manifest.json"
WEIGHTS_ONLY_FILES = (
    "trained_lengths.npy",
    "model_config.json",
    "tokenizer_spec.json",
    "config.json",
)
FORMAT = "posfreq-pretrain-v1"
CONSOLIDATED_WEIGHTS = "model.safetensors"
UNTRUSTED_FIX = (
    "Fix: resume from another checkpoint (--resume PATH) or move this one away; load only "
    "checkpoints this code wrote, from a source you trust."
)


class CheckpointError(ValueError):
    """A checkpoint file that cannot be loaded safely or at all; the message names the file and a fix."""


def checkpoint_root(out_dir: str | Path) -> Path:
    """OUT/checkpoints."""
    return Path(out_dir) / CHECKPOINTS


def milestone_name(tokens: int) -> str:
    """Directory name of the milestone at `tokens` tokens seen (zero-padded so names sort)."""
    return f"{MILESTONE_PREFIX}{tokens:015d}"


def temporary(path: Path) -> Path:
    """Where `path` is written before it is renamed into place."""
    return path.with_name(path.name + ".tmp")


def fsync_tree(root: Path) -> None:
    """fsync every file under `root`, then its directories bottom-up: a rename then publishes durable bytes."""
    for directory, _, names in os.walk(root, topdown=False):
        for name in names:
            fsync_path(Path(directory) / name)
        fsync_path(Path(directory))


def discard(path: Path) -> None:
    """Delete directory `path` if present, renaming it to NAME.tmp first so a half-deleted one never looks whole."""
    if not path.exists():
        return
    trash = temporary(path)
    if trash.exists():
        shutil.rmtree(trash)
    os.replace(path, trash)
    shutil.rmtree(trash)


def publish(tmp: Path, final: Path) -> None:
    """Make a complete `tmp` durable and rename it to `final`; `final` or `final.old` is whole at every instant."""
    fsync_tree(tmp)
    fsync_path(tmp.parent)
    old = final.with_name(final.name + ".old")
    if final.exists():
        discard(old)  # `final` is whole, so the copy before it may go
        os.replace(final, old)
    os.replace(tmp, final)  # with no `final`, a left-over `old` stays until this rename is done
    fsync_path(final.parent)
    discard(old)


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
        (path / name).is_file() for name in ("state/.metadata", "state.pt", CONSOLIDATED_WEIGHTS)
    )
    return meta if has_state else None


def list_checkpoints(out_dir: str | Path) -> list[tuple[Path, dict]]:
    """Complete checkpoints under OUT/checkpoints (never a .tmp), oldest first by tokens seen."""
    root = checkpoint_root(out_dir)
    found = []
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        meta = read_trainer_state(path)
        if meta is not None:
            found.append((path, meta))
    return sorted(found, key=lambda item: (item[1]["tokens_seen"], item[1].get("resumable", False)))


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


def verify_checkpoint(path: Path, meta: dict) -> None:
    """Check every file in the checkpoint's manifest has its recorded size, then its sha256; raise naming the first
    that does not. Sizes first: a file truncated by a crash is found without reading the others."""
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
    for name, entry in entries.items():
        if file_sha256(files[name]) != entry["sha256"]:
            raise CheckpointError(
                f"{files[name]}: its sha256 differs from {MANIFEST_FILE}'s (damaged on disk)"
            )


def _incomplete_directories(out_dir: str | Path) -> list[Path]:
    """Directories under OUT/checkpoints (never a .tmp) that are not complete checkpoints."""
    root = checkpoint_root(out_dir)
    found = sorted(root.iterdir()) if root.is_dir() else []
    return [
        p
        for p in found
        if p.is_dir() and not p.name.endswith(".tmp") and read_trainer_state(p) is None
    ]


def choose_resume_checkpoint(out_dir: str | Path) -> tuple[Path | None, list[str]]:
    """The newest resumable checkpoint whose files verify (or None), and why each other candidate was skipped."""
    skipped = [
        f"{p}: not a complete checkpoint (no readable {TRAINER_FILE}, or no state/.metadata or state.pt)"
        for p in _incomplete_directories(out_dir)
    ]
    for path, meta in reversed(list_checkpoints(out_dir)):
        if not meta.get("resumable"):
            continue
        try:
            verify_checkpoint(path, meta)
        except CheckpointError as err:
            skipped.append(f"{path}: {err}")
            continue
        return path, skipped
    return None, skipped


def find_resume_checkpoint(out_dir: str | Path) -> Path | None:
    """The newest complete, resumable checkpoint (most tokens seen) whose files verify, or None."""
    return choose_resume_checkpoint(out_dir)[0]


def remove_stale_temporaries(out_dir: str | Path) -> list[Path]:
    """Delete leftovers of interrupted saves (*.tmp); returns what was removed."""
    root = checkpoint_root(out_dir)
    stale = [p for p in root.glob("*.tmp")] if root.is_dir() else []
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


# --------------------------------------------------------------------------------------------
# RNG states
# --------------------------------------------------------------------------------------------


def capture_rng() -> dict:
    """Python, numpy, torch (and CUDA) RNG states, in types `torch.load(weights_only=True)` accepts."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
        "torch": torch.get_rng_state(),
    }
    if (
        torch.cuda.is_available() and torch.cuda.is_initialized()
    ):  # this rank's GPU only: a node of another size
        state["cuda_device"] = (
            torch.cuda.get_rng_state()
        )  # can resume it (one generator per rank is used)
    return state


def restore_rng(state: dict) -> None:
    """Inverse of `capture_rng`."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if not torch.cuda.is_available():
        return
    if "cuda_device" in state:
        torch.cuda.set_rng_state(state["cuda_device"])
    elif (
        "cuda" in state
    ):  # older checkpoints: every visible GPU's state; this rank's device is the one it used
        index = torch.cuda.current_device()
        if index < len(state["cuda"]):
            torch.cuda.set_rng_state(state["cuda"][index])


def rng_file(directory: Path, rank: int) -> Path:
    return directory / "rng" / f"rank-{rank:05d}.pt"


def _write_file(path: Path, content: Any) -> None:
    """Write one checkpoint file atomically: a numpy array as .npy, anything else as sorted, indented JSON."""
    if isinstance(content, np.ndarray):
        with atomic_open(path, "wb") as f:
            np.save(f, content, allow_pickle=False)
    else:
        write_json_atomic(path, content, indent=1, sort_keys=True, default=int)


def save_checkpoint(
    fabric: Any,
    final: Path,
    objects: dict,
    files: dict[str, Any],
    trainer_state: dict,
    sharded: bool,
) -> Path:
    """Write a checkpoint atomically; call on every rank.

    `objects` (model, optimizer) go through Fabric (sharded DCP or one full file); each rank
    writes its RNG states; rank 0 writes `files` (name -> JSON-able dict or numpy array), the
    manifest of them all, then trainer.json last, and publishes ``final.tmp`` as `final`.
    """
    tmp = temporary(final)
    if fabric.global_rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        (tmp / "rng").mkdir(parents=True)
    fabric.barrier()
    fabric.save(tmp / ("state" if sharded else "state.pt"), objects)
    torch.save(capture_rng(), rng_file(tmp, fabric.global_rank))
    fsync_path(
        rng_file(tmp, fabric.global_rank)
    )  # on its own node: rank 0's fsync reaches only its own writes
    fabric.barrier()
    if fabric.global_rank == 0:
        for name, content in files.items():
            _write_file(tmp / name, content)
        manifest = write_manifest(tmp)
        _write_file(
            tmp / TRAINER_FILE, {"format": FORMAT, "manifest_sha256": manifest, **trainer_state}
        )
        publish(tmp, final)
    fabric.barrier()
    return final


# --------------------------------------------------------------------------------------------
# Safe reading of torch.distributed.checkpoint (DCP) directories
# --------------------------------------------------------------------------------------------

_DCP_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's `.metadata` allowing only its own record classes, torch.Size and dtypes."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from checkpoint metadata")


def contained_file(directory: Path, name: str, source: str) -> Path:
    """`directory / name` for a file name read from `source`, refusing absolute names and `..` (no escape)."""
    if (
        not isinstance(name, str)
        or not name
        or PurePath(name).is_absolute()
        or ".." in re.split(r"[/\\]", name)
    ):
        raise CheckpointError(
            f"{source}: file name {name!r} points outside {directory}; refusing to read it. "
            "Fix: list only files inside that directory, by plain relative names."
        )
    return directory / name


def _load_failure(err: Exception) -> str:
    """The one sentence of a torch.load error that says what was refused (or why the file is unreadable)."""
    text = str(err)
    found = re.search(r"WeightsUnpickler error:\s*(.*?)(?:\.\s|\n\n|$)", text, re.S)
    reason = found.group(1) if found else re.split(r"\.\s|\n", text, maxsplit=1)[0]
    return " ".join(reason.split())[:300]


def load_pickled(file: Path | str, data: IO[bytes] | None = None, **kwargs: Any) -> Any:
    """`torch.load(weights_only=True)` of a checkpoint file (or of `data` read from it): tensors and plain data
    only; anything else (a class, a callable) raises `CheckpointError` naming the file instead of running."""
    try:
        return torch.load(
            file if data is None else data, map_location="cpu", weights_only=True, **kwargs
        )
    except (pickle.UnpicklingError, RuntimeError, EOFError) as err:
        raise CheckpointError(
            f"{file}: refusing to load it: it holds more than tensors and plain data, or is "
            f"damaged ({_load_failure(err)}). Nothing in it was run. {UNTRUSTED_FIX}"
        ) from None


def read_dcp_metadata(directory: Path) -> Any:
    """DCP's `.metadata` of `directory`, read with `_MetadataUnpickler`, after `_check_dcp_items`."""
    from torch.distributed.checkpoint.metadata import Metadata

    file = directory / ".metadata"
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise TypeError(f"it holds a {type(metadata).__name__}")
        _check_dcp_items(directory, metadata)
    except CheckpointError:
        raise
    except (
        Exception
    ) as err:  # crafted or damaged metadata fails in many ways; none of them may run code
        raise CheckpointError(
            f"{file}: refusing to load it ({type(err).__name__}: {err}); it is not DCP metadata "
            f"this code wrote. Nothing in it was run. {UNTRUSTED_FIX}"
        ) from None
    return metadata


def _check_dcp_items(directory: Path, metadata: Any) -> None:
    """Check every item's file is inside `directory` and load every non-tensor item as plain data.

    DCP (torch 2.13, `DefaultLoadPlanner.load_bytes`) unpickles non-tensor items (e.g. the optimizer's
    param_groups) with ``torch.load(weights_only=False)``, so one crafted item would run code on load.
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    source = directory / ".metadata"
    byte_items = {
        fqn
        for fqn, entry in metadata.state_dict_metadata.items()
        if isinstance(entry, BytesStorageMetadata)
    }
    for index, info in metadata.storage_data.items():
        file = contained_file(directory, info.relative_path, str(source))
        if index.fqn not in byte_items:
            continue  # tensors: DCP loads them with weights_only=True
        where = f"{file} (item {index.fqn!r}, bytes {info.offset}..{info.offset + info.length})"
        if info.transform_descriptors:
            raise CheckpointError(
                f"{where}: stored with transforms {info.transform_descriptors}, which this code "
                f"never writes. {UNTRUSTED_FIX}"
            )
        with open(file, "rb") as f:
            f.seek(info.offset)
            load_pickled(where, io.BytesIO(f.read(info.length)))


def _safe_reader(path: Path):
    """A DCP FileSystemReader serving metadata read (and checked) by `read_dcp_metadata`, which raises here,
    not inside `dcp.load` (that would wrap the error in its own)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    metadata = read_dcp_metadata(path)

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(path))


def verify_resume_files(path: Path) -> None:
    """Load every pickled file a resume reads as tensors and plain data, before Fabric unpickles them.

    Fabric resumes through DCP's own reader, whose `.metadata` is a plain `pickle.load` and whose
    non-tensor items load with weights_only=False: a crafted checkpoint would run code there.
    """
    state = path / "state"
    if (state / ".metadata").is_file():
        read_dcp_metadata(state)
        if (state / "meta.pt").is_file():  # Fabric's non-module state, beside the shards
            load_pickled(state / "meta.pt")
    else:
        load_pickled(path / "state.pt", mmap=True)
    for rng in sorted((path / "rng").glob("*.pt")):
        load_pickled(rng)
    load_trained_lengths(path)


# --------------------------------------------------------------------------------------------
# Loading models
# --------------------------------------------------------------------------------------------


def _read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise FileNotFoundError(
            f"{path.parent}: no {path.name} ({what}). Is this a posfreq checkpoint or "
            "consolidated model directory?"
        )
    return json.loads(path.read_text())


def load_model_config(checkpoint_dir: str | Path) -> ModelConfig:
    """The ModelConfig a checkpoint or consolidated directory was written with (its model_config.json)."""
    return ModelConfig.from_dict(
        _read_json(Path(checkpoint_dir) / "model_config.json", "model config")
    )


def model_state_dict(
    checkpoint_dir: str | Path, config: ModelConfig | None = None
) -> dict[str, torch.Tensor]:
    """Plain (CPU, full) model state_dict from a consolidated dir or a full/sharded trainer checkpoint."""
    path = Path(checkpoint_dir)
    config = config or load_model_config(path)
    if (path / CONSOLIDATED_WEIGHTS).is_file():
        from safetensors.torch import load_file

        return load_file(str(path / CONSOLIDATED_WEIGHTS))
    if (path / "state.pt").is_file():
        return load_pickled(path / "state.pt", mmap=True)["model"]
    if (path / "state" / ".metadata").is_file():
        import torch.distributed.checkpoint as dcp

        with torch.device("meta"):
            shapes = {k: (v.shape, v.dtype) for k, v in Transformer(config).state_dict().items()}
        state = {
            "model": {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in shapes.items()}
        }
        with (
            warnings.catch_warnings()
        ):  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=_safe_reader(path / "state"), no_dist=True)
        return state["model"]
    raise FileNotFoundError(
        f"{path}: no {CONSOLIDATED_WEIGHTS}, state.pt or state/.metadata. Pass a checkpoint "
        f"directory (OUT/{CHECKPOINTS}/tokens-*/ or latest/) or a consolidated model directory."
    )


def load_model(
    checkpoint_dir: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    attention_backend: str = "auto",
) -> tuple[Transformer, dict, dict]:
    """(model in eval mode, tokenizer spec, meta) from a consolidated dir or any trainer checkpoint.

    The tokenizer spec is {"spec", "vocab_size", "bos_id", "eos_id"} (`get_tokenizer(spec["spec"])`);
    meta is trainer.json (or meta.json of a consolidated dir): step, tokens_seen, config, ...
    """
    path = Path(checkpoint_dir)
    config = load_model_config(path)
    tokenizer = _read_json(path / "tokenizer_spec.json", "tokenizer spec")
    meta_file = path / ("meta.json" if (path / "meta.json").is_file() else TRAINER_FILE)
    meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
    state = model_state_dict(path, config)
    with torch.device("meta"):
        model = Transformer(config, attention_backend=attention_backend)
    model.load_state_dict(state, assign=True)
    if config.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.set_positions("rope")  # rebuild the rotary tables off the meta device
    model.to(device=device, dtype=dtype)
    return model.eval(), tokenizer, meta


def model_fingerprint(checkpoint_dir: str | Path) -> str:
    """sha256 of a checkpoint's model: its config and tokenizer spec files and its weight tensors.

    The weights are hashed as loaded (name, dtype, shape, bytes), not as files, so the optimizer
    state beside them in a trainer checkpoint does not count: a full milestone, its weights-only
    reduction (`checkpoint.keep_full`) and a consolidation in the same dtype share one fingerprint,
    and probe results made on one are found for the others.
    """
    path = Path(checkpoint_dir)
    digest = hashlib.sha256()
    for name in ("model_config.json", "tokenizer_spec.json"):
        if (path / name).is_file():
            digest.update(name.encode() + b"\0" + (path / name).read_bytes() + b"\n")
    state = model_state_dict(path)
    for key in sorted(state):
        tensor = state[key].detach().contiguous().reshape(-1)
        digest.update(f"{key}\0{tensor.dtype}\0{tuple(state[key].shape)}\n".encode())
        digest.update(memoryview(tensor.view(torch.uint8).numpy()))
    return digest.hexdigest()


@dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint (trainer milestone or consolidated directory) says about its model, read without weights."""

    path: Path
    config: ModelConfig
    tokenizer_spec: str | None
    """tokenizer_spec.json's "spec"; None if the file is absent."""
    bos_in_training: bool
    """tokenizer_spec.json's "bos_in_training"; False if absent."""
    trained_lengths: np.ndarray | None
    """trained_lengths.npy; None if absent."""
    run_tokens: int | None
    """Tokens this checkpoint's own run trained (trainer.json, else meta.json: "tokens_seen")."""
    tokens_before: int
    """Tokens its initial weights had seen (warm-up / init_from): "tokens_before", default 0."""
    fingerprint: str
    """`model_fingerprint(path)`."""

    @property
    def tokens_trained(self) -> int | None:
        """Every token the weights saw: this run's plus those before it (None if the run's is unknown)."""
        return None if self.run_tokens is None else self.run_tokens + self.tokens_before


def _run_tokens(path: Path) -> tuple[int | None, int]:
    """(tokens this checkpoint's run trained, tokens its initial weights had seen) from trainer/meta.json."""
    for name in (TRAINER_FILE, "meta.json"):
        if (path / name).is_file():
            meta = json.loads((path / name).read_text())
            value = meta.get("tokens_seen")
            return (None if value is None else int(value)), int(meta.get("tokens_before", 0))
    return None, 0


def read_checkpoint_info(path: str | Path) -> CheckpointInfo:
    """The config, tokenizer, trained lengths, token counts and fingerprint of one checkpoint directory.

    Raises CheckpointError naming the path and the fix when it holds no model_config.json.
    """
    path = Path(path)
    if not (path / "model_config.json").is_file():
        what = (
            "does not exist" if not path.exists() else "is not a checkpoint (no model_config.json)"
        )
        raise CheckpointError(
            f"{path} {what}. Fix: pass RUN/{CHECKPOINTS}/{MILESTONE_PREFIX}*/ (or {LATEST}/) or a "
            "consolidated model directory"
        )
    spec_file = path / "tokenizer_spec.json"
    spec = json.loads(spec_file.read_text()) if spec_file.is_file() else {}
    hist_file = path / "trained_lengths.npy"
    run_tokens, before = _run_tokens(path)
    return CheckpointInfo(
        path=path,
        config=load_model_config(path),
        tokenizer_spec=spec.get("spec"),
        bos_in_training=bool(spec.get("bos_in_training", False)),
        trained_lengths=load_trained_lengths(path) if hist_file.is_file() else None,
        run_tokens=run_tokens,
        tokens_before=before,
        fingerprint=model_fingerprint(path),
    )


def load_trained_lengths(checkpoint_dir: str | Path) -> np.ndarray:
    """The trained-segment-length histogram (int64, length L + 1) saved with a checkpoint."""
    file = Path(checkpoint_dir) / "trained_lengths.npy"
    try:
        return np.load(file, allow_pickle=False)
    except (
        ValueError
    ) as err:  # numpy refuses pickled (object) arrays and damaged headers with ValueError
        raise CheckpointError(f"{file}: refusing to load it ({err}). {UNTRUSTED_FIX}") from None


def _write_weights(
    state: dict[str, torch.Tensor], file: Path, dtype: torch.dtype | None = None
) -> None:
    """Save a state_dict as safetensors, each tensor its own contiguous copy (safetensors refuses shared storage,
    e.g. tied embeddings), floating tensors cast to `dtype` if given."""
    from safetensors.torch import save_file

    tensors = {
        k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).contiguous().clone()
        for k, v in state.items()
    }
    save_file(tensors, str(file), metadata={"format": "pt"})


def reduce_to_weights(path: Path) -> None:
    """Rewrite a verified full checkpoint as weights only (see the module docstring), marked non-resumable.

    Built in NAME.tmp and published: a kill leaves the full NAME (or NAME.old), never a half-reduced one.
    """
    meta = read_trainer_state(path)
    if meta is None:
        raise CheckpointError(f"{path} is not a complete checkpoint")
    verify_checkpoint(path, meta)  # never seal damaged weights under a fresh manifest
    tmp = temporary(path)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    _write_weights(model_state_dict(path), tmp / CONSOLIDATED_WEIGHTS)
    for name in WEIGHTS_ONLY_FILES:
        shutil.copyfile(path / name, tmp / name)
    manifest = write_manifest(tmp)
    _write_file(
        tmp / TRAINER_FILE,
        {**meta, "resumable": False, "reduced_to_weights": True, "manifest_sha256": manifest},
    )
    publish(tmp, path)


def reduce_old_milestones(out_dir: str | Path, keep_full: int) -> list[str]:
    """Reduce every resumable milestone but the newest `keep_full` to weights only; one report line for each.

    A milestone whose files do not verify is left as it is (reported), not sealed under a new manifest.
    """
    milestones = [
        path
        for path, meta in list_checkpoints(out_dir)
        if re.fullmatch(rf"{MILESTONE_PREFIX}\d+", path.name) and meta.get("resumable")
    ]
    report = []
    for path in milestones[: max(0, len(milestones) - keep_full)]:
        try:
            reduce_to_weights(path)
            report.append(f"reduced {path} to weights only")
        except (
            CheckpointError,
            OSError,
        ) as err:  # retention must not end a weeks-long run; the .tmp goes at start-up
            report.append(f"left {path} as it is, not reduced: {err}")
    return report


CONSOLIDATE = "checkpoint consolidate"


def consolidate(
    checkpoint_dir: str | Path, out_dir: str | Path, dtype: torch.dtype | None = None
) -> Path:
    """Write one trainer checkpoint as a single-file model directory (atomically); returns it.

    `out_dir` must be new, empty or an earlier consolidation (OutputDirError otherwise: never a run directory).
    """
    src, out = Path(checkpoint_dir), Path(out_dir)
    tmp, old = temporary(out), out.with_name(out.name + ".old")
    check_output_dir(out, CONSOLIDATE, written_before=_earlier_consolidation)
    for sibling in (
        tmp,
        old,
    ):  # publish() replaces them: only an interrupted consolidation's own may go
        check_output_dir(sibling, CONSOLIDATE, flag="--out's temporary")
    state = model_state_dict(
        src
    )  # before anything is written: a wrong --checkpoint leaves nothing behind
    if tmp.exists():
        shutil.rmtree(tmp)
    claim_output_dir(tmp, CONSOLIDATE)
    try:
        _write_weights(state, tmp / CONSOLIDATED_WEIGHTS, dtype)
        for name in ("model_config.json", "tokenizer_spec.json", "trained_lengths.npy"):
            shutil.copyfile(src / name, tmp / name)
        meta = (
            json.loads((src / TRAINER_FILE).read_text()) if (src / TRAINER_FILE).is_file() else {}
        )
        meta["consolidated_from"] = str(src.resolve())
        write_json_atomic(tmp / "meta.json", meta, indent=1, sort_keys=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # this call's own temporary
        raise
    publish(tmp, out)
    return out


CONSOLIDATED_FILES = {
    CONSOLIDATED_WEIGHTS,
    "model_config.json",
    "tokenizer_spec.json",
    "trained_lengths.npy",
    "meta.json",
}


def _earlier_consolidation(out: Path) -> bool:
    """Whether an older posfreq consolidated into `out`: exactly its files, meta.json naming the source."""
    if entry_names(out) != CONSOLIDATED_FILES:
        return False
    try:
        return "consolidated_from" in json.loads((out / "meta.json").read_text())
    except (OSError, ValueError, TypeError):
        return False


def build_parser() -> ArgumentParser:
    """`posfreq checkpoint`: the subcommands `consolidate` and `list`."""
    parser = command_parser(
        "posfreq checkpoint",
        "List a run's complete checkpoints, or consolidate one into a "
        "model directory (model.safetensors and its config files).",
    )
    consolidate_parser = command_parser(
        "posfreq checkpoint consolidate",
        "Write a trainer checkpoint's weights as "
        "model.safetensors, with its config files, into a new directory (atomically).",
    )
    consolidate_parser.add_argument(
        "--checkpoint",
        type=Path,
        required=True,
        help="A trainer checkpoint directory (RUN/checkpoints/tokens-*/ or latest/).",
    )
    consolidate_parser.add_argument(
        "--out", type=Path, required=True, help="The model directory to write."
    )
    consolidate_parser.add_argument(
        "--dtype",
        type=Optional[Literal[tuple(DTYPES) + tuple(DTYPE_ALIASES)]],
        default=None,
        help="Cast the floating-point weights to this dtype (null: keep the trained one).",
    )
    list_parser = command_parser(
        "posfreq checkpoint list",
        "One line per complete checkpoint of a run: its path, "
        "step, tokens seen, and whether it is resumable or weights only.",
    )
    list_parser.add_argument(
        "--run", type=Path, required=True, help="A training run directory (the trainer's --out)."
    )
    subcommands = parser.add_subcommands(dest="command")
    subcommands.add_subcommand(
        "consolidate", consolidate_parser, help="consolidate a checkpoint into model.safetensors"
    )
    subcommands.add_subcommand("list", list_parser, help="list the complete checkpoints of a run")
    return parser


def main(argv: list[str] | None = None) -> int:
    """`posfreq checkpoint consolidate --checkpoint CKPT --out DIR [--dtype bfloat16]` or `list --run RUN`."""
    args = parse(build_parser(), argv)
    if args.command == "consolidate":
        cmd = args.consolidate
        try:
            print(
                consolidate(
                    cmd.checkpoint, cmd.out, DTYPES.get(DTYPE_ALIASES.get(cmd.dtype, cmd.dtype))
                )
            )
        except OutputDirError as err:
            sys.exit(f"error: {err}")
    else:
        run = args.list.run
        if not run.is_dir():
            sys.exit(
                f"error: --run {run} does not exist. Fix: pass a training run directory (the trainer's --out)"
            )
        found = list_checkpoints(run)
        if not found:
            print(f"{run}: no complete checkpoint under {checkpoint_root(run)}", file=sys.stderr)
        for path, meta in found:
            kind = "resumable" if meta.get("resumable") else "weights only"
            print(f"{path}\tstep {meta['step']}\ttokens {meta['tokens_seen']}\t{kind}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

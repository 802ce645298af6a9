"""Reading checkpoint files without running code from them, and the error every checkpoint reader raises.

Pickled files load with ``torch.load(weights_only=True)`` (tensors and plain data only); DCP's
``.metadata`` loads with an unpickler that allows only DCP's own record classes, and every
non-tensor item it lists is loaded the same restricted way before DCP would unpickle it freely.
"""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path, PurePath
from typing import IO, Any, Iterable

import numpy as np
import torch

UNTRUSTED_FIX = (
    "Fix: use another checkpoint (pretrain --resume PATH, probe --checkpoint PATH) or move this one away; load "
    "only checkpoints this code wrote, from a source you trust."
)


class CheckpointError(ValueError):
    """A checkpoint file that cannot be loaded safely or at all; the message names the file and a fix."""


def first_non_finite(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[str, int] | None:
    """(name, count) of the first floating-point tensor holding NaN or an infinity, else None: weights that would
    make every score NaN, which argmax and means then turn into numbers."""
    for name, tensor in named:
        if tensor.is_floating_point():
            bad = int((~torch.isfinite(tensor)).sum())
            if bad:
                return name, bad
    return None


def non_finite_message(where: str, found: tuple[str, int]) -> str:
    """The one line that refuses weights `first_non_finite` found bad in `where`."""
    name, bad = found
    return (
        f"{where}: weight {name} holds {bad:,} NaN or infinite value{'s' if bad != 1 else ''}; every score of "
        "this model would be NaN, which a probe would count as a number. Fix: use an earlier checkpoint or "
        "another copy of the model"
    )


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
    """`directory / name` for a file name read from `source`, refusing absolute names, `..` and symbolic links that
    lead outside `directory` (no escape)."""
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
    path = directory / name
    if not path.resolve().is_relative_to(Path(directory).resolve()):  # a link on the way leads out
        raise CheckpointError(
            f"{source}: file name {name!r} leads outside {directory} through a symbolic link (to "
            f"{path.resolve()}); refusing to read it. Fix: copy the file into the directory itself."
        )
    return path


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


def safe_dcp_reader(path: Path):
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


def load_array(file: Path) -> np.ndarray:
    """A .npy file of plain numbers; numpy refuses pickled (object) arrays and damaged headers: CheckpointError."""
    try:
        return np.load(file, allow_pickle=False)
    except ValueError as err:
        raise CheckpointError(f"{file}: refusing to load it ({err}). {UNTRUSTED_FIX}") from None

"""Consolidation: one trainer checkpoint as a single-file model directory (model.safetensors and its config files),
written atomically into a folder that is new, empty or an earlier consolidation."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from posfreq.train import atomic
from posfreq.train.atomic import write_json_atomic
from posfreq.train.checkpoint.layout import (
    CONSOLIDATED_WEIGHTS,
    DAMAGED_FIX,
    LENGTHS_FILE,
    MEASUREMENT_FILES,
    META_FILE,
    MODEL_CONFIG_FILE,
    TOKENIZER_FILE,
    TRAINER_FILE,
    read_checkpoint_json,
)
from posfreq.train.checkpoint.load import model_state_dict
from posfreq.train.checkpoint.safe_load import CheckpointError
from posfreq.train.checkpoint.save import write_manifest, write_weights
from posfreq.train.journal import claimed_inside, record_written
from posfreq.train.outdir import (
    OutputDirError,
    check_output_dir,
    claim_output_dir,
    entry_names,
    lock_beside,
    owner_of,
)

CONSOLIDATE = "checkpoint consolidate"


def consolidate(
    checkpoint_dir: str | Path, out_dir: str | Path, dtype: torch.dtype | None = None
) -> Path:
    """Write one trainer checkpoint as a single-file model directory (atomically); returns it.

    `out_dir` must be new, empty or an earlier consolidation (OutputDirError otherwise: never a run directory), and
    hold no other command's results (a probe's folder claimed inside it), which replacing it would delete.
    """
    src, out = Path(checkpoint_dir), Path(out_dir)
    with lock_beside(
        out
    ):  # before OUT.tmp or OUT.old is looked at: a concurrent consolidation waits its turn
        return _consolidate(src, out, dtype)


def _consolidate(src: Path, out: Path, dtype: torch.dtype | None) -> Path:
    """`consolidate` under the lock beside `out`."""
    tmp, old = atomic.temporary(out), out.with_name(out.name + ".old")
    check_output_dir(out, CONSOLIDATE, written_before=_earlier_consolidation)
    # publish_dir() replaces `out` whole: another command's results claimed inside it would go with it
    nested = claimed_inside(out) if out.is_dir() else []
    if nested:
        theirs = out / nested[0]
        raise OutputDirError(
            f"--out {out} holds {theirs}, the outputs of `posfreq {owner_of(theirs)}`, and a consolidation replaces "
            f"--out whole. Fix: move {theirs} out of {out}, or pass another --out (nothing was changed)"
        )
    # publish_dir() replaces them: only an interrupted consolidation's own may go
    for sibling in (tmp, old):
        check_output_dir(sibling, CONSOLIDATE, flag="--out's temporary")
    # before anything is written: a wrong --checkpoint, or one missing a file it must carry, leaves nothing behind
    state = model_state_dict(src)
    read_checkpoint_json(src / TOKENIZER_FILE, "tokenizer spec")
    meta = (
        read_checkpoint_json(src / TRAINER_FILE, "run state")
        if (src / TRAINER_FILE).is_file()
        else {}
    )
    if not (src / LENGTHS_FILE).is_file():
        raise CheckpointError(
            f"{src}: no {LENGTHS_FILE} (the trained-length histogram): not a complete checkpoint. {DAMAGED_FIX}"
        )
    if tmp.exists():
        shutil.rmtree(
            tmp
        )  # an interrupted consolidation's, checked above; no other process is writing it now
    claim_output_dir(tmp, CONSOLIDATE)
    try:
        write_weights(state, tmp / CONSOLIDATED_WEIGHTS, dtype)
        kept = tuple(n for n in MEASUREMENT_FILES if (src / n).is_file())
        for name in (MODEL_CONFIG_FILE, TOKENIZER_FILE, LENGTHS_FILE, *kept):
            record_written(tmp / name)
            shutil.copyfile(src / name, tmp / name)
        meta["consolidated_from"] = str(src.resolve())
        if "manifest_sha256" in meta:  # the source's, kept under its own name
            meta["source_manifest_sha256"] = meta.pop("manifest_sha256")
        meta["manifest_sha256"] = write_manifest(tmp)  # checked whenever the weights are read
        write_json_atomic(tmp / META_FILE, meta, indent=1, sort_keys=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # this call's own temporary
        raise
    atomic.publish_dir(tmp, out)
    return out


CONSOLIDATED_FILES = {
    CONSOLIDATED_WEIGHTS,
    MODEL_CONFIG_FILE,
    TOKENIZER_FILE,
    LENGTHS_FILE,
    META_FILE,
}


def _earlier_consolidation(out: Path) -> bool:
    """Whether an older posfreq consolidated into `out`: exactly its files, meta.json naming the source."""
    if entry_names(out) != CONSOLIDATED_FILES:
        return False
    try:
        return "consolidated_from" in json.loads((out / META_FILE).read_text())
    except (OSError, ValueError, TypeError):
        return False

"""Checkpoint retention: older milestones reduced to weights only (``checkpoint.keep_full``), to save disk.

A reduced milestone keeps ``model.safetensors``, the histogram, the three config files, a
manifest of exactly those, and trainer.json with ``"resumable": false``; `load_model` reads it,
and resume never picks it.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from posfreq.train import atomic
from posfreq.train.checkpoint.layout import (
    CONSOLIDATED_WEIGHTS,
    MEASUREMENT_FILES,
    MILESTONE_PREFIX,
    WEIGHTS_ONLY_FILES,
    list_checkpoints,
    read_trainer_state,
)
from posfreq.train.checkpoint.load import model_state_dict, verify_before_reading
from posfreq.train.checkpoint.safe_load import CheckpointError
from posfreq.train.checkpoint.save import seal, write_weights


def reduce_to_weights(path: Path) -> None:
    """Rewrite a verified full checkpoint as weights only (see the module docstring), marked non-resumable.

    Built in NAME.tmp and published: a kill leaves the full NAME (or NAME.old), never a half-reduced one.
    """
    meta = read_trainer_state(path)
    if meta is None:
        raise CheckpointError(f"{path} is not a complete checkpoint")
    # never seal damaged weights under a fresh manifest (cached: the weights' read below checks nothing again)
    verify_before_reading(path)
    tmp = atomic.temporary(path)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    write_weights(model_state_dict(path), tmp / CONSOLIDATED_WEIGHTS)
    for name in WEIGHTS_ONLY_FILES + tuple(n for n in MEASUREMENT_FILES if (path / n).is_file()):
        shutil.copyfile(path / name, tmp / name)
    seal(tmp, {**meta, "resumable": False, "reduced_to_weights": True})
    atomic.publish_dir(tmp, path)


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
        except (CheckpointError, OSError) as err:
            # retention must not end a weeks-long run; the .tmp goes at start-up
            report.append(f"left {path} as it is, not reduced: {err}")
    return report

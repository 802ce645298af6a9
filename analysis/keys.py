"""Result keys: what a stored result was made from, hashed, so that a rerun reuses exactly the results it may.

One module for both result stores, the probe's (one folder per model content and probe settings) and RULER's
(one part per task and length). Each declares here which source files can change its answers; the hashing
itself (file bytes, import closures) is train/fingerprint.py's. Editing a covered file changes every key,
so results made by other code are never reused.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING

from posfreq.train.fingerprint import code_sha256, import_closure

if TYPE_CHECKING:
    from posfreq.analysis.niah.needles import NiahBuilder
    from posfreq.analysis.niah.settings import ProbeSettings
    from posfreq.analysis.niah.sources import ModelSource

PROBE_ENTRY = "scripts/commands/probe.py"
"""The probe's command line: every posfreq module it imports, directly or not, can decide its answers..."""
NOT_ANSWER_DECIDING = (
    "scripts/commands/probe.py",
    "train/command_line.py",
    "train/outdir.py",
    "train/atomic.py",
    "train/fingerprint.py",
    "train/run/log.py",
    "train/checkpoint/save.py",
    "train/checkpoint/consolidate.py",
    "train/checkpoint/retention.py",
    "train/checkpoint/rng_state.py",
    "analysis/keys.py",
    "analysis/table_files.py",
    "analysis/plots/*.py",
    "analysis/tables/*.py",
    "analysis/niah/store.py",
    "analysis/corpus/frequency.py",
    "*/__init__.py",
)
"""...but these: the command line itself and argument parsing (its flags become ProbeSettings, which the key holds
as settings; its help text must not re-key every result), output folders, saving and consolidating checkpoints, this module, package
docstrings, and the tables and figures derived from records the probe has already written."""

RULER_ENTRIES = (
    "analysis/ruler_task/evaluate.py",
    "analysis/ruler_task/tasks.py",
    "analysis/ruler_task/offline.py",
)
"""What decides a RULER score besides the model, the settings and the task YAML files: one task's evaluation
at one length, lm-eval's task code and its offline patches, and what they import. Not the command line, the
parts store or the tables."""


def content_key(parts: dict) -> str:
    """sha256 (16 hex) of `parts` as sorted JSON: the one hash every result key is."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def probe_code() -> tuple[str, ...]:
    """The source files that decide a probe's answers: PROBE_ENTRY's import closure, less NOT_ANSWER_DECIDING."""
    return import_closure((PROBE_ENTRY,), NOT_ANSWER_DECIDING)


def probe_result_key(
    source: ModelSource, builder: NiahBuilder, settings: ProbeSettings, model: bool = True
) -> tuple[str, dict]:
    """(key, parts) of a probe's results: model content, prompt content, decoding settings and code. model=False
    leaves the model out (a run's key, shared by its checkpoints)."""
    parts = {
        "model": source.fingerprint,
        "prompts": builder.digest,
        "decoding": settings.decoding(),
        "code": code_sha256(probe_code()),
    }
    if not model:
        del parts["model"]
    return content_key(parts), parts


def ruler_code(task_yamls: list[str]) -> str:
    """sha256 of RULER's evaluation code (RULER_ENTRIES' import closure) and its task files."""
    return code_sha256((*import_closure(RULER_ENTRIES, ()), *task_yamls))


def ruler_unit_key(request: dict, task: str, length: int) -> str:
    """The key of one (task, length) score. lm-eval's context limit is not in it: at twice the longest length or
    more it never truncates a prompt, so it cannot change a score."""
    return content_key({**request, "task": task, "length": length})

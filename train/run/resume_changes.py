"""What may differ between a checkpoint's config and the run resuming it: keys that do not change the run's math
(RESUMABLE_CHANGES), schedule keys that change only through --resume-override (RESUME_OVERRIDABLE), and the
differences a resume refuses, each with the flag that would allow it (train/run/resolved.py asks)."""

from __future__ import annotations

from typing import Any

# Keys that may change between a checkpoint and the run resuming it: they do not change the
# math of the run (which rows each step trains on, the model, the optimiser, the schedule).
RESUMABLE_CHANGES = (
    "out",
    "resume",
    "overwrite",
    "stop_at_step",
    "micro_batch_rows",
    "devices",
    "num_nodes",
    "fsdp",
    "accelerator",
    "requeue_on_signal",
    "memory_check",
    "on_nonfinite",
    "resume_override",
    "data.dir",
    "data.val_dir",
    "data.val_every_tokens",
    "data.val_rows",
    "data.val_len",
    "model.attention_backend",
    "model.activation_checkpointing",
    "model.compile",
    "model.init_from",
    "checkpoint.",
    "logging.",
)
# Keys that change the schedule: they may change on resume only through --resume-override.
RESUME_OVERRIDABLE = ("optim.lr", "optim.min_lr", "optim.warmup_steps", "total_tokens")
NOT_FLATTENED = ("overrides", "resume_override")  # dict-valued keys, not sections


def _flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    """A nested config dict as {'section.key': value}."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and key not in NOT_FLATTENED:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_differences(saved: dict, current: dict) -> list[str]:
    """Keys whose values differ between two config dicts, ignoring RESUMABLE_CHANGES and the keys `current`
    overrides (its resume_override); a RESUME_OVERRIDABLE key names the flag that would allow its change."""
    a, b = _flatten(saved), _flatten(current)
    allowed = set(current.get("resume_override", {}))
    diffs = []
    for key in sorted(set(a) | set(b)):
        if key in allowed or any(
            key == k or (k.endswith(".") and key.startswith(k)) for k in RESUMABLE_CHANGES
        ):
            continue
        if a.get(key) != b.get(key):
            if key in RESUME_OVERRIDABLE:
                hint = f' (to change it on resume: --resume-override "{{{key}: {b.get(key)}}}")'
            elif isinstance(a.get(key), (str, int, float)) and not isinstance(a.get(key), bool):
                hint = f" (to continue the run as it was: --{key} {a.get(key)})"
            else:
                hint = ""
            diffs.append(f"{key}: checkpoint {a.get(key)!r} vs now {b.get(key)!r}{hint}")
    return diffs


def overridden_changes(saved: dict, current: dict) -> list[str]:
    """The RESUME_OVERRIDABLE keys `current` overrides to a value other than the checkpoint's, as 'key: old -> new'."""
    a, b = _flatten(saved), _flatten(current)
    return [
        f"{key}: {a.get(key)!r} -> {b.get(key)!r}"
        for key in current.get("resume_override", {})
        if a.get(key) != b.get(key)
    ]

"""Small helpers shared by the command-line entry points (train, analysis and scripts)."""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parse_shard(text: str) -> tuple[int, int]:
    """'i/n' (0-based i, as SLURM_ARRAY_TASK_ID / SLURM_ARRAY_TASK_COUNT) -> (i, n), for argparse."""
    try:
        index, count = (int(x) for x in text.strip().split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard expects i/n such as 3/64 (0-based i), got {text!r}") from None
    if not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"--shard {text}: need 0 <= i < n")
    return index, count


def code_version() -> str:
    """`git describe --always --dirty --tags` of this repository, or 'unknown' outside a git checkout."""
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty", "--tags"], cwd=REPO, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"

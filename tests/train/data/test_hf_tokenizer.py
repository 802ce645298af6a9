"""Hugging Face tokenizer files (train/data/hf_tokenizer.py) against transformers and quicktok: the bytes and
Llama 3 tokenizers give our ids offline; a tokenizer with no Hugging Face form writes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from helpers.hf import consolidated_bytes_model  # noqa: E402

BYTE_TEXTS = [
    "Hello world!",
    "café résumé — Zürich",
    "日本語 \U0001f680\U0001f525",
    "  two  spaces\n\n\ttab\r\n",
    "",
    "One of the magic numbers is 424727.",
    "text <|end_of_text|> and <|begin_of_text|> stay bytes",
]


def test_bytes_model_export_loads_offline_with_our_ids(tmp_path: Path) -> None:
    """A bytes-tokenizer model exports a tokenizer AutoTokenizer loads offline, giving UTF-8 bytes as ids; files 0644."""
    import os

    from posfreq.scripts.commands import export_hf as script

    consolidated_bytes_model(tmp_path / "ckpt")
    old_umask = os.umask(0o022)
    try:
        script.main(["--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf")])
    finally:
        os.umask(old_umask)
    out = tmp_path / "hf"
    modes = {f.name: f.stat().st_mode & 0o777 for f in out.iterdir()}
    assert set(modes) == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        ".posfreq-files",
        ".posfreq-lock",
        ".posfreq-output.json",
    }  # the last three: what the export wrote, its lock and its owner (train/journal.py)
    assert set(modes.values()) == {0o644}, modes
    hf = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert (hf.bos_token_id, hf.eos_token_id, len(hf)) == (256, 257, 258)
    for text in BYTE_TEXTS:
        assert hf(text).input_ids == list(text.encode("utf-8")), (
            text
        )  # the bytes tokenizer's ids, independently
        assert hf.decode(list(text.encode("utf-8"))) == text
    model = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert (model.generation_config.eos_token_id, model.config.vocab_size) == (257, 258)


def test_tokenizer_without_hf_form_warns_and_writes_none(tmp_path: Path) -> None:
    from posfreq.train.data.hf_tokenizer import write_tokenizer_files

    with pytest.warns(UserWarning, match="no Hugging Face files"):
        assert write_tokenizer_files("demo-vocabulary", tmp_path) == []
    assert list(tmp_path.iterdir()) == []


def _umask() -> int:
    """The process umask (read by setting and restoring it)."""
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.slow  # a child process, a notebook kernel or a deliberate timeout
def test_llama3_tokenizer_json_matches_quicktok(tmp_path: Path) -> None:
    """The exported tokenizer.json gives quicktok's Llama 3 ids (HF's own loader reads it too)."""
    from posfreq.train.data.hf_tokenizer import write_llama3_tokenizer
    from posfreq.train.data.tokenizer import get_tokenizer

    assert {f.stat().st_mode & 0o777 for f in write_llama3_tokenizer(tmp_path)} == {
        0o666 & ~_umask()
    }
    ours, reference = get_tokenizer(f"hf:{tmp_path}"), get_tokenizer("llama3")
    assert (ours.vocab_size, ours.bos_id, ours.eos_id) == (
        reference.vocab_size,
        reference.bos_id,
        reference.eos_id,
    )
    texts = [
        "Hello world!",
        "def f(x):\n    return [i**2 for i in range(100)]  # 1+2+3==6",
        "café résumé naïve — Zürich",
        "日本語のトークナイザー 中文 한국어",
        "emoji \U0001f680\U0001f525 mixed",
        "   leading\n\ttabs  \r\n \r\n\n\n",
        "ALLCAPS 1234567890 3.14159 0xDEADBEEF 99.99%",
        "don't I'll they're 'TWAS",
        "\t\t\t\t\t\t\t\t\r\n",
        "",
    ]
    for text in texts:
        assert ours.encode(text) == reference.encode(text), text
        assert ours.decode(reference.encode(text)) == text
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert hf("Hello world!").input_ids == [reference.bos_id, *reference.encode("Hello world!")]


def tokenizer_with(tmp_path: Path, **settings) -> Path:
    """The bytes tokenizer's folder, with `settings` written into its tokenizer.json (as a stranger's file may)."""
    import json

    from posfreq.train.data.hf_tokenizer import write_bytes_tokenizer

    folder = tmp_path / "tok"
    write_bytes_tokenizer(folder)
    data = json.loads((folder / "tokenizer.json").read_text())
    data.update(settings)
    (folder / "tokenizer.json").write_text(json.dumps(data))
    return folder


def test_a_tokenizer_files_own_truncation_and_padding_do_not_bend_lengths(tmp_path: Path) -> None:
    """A tokenizer.json that truncates at 64 tokens or pads to a huge fixed length must not change the ids
    posfreq counts (issue 30: analyze reported 65 tokens for a 601-token document)."""
    from posfreq.train.data.tokenizer import HFTokenizer

    text = "a long document " * 40  # 640 bytes
    truncating = {
        "truncation": {
            "direction": "Right",
            "max_length": 64,
            "strategy": "LongestFirst",
            "stride": 0,
        }
    }
    tok = HFTokenizer(tokenizer_with(tmp_path, **truncating))
    assert tok.encode(text) == list(text.encode())
    assert [len(ids) for ids in tok.encode_batch([text, "ab"])] == [640, 2]


def test_a_huge_fixed_padding_is_switched_off_not_allocated(tmp_path: Path) -> None:
    """Padding to a fixed 10^12 tokens aborted the process; it runs in a child so an abort fails the test only."""
    import subprocess
    import sys

    padding = {
        "padding": {
            "strategy": {"Fixed": 10**12},
            "direction": "Right",
            "pad_to_multiple_of": None,
            "pad_id": 0,
            "pad_type_id": 0,
            "pad_token": "a",
        }
    }
    folder = tokenizer_with(tmp_path, **padding)
    code = (
        "from posfreq.train.data.tokenizer import HFTokenizer\n"
        f"print(len(HFTokenizer({str(folder)!r}).encode_batch(['abc', 'de'])[0]))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == "3", result.stderr[-500:]


def test_a_tokenizer_that_panics_is_one_error_naming_the_file(tmp_path: Path, monkeypatch) -> None:
    """A Rust panic (pyo3's PanicException, a BaseException) becomes a TokenizerFileError naming the file."""
    from posfreq.train.data.tokenizer import HFTokenizer, TokenizerFileError

    folder = tokenizer_with(tmp_path)
    tok = HFTokenizer(folder)

    class PanicException(BaseException):  # what pyo3 raises for a panic, as a stand-in
        pass

    class Panicking:
        def encode(self, *args, **kwargs):
            raise PanicException("called `Option::unwrap()` on a `None` value")

    monkeypatch.setattr(tok, "_tok", Panicking())
    with pytest.raises(TokenizerFileError, match=r"tok/tokenizer.json: .*PanicException: called"):
        tok.encode("text")

"""Tokenizers behind one small protocol: encode, decode, bos_id, eos_id, vocab_size.

`get_tokenizer(spec)` picks one by name:
- ``llama3`` (default): the exact Llama-3 ids, from quicktok-v1's bundled encoding (offline).
- ``hf:<local dir>``: a Hugging Face tokenizer saved on disk (needs `tokenizers`).
- ``bytes``: UTF-8 bytes plus BOS/EOS; tiny and dependency-free, for fast tests.

`encode` never adds BOS/EOS and never parses special-token strings in the text: corpus text
that happens to contain "<|end_of_text|>" is ordinary text, as in training data.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, Sequence, runtime_checkable

import numpy as np


@runtime_checkable
class Tokenizer(Protocol):
    """What the rest of the code may ask of a tokenizer."""

    name: str
    vocab_size: int
    bos_id: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class Llama3Tokenizer:
    """Llama-3's 128,256-token BPE, exact ids, via quicktok (a fast tiktoken-compatible encoder)."""

    name = "llama3"

    def __init__(self) -> None:
        import quicktok

        self._enc = quicktok.get_encoding("llama3")
        self.vocab_size = int(self._enc.n_vocab)
        self.bos_id = int(self._enc.encode_single_token("<|begin_of_text|>"))
        self.eos_id = int(self._enc.encode_single_token("<|end_of_text|>"))

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self._enc.encode_ordinary(text)]

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        if not texts:
            return []
        tokens, offsets = self._enc.encode_batch(list(texts), threads=1)  # offsets: n + 1 bounds
        return [np.asarray(tokens[a:b], dtype=np.int64) for a, b in zip(offsets[:-1], offsets[1:])]

    def decode(self, ids: Sequence[int]) -> str:
        return self._enc.decode([int(i) for i in ids])

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()


class ByteTokenizer:
    """UTF-8 bytes (ids 0-255) with BOS 256 and EOS 257: for fast tests, never for real runs."""

    name = "bytes"
    vocab_size = 258
    bos_id = 256
    eos_id = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int64) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A tokenizer saved by Hugging Face (`tokenizer.json` in a local directory)."""

    def __init__(self, directory: str | Path) -> None:
        path = Path(directory)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(
                f"hf tokenizer: no tokenizer.json at {file}. Pass hf:<dir> where <dir> holds a "
                "Hugging Face tokenizer.json (save one with tokenizer.save_pretrained(dir))."
            )
        try:
            from tokenizers import Tokenizer as _HFTok
        except ImportError as err:
            raise ImportError("hf:<dir> tokenizers need `pip install tokenizers`") from err
        self._tok = _HFTok.from_file(str(file))
        self._tok.encode_special_tokens = True  # special-token strings in text stay plain text
        self.name = f"hf:{path}"
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.bos_id, self.eos_id = self._special_ids(path)

    def _special_ids(self, path: Path) -> tuple[int, int]:
        """BOS/EOS from tokenizer_config.json when present, else the usual Llama names."""
        import json

        names = {"bos": ["<|begin_of_text|>", "<s>"], "eos": ["<|end_of_text|>", "</s>", "<|endoftext|>"]}
        config = path / "tokenizer_config.json" if path.is_dir() else None
        if config is not None and config.is_file():
            data = json.loads(config.read_text())
            for key in ("bos", "eos"):
                value = data.get(f"{key}_token")
                if isinstance(value, dict):
                    value = value.get("content")
                if value:
                    names[key] = [value] + names[key]
        ids = []
        for key in ("bos", "eos"):
            found = [self._tok.token_to_id(n) for n in names[key] if self._tok.token_to_id(n) is not None]
            if not found:
                raise ValueError(f"hf tokenizer at {path}: no {key.upper()} token among {names[key]}")
            ids.append(int(found[0]))
        return ids[0], ids[1]

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encoded = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encoded]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


_REGISTRY = {"llama3": Llama3Tokenizer, "bytes": ByteTokenizer}


def register_tokenizer(name: str, factory) -> None:
    """Add a named tokenizer (e.g. the demo's small vocabulary) to `get_tokenizer`."""
    _REGISTRY[name] = factory


def get_tokenizer(spec: str = "llama3") -> Tokenizer:
    """Build a tokenizer from its name: llama3, bytes, hf:<dir>, or a registered name."""
    if spec.startswith("hf:"):
        return HFTokenizer(spec[3:])
    if spec not in _REGISTRY:
        raise ValueError(f"unknown tokenizer {spec!r}; choose one of {sorted(_REGISTRY)} or hf:<dir>")
    return _REGISTRY[spec]()

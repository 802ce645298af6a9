"""Tokenizers behind one small protocol: encode, decode, bos_id, eos_id, vocab_size.

`get_tokenizer(spec)` picks one by name:
- ``llama3`` (default): the exact Llama-3 ids, from quicktok-v1's bundled encoding (offline).
- ``hf:<local dir>``: a Hugging Face tokenizer saved on disk (needs `tokenizers`).
- ``bytes``: UTF-8 bytes plus BOS/EOS; tiny and dependency-free, for fast tests.

`encode` never adds BOS/EOS and never parses special-token strings in the text: corpus text
that happens to contain "<|end_of_text|>" is ordinary text, as in training data. Each tokenizer
also says whether its own convention starts a text with BOS (`adds_bos`, what Hugging Face's
post-processor or `add_bos_token` does), identifies its content (`fingerprint`, for result keys),
and, when it has one, frames a chat turn with its chat template (`chat_frame`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Protocol, Sequence, runtime_checkable

import numpy as np

from posfreq.train.json_file import read_json_object

CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where transformers 5 saves a tokenizer's chat template


@runtime_checkable
class Tokenizer(Protocol):
    """What the rest of the code may ask of a tokenizer."""

    name: str
    vocab_size: int
    bos_id: int | None  # None: the tokenizer has no BOS token (Qwen's, for one) and never adds one
    eos_id: int
    adds_bos: bool  # the tokenizer's own convention: a text starts with BOS
    fingerprint: str  # identifies the tokenizer by content (its files), not by where it lives

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
        self.adds_bos = True  # Meta's tokenizer.json prepends <|begin_of_text|>
        self.fingerprint = f"llama3:quicktok-{_package_version('quicktok-v1')}"

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
    adds_bos = False
    fingerprint = "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int64) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


class TokenizerFileError(ValueError):
    """A tokenizer file the tokenizers library cannot load or run; the message names the file and the fix."""


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
        self.file = file
        self._tok = self._guarded("load it", _HFTok.from_file, str(file))
        # A tokenizer.json's own truncation or padding would cut or pad every document: lengths, shards and
        # f(i) would be the file's settings, not the corpus. posfreq counts and packs raw token ids.
        self._tok.no_truncation()
        self._tok.no_padding()
        self._tok.encode_special_tokens = True  # special-token strings in text stay plain text
        # The absolute folder: a spec stored in shards and checkpoints must not depend on where a later command runs.
        self.name = f"hf:{path.resolve()}"
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        config_file = path / "tokenizer_config.json" if path.is_dir() else None
        self._config = (
            read_json_object(config_file, TokenizerFileError, "Fix: repair or remove the file")
            if config_file is not None and config_file.is_file()
            else {}
        )
        # read once: a large vocabulary's tokenizer.json takes a while to parse
        self._leading_special = self._post_processor_first_special(file)
        self.bos_id, self.eos_id = self._special_ids(path)
        self.adds_bos = self._adds_bos()
        # transformers 5's save_pretrained writes the template to chat_template.jinja, older ones into
        # tokenizer_config.json; the file wins, as transformers reads it.
        jinja = path / CHAT_TEMPLATE_FILE if path.is_dir() else None
        template = (
            jinja.read_text()
            if jinja is not None and jinja.is_file()
            else self._config.get("chat_template")
        )
        self.chat_template: str | None = template if isinstance(template, str) else None
        self.chat_template_file = jinja if jinja is not None and jinja.is_file() else config_file
        digest = hashlib.sha256(file.read_bytes())
        for extra in (config_file, jinja):
            if extra is not None and extra.is_file():
                digest.update(extra.read_bytes())
        self.fingerprint = f"hf-sha256:{digest.hexdigest()}"

    def _adds_bos(self) -> bool:
        """True when tokenizer_config says add_bos_token, or tokenizer.json's post-processor starts with BOS."""
        if self.bos_id is None:  # _special_ids refused a config that adds a BOS it does not have
            return False
        if "add_bos_token" in self._config:
            return bool(self._config["add_bos_token"])
        leading = self._leading_special
        return leading is not None and self._tok.token_to_id(leading) == self.bos_id

    @staticmethod
    def _post_processor_first_special(file: Path) -> str | None:
        """The special token tokenizer.json's post-processor puts before every text, if any (a BOS by another
        name, for a tokenizer whose config names none)."""
        post = json.loads(file.read_text(encoding="utf-8")).get("post_processor") or {}
        processors = post.get("processors", [post]) if post.get("type") == "Sequence" else [post]
        for proc in processors:
            if proc.get("type") == "TemplateProcessing":
                first = (proc.get("single") or [{}])[0]
                return first.get("SpecialToken", {}).get("id")
        return None

    def _special_ids(self, path: Path) -> tuple[int | None, int]:
        """BOS/EOS from tokenizer_config.json when present, else the usual Llama names. A tokenizer may have no
        BOS (Qwen's: `bos_token` null, `add_bos_token` false): then None, unless its config names one or says
        to add one, which it cannot. Every tokenizer needs an EOS: it ends an answer."""
        names = {
            "bos": ["<|begin_of_text|>", "<s>"],
            "eos": ["<|end_of_text|>", "</s>", "<|endoftext|>"],
        }
        leading = self._leading_special
        # what the tokenizer itself puts first is its BOS, whatever it is called
        if leading is not None:
            names["bos"] = [leading] + names["bos"]
        named = {}
        for key in ("bos", "eos"):
            value = self._config.get(f"{key}_token")
            if isinstance(value, dict):
                value = value.get("content")
            if value:
                names[key] = [value] + names[key]
                named[key] = value
        ids: list[int | None] = []
        for key in ("bos", "eos"):
            found = [
                self._tok.token_to_id(n) for n in names[key] if self._tok.token_to_id(n) is not None
            ]
            if found:
                ids.append(int(found[0]))
                continue
            if key == "bos" and "bos" not in named and not self._config.get("add_bos_token"):
                ids.append(None)
                continue
            why = (
                f"its tokenizer_config.json names {named[key]!r}, which is not in its vocabulary"
                if key in named
                else f"no {key.upper()} token among {names[key]}"
                + (" although its tokenizer_config.json sets add_bos_token" if key == "bos" else "")
            )
            raise ValueError(
                f"hf tokenizer at {path}: {why}. Fix: use the tokenizer files the model was saved with "
                "(tokenizer.json and tokenizer_config.json from save_pretrained)"
            )
        return ids[0], int(ids[1])

    def _guarded(self, what: str, call, *args, **kwargs):
        """call(*args, **kwargs), with any failure of the tokenizers library, a Rust panic included (a
        BaseException, which would pass every `except Exception`), raised as one TokenizerFileError naming
        the file."""
        try:
            return call(*args, **kwargs)
        except (KeyboardInterrupt, SystemExit, GeneratorExit):
            raise
        except BaseException as err:  # noqa: B036 -- pyo3's PanicException derives from BaseException
            first = str(err).strip().splitlines()[0][:300] if str(err).strip() else ""
            raise TokenizerFileError(
                f"{self.file}: the tokenizers library failed to {what} ({type(err).__name__}: {first}). "
                "Fix: use a tokenizer.json that transformers' own tokenizers load, e.g. one written by "
                "tokenizer.save_pretrained(DIR)"
            ) from None

    def encode(self, text: str) -> list[int]:
        return list(
            self._guarded("encode a text", self._tok.encode, text, add_special_tokens=False).ids
        )

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encoded = self._guarded(
            "encode a batch of texts", self._tok.encode_batch, list(texts), add_special_tokens=False
        )
        return [np.asarray(e.ids, dtype=np.int64) for e in encoded]

    def decode(self, ids: Sequence[int]) -> str:
        return self._guarded(
            "decode ids", self._tok.decode, [int(i) for i in ids], skip_special_tokens=False
        )

    def encode_with_special(self, text: str) -> list[int]:
        """Like `encode`, but special-token strings in `text` (e.g. "<|im_start|>") become their ids."""
        self._tok.encode_special_tokens = False
        try:
            encoded = self._guarded(
                "encode a text", self._tok.encode, text, add_special_tokens=False
            )
            return list(encoded.ids)
        finally:
            self._tok.encode_special_tokens = True

    def chat_frame(self) -> tuple[list[int], list[int]]:
        """Token ids before and after the user's message in one user turn with the generation prompt.

        The chat template (a Jinja string from tokenizer_config.json, i.e. user data) is rendered in
        Jinja's immutable sandbox, as Hugging Face does, in a child process under hard limits (train/data/chat_template),
        so a hostile template can neither run code nor take the machine.
        """
        if self.chat_template is None:
            raise ValueError(
                f"tokenizer {self.name}: no chat template (neither {CHAT_TEMPLATE_FILE} nor "
                "tokenizer_config.json's chat_template)"
            )
        from posfreq.train.data.chat_template.render import render_chat_template

        marker = "\u0000posfreq-user-message\u0000"
        text = render_chat_template(
            self.chat_template,
            [{"role": "user", "content": marker}],
            source=str(self.chat_template_file),
            bos_token="" if self.bos_id is None else self._tok.id_to_token(self.bos_id),
            eos_token=self._tok.id_to_token(self.eos_id),
        )
        if text.count(marker) != 1:
            raise ValueError(
                f"tokenizer {self.name}: its chat template does not place the user message exactly once"
            )
        before, after = text.split(marker)
        return self.encode_with_special(before), self.encode_with_special(after)


def _package_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"


_REGISTRY = {"llama3": Llama3Tokenizer, "bytes": ByteTokenizer}


BUILT_IN = ("llama3", "bytes")
"""The tokenizers posfreq defines itself (and rebuilds as Hugging Face files: `write_tokenizer_files`)."""


def built_in_identity(fingerprint: str) -> str:
    """A built-in tokenizer's name for its fingerprint (`llama3:quicktok-0.4.0` -> `llama3`: the package version is
    in the fingerprint for result keys, but every version gives the spec's fixed ids); any other unchanged."""
    for spec in BUILT_IN:
        if fingerprint == spec or fingerprint.startswith(f"{spec}:"):
            return spec
    return fingerprint


def register_tokenizer(name: str, factory) -> None:
    """Add a named tokenizer (e.g. the demo's small vocabulary) to `get_tokenizer`."""
    _REGISTRY[name] = factory


def hf_dir(spec: str) -> Path | None:
    """The directory of the `hf:DIR` spelling (a local Hugging Face model or tokenizer); None for another spec."""
    return Path(spec.removeprefix("hf:")) if spec.startswith("hf:") else None


def absolute_spec(spec: str) -> str:
    """A tokenizer spec with an hf:DIR made absolute (older shards recorded the folder as prepare was given it)."""
    directory = hf_dir(spec)
    return spec if directory is None else f"hf:{directory.resolve()}"


def get_tokenizer(spec: str = "llama3") -> Tokenizer:
    """Build a tokenizer from its name: llama3, bytes, hf:<dir>, or a registered name."""
    if (directory := hf_dir(spec)) is not None:
        return HFTokenizer(directory)
    if spec not in _REGISTRY:
        raise ValueError(
            f"unknown tokenizer {spec!r}; choose one of {sorted(_REGISTRY)} or hf:<dir>"
        )
    return _REGISTRY[spec]()

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

import functools
import hashlib
import json
import re
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
        Jinja's immutable sandbox, as Hugging Face does, so a hostile template cannot run code.
        """
        if self.chat_template is None:
            raise ValueError(
                f"tokenizer {self.name}: no chat template (neither {CHAT_TEMPLATE_FILE} nor "
                "tokenizer_config.json's chat_template)"
            )
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


TEMPLATE_SECONDS = 2.0
"""Wall-clock limit on rendering a chat template (user data: it may loop for ever)."""
TEMPLATE_CHARS = 1_000_000
"""Output limit on a rendered chat template (one user turn is a few hundred characters)."""


class _TemplateTimeout(Exception):
    pass


_FORMAT_WIDTHS = re.compile(
    r"%(?:\([^()]*\))?[-#0 +]*(\d+|\*)?(?:\.(\d+|\*))?|\{[^{}]*:[^{}]*?(\d+)[^{}]*\}|\{[^{}]*\{"
)
"""Widths and precisions in a %-format or a str.format string (a nested `{` is a width given at run time)."""
_GROWING_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs", "join", "replace"})
"""String methods checked before they run (str.format is checked where jinja wraps it, `wrap_str_format`)."""


def _check_size(size: int, what: str) -> None:
    from jinja2.exceptions import SecurityError

    if size > TEMPLATE_CHARS:
        raise SecurityError(f"{what} of {size:,} items (limit {TEMPLATE_CHARS:,})")


def _check_format(fmt: str, what: str) -> None:
    """Refuse a format string whose widths could build a value beyond TEMPLATE_CHARS (`'%100000000d' % 1`)."""
    for match in _FORMAT_WIDTHS.finditer(fmt):
        numbers = [g for g in match.groups() if g]
        if "*" in numbers or match.group(0).startswith("{") and match.group(0).endswith("{"):
            _check_size(TEMPLATE_CHARS + 1, f"{what} with a width given at run time")
        for number in numbers:
            if number != "*":
                _check_size(int(number), f"{what} with a width")


def _joined(items, separator: str = "") -> list:
    """`items` as a list, refused when joining them would build a value beyond TEMPLATE_CHARS."""
    items = list(items)
    _check_size(sum(len(str(i)) for i in items) + len(separator) * max(len(items) - 1, 0), "a join")
    return items


def _check_growth(obj, name: str, args: tuple, kwargs: dict) -> None:
    """Before a string method that can grow its value runs: its result's size, bounded."""
    if name in ("center", "ljust", "rjust", "zfill") and args and isinstance(args[0], int):
        _check_size(args[0], f"str.{name}")
    elif name == "expandtabs":
        _check_size(
            len(obj) + obj.count("\t") * int(args[0] if args else kwargs.get("tabsize", 8)),
            "expandtabs",
        )
    elif (
        name == "replace"
        and len(args) >= 2
        and isinstance(args[0], str)
        and isinstance(args[1], str)
    ):
        count = obj.count(args[0]) if args[0] else len(obj) + 1
        _check_size(len(obj) + count * max(len(args[1]) - len(args[0]), 0), "str.replace")


@functools.cache
def _bounded_sandbox_class():
    """Jinja's immutable sandbox in which no operation can build a value beyond TEMPLATE_CHARS: `*`, `**`, `+`,
    `%`, `~`, the string methods and filters that grow a value are checked before they run. A C-level
    `'a' * 10**8` or `'%100000000d' % 1` runs to its end before any alarm or output check could stop it."""
    from jinja2 import filters
    from jinja2.compiler import CodeGenerator
    from jinja2.exceptions import SecurityError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedConcat(CodeGenerator):
        def visit_Concat(self, node, frame) -> None:  # `a ~ b`: through environment.concat_bounded
            self.write("environment.concat_bounded((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    def bounded_filters() -> dict:
        def center(value, width=80):
            _check_size(int(width), "center")
            return filters.do_center(value, width)

        def indent(s, width=4, first=False, blank=False):
            _check_size(
                len(str(s))
                + (int(width) if isinstance(width, int) else len(str(width)))
                * (str(s).count("\n") + 1),
                "indent",
            )
            return filters.do_indent(s, width, first, blank)

        def format_(value, *args, **kwargs):
            _check_format(str(value), "format")
            return filters.do_format(value, *args, **kwargs)

        def replace(eval_ctx, s, old, new, count=None):
            _check_growth(str(s), "replace", (str(old), str(new)), {})
            return filters.do_replace(eval_ctx, s, old, new, count)

        def join(eval_ctx, value, d="", attribute=None):
            return filters.do_join(eval_ctx, _joined(value, str(d)), d, attribute)

        def batch(value, linecount, fill_with=None):
            _check_size(int(linecount), "batch")
            return filters.do_batch(value, linecount, fill_with)

        def slice_(value, slices, fill_with=None):
            _check_size(int(slices), "slice")
            return filters.do_slice(value, slices, fill_with)

        def tojson(eval_ctx, value, indent=None):
            if indent is not None:
                _check_size(int(indent) * 1000, "tojson's indent")
            return filters.do_tojson(eval_ctx, value, indent)

        for name, wrapper in (("replace", replace), ("join", join), ("tojson", tojson)):
            wrapper.jinja_pass_arg = getattr(filters, f"do_{name}").jinja_pass_arg  # type: ignore[attr-defined]
        return {
            "center": center,
            "indent": indent,
            "format": format_,
            "replace": replace,
            "join": join,
            "batch": batch,
            "slice": slice_,
            "tojson": tojson,
        }

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        code_generator_class = BoundedConcat
        intercepted_binops = frozenset(
            {"*", "**", "+", "%"}
        )  # also keeps them out of constant folding

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.filters.update(bounded_filters())

        def concat_bounded(self, values) -> str:
            values = [str(v) for v in values]
            _check_size(sum(map(len, values)), "a `~` concatenation")
            return "".join(values)

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                        _check_size(len(seq) * n, "a repetition")
            elif (
                operator == "+"
                and isinstance(left, (str, list, tuple))
                and isinstance(right, (str, list, tuple))
            ):
                _check_size(len(left) + len(right), "a `+` concatenation")
            elif operator == "%" and isinstance(left, str):
                _check_format(left, "a %-format")
            elif (
                operator == "**"
                and isinstance(left, (int, float))
                and isinstance(right, (int, float))
                and abs(right) > 64
                and abs(left) > 1
            ):
                raise SecurityError("a power beyond 64 (limit)")
            return super().call_binop(context, operator, left, right)

        def wrap_str_format(
            self, value
        ):  # jinja wraps str.format where it is looked up, not where called
            owner = getattr(value, "__self__", None)
            if isinstance(owner, str) and getattr(value, "__name__", "") in (
                "format",
                "format_map",
            ):
                _check_format(owner, "str.format")
            return super().wrap_str_format(value)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own signature)
            owner, name = getattr(__obj, "__self__", None), getattr(__obj, "__name__", "")
            if isinstance(owner, str) and name in _GROWING_METHODS:
                if name == "join" and args:
                    args = (_joined(args[0], owner), *args[1:])
                else:
                    _check_growth(owner, name, args, kwargs)
            return super().call(__context, __obj, *args, **kwargs)

    return BoundedSandbox


def render_chat_template(
    template: str,
    messages: list[dict],
    add_generation_prompt: bool = True,
    source: str = "the chat template",
    **variables: str,
) -> str:
    """Render a Hugging Face chat template (user data) with the generation prompt in a child process under hard
    limits (train/data/template_worker.py: address space, CPU time and output, set with `resource` before it renders
    anything), beside the sandbox's own checks (`_render_here`). A limit reached, a template that fails or one that
    overflows is one ValueError naming `source` (its file) and the limit."""
    from posfreq.train.data.template_worker import render_in_worker

    return render_in_worker(template, messages, add_generation_prompt, variables, source)


def _render_here(
    template: str, messages: list[dict], add_generation_prompt: bool = True, **variables: str
) -> str:
    """Render a Hugging Face chat template (sandboxed Jinja, HF's whitespace options) with the generation prompt
    in this process, within TEMPLATE_SECONDS (an alarm between bytecodes) and TEMPLATE_CHARS; ValueError for a
    template that fails, overflows or runs too long. `render_chat_template` runs it in a child with hard limits."""
    import signal
    import threading

    from jinja2.exceptions import TemplateError

    _BoundedSandbox = _bounded_sandbox_class()

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def timeout(signum, frame) -> None:
        raise _TemplateTimeout

    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    timed = (
        threading.current_thread() is threading.main_thread()
    )  # signals reach the main thread only
    previous = signal.signal(signal.SIGALRM, timeout) if timed else None
    if timed:
        signal.setitimer(signal.ITIMER_REAL, TEMPLATE_SECONDS)
    try:
        parts, size = [], 0
        for chunk in env.from_string(template).generate(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        ):
            parts.append(chunk)
            size += len(chunk)
            if size > TEMPLATE_CHARS:
                raise ValueError(
                    f"chat template renders more than {TEMPLATE_CHARS:,} characters for one user turn; "
                    "refusing it"
                )
        return "".join(parts)
    except _TemplateTimeout:
        raise ValueError(
            f"chat template did not finish rendering within {TEMPLATE_SECONDS:g} s; refusing it"
        ) from None
    except (
        TemplateError,
        OverflowError,
        RecursionError,
    ) as err:  # MemoryError: the worker names its limit
        raise ValueError(
            f"chat template could not be rendered: {type(err).__name__}: {err}"
        ) from None
    finally:
        if timed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


def _package_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"


_REGISTRY = {"llama3": Llama3Tokenizer, "bytes": ByteTokenizer}


def register_tokenizer(name: str, factory) -> None:
    """Add a named tokenizer (e.g. the demo's small vocabulary) to `get_tokenizer`."""
    _REGISTRY[name] = factory


def hf_dir(spec: str) -> Path | None:
    """The directory of the `hf:DIR` spelling (a local Hugging Face model or tokenizer); None for another spec."""
    return Path(spec.removeprefix("hf:")) if spec.startswith("hf:") else None


def get_tokenizer(spec: str = "llama3") -> Tokenizer:
    """Build a tokenizer from its name: llama3, bytes, hf:<dir>, or a registered name."""
    if (directory := hf_dir(spec)) is not None:
        return HFTokenizer(directory)
    if spec not in _REGISTRY:
        raise ValueError(
            f"unknown tokenizer {spec!r}; choose one of {sorted(_REGISTRY)} or hf:<dir>"
        )
    return _REGISTRY[spec]()

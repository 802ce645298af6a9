"""Hugging Face tokenizer files for our tokenizers, written offline with the same ids as ours.

Llama 3's BPE is rebuilt from quicktok's ranks, the `bytes` tokenizer becomes a byte-level model
(byte b is id b, BOS 256, EOS 257), and a `hf:<dir>` tokenizer's own files are copied; every
file is written atomically via `train.atomic`.
"""

from __future__ import annotations

import functools
import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from posfreq.train.atomic import write_bytes_atomic, write_json_atomic, write_text_atomic
from posfreq.train.data.tokenizer import (
    BUILT_IN,
    ByteTokenizer,
    built_in_identity,
    get_tokenizer,
    hf_dir,
)

if TYPE_CHECKING:
    import tokenizers


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
)


BYTES_SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
)  # the exported names of the bytes tokenizer's 256, 257


def write_tokenizer_files(spec: str, out_dir: str | Path) -> list[Path]:
    """Hugging Face tokenizer files for the tokenizer `spec` names, in `out_dir`; [] when we cannot make any.

    `llama3` and `bytes` are rebuilt offline with the `tokenizers` library (same ids as ours);
    `hf:<dir>` copies that directory's tokenizer files. A tokenizer registered in Python
    (`register_tokenizer`) has no Hugging Face form: a warning says so and nothing is written.
    """
    if spec == "llama3":
        return write_llama3_tokenizer(out_dir)
    if spec == "bytes":
        return write_bytes_tokenizer(out_dir)
    if (source := hf_dir(spec)) is not None:
        out = Path(out_dir)
        copied = [name for name in TOKENIZER_FILES if (source / name).is_file()]
        if not copied:
            raise FileNotFoundError(f"{source}: none of the tokenizer files {TOKENIZER_FILES}")
        out.mkdir(parents=True, exist_ok=True)
        for name in copied:
            write_bytes_atomic(out / name, (source / name).read_bytes())
        return [out / name for name in copied]
    warnings.warn(
        f"tokenizer {spec!r} has no Hugging Face files; {out_dir} gets none", stacklevel=2
    )
    return []


def _write_tokenizer(
    tokenizer: tokenizers.Tokenizer, config: dict, out_dir: str | Path
) -> list[Path]:
    """Save a `tokenizers.Tokenizer` as tokenizer.json beside `config` as tokenizer_config.json (atomic, 0644)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "tokenizer.json", tokenizer.to_str())
    write_json_atomic(out / "tokenizer_config.json", config, indent=2)
    return [out / "tokenizer.json", out / "tokenizer_config.json"]


def _tokenizer_config(
    bos: str, eos: str, model_max_length: int, split_special_tokens: bool
) -> dict:
    """tokenizer_config.json for a PreTrainedTokenizerFast.

    `split_special_tokens` keeps special-token strings in text as plain text (as our `encode` does);
    Llama 3's export leaves it off, as Meta's files do, so chat markers rendered by a template still parse.
    """
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "split_special_tokens": split_special_tokens,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": model_max_length,
    }


def write_bytes_tokenizer(out_dir: str | Path) -> list[Path]:
    """tokenizer.json + tokenizer_config.json equal to `train.data.tokenizer.ByteTokenizer`: byte b is id b, BOS 256, EOS 257.

    A byte-level BPE with no merges over GPT-2's printable byte alphabet, so every UTF-8 byte is its
    own token; no BOS is added (ours never adds one) and "<|end_of_text|>" in text stays bytes.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = _byte_level_alphabet()
    tokenizer = Tokenizer(models.BPE({alphabet[b]: b for b in range(256)}, []))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False
    )
    tokenizer.decoder = decoders.ByteLevel()
    bos, eos = BYTES_SPECIAL_TOKENS
    tokenizer.add_special_tokens([bos, eos])
    ids = (tokenizer.token_to_id(bos), tokenizer.token_to_id(eos))
    if ids != (ByteTokenizer.bos_id, ByteTokenizer.eos_id):
        raise AssertionError(
            f"bytes tokenizer export gave BOS/EOS ids {ids}, ours are "
            f"{(ByteTokenizer.bos_id, ByteTokenizer.eos_id)}: a bug in write_bytes_tokenizer"
        )
    return _write_tokenizer(
        tokenizer, _tokenizer_config(bos, eos, 1 << 20, split_special_tokens=True), out_dir
    )


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map that byte-level BPE vocabularies are written in."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    extra = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(extra)}}


def _merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Every (left, right) split of every token into two tokens, ordered by the merged token's rank.

    tiktoken ranks imply these merges (transformers' TikTokenConverter derives them the same way);
    some Llama 3 tokens are reachable only as whole pre-tokens, which `ignore_merges` handles.
    """
    merges = []
    for token, rank in ranks.items():
        splits = [
            (token[:i], token[i:])
            for i in range(1, len(token))
            if token[:i] in ranks and token[i:] in ranks
        ]
        merges += sorted(((rank, ranks[a], ranks[b]), a, b) for a, b in splits)
    return [(a, b) for _, a, b in sorted(merges)]


# Llama 3's pretokenizer regex (as in Meta's tokenizer.json / tiktoken model).
LLAMA3_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def write_llama3_tokenizer(out_dir: str | Path) -> list[Path]:
    """Write a Hugging Face tokenizer.json + tokenizer_config.json equal to Llama 3's, from quicktok's bundled ranks.

    Needs the `tokenizers` package (the `hf` extra); the ids match quicktok's exactly (tests/train/model/test_hf.py).
    """
    import quicktok
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    enc = quicktok.get_encoding("llama3")
    n_base = len(enc.token_byte_values())  # sorted by bytes, not by rank
    ranks = {enc.decode_single_token_bytes(rank): rank for rank in range(n_base)}
    alphabet = _byte_level_alphabet()
    as_text = lambda token: "".join(alphabet[b] for b in token)  # noqa: E731
    vocab = {as_text(token): rank for token, rank in ranks.items()}
    merges = [(as_text(a), as_text(b)) for a, b in _merges(ranks)]
    tokenizer = Tokenizer(models.BPE(vocab, merges, ignore_merges=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    specials = sorted(enc.special_tokens_set, key=enc.encode_single_token)
    if [enc.encode_single_token(s) for s in specials] != list(
        range(len(ranks), len(ranks) + len(specials))
    ):
        raise ValueError(
            "quicktok's llama3 special tokens are not the ids after the base vocabulary"
        )
    tokenizer.add_special_tokens(specials)
    bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A",
        pair=f"{bos} $A {bos} $B",
        special_tokens=[(bos, enc.encode_single_token(bos))],
    )
    return _write_tokenizer(
        tokenizer, _tokenizer_config(bos, eos, 131072, split_special_tokens=False), out_dir
    )


def render_in_sandbox(tokenizer) -> None:
    """Make a transformers tokenizer render its chat template in posfreq's bounded sandbox
    (`render_chat_template`: time, output and every growing operation bounded) instead of transformers' own
    Jinja environment, which bounds none of them; for libraries that call `apply_chat_template` (lm-eval)."""
    from posfreq.train.data.chat_template.render import render_chat_template

    def apply_chat_template(
        conversation,
        tokenize: bool = False,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        **variables,
    ) -> str:
        if tokenize:
            raise ValueError("posfreq renders chat templates to text only (tokenize=False)")
        messages = list(conversation)
        text = render_chat_template(
            chat_template or tokenizer.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=tokenizer.bos_token or "",
            eos_token=tokenizer.eos_token or "",
            **{k: v for k, v in variables.items() if isinstance(v, str)},
        )
        if (
            continue_final_message
        ):  # as transformers does: the text ends where the last message does
            final = str(messages[-1]["content"]).strip()
            if final not in text:
                raise ValueError("the chat template does not render the final message")
            text = text[: text.rindex(final) + len(final)]
        return text

    tokenizer.apply_chat_template = apply_chat_template


@functools.lru_cache(maxsize=None)
def exported_fingerprint(spec: str) -> str:
    """The content fingerprint of the Hugging Face files `write_tokenizer_files` writes for a built-in `spec`: what
    a model exported by posfreq export-hf carries as its tokenizer."""
    with tempfile.TemporaryDirectory() as directory:
        write_tokenizer_files(spec, directory)
        return get_tokenizer(f"hf:{directory}").fingerprint


def same_tokenizer(fingerprint: str, tokenizer) -> bool:
    """Whether `tokenizer` is, by content, the tokenizer whose fingerprint is `fingerprint`, a built-in tokenizer
    and its exported Hugging Face files counting as one (shards prepared with `bytes`, a model exported with
    them), and a built-in under another version of its package as itself (its ids are the spec's)."""
    recorded, live = built_in_identity(fingerprint), built_in_identity(tokenizer.fingerprint)
    if recorded == live:
        return True
    for spec in BUILT_IN:
        if spec in (recorded, live):
            other = live if recorded == spec else recorded
            return other == exported_fingerprint(spec)
    return False

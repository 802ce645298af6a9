"""A Hugging Face model or tokenizer folder is data: refuse one that asks for its own Python code.

transformers imports a folder's own classes (a `.py` beside the weights) when a JSON file there names them
under ``auto_map`` and the caller trusts remote code; lm-eval's RULER loader does trust it. posfreq runs no
code from a model folder, so such a folder is refused before anything loads, in one line that names the file.
"""

from __future__ import annotations

import json
import re
from pathlib import Path


class ModelFolderError(ValueError):
    """A model folder posfreq will not load; the message names the file and the fix."""


_SPELLED_WITH_ESCAPES = re.compile(rb'"(?:[A-Za-z_]|\\u[0-9A-Fa-f]{4}){8}"')
"""A JSON string of 8 characters, each a letter, an underscore or a \\u escape: every spelling of "auto_map"."""


def _may_spell_auto_map(raw: bytes) -> bool:
    """Whether JSON bytes can hold the key "auto_map": literally, or with \\u escapes, which json decodes alike."""
    return b"auto_map" in raw or any(
        json.loads(m.group()) == "auto_map"
        for m in _SPELLED_WITH_ESCAPES.finditer(raw)
        if b"\\u" in m.group()
    )


def custom_code_declaration(folder: Path) -> str | None:
    """The first JSON file in `folder` whose top level has an ``auto_map`` (classes from the folder's own code),
    as "FILE: auto_map {...}", else None. Unreadable JSON is left to the loaders, which name it."""
    for file in sorted(folder.glob("*.json")):
        try:
            raw = file.read_bytes()
            # only a file that can hold the key is parsed: a large vocabulary's tokenizer.json is slow to parse
            if not _may_spell_auto_map(raw):
                continue
            data = json.loads(raw.decode("utf-8"))
        except (OSError, UnicodeDecodeError, ValueError, RecursionError):
            continue
        if isinstance(data, dict) and data.get("auto_map"):
            return f"{file}: auto_map {json.dumps(data['auto_map'])[:200]}"
    return None


def refuse_custom_code(folder: Path, flag: str) -> None:
    """ModelFolderError if `folder` declares classes of its own code (`auto_map`): posfreq imports none."""
    found = custom_code_declaration(folder) if folder.is_dir() else None
    if found:
        raise ModelFolderError(
            f"{flag}: {found} names Python classes from the folder itself, which transformers "
            "and lm-eval would import and run; posfreq runs no code from a model folder. Fix: use a "
            "model and tokenizer of a standard transformers architecture (without auto_map), converted "
            "and saved with save_pretrained"
        )

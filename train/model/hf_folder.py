"""A Hugging Face model or tokenizer folder is data: refuse one that asks for its own Python code.

transformers imports a folder's own classes (a `.py` beside the weights) when a JSON file there names them
under ``auto_map`` and the caller trusts remote code; lm-eval's RULER loader does trust it. posfreq runs no
code from a model folder, so such a folder is refused before anything loads, in one line that names the file.
"""

from __future__ import annotations

import json
import re
import stat
from pathlib import Path

from posfreq.train.json_file import read_json_object


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


MAX_JSON_BYTES = 256 << 20
"""The largest JSON file of a model folder posfreq reads (a 128K-vocabulary tokenizer.json is about 10 MB)."""


def _json_file(file: Path) -> bool:
    """Whether `file` is a JSON file to scan: a regular file (a link to one is followed, as in the hub cache's
    snapshots) of at most MAX_JSON_BYTES; ModelFolderError for anything else that carries the name (a FIFO, a
    device such as /dev/zero, a file too large), which could hang or exhaust a reader."""
    try:
        st = file.stat()
    except OSError:
        return False  # a dangling link: the loaders name what they miss
    if not stat.S_ISREG(st.st_mode):
        raise ModelFolderError(
            f"{file} is not a regular file ({'a link to ' if file.is_symlink() else ''}a FIFO, device or "
            "socket): posfreq reads only regular files from a model folder. Fix: replace it with the file, or "
            "remove it"
        )
    if st.st_size > MAX_JSON_BYTES:
        raise ModelFolderError(
            f"{file} is {st.st_size:,} bytes, more than a model folder's JSON holds (at most {MAX_JSON_BYTES:,}). "
            "Fix: remove it from the folder"
        )
    return True


def custom_code_declaration(folder: Path) -> str | None:
    """The first JSON file in `folder` whose top level has an ``auto_map`` (classes from the folder's own code),
    as "FILE: auto_map {...}", else None. Unreadable JSON is left to the loaders, which name it; anything that is
    not a regular file of bounded size is refused (`_json_file`)."""
    for file in sorted(folder.glob("*.json")):
        if not _json_file(file):
            continue
        try:
            with open(file, "rb") as handle:
                raw = handle.read(MAX_JSON_BYTES + 1)
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


CONFIG_FILE = "config.json"

NUMERIC_KEYS = frozenset(
    {
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "original_max_position_embeddings",
        "rope_theta",
        "rms_norm_eps",
        "sliding_window",
        "partial_rotary_factor",
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "beta_fast",
        "beta_slow",
        "attention_factor",
    }
)
"""config.json keys (top level, or inside rope_parameters / rope_scaling) that hold a number or null."""

_ROPE_KEYS = ("rope_parameters", "rope_scaling")


def _wrong_number(data: dict, where: str = "") -> str | None:
    """The first NUMERIC_KEYS entry of `data` (and of its rope dicts, nested per layer type too) that is neither a
    number nor null, as 'key=value', else None."""
    for key, value in data.items():
        dotted = f"{where}{key}"
        if key in NUMERIC_KEYS and value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                return f"{dotted}={value!r}"
        if (key in _ROPE_KEYS or where) and isinstance(value, dict):
            found = _wrong_number(value, f"{dotted}.")
            if found:
                return found
    return None


def read_model_config(folder: str | Path) -> dict:
    """A Hugging Face model folder's config.json as a dict: the one reader every loader (probe, ruler,
    loss-by-distance, the import into posfreq's model) goes through, so a damaged file is one ModelFolderError that
    names it and the fix, whichever command reads it. Refused: a missing or unreadable file, bytes that are not
    UTF-8, text that is not JSON, JSON that is not an object, and a size or rope key that is not a number."""
    file = Path(folder) / CONFIG_FILE
    fix = (
        "Fix: restore the folder's config.json (download or save_pretrained the model again), "
        "or pass another folder"
    )
    if not file.is_file():
        raise ModelFolderError(
            f"{Path(folder)} holds no {CONFIG_FILE}: it is not a Hugging Face model folder. "
            "Fix: pass a folder holding config.json and *.safetensors weights"
        )
    data = read_json_object(file, ModelFolderError, fix)
    wrong = _wrong_number(data)
    if wrong:
        raise ModelFolderError(f"{file}: {wrong} is not a number. {fix}")
    return data


def transformers_config(folder: str | Path):
    """The folder's config as transformers reads it (AutoConfig, never folder code), after `read_model_config`'s
    checks: a model type this transformers release does not know, or a config it cannot build, is one
    ModelFolderError naming config.json, the type and the installed release, not transformers' paragraph."""
    import transformers
    from transformers import AutoConfig

    data = read_model_config(folder)
    file = Path(folder) / CONFIG_FILE
    try:
        return AutoConfig.from_pretrained(folder, trust_remote_code=False)
    except (ValueError, KeyError, TypeError, OSError) as err:
        model_type = data.get("model_type")
        if isinstance(model_type, str) and "does not recognize this architecture" in str(err):
            raise ModelFolderError(
                f"{file}: model_type {model_type!r} is not an architecture transformers "
                f"{transformers.__version__} knows. Fix: install a transformers release that knows it if the model "
                "is newer than this one, or pass a folder saved by save_pretrained with this release"
            ) from None
        raise ModelFolderError(
            f"{file}: transformers {transformers.__version__} cannot read it ({str(err).splitlines()[0][:300]}). "
            "Fix: pass a model folder saved by save_pretrained with a transformers release that knows its type"
        ) from None


PICKLED_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
"""Weight files in Python's pickle format, which can run code when loaded: never read."""


def refuse_pickled_weights(folder: str | Path) -> None:
    """ModelFolderError unless `folder` holds safetensors weights: the one rule, and the one line, of every loader
    (the probe and loss-by-distance through either engine, RULER, the import into posfreq's model). A folder with only
    pickled weights (.bin, .pt, .pth) is refused by name: transformers would unpickle them."""
    folder = Path(folder)
    if any(folder.glob("*.safetensors")):
        return
    pickled = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLED_SUFFIXES)
    if pickled:
        raise ModelFolderError(
            f"{folder} holds only pickled weights ({', '.join(pickled[:3])}), which posfreq never loads: "
            "unpickling can run code. Fix: convert them to safetensors on a machine you trust "
            "(AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(OUT)), or pass a folder with *.safetensors"
        )
    raise ModelFolderError(
        f"{folder} holds no *.safetensors weights. Fix: pass a Hugging Face model folder saved with save_pretrained"
    )


def check_weight_files(folder: str | Path) -> None:
    """ModelFolderError for a folder without safetensors weights (`refuse_pickled_weights`) or naming the first
    *.safetensors file of `folder` whose header cannot be read or does not cover the file (a truncated download, a
    damaged disk); only headers are read, so this is quick before a long job."""
    from safetensors import safe_open

    refuse_pickled_weights(folder)
    for file in sorted(Path(folder).glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except (
            Exception
        ) as err:  # SafetensorError, OSError: safetensors' errors share no base class
            raise damaged_weights(file, err) from None


def damaged_weights(file: Path, err: Exception) -> ModelFolderError:
    """The ModelFolderError for a safetensors `file` that safetensors could not read (`err`)."""
    text = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)
    return ModelFolderError(
        f"{file} is not a readable safetensors file ({text}): truncated or damaged. "
        "Fix: download or save_pretrained the model again"
    )

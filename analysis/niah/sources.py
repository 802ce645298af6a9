"""Model sources: the models a probe can load (our checkpoints, Hugging Face directories, a run's
milestones), each known by content (fingerprint, tokenizer, training length) before it is loaded,
and the builders of their prompts (tokenizer, BOS policy and chat template resolved)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from posfreq.analysis.niah.decoding import Generator
from posfreq.analysis.niah.needles import NiahBuilder, PromptFormat, load_haystack
from posfreq.analysis.niah.settings import ProbeError, ProbeSettings
from posfreq.train.data.tokenizer import Tokenizer, get_tokenizer, hf_dir
from posfreq.train.model.hf_folder import (
    ModelFolderError,
    check_weight_files,
    read_model_config,
    refuse_custom_code,
    transformers_config,
)


@dataclass
class ModelSource:
    """A model the probe can load, known by content before it is loaded: name, fingerprint, tokenizer, lengths."""

    name: str
    path: Path
    kind: str  # "checkpoint" (ours: trainer or consolidated) or "hf"
    fingerprint: str
    tokenizer_spec: str
    train_len: int
    vocab_size: int
    bos_in_training: bool
    length_hist: np.ndarray | None = None
    tokens_trained: int | None = None
    run_tokens: int | None = None

    def load(
        self, settings: ProbeSettings, device: torch.device, attention_backend: str = "auto"
    ) -> Generator:
        """The model on `device` in float32, eval mode, with the settings' position scheme."""
        if settings.engine == "transformers":
            from posfreq.analysis.niah.hf_engine import load_transformers_model

            return load_transformers_model(self.path, settings, device, self.train_len)
        if self.kind == "checkpoint":
            from posfreq.train.checkpoint.load import load_model

            model, _, _ = load_model(
                self.path, device="cpu", dtype=torch.float32, attention_backend=attention_backend
            )
        else:
            from posfreq.train.model.hf import load_hf_model

            model = load_hf_model(
                self.path, dtype=torch.float32, attention_backend=attention_backend
            )
        model = model.to(device=device, dtype=torch.float32).eval()
        if settings.positions != "rope" or settings.position_options:
            model.set_positions(settings.positions, **settings.position_options)
        return model


def checkpoint_source(path: Path, settings: ProbeSettings) -> ModelSource:
    """One of our checkpoints (trainer milestone or consolidated directory), as train.checkpoint.load reads it."""
    from posfreq.train.checkpoint.layout import MODEL_CONFIG_FILE, CheckpointError
    from posfreq.train.checkpoint.load import check_checkpoint_tokenizer, read_checkpoint_info

    if settings.engine == "transformers":
        raise ProbeError(
            f"{path}: --engine transformers loads Hugging Face model directories. Fix: export it with "
            "`posfreq export-hf`, then probe --model hf:DIR, or use --engine posfreq"
        )

    try:
        info = read_checkpoint_info(path)
    except CheckpointError as err:
        # a checkpoint, damaged or unreadable: the error names the file
        if (path / MODEL_CONFIG_FILE).is_file():
            raise ProbeError(str(err)) from None
        what = (
            "does not exist" if not path.exists() else "is not a checkpoint (no model_config.json)"
        )
        raise ProbeError(
            f"--checkpoint {path} {what}. Fix: pass RUN/checkpoints/tokens-*/ (or latest/), a "
            "consolidated model directory, or --run RUN for every milestone"
        ) from None
    if settings.tokenizer is None and info.tokenizer_spec is None:
        raise ProbeError(
            f"{path}: no tokenizer_spec.json. Fix: pass --tokenizer SPEC (llama3, bytes, hf:DIR)"
        )
    try:
        check_checkpoint_tokenizer(
            path, info.tokenizer_spec, info.tokenizer_fingerprint, settings.tokenizer
        )
    except CheckpointError as err:
        raise ProbeError(str(err)) from None
    return ModelSource(
        path.name,
        path,
        "checkpoint",
        info.fingerprint,
        settings.tokenizer or info.tokenizer_spec,
        info.config.train_len,
        info.config.vocab_size,
        info.bos_in_training,
        info.trained_lengths,
        info.tokens_trained,
        info.run_tokens,
    )


def hf_source(directory: Path, settings: ProbeSettings) -> ModelSource:
    """A Hugging Face Llama-family directory (its tokenizer.json unless --tokenizer overrides)."""
    from posfreq.train.model.hf import config_from_hf, hf_model_fingerprint, tokenizer_spec

    if not (directory / "config.json").is_file():
        what = "does not exist" if not directory.exists() else "holds no config.json"
        raise ProbeError(
            f"--model hf:{directory} {what}. Fix: pass a Hugging Face model directory "
            "(config.json and *.safetensors)"
        )
    try:  # the transformers engine loads the folder through transformers
        refuse_custom_code(directory, "--model")
        raw = read_model_config(directory)
        check_weight_files(
            directory
        )  # a truncated download is named now, not after the prompts are built
    except ModelFolderError as err:
        raise ProbeError(str(err)) from None
    spec = settings.tokenizer or tokenizer_spec(directory)
    if spec is None:
        raise ProbeError(
            f"--model hf:{directory}: no tokenizer.json there; pass --tokenizer SPEC (e.g. llama3)"
        )
    if (
        settings.engine == "transformers"
    ):  # any architecture: only its length and vocabulary are read
        train_len, vocab_size = _length_and_vocabulary(directory, raw)
    else:
        try:
            config = config_from_hf(raw, str(directory / "config.json"))
        except ValueError as err:
            raise ProbeError(
                f"{err}. Fix: --engine transformers probes any architecture transformers loads"
            ) from None
        train_len, vocab_size = config.train_len, config.vocab_size
    return ModelSource(
        directory.name,
        directory,
        "hf",
        hf_model_fingerprint(directory),
        spec,
        train_len,
        vocab_size,
        get_tokenizer(spec).adds_bos,
    )


def model_source(spec: str, settings: ProbeSettings) -> ModelSource:
    """`hf:DIR` (a Hugging Face model directory) or the path of one of our checkpoints, as a source."""
    directory = hf_dir(spec)
    return (
        hf_source(directory, settings)
        if directory is not None
        else checkpoint_source(Path(spec), settings)
    )


def scheme_resolver(spec: str, engine: str) -> tuple[int, Callable[[str, dict], dict]]:
    """(the training length L of `spec`, hf:DIR or our checkpoint, and a function giving a scheme's options as
    `engine` runs them on that model, defaults included), from its config alone: a bad option is refused before
    any weights load."""
    from posfreq.train.positions.schemes import build_scheme

    directory = hf_dir(spec)
    if directory is None:
        from posfreq.train.checkpoint.layout import load_model_config
        from posfreq.train.positions.rotary import RotaryBase

        config = load_model_config(spec)
        train_len = config.train_len
        rope = RotaryBase(config.head_dim, config.rope_base, config.rope_scaling)
    else:
        from transformers import AutoConfig

        from posfreq.train.positions.hf_schemes import rotary_base, scheme_options

        refuse_custom_code(directory, "the model folder")
        hf_config = AutoConfig.from_pretrained(directory, trust_remote_code=False)
        train_len = hf_config.max_position_embeddings
        if engine != "posfreq":  # transformers runs the schemes: its adapter's options
            return train_len, lambda name, options: scheme_options(
                hf_config, name, train_len, **options
            )
        rope = rotary_base(hf_config)
    # posfreq's own model runs the schemes (our checkpoint, or an hf:DIR under --engine posfreq): their options
    return train_len, lambda name, options: dict(
        build_scheme(name, rope, train_len, **options).options
    )


def _length_and_vocabulary(directory: Path, raw: dict) -> tuple[int, int]:
    """(trained length, vocabulary size) of a transformers model folder, under whatever names its config class
    gives them (GPT-2's n_positions, a multimodal model's text_config), as transformers reads them; ProbeError
    when config.json does not state one (transformers would fill in its class default, not the model's)."""
    try:
        whole = transformers_config(directory)
    except ModelFolderError as err:
        raise ProbeError(str(err)) from None
    config = whole.get_text_config()
    # the values are the text model's: where they live in a text_config, that is where config.json must state them
    stated = raw if config is whole else raw.get("text_config") or {}
    found, missing = {}, []
    for key in ("max_position_embeddings", "vocab_size"):
        name = getattr(config, "attribute_map", {}).get(key, key)
        value = getattr(config, key, None)
        if name not in stated or not isinstance(value, int) or value < 1:
            missing.append(key if name == key else f"{key} ({name})")
        found[key] = value
    if missing:
        raise ProbeError(
            f"{directory / 'config.json'} states no {' or '.join(missing)} (a positive integer). Fix: add it to "
            "config.json as the model was trained"
        )
    return found["max_position_embeddings"], found["vocab_size"]


def milestones(run_dir: Path) -> list[Path]:
    """The run's complete milestone checkpoints (tokens-*/, never .tmp), oldest first."""
    from posfreq.train.checkpoint.layout import MILESTONE_PREFIX, list_checkpoints

    found = [p for p, _ in list_checkpoints(run_dir) if p.name.startswith(MILESTONE_PREFIX)]
    if not found:
        raise ProbeError(
            f"--run {run_dir}: no complete checkpoints under {run_dir / 'checkpoints'}/tokens-*/"
        )
    return found


class Builders:
    """One NiahBuilder per (tokenizer content, prompt format): the haystack is tokenized once for each."""

    def __init__(self, haystack: str) -> None:
        self.haystack = load_haystack(haystack)
        self._built: dict[tuple, NiahBuilder] = {}
        self._tokenizers: dict[str, Tokenizer] = {}

    def tokenizer(self, spec: str) -> Tokenizer:
        if spec not in self._tokenizers:
            self._tokenizers[spec] = get_tokenizer(spec)
        return self._tokenizers[spec]

    def for_source(self, source: ModelSource, settings: ProbeSettings) -> NiahBuilder:
        """The builder of a model's prompts: its tokenizer, the BOS policy and chat template resolved."""
        tokenizer = self.tokenizer(source.tokenizer_spec)
        if tokenizer.vocab_size > source.vocab_size:
            raise ProbeError(
                f"{source.path}: tokenizer {tokenizer.name} has {tokenizer.vocab_size:,} ids but the model "
                f"only {source.vocab_size:,}; pass the model's own tokenizer with --tokenizer"
            )
        chat: tuple[list[int], list[int]] = ([], [])
        if settings.chat_template:
            frame = getattr(tokenizer, "chat_frame", None)
            if frame is None or getattr(tokenizer, "chat_template", None) is None:
                raise ProbeError(
                    f"--chat-template: tokenizer {tokenizer.name} has no chat template "
                    "(neither chat_template.jinja nor tokenizer_config.json's chat_template); "
                    "leave --chat-template false"
                )
            chat = frame()
        bos = {"always": True, "never": False}.get(settings.bos)
        if bos is None:
            bos = False if settings.chat_template else source.bos_in_training
        if bos and tokenizer.bos_id is None:
            why = (
                "which follows the model: it trained with a BOS"
                if settings.bos == "auto"
                else "which asks for one"
            )
            raise ProbeError(
                f"--bos {settings.bos} ({why}): tokenizer {tokenizer.name} has no BOS token. Fix: --bos never, "
                "or the tokenizer the model trained with (--tokenizer)"
            )
        fmt = PromptFormat(settings.max_new_tokens, bos, tuple(chat[0]), tuple(chat[1]))
        cache_key = (tokenizer.fingerprint, fmt)
        if cache_key not in self._built:
            self._built[cache_key] = NiahBuilder(tokenizer, self.haystack, fmt)
        return self._built[cache_key]

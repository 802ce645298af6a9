"""Hugging Face Llama-family checkpoints in and out of our `Transformer`, without needing transformers.

Import reads a local directory's config.json and safetensors weights (single file or sharded) of
a LlamaForCausalLM (TinyLlama, Llama 2/3/3.1) or a MistralForCausalLM without sliding window.
Our parameter names are HF's without the "model." prefix, and our rotary uses HF's half-split
(rotate_half) layout, so weights map one to one with no q/k permutation (tests/train/model/test_hf.py checks
logits against transformers). Anything we would compute differently (biases, another activation,
sliding window, an unknown rope_scaling type, ...) is refused with an error naming the field.

Export writes config.json, model.safetensors and generation_config.json that
`transformers.AutoModelForCausalLM.from_pretrained` loads; the tokenizer files that
`transformers.AutoTokenizer.from_pretrained` loads are train/data/hf_tokenizer.py's. Every file is
written atomically with mode 0666 & ~umask (0644 under the usual umask), via `train.atomic`.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from torch import Tensor

from posfreq.train.atomic import write_bytes_atomic, write_json_atomic
from posfreq.train.checkpoint.safe_load import contained_file, first_non_finite, non_finite_message
from posfreq.train.journal import JOURNAL_FILE, remove_recorded
from posfreq.train.model.config import DTYPES, ModelConfig
from posfreq.train.model.hf_folder import (
    ModelFolderError,
    damaged_weights,
    read_model_config,
    refuse_pickled_weights,
)
from posfreq.train.model.transformer import Transformer
from posfreq.train.outdir import OutputDirError, claim_output_dir
from posfreq.train.positions.rotary import rope_scaling_type, rope_type_of

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral"}

# HF's defaults for keys a config.json may omit (LlamaConfig / MistralConfig).
_DEFAULTS = {
    "llama": {
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10_000.0,
        "sliding_window": None,
    },
    "mistral": {
        "max_position_embeddings": 4096 * 32,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10_000.0,
        "sliding_window": 4096,
    },
}
# Keys that do not change the forward computation (or are checked explicitly below).
_KNOWN_KEYS = {
    "_name_or_path",
    "architectures",
    "attention_bias",
    "attention_dropout",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "head_dim",
    "hidden_act",
    "hidden_size",
    "initializer_range",
    "intermediate_size",
    "max_position_embeddings",
    "mlp_bias",
    "model_type",
    "num_attention_heads",
    "num_hidden_layers",
    "num_key_value_heads",
    "pretraining_tp",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "tie_word_embeddings",
    "torch_dtype",
    "dtype",
    "transformers_version",
    "use_cache",
    "vocab_size",
    "sliding_window",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
    "id2label",
    "label2id",
    "problem_type",
    "partial_rotary_factor",
    "quantization_config",
    "original_max_position_embeddings",
}


def _metadata(key: str) -> bool:
    """Config keys that only name things: special-token ids and where the model came from (a model converted by
    transformers, e.g. from GGUF, writes `_model_name_or_path` and `unk_token_id`). They never change the model."""
    return key.endswith("_token_id") or key.endswith("_name_or_path")


# Weights HF checkpoints may carry that we recompute (old Llama files saved the rotary buffer).
_IGNORED_WEIGHT_SUFFIXES = ("rotary_emb.inv_freq",)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{path} not found: expected a Hugging Face model directory with config.json"
        ) from None


def _inexact_settings(
    hf: dict, model_type: str, rope_scaling: dict, partial: float | None
) -> list[str]:
    """The settings of a Hugging Face config that our model would compute differently, each with why."""
    problems = []
    for key, expected in (("attention_bias", False), ("mlp_bias", False)):
        if hf.get(key, expected) != expected:
            problems.append(f"{key}={hf[key]!r} (only {expected!r} is supported)")
    # transformers' two names of one function
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):
        problems.append(f"hidden_act={hf['hidden_act']!r} (only 'silu' is supported)")
    if hf.get("quantization_config"):
        problems.append(
            "quantization_config (quantized weights are not supported; use a bf16/fp16/fp32 checkpoint)"
        )
    if partial not in (None, 1, 1.0):
        problems.append(f"partial_rotary_factor={partial} (only 1.0 is supported)")
    window = hf.get("sliding_window", _DEFAULTS[model_type]["sliding_window"])
    # transformers' Llama ignores the key; its Mistral attends within the window once a sequence is longer
    if model_type == "mistral" and window is not None:
        problems.append(
            f"sliding_window={window} (Mistral attends within it on any longer sequence, which our model "
            "does not; set it to null only if the model was trained without a window)"
        )
    try:
        rope_scaling_type(rope_scaling)
    except ValueError as err:
        problems.append(str(err))
    return problems


def config_from_hf(hf: dict, source: str = "config.json") -> ModelConfig:
    """Our ModelConfig from a Hugging Face config dict, refusing anything we would compute differently."""
    architectures = hf.get("architectures") or []
    model_type = hf.get("model_type")
    unsupported = [a for a in architectures if a not in SUPPORTED_ARCHITECTURES]
    if unsupported or model_type not in SUPPORTED_ARCHITECTURES.values():
        raise ValueError(
            f"{source}: unsupported architecture {unsupported or architectures} (model_type={model_type!r}); "
            f"supported: {sorted(SUPPORTED_ARCHITECTURES)} with model_type in {sorted(set(SUPPORTED_ARCHITECTURES.values()))}"
        )
    defaults = _DEFAULTS[model_type]
    max_len = int(hf.get("max_position_embeddings", defaults["max_position_embeddings"]))
    rope_theta, rope_scaling = _rope_from_hf(hf, defaults, max_len)
    partial = rope_scaling.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    problems = _inexact_settings(hf, model_type, rope_scaling, partial)
    if problems:
        raise ValueError(
            f"{source}: cannot import this {model_type} model exactly: " + "; ".join(problems)
        )
    unknown = sorted(k for k in set(hf) - _KNOWN_KEYS if not _metadata(k))
    if unknown:
        warnings.warn(
            f"{source}: ignoring config keys {unknown}; check that they do not change the model",
            stacklevel=2,
        )
    missing = [
        k
        for k in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "vocab_size",
        )
        if k not in hf
    ]
    if missing:
        raise ValueError(f"{source}: missing required keys {missing}")
    n_heads = int(hf["num_attention_heads"])
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim * n_heads != hf["hidden_size"]:
        raise ValueError(
            f"{source}: head_dim={head_dim} with num_attention_heads={n_heads} differs from hidden_size={hf['hidden_size']}; "
            "our model needs head_dim == hidden_size // num_attention_heads"
        )
    return ModelConfig(
        vocab_size=int(hf["vocab_size"]),
        d_model=int(hf["hidden_size"]),
        n_layers=int(hf["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
        ffn_dim=int(hf["intermediate_size"]),
        rope_base=float(rope_theta),
        norm_eps=float(hf.get("rms_norm_eps", defaults["rms_norm_eps"])),
        train_len=max_len,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope_scaling=None if rope_scaling_type(rope_scaling) == "default" else dict(rope_scaling),
    )


def _rope_from_hf(hf: dict, defaults: dict, max_len: int) -> tuple[float, dict]:
    """(rope_theta, the rope dict without theta) as transformers 5 reads config.json (modeling_rope_utils'
    convert_rope_params_to_dict and standardize_rope_params): a rope_scaling dict, if any, wins over
    rope_parameters; theta comes from the chosen dict, else the top level; for llama3, yarn and longrope a
    top-level original_max_position_embeddings overrides the dict's, which defaults to max_position_embeddings
    (transformers applies that override when it computes the frequencies, not when it reads the config, so
    config.rope_parameters after from_pretrained can still show the dict's value).
    transformers 4 read rope_scaling and the top-level theta, the same for every file it wrote."""
    chosen = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    theta = chosen.pop("rope_theta", hf.get("rope_theta", defaults["rope_theta"]))
    if rope_type_of(chosen) in ("llama3", "yarn", "longrope"):
        outer = hf.get("original_max_position_embeddings")
        chosen["original_max_position_embeddings"] = (
            outer if outer is not None else chosen.get("original_max_position_embeddings", max_len)
        )
    return theta, chosen


def _weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a HF directory (sharded via its index, or one file); refuses pickles."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        names = _read_json(index)["weight_map"].values()
        return sorted({contained_file(directory, name, str(index)) for name in names})
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    refuse_pickled_weights(directory)  # only pickles, or nothing: the one line every loader gives
    raise FileNotFoundError(f"{directory}: no model.safetensors or model.safetensors.index.json")


def _read_hf_weights(directory: Path, dtype: torch.dtype | None, device: str) -> dict[str, Tensor]:
    """All tensors of the directory keyed by our names (HF's without the "model." prefix)."""
    from safetensors.torch import load_file

    weights: dict[str, Tensor] = {}
    for file in _weight_files(directory):
        try:
            tensors = load_file(str(file), device=device)
        except (
            Exception
        ) as err:  # SafetensorError, OSError: safetensors' errors share no base class
            raise damaged_weights(file, err) from None
        for name, tensor in tensors.items():
            if name.endswith(_IGNORED_WEIGHT_SUFFIXES):
                continue
            key = name.removeprefix("model.")
            weights[key] = tensor if dtype is None else tensor.to(dtype)
    found = first_non_finite(weights.items())
    if found:
        raise ModelFolderError(non_finite_message(str(directory), found))
    return weights


def load_hf_model(
    directory: str | Path,
    dtype: torch.dtype | str | None = None,
    attention_backend: str = "auto",
    device: str = "cpu",
) -> Transformer:
    """Our Transformer with the weights of a local Hugging Face Llama/Mistral directory (dtype None: as stored)."""
    directory = Path(directory)
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
        dtype = DTYPES[dtype]
    config = config_from_hf(read_model_config(directory), source=str(directory / "config.json"))
    weights = _read_hf_weights(directory, dtype, device)
    if config.tie_embeddings and "lm_head.weight" in weights:
        head = weights.pop("lm_head.weight")
        # transformers ties to whichever of the two a folder stores; one that stores both, different, keeps
        # them apart in transformers 5 and not in older releases, so it is refused
        weights.setdefault("embed_tokens.weight", head)
        if not torch.equal(head, weights["embed_tokens.weight"]):
            raise ValueError(
                f"{directory}: config.json ties the output head to the embeddings (tie_word_embeddings), but "
                "model.safetensors stores a different lm_head.weight. Fix: set tie_word_embeddings to false if "
                "the stored head is the trained one, or remove lm_head.weight from the weights"
            )
    with torch.device("meta"):
        model = Transformer(config, attention_backend=attention_backend)
    shapes = {
        k: tuple(v.shape)
        for k, v in model.state_dict().items()
        if not (config.tie_embeddings and k == "lm_head.weight")
    }
    missing, unexpected = sorted(set(shapes) - set(weights)), sorted(set(weights) - set(shapes))
    if missing or unexpected:
        raise ValueError(
            f"{directory}: weights do not match the config: missing {missing[:8]}, unexpected {unexpected[:8]}"
        )
    for key, shape in shapes.items():
        if tuple(weights[key].shape) != shape:
            raise ValueError(
                f"{directory}: weight {key} has shape {tuple(weights[key].shape)}, the config implies {shape}"
            )
    model.load_state_dict(weights, strict=False, assign=True)
    if config.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.set_positions("rope")  # rebuild the rotary off the meta device
    return model.eval()


def hf_model_fingerprint(directory: str | Path) -> str:
    """sha256 of a Hugging Face model directory's config, its index and every weight file a load reads (the
    index's shards wherever they sit, sub-folders included): changed weights never reuse old probe records."""
    from posfreq.train.fingerprint import files_sha256

    path = Path(directory)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path}: needs config.json and *.safetensors weights to fingerprint"
        )
    index = (
        [path / "model.safetensors.index.json"]
        if (path / "model.safetensors.index.json").is_file()
        else []
    )
    return files_sha256(path, [path / "config.json", *index, *_weight_files(path)])


def tokenizer_spec(directory: str | Path) -> str | None:
    """The `get_tokenizer` spec (hf:<dir>) of a HF model directory, or None without tokenizer.json."""
    return f"hf:{directory}" if (Path(directory) / "tokenizer.json").is_file() else None


def config_to_hf(
    config: ModelConfig, dtype: torch.dtype, bos_token_id: int | None, eos_token_id: int | None
) -> dict:
    """A LlamaForCausalLM config.json dict for our config (transformers 4 spelling, which 5 also reads)."""
    dtype_name = str(dtype).removeprefix("torch.")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.ffn_dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.train_len,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_base,
        "rope_scaling": config.rope_scaling,
        "tie_word_embeddings": config.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": dtype_name,
        "use_cache": True,
    }


EXPORT_HF = "export-hf"


def export_hf(
    model: Transformer,
    out_dir: str | Path,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
) -> Path:
    """Write `model` as a HF LlamaForCausalLM directory: config, safetensors weights and generation config.

    Refuses a model whose position scheme is not plain RoPE (transformers would compute it differently), and an
    `out_dir` that holds files an export did not write (OutputDirError). Tokenizer files are
    `posfreq.train.data.hf_tokenizer.write_tokenizer_files`'s job.
    """
    from safetensors.torch import save

    if model.positions.name != "rope":
        raise ValueError(
            f"the model uses position scheme {model.positions.name!r}; transformers only runs 'rope'"
        )
    out = claim_output_dir(out_dir, EXPORT_HF)
    if (out / JOURNAL_FILE).is_file():
        remove_recorded(out)  # exactly the earlier export's files: weights, configs, tokenizer
    else:  # an older export, without a record: other weight files there would be loaded instead of these
        stale = [
            p.name
            for p in [*out.glob("*.safetensors"), *out.glob("*.safetensors.index.json")]
            if p.name != "model.safetensors"
        ]
        if stale:
            raise OutputDirError(
                f"--out {out} holds weight files an older export may not have written ({', '.join(sorted(stale))}), "
                "and it has no record of what it wrote. Fix: remove them, or pass a new --out (nothing was changed)"
            )
    tied = model.config.tie_embeddings
    tensors = {}
    for name, tensor in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        hf_name = name if name == "lm_head.weight" else f"model.{name}"
        tensors[hf_name] = tensor.detach().to("cpu").contiguous()
    dtype = model.embed_tokens.weight.dtype
    # safetensors' own save_file creates the file 0600; serialising to bytes lets train.atomic write it 0644.
    write_bytes_atomic(out / "model.safetensors", save(tensors, metadata={"format": "pt"}))
    write_json_atomic(
        out / "config.json", config_to_hf(model.config, dtype, bos_token_id, eos_token_id), indent=2
    )
    generation = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "do_sample": False}
    write_json_atomic(out / "generation_config.json", generation, indent=2)
    return out

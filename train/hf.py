"""Hugging Face Llama-family checkpoints in and out of our `Transformer`, without needing transformers.

Import reads a local directory's config.json and safetensors weights (single file or sharded) of
a LlamaForCausalLM (TinyLlama, Llama 2/3/3.1) or a MistralForCausalLM without sliding window.
Our parameter names are HF's without the "model." prefix, and our rotary uses HF's half-split
(rotate_half) layout, so weights map one to one with no q/k permutation (tests/test_hf.py checks
logits against transformers). Anything we would compute differently (biases, another activation,
sliding window, an unknown rope_scaling type, ...) is refused with an error naming the field.

Export writes config.json, model.safetensors and generation_config.json (plus tokenizer files
when we have them) that `transformers.AutoModelForCausalLM.from_pretrained` loads.
"""

from __future__ import annotations

import json
import math
import shutil
import warnings
from pathlib import Path

import torch
from torch import Tensor

from train.config import ModelConfig
from train.model import Transformer
from train.positions import rotary_inv_freq

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral"}
ROPE_SCALING_TYPES = ("default", "linear", "llama3")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")

# HF's defaults for keys a config.json may omit (LlamaConfig / MistralConfig).
_DEFAULTS = {
    "llama": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10_000.0, "sliding_window": None},
    "mistral": {"max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-6, "rope_theta": 10_000.0, "sliding_window": 4096},
}
# Keys that do not change the forward computation (or are checked explicitly below).
_KNOWN_KEYS = {
    "_name_or_path", "architectures", "attention_bias", "attention_dropout", "bos_token_id", "eos_token_id",
    "pad_token_id", "head_dim", "hidden_act", "hidden_size", "initializer_range", "intermediate_size",
    "max_position_embeddings", "mlp_bias", "model_type", "num_attention_heads", "num_hidden_layers",
    "num_key_value_heads", "pretraining_tp", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
    "tie_word_embeddings", "torch_dtype", "dtype", "transformers_version", "use_cache", "vocab_size",
    "sliding_window", "output_attentions", "output_hidden_states", "return_dict", "chunk_size_feed_forward",
    "is_encoder_decoder", "id2label", "label2id", "problem_type",
}
# Weights HF checkpoints may carry that we recompute (old Llama files saved the rotary buffer).
_IGNORED_WEIGHT_SUFFIXES = ("rotary_emb.inv_freq",)
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def llama3_inv_freq(
    inv_freq: Tensor, factor: float, low_freq_factor: float, high_freq_factor: float, original_max_position_embeddings: int
) -> Tensor:
    """Llama-3.1's rope scaling: divide low frequencies by `factor`, keep high ones, interpolate between."""
    low_freq_wavelen = original_max_position_embeddings / low_freq_factor
    high_freq_wavelen = original_max_position_embeddings / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def scaled_inv_freq(inv_freq: Tensor, rope_scaling: dict | None) -> Tensor:
    """Apply a Hugging Face `rope_scaling` dict (none/default, linear, llama3) to RoPE's inverse frequencies."""
    rope_type = _rope_type(rope_scaling)
    if rope_type == "default":
        return inv_freq
    try:
        if rope_type == "linear":
            return inv_freq / float(rope_scaling["factor"])
        return llama3_inv_freq(
            inv_freq,
            float(rope_scaling["factor"]),
            float(rope_scaling["low_freq_factor"]),
            float(rope_scaling["high_freq_factor"]),
            int(rope_scaling["original_max_position_embeddings"]),
        )
    except KeyError as err:
        raise ValueError(f"rope_scaling of type {rope_type!r} lacks the key {err.args[0]!r}: {rope_scaling}") from err


def _rope_type(rope_scaling: dict | None) -> str:
    """The scaling type of a rope_scaling dict (HF spells it rope_type, older files type); refuses unknown types."""
    if not rope_scaling:
        return "default"
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type not in ROPE_SCALING_TYPES:
        raise ValueError(
            f"unsupported rope_scaling type {rope_type!r} (rope_scaling={rope_scaling}); supported: {ROPE_SCALING_TYPES}"
        )
    return rope_type


def apply_rope_scaling(model: Transformer) -> None:
    """Set the model's rotary frequencies from `config.rope_scaling` (needed again after every `set_positions`)."""
    config = model.config
    if config.rope_scaling is not None:
        model.positions.rotary.inv_freq = scaled_inv_freq(rotary_inv_freq(config.head_dim, config.rope_base), config.rope_scaling)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} not found: expected a Hugging Face model directory with config.json") from None


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
    get = lambda key: hf.get(key, defaults.get(key))  # noqa: E731
    problems = []
    for key, expected in (("attention_bias", False), ("mlp_bias", False), ("hidden_act", "silu")):
        if hf.get(key, expected) != expected:
            problems.append(f"{key}={hf[key]!r} (only {expected!r} is supported)")
    if hf.get("quantization_config"):
        problems.append("quantization_config (quantized weights are not supported; use a bf16/fp16/fp32 checkpoint)")
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        problems.append(f"partial_rotary_factor={hf['partial_rotary_factor']} (only 1.0 is supported)")
    max_len = int(get("max_position_embeddings"))
    window = get("sliding_window")
    if window is not None and window < max_len:
        problems.append(f"sliding_window={window} < max_position_embeddings={max_len} (sliding-window attention is not supported)")
    rope_theta, rope_scaling = _rope_from_hf(hf, defaults)
    try:
        _rope_type(rope_scaling)
    except ValueError as err:
        problems.append(str(err))
    if problems:
        raise ValueError(f"{source}: cannot import this {model_type} model exactly: " + "; ".join(problems))
    unknown = sorted(set(hf) - _KNOWN_KEYS)
    if unknown:
        warnings.warn(f"{source}: ignoring config keys {unknown}; check that they do not change the model", stacklevel=2)
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size") if k not in hf]
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
        norm_eps=float(get("rms_norm_eps")),
        max_seq_len=max_len,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope_scaling=None if _rope_type(rope_scaling) == "default" else dict(rope_scaling),
    )


def _rope_from_hf(hf: dict, defaults: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either transformers 4's keys or transformers 5's rope_parameters."""
    params = hf.get("rope_parameters")
    if params:
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        return params.get("rope_theta", hf.get("rope_theta", defaults["rope_theta"])), scaling
    return hf.get("rope_theta", defaults["rope_theta"]), hf.get("rope_scaling")


def _weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a HF directory (sharded via its index, or one file); refuses pickles."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(_read_json(index)["weight_map"].values()))
        return [directory / n for n in names]
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    if any(directory.glob("*.bin")) or any(directory.glob("*.pth")):
        raise ValueError(
            f"{directory} has only pickled weights (.bin/.pth), which we never load. Convert them to safetensors "
            "first, e.g. with transformers: AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out_dir)."
        )
    raise FileNotFoundError(f"{directory}: no model.safetensors or model.safetensors.index.json")


def _read_hf_weights(directory: Path, dtype: torch.dtype | None, device: str) -> dict[str, Tensor]:
    """All tensors of the directory keyed by our names (HF's without the "model." prefix)."""
    from safetensors.torch import load_file

    weights: dict[str, Tensor] = {}
    for file in _weight_files(directory):
        for name, tensor in load_file(str(file), device=device).items():
            if name.endswith(_IGNORED_WEIGHT_SUFFIXES):
                continue
            key = name.removeprefix("model.")
            weights[key] = tensor if dtype is None else tensor.to(dtype)
    return weights


def load_hf_model(
    directory: str | Path, dtype: torch.dtype | None = None, attention_backend: str = "auto", device: str = "cpu"
) -> Transformer:
    """Our Transformer with the weights of a local Hugging Face Llama/Mistral directory (dtype None: as stored)."""
    directory = Path(directory)
    config = config_from_hf(_read_json(directory / "config.json"), source=str(directory / "config.json"))
    weights = _read_hf_weights(directory, dtype, device)
    if config.tie_embeddings:
        weights.pop("lm_head.weight", None)  # transformers ignores a stored head when embeddings are tied
    with torch.device("meta"):
        model = Transformer(config, attention_backend=attention_backend)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items() if not (config.tie_embeddings and k == "lm_head.weight")}
    missing, unexpected = sorted(set(shapes) - set(weights)), sorted(set(weights) - set(shapes))
    if missing or unexpected:
        raise ValueError(f"{directory}: weights do not match the config: missing {missing[:8]}, unexpected {unexpected[:8]}")
    for key, shape in shapes.items():
        if tuple(weights[key].shape) != shape:
            raise ValueError(f"{directory}: weight {key} has shape {tuple(weights[key].shape)}, the config implies {shape}")
    model.load_state_dict(weights, strict=False, assign=True)
    if config.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.set_positions("rope")  # rebuild the rotary off the meta device
    apply_rope_scaling(model)
    return model.eval()


def tokenizer_spec(directory: str | Path) -> str | None:
    """The `get_tokenizer` spec (hf:<dir>) of a HF model directory, or None without tokenizer.json."""
    return f"hf:{directory}" if (Path(directory) / "tokenizer.json").is_file() else None


def config_to_hf(config: ModelConfig, dtype: torch.dtype, bos_token_id: int | None, eos_token_id: int | None) -> dict:
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
        "max_position_embeddings": config.max_seq_len,
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


def export_hf(
    model: Transformer,
    out_dir: str | Path,
    tokenizer_dir: str | Path | None = None,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
) -> Path:
    """Write `model` as a HF LlamaForCausalLM directory (config, safetensors, generation config, tokenizer files).

    Refuses a model whose position scheme is not plain RoPE (transformers would compute it differently).
    """
    from safetensors.torch import save_file

    if model.positions.name != "rope":
        raise ValueError(f"the model uses position scheme {model.positions.name!r}; transformers only runs 'rope'")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tied = model.config.tie_embeddings
    tensors = {}
    for name, tensor in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        hf_name = name if name == "lm_head.weight" else f"model.{name}"
        tensors[hf_name] = tensor.detach().to("cpu").contiguous()
    dtype = model.embed_tokens.weight.dtype
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = config_to_hf(model.config, dtype, bos_token_id, eos_token_id)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if tokenizer_dir is not None:
        copied = [f for f in TOKENIZER_FILES if (Path(tokenizer_dir) / f).is_file()]
        if not copied:
            raise FileNotFoundError(f"{tokenizer_dir}: none of the tokenizer files {TOKENIZER_FILES}")
        for name in copied:
            shutil.copyfile(Path(tokenizer_dir) / name, out / name)
    return out

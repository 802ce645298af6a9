"""Hugging Face Llama-family checkpoints in and out of our `Transformer`, without needing transformers.

Import reads a local directory's config.json and safetensors weights (single file or sharded) of
a LlamaForCausalLM (TinyLlama, Llama 2/3/3.1) or a MistralForCausalLM without sliding window.
Our parameter names are HF's without the "model." prefix, and our rotary uses HF's half-split
(rotate_half) layout, so weights map one to one with no q/k permutation (tests/test_hf.py checks
logits against transformers). Anything we would compute differently (biases, another activation,
sliding window, an unknown rope_scaling type, ...) is refused with an error naming the field.

Export writes config.json, model.safetensors and generation_config.json that
`transformers.AutoModelForCausalLM.from_pretrained` loads, and tokenizer files that
`transformers.AutoTokenizer.from_pretrained` loads offline with our ids (`write_tokenizer_files`):
Llama 3's BPE rebuilt from quicktok's ranks, the `bytes` tokenizer as a byte-level model (byte b
is id b, BOS 256, EOS 257), or a `hf:<dir>` tokenizer's own files copied. Every file is written
atomically with mode 0666 & ~umask (0644 under the usual umask), via `train.atomic`.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from posfreq.train.atomic import write_bytes_atomic, write_json_atomic, write_text_atomic
from posfreq.train.config import DTYPES, ModelConfig  # noqa: F401 (DTYPES re-exported)
from posfreq.train.model import Transformer
from posfreq.train.outdir import claim_output_dir
from posfreq.train.rotary import rope_scaling_type
from posfreq.train.safe_load import contained_file
from posfreq.train.tokenizer import ByteTokenizer

if TYPE_CHECKING:
    import tokenizers

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral"}
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
}
# Weights HF checkpoints may carry that we recompute (old Llama files saved the rotary buffer).
_IGNORED_WEIGHT_SUFFIXES = ("rotary_emb.inv_freq",)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{path} not found: expected a Hugging Face model directory with config.json"
        ) from None


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
    problems = []
    for key, expected in (("attention_bias", False), ("mlp_bias", False), ("hidden_act", "silu")):
        if hf.get(key, expected) != expected:
            problems.append(f"{key}={hf[key]!r} (only {expected!r} is supported)")
    if hf.get("quantization_config"):
        problems.append(
            "quantization_config (quantized weights are not supported; use a bf16/fp16/fp32 checkpoint)"
        )
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        problems.append(
            f"partial_rotary_factor={hf['partial_rotary_factor']} (only 1.0 is supported)"
        )
    max_len = int(hf.get("max_position_embeddings", defaults["max_position_embeddings"]))
    window = hf.get("sliding_window", defaults["sliding_window"])
    if window is not None and window < max_len:
        problems.append(
            f"sliding_window={window} < max_position_embeddings={max_len} (sliding-window attention is not supported)"
        )
    rope_theta, rope_scaling = _rope_from_hf(hf, defaults)
    try:
        rope_scaling_type(rope_scaling)
    except ValueError as err:
        problems.append(str(err))
    if problems:
        raise ValueError(
            f"{source}: cannot import this {model_type} model exactly: " + "; ".join(problems)
        )
    unknown = sorted(set(hf) - _KNOWN_KEYS)
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
        names = _read_json(index)["weight_map"].values()
        return sorted({contained_file(directory, name, str(index)) for name in names})
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
    config = config_from_hf(
        _read_json(directory / "config.json"), source=str(directory / "config.json")
    )
    weights = _read_hf_weights(directory, dtype, device)
    if config.tie_embeddings:
        weights.pop(
            "lm_head.weight", None
        )  # transformers ignores a stored head when embeddings are tied
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
    `write_tokenizer_files`'s job.
    """
    from safetensors.torch import save

    if model.positions.name != "rope":
        raise ValueError(
            f"the model uses position scheme {model.positions.name!r}; transformers only runs 'rope'"
        )
    out = claim_output_dir(out_dir, EXPORT_HF)
    for stale in [*out.glob("*.safetensors"), *out.glob("*.safetensors.index.json")]:
        if (
            stale.name != "model.safetensors"
        ):  # an earlier export's other weight files would be loaded instead
            stale.unlink()
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


def write_tokenizer_files(spec: str, out_dir: str | Path) -> list[Path]:
    """Hugging Face tokenizer files for the tokenizer `spec` names, in `out_dir`; [] when we cannot make any.

    `llama3` and `bytes` are rebuilt offline with the `tokenizers` library (same ids as ours);
    `hf:<dir>` copies that directory's tokenizer files. Other tokenizers (e.g. a registered demo
    vocabulary) have no Hugging Face form yet: a warning says so and nothing is written.
    """
    if spec == "llama3":
        return write_llama3_tokenizer(out_dir)
    if spec == "bytes":
        return write_bytes_tokenizer(out_dir)
    if spec.startswith("hf:"):
        source, out = Path(spec[3:]), Path(out_dir)
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
    """tokenizer.json + tokenizer_config.json equal to `train.tokenizer.ByteTokenizer`: byte b is id b, BOS 256, EOS 257.

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


# Llama 3's pretokenizer regex (as in Meta's tokenizer.json / tiktoken model).
LLAMA3_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


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


def write_llama3_tokenizer(out_dir: str | Path) -> list[Path]:
    """Write a Hugging Face tokenizer.json + tokenizer_config.json equal to Llama 3's, from quicktok's bundled ranks.

    Needs the `tokenizers` package (the `hf` extra); the ids match quicktok's exactly (tests/test_hf.py).
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

"""What the Hugging Face tests share: a tiny consolidated checkpoint with the bytes tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from posfreq.train.model.config import ModelConfig
from posfreq.train.model.transformer import Transformer


def consolidated_bytes_model(
    directory: Path, config: ModelConfig | None = None, weight_std: float | None = None
) -> Transformer:
    """A tiny random model saved as a consolidated checkpoint (train.checkpoint.layout's layout) with the bytes tokenizer;
    `weight_std` redraws every weight but the norms, large enough for clear argmaxes."""
    from safetensors.torch import save_file

    config = config or ModelConfig(
        vocab_size=258,
        d_model=32,
        n_layers=1,
        n_heads=2,
        n_kv_heads=1,
        ffn_dim=64,
        tie_embeddings=True,
    )
    torch.manual_seed(0)
    ours = Transformer(config).eval()
    if weight_std is not None:
        with torch.no_grad():
            for name, param in ours.named_parameters():
                if "norm" not in name:
                    param.normal_(0.0, weight_std)
    directory.mkdir(parents=True)
    save_file(
        {k: v.clone() for k, v in ours.state_dict().items()}, str(directory / "model.safetensors")
    )
    (directory / "model_config.json").write_text(json.dumps(config.to_dict()))
    (directory / "tokenizer_spec.json").write_text(
        json.dumps({"spec": "bytes", "vocab_size": 258, "bos_id": 256, "eos_id": 257})
    )
    return ours


SMALL_DECODER = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
"""The position-scheme tests' tiny random decoder (any transformers config takes these keys)."""

TINY_HF = dict(
    vocab_size=258,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=768,
    bos_token_id=256,
    eos_token_id=257,
    tie_word_embeddings=False,
)
"""A tiny transformers decoder's config over the bytes tokenizer's 258 ids (overridable per test)."""


def save_tiny_hf(
    directory: Path, family: str = "llama", tokenizer: bool = True, **overrides
) -> Path:
    """A random (seed 0) tiny transformers model of `family` (llama, qwen2, mistral) saved in `directory` with
    TINY_HF's config and `overrides`, and the bytes tokenizer's files unless `tokenizer` is False."""
    import transformers

    from posfreq.train.data.hf_tokenizer import write_tokenizer_files

    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[family]
    torch.manual_seed(0)
    model_class(config_class(**{**TINY_HF, **overrides})).save_pretrained(directory)
    if tokenizer:
        write_tokenizer_files("bytes", directory)
    return Path(directory)

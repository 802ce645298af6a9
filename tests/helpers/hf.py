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

"""What the Hugging Face tests share: a tiny consolidated checkpoint with the bytes tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from posfreq.train.config import ModelConfig
from posfreq.train.model import Transformer


def consolidated_bytes_model(directory: Path) -> Transformer:
    """A tiny random model saved as a consolidated checkpoint (train.checkpoint's layout) with the bytes tokenizer."""
    from safetensors.torch import save_file

    config = ModelConfig(
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
    directory.mkdir()
    save_file(
        {k: v.clone() for k, v in ours.state_dict().items()}, str(directory / "model.safetensors")
    )
    (directory / "model_config.json").write_text(json.dumps(config.to_dict()))
    (directory / "tokenizer_spec.json").write_text(
        json.dumps({"spec": "bytes", "vocab_size": 258, "bos_id": 256, "eos_id": 257})
    )
    return ours

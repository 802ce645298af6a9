"""Model configuration and named presets (the paper's TinyLlama-1.3B and small CPU models)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace

import torch

MAX_PARAMS = 10**12
"""A sanity bound on a model's size: a config beyond it is a mistake (a corrupt or hostile config.json), refused
before anything is allocated."""

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The weight dtypes a command can cast to, by one name in every command (`--dtype`)."""
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""Older spellings `checkpoint consolidate --dtype` took; they keep working."""


@dataclass(frozen=True)
class ModelConfig:
    """A Llama/TinyLlama decoder: RMSNorm, grouped-query attention with RoPE, SwiGLU."""

    vocab_size: int = 128_256
    d_model: int = 2048
    n_layers: int = 22
    n_heads: int = 32
    n_kv_heads: int = 4
    ffn_dim: int = 5632
    rope_base: float = 10_000.0
    norm_eps: float = 1e-5
    train_len: int = (
        2048  # the training length L: the rows it was trained on; STRING's defaults derive from it
    )
    tie_embeddings: bool = False
    # Hugging Face's rope_scaling dict for imported models (e.g. {"rope_type": "llama3", "factor": 8.0,
    # ...}; see train.positions.rotary.scaled_inv_freq); None for plain RoPE. Excluded from the hash (a dict).
    rope_scaling: dict | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "d_model",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "ffn_dim",
            "train_len",
        ):
            if not getattr(self, name) >= 1:
                raise ValueError(f"{name}={getattr(self, name)!r} is out of range: it must be >= 1")
        for name in ("rope_base", "norm_eps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r} is out of range: it must be > 0")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}"
            )
        if (self.d_model // self.n_heads) % 2:
            raise ValueError("the head dimension must be even for rotary embeddings")
        if self.vocab_size > 2**32:
            raise ValueError(
                f"vocab_size={self.vocab_size:,} does not fit the uint32 token format (at most 2^32)"
            )
        if self.num_params() > MAX_PARAMS:
            raise ValueError(
                f"this config has {self.num_params():,} parameters ({4 * self.num_params() / 2**40:,.1f} "
                f"TiB in float32), more than any model this code is for ({MAX_PARAMS:.0e}); a size "
                "field is probably wrong (vocab_size, d_model, ffn_dim, n_layers)"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ModelConfig":
        """A config from its JSON dict; unknown keys are an error. A checkpoint written before the training length
        had one name calls it `max_seq_len`; it is read as `train_len`."""
        if "max_seq_len" in data and "train_len" not in data:
            data = {("train_len" if k == "max_seq_len" else k): v for k, v in data.items()}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown model config keys {unknown}; known keys: {sorted(known)}")
        return cls(**data)

    def num_params(self, include_embeddings: bool = True) -> int:
        """Exact parameter count (matches `sum(p.numel())` of the built model)."""
        d, f, hd = self.d_model, self.ffn_dim, self.head_dim
        attn = d * self.n_heads * hd + 2 * d * self.n_kv_heads * hd + self.n_heads * hd * d
        block = attn + 3 * d * f + 2 * d
        body = self.n_layers * block + d
        emb = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return body + (emb if include_embeddings else 0)


# TinyLlama's architecture with the Llama-3 vocabulary, as in the paper. Embeddings are untied
# (as in TinyLlama and Llama): 0.97B parameters without the two 128,256 x 2048 matrices, 1.49B
# with them (1.23B if they were tied); the paper's "1.3B" matches none exactly (docs/pretraining.md).
PRESETS: dict[str, ModelConfig] = {
    "tinyllama-1.3b": ModelConfig(),
    "tiny-4l-256": ModelConfig(
        d_model=256, n_layers=4, n_heads=8, n_kv_heads=2, ffn_dim=704, train_len=4096
    ),
    "tiny-2l-128": ModelConfig(
        d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=352, train_len=4096
    ),
    # SmolLM-135M's shape (a public Llama-family model of about 135M parameters): the benchmarks' real-size model.
    "smollm-135m": ModelConfig(
        vocab_size=49_152,
        d_model=576,
        n_layers=30,
        n_heads=9,
        n_kv_heads=3,
        ffn_dim=1536,
        tie_embeddings=True,
    ),
}


def model_preset(name: str, **overrides) -> ModelConfig:
    """A named preset with optional field overrides (e.g. vocab_size for a small tokenizer)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return replace(PRESETS[name], **overrides)

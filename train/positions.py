"""Position schemes: which relative distance the rotary embedding sees for each (query, key).

Keys are always rotated (and cached) at their true positions by the model. A scheme receives
the un-rotated queries and decides how to rotate them, and over which keys, so that each
(query m, key n) pair sees the scheme's distance. `rope` is ordinary rotary attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from train.attention import varlen_attention


def rotary_inv_freq(head_dim: int, base: float) -> Tensor:
    """RoPE's inverse frequencies base^(-2j/d), float32, as Llama computes them."""
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


@dataclass
class Rotary:
    """Rotates vectors by their positions: x * cos + rotate_half(x) * sin (Llama's half-split layout)."""

    inv_freq: Tensor
    scale: float = 1.0  # multiplies cos/sin (YaRN's attention temperature); 1 for plain RoPE

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scale).to(dtype)[:, None, :], (emb.sin() * self.scale).to(dtype)[:, None, :]

    def rotate(self, x: Tensor, positions: Tensor) -> Tensor:
        """x: (T, H, D) rotated at `positions` (T,), which may be any integers, negative included."""
        cos, sin = self.cos_sin(positions, x.dtype)
        half = x.shape[-1] // 2
        rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated_half * sin


@dataclass
class AttentionInputs:
    """Everything a scheme needs for one layer's attention over packed sequences."""

    q: Tensor  # (Tq, H, D), not yet rotated
    k: Tensor  # (Tk, Hkv, D), rotated at pos_k
    v: Tensor  # (Tk, Hkv, D)
    pos_q: Tensor  # (Tq,) true positions of the queries within their sequence
    pos_k: Tensor  # (Tk,)
    cu_seqlens_q: Tensor
    cu_seqlens_k: Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    backend: str = "auto"


@dataclass
class PositionScheme:
    """Base scheme = RoPE: every pair sees distance m - n."""

    name: str = "rope"
    rotary: Rotary = field(default=None)  # type: ignore[assignment]

    def distances(self, length: int) -> np.ndarray:
        """Reference: the (length, length) matrix of relative distances seen (-1 above the diagonal)."""
        m = np.arange(length)[:, None]
        n = np.arange(length)[None, :]
        return np.where(n <= m, m - n, -1)

    def attend(self, x: AttentionInputs) -> Tensor:
        q = self.rotary.rotate(x.q, x.pos_q)
        return varlen_attention(
            q, x.k, x.v, x.cu_seqlens_q, x.cu_seqlens_k, x.max_seqlen_q, x.max_seqlen_k, backend=x.backend
        )


def build_scheme(name: str, head_dim: int, rope_base: float, train_len: int, **kwargs) -> PositionScheme:
    """A position scheme by name with its options (e.g. shift=, window= for string).

    `train_len` is the model's training length L, from which schemes derive their defaults.
    """
    if name == "rope":
        if kwargs:
            raise ValueError(f"rope takes no options, got {sorted(kwargs)}")
        return PositionScheme(name="rope", rotary=Rotary(rotary_inv_freq(head_dim, rope_base)))
    raise ValueError(f"unknown position scheme {name!r}; choose one of {SCHEMES}")


SCHEMES = ("rope",)

"""STRING for Hugging Face transformers models: an attention function registered as "posfreq_string".

Every transformers decoder (Llama, Mistral, Qwen2, ...) rotates q and k, then calls the attention
function its config names. Rotations compose, so STRING needs only a second copy of each query rotated
by -(S - W) with the model's own inverse frequencies (rope scaling included) for the keys at distance
>= S; keys stay as cached. One softmax over both score sets equals the two passes merged by log-sum-exp.
This path materialises (Lq, Lk) scores per head, as transformers' eager attention does; it has not
been run on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from posfreq.train.string_scheme import string_shift_window

STRING_ATTENTION = "posfreq_string"
CONFIG_KEY = (
    "posfreq_string"  # {"shift": S, "window": W} on the model's config, set by apply_string
)


@dataclass(frozen=True)
class StringSettings:
    """Distances below `shift` are kept; from `shift` on, a distance d is seen as d - shift + window."""

    shift: int
    window: int


def settings_of(config: Any) -> StringSettings:
    """The settings `apply_string` stored on a config, else the defaults for its max_position_embeddings."""
    stored = getattr(config, CONFIG_KEY, None) or {}
    shift, window = string_shift_window(
        config.max_position_embeddings, stored.get("shift"), stored.get("window")
    )
    return StringSettings(shift, window)


def rope_inv_freq(config: Any) -> Tensor:
    """The model's rotary inverse frequencies, as its rotary embedding computes them (rope scaling included)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "dynamic":
        raise ValueError(
            "posfreq_string: dynamic rope scaling changes the frequencies with the input length; "
            "STRING needs fixed ones. Fix: load the model with static rope scaling (linear, yarn, llama3)"
        )
    if rope_type == "default":
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    return ROPE_INIT_FUNCTIONS[rope_type](config)[0].float()


def rotate(x: Tensor, angles: Tensor) -> Tensor:
    """x (..., D) rotated by `angles` (D/2,) in transformers' rotate-half layout (pairs i and i + D/2)."""
    cos = torch.cat((angles.cos(), angles.cos())).to(x.dtype)
    sin = torch.cat((angles.sin(), angles.sin())).to(x.dtype)
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _shifted_rotation(module: torch.nn.Module, settings: StringSettings) -> Tensor:
    """-(S - W) * inv_freq for this module's config, computed once per module and settings."""
    cached = getattr(module, "_posfreq_string_angles", None)
    if cached is None or cached[0] != settings:
        angles = -(settings.shift - settings.window) * rope_inv_freq(module.config)
        cached = (settings, angles)
        module._posfreq_string_angles = cached
    return cached[1]


def string_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention-function contract: q (B, H, Lq, D), cached k/v (B, Hkv, Lk, D), a boolean
    mask (B, 1, Lq, Lk) or None; returns (B, Lq, H, D). The queries are the last Lq of the Lk positions."""
    settings = settings_of(module.config)
    batch, heads, len_q, dim = query.shape
    len_k, groups = key.shape[2], heads // key.shape[1]
    keys = key.repeat_interleave(groups, dim=1) if groups > 1 else key
    values = value.repeat_interleave(groups, dim=1) if groups > 1 else value
    scale = dim**-0.5 if scaling is None else scaling
    far_query = rotate(query, _shifted_rotation(module, settings).to(query.device))
    near = torch.matmul(query, keys.transpose(-1, -2)) * scale
    far = torch.matmul(far_query, keys.transpose(-1, -2)) * scale
    positions = torch.arange(len_k, device=query.device)
    distance = positions[len_k - len_q :, None] - positions[None, :]
    scores = torch.where(distance < settings.shift, near, far)
    allowed = distance >= 0
    if attention_mask is not None:
        allowed = allowed & attention_mask.bool()
    scores = scores.float().masked_fill(~allowed, float("-inf"))
    probs = (
        torch.softmax(scores, dim=-1).nan_to_num(0.0).to(value.dtype)
    )  # a query with no key: zeros
    if dropout and module.training:
        probs = torch.nn.functional.dropout(probs, p=dropout)
    return torch.matmul(probs, values).transpose(1, 2).contiguous(), None


def register() -> None:
    """Make `attn_implementation="posfreq_string"` known to transformers (a boolean mask, as for sdpa)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(STRING_ATTENTION, string_attention)
    AttentionMaskInterface.register(STRING_ATTENTION, sdpa_mask)


def apply_string(
    model: Any,
    shift: int | None = None,
    window: int | None = None,
    train_len: int | None = None,
) -> Any:
    """Run a loaded transformers model with STRING: S = L // 3 of `train_len` (default: the config's
    max_position_embeddings) and W = min(128, S // 2) unless given. Returns the model."""
    register()
    length = train_len or model.config.max_position_embeddings
    shift, window = string_shift_window(length, shift, window)
    model.config.posfreq_string = {"shift": shift, "window": window}
    model.set_attn_implementation(STRING_ATTENTION)
    return model


register()

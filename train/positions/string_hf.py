"""STRING for Hugging Face transformers models: an attention function registered as "posfreq_string".

Every transformers decoder (Llama, Mistral, Qwen2, ...) rotates q and k, then calls the attention
function its config names. Rotations compose, so STRING needs only a second copy of each query rotated
by -(S - W) with the model's own inverse frequencies (rope scaling included) for the keys at distance
>= S; keys stay as cached. Each row's real tokens are packed and attended by posfreq's varlen_attention
(sdpa on a CPU; torch's varlen FlashAttention on a GPU) in the two passes, merged exactly by their
log-sum-exp, in one compute dtype (autocast's while it is on).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from posfreq.train.positions.hf_rows import (
    attention_inputs,
    packed,
    plain_attention,
    refuse_unsupported,
    rope_inv_freq,
    scaled_queries,
    unpack_queries,
    uses_rope,
)
from posfreq.train.positions.rotary import Rotary
from posfreq.train.positions.string import StringScheme, string_shift_window

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


def _scheme(module: torch.nn.Module, settings: StringSettings) -> StringScheme:
    """posfreq's STRING with this module's frequencies, made once per module and settings."""
    cached = getattr(module, "_posfreq_string_scheme", None)
    if cached is None or cached[0] != settings:
        options = {"shift": settings.shift, "window": settings.window}
        rotary = Rotary(rope_inv_freq(module.config))
        scheme = StringScheme(
            "string", rotary, options, split=settings.shift, window=settings.window
        )
        cached = (settings, scheme)
        module._posfreq_string_scheme = cached
    return cached[1]


def decode_step(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scheme: StringScheme,
    scale: float,
) -> Tensor:
    """One new query per row over the cache, in place: keys before Lk - S are scored with the query turned
    by -(S - W) (the scheme's far rotation), the S nearest with the plain one, each key once, grouped
    heads without copying the cache."""
    batch, heads, _, dim = query.shape
    kv_heads, len_k = key.shape[1], key.shape[2]
    split = max(0, len_k - scheme.split)  # keys [0, split) are at distance >= S
    at_zero = torch.zeros(batch, dtype=torch.long, device=query.device)  # queries arrive rotated
    turned = scheme.rotary.rotate(
        query.reshape(batch, heads, dim), scheme.far_query_positions(at_zero)
    )
    q, far_q = (x.reshape(batch, kv_heads, heads // kv_heads, dim) for x in (query, turned))
    far = torch.matmul(far_q, key[:, :, :split].transpose(-1, -2))
    near = torch.matmul(q, key[:, :, split:].transpose(-1, -2))
    scores = torch.cat((far, near), dim=-1).float() * scale  # (B, Hkv, G, Lk)
    if attention_mask is not None:
        scores = scores.masked_fill(~attention_mask.bool().view(batch, 1, 1, len_k), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    return torch.matmul(probs, value).reshape(batch, 1, heads, dim)


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
    mask (B, 1, Lq, Lk) or None; returns (B, Lq, H, D), zeros for padding queries. The queries are the
    last Lq of the Lk positions. One query per row is scored on the cache in place (`decode_step`);
    longer inputs are packed and attended by posfreq's own StringScheme (its windowed near pass and
    shifted far pass, merged by their log-sum-exp)."""
    refuse_unsupported(kwargs)
    settings = settings_of(module.config)
    backend = (getattr(module.config, CONFIG_KEY, None) or {}).get("backend", "auto")
    if not uses_rope(module):
        return plain_attention(query, key, value, attention_mask, scaling, backend), None
    len_q, dim = query.shape[2], query.shape[3]
    len_k = key.shape[2]
    if len_q == 1:  # cached decoding: scores of one query are as small as the cache
        scale = dim**-0.5 if scaling is None else scaling
        return decode_step(
            query, key, value, attention_mask, _scheme(module, settings), scale
        ), None
    layout, q, k, v = packed(query, key, value, attention_mask)
    q = scaled_queries(q, scaling)
    # posfreq's own STRING over the packed rows. Its queries are rotated from their positions; these
    # arrive rotated, so they sit at position 0: the near pass turns them by 0, the far pass by -(S - W)
    # (STRING depends on distances only; the keys' positions are not read either).
    inputs = attention_inputs(layout, q, k, v, layout.zeros_q, layout.zeros_k, backend)
    return unpack_queries(_scheme(module, settings).attend(inputs), layout, query, len_k), None


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
    rope_inv_freq(model.config)  # refuses, before any forward, a model STRING cannot run on
    length = train_len or model.config.max_position_embeddings
    shift, window = string_shift_window(length, shift, window)
    model.config.posfreq_string = {"shift": shift, "window": window}
    model.set_attn_implementation(STRING_ATTENTION)
    return model


register()

"""What every posfreq attention function inside a transformers model shares: the model's own rotary frequencies,
and the packing of each row's real queries and keys (left or right padding) into posfreq's varlen layout and back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from posfreq.train.model.attention import LayoutMemo, varlen_attention
from posfreq.train.positions.merge import AttentionInputs, cu_seqlens_of


def rope_parameters(config: Any) -> dict:
    """The config's rope parameters (transformers' rope_parameters: rope_theta, rope_type and the scaling's keys)."""
    return dict(getattr(config, "rope_parameters", None) or {})


VERIFIED_MODEL_TYPES = (
    "gemma",
    "granite",
    "granitemoe",
    "llama",
    "mistral",
    "mixtral",
    "olmo2",
    "olmoe",
    "phi3",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "smollm3",
    "starcoder2",
)
"""transformers model types the position schemes are checked on, pair by pair, against each model's own rotary
function (tests/train/positions/test_hf_architectures.py). Other decoders differ in ways the schemes' extra
rotation cannot see from a config: interleaved or reversed rotary layouts (Cohere, ERNIE 4.5, Helium, NanoChat),
learned norms after the rotation (HunYuan), complex-valued rotary (Llama 4), latent attention (DeepSeek-V3).
A type joins the list when that test passes with it."""


def check_architecture(config: Any) -> None:
    """ValueError, before any forward, for a model whose attention the position schemes are not checked on."""
    model_type = getattr(config, "model_type", None)
    # a window the mask alone expresses passes for left padding in cached decoding, and a window the layers
    # name would be refused only at the first forward, after the weights loaded: both refused from the config.
    # Where a config lists layer_types, they alone decide (transformers' Qwen2 and SmolLM3 derive them)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        windowed = sorted(set(layer_types) - {"full_attention"})
    elif getattr(config, "use_sliding_window", False) or getattr(config, "sliding_window", None):
        windowed = [f"sliding_window={getattr(config, 'sliding_window', None)}"]
    else:
        windowed = []
    if windowed:
        raise ValueError(
            "posfreq attention: this model's config declares sliding-window or chunked layers "
            f"({', '.join(windowed)}), which the position schemes do not model. Fix: load the model without "
            "them (sliding_window=None, use_sliding_window=False, layer_types all full_attention) only if it "
            "was trained that way, or use rope"
        )
    if model_type not in VERIFIED_MODEL_TYPES:
        raise ValueError(
            f"posfreq attention: position schemes are checked on the model types {', '.join(VERIFIED_MODEL_TYPES)}, "
            f"not {model_type!r} (its rotary layout or attention may differ in ways a scheme would get silently "
            "wrong). Fix: use rope (transformers' own attention), or add the type to VERIFIED_MODEL_TYPES in "
            "train/positions/hf_rows.py once tests/train/positions/test_hf_architectures.py passes with it"
        )


def rope_inv_freq(config: Any) -> Tensor:
    """The model's rotary inverse frequencies, as its rotary embedding computes them (rope scaling included);
    ValueError for a model the schemes cannot run on (`check_architecture`, rotary embeddings they cannot turn)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    check_architecture(config)
    params = rope_parameters(config)
    if any(isinstance(value, dict) for value in params.values()):
        raise ValueError(
            "posfreq attention: this model has rope parameters per layer type "
            f"({', '.join(k for k, v in params.items() if isinstance(v, dict))}); position schemes need one "
            "rotary embedding. Fix: use rope"
        )
    if "rope_theta" not in params:
        raise ValueError(
            "posfreq attention: the model's config names no rope_theta (rope_parameters), so its rotary "
            "frequencies are unknown. Fix: use rope"
        )
    rope_type = params.get("rope_type", "default")
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(
            f"posfreq attention: this model rotates only part of each head (partial_rotary_factor={partial}); "
            "position schemes rotate whole heads. Fix: use rope (the model's own attention)"
        )
    if rope_type in ("dynamic", "longrope"):
        raise ValueError(
            f"posfreq attention: {rope_type} rope scaling changes the frequencies with the input length; "
            "position schemes need fixed ones. Fix: load the model with static rope scaling (linear, yarn, llama3)"
        )
    if rope_type == "default":
        dim = head_dim(config)
        return 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    return ROPE_INIT_FUNCTIONS[rope_type](config)[0].float()


def head_dim(config: Any) -> int:
    """The attention head size of a transformers config."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def refuse_unsupported(kwargs: dict) -> None:
    """ValueError for what the attention functions do not model: a sliding window, logit soft-capping, attention
    sinks."""
    if kwargs.get("s_aux") is not None:
        raise ValueError(
            "posfreq attention: this model adds attention sinks to its softmax, which the position schemes do "
            "not. Fix: use rope (transformers' own attention)"
        )
    if kwargs.get("sliding_window"):
        raise ValueError(
            "posfreq attention: this layer attends within a sliding window, which the position schemes do not "
            "model. Fix: load the model with sliding_window=None, or use rope"
        )
    if kwargs.get("softcap"):
        raise ValueError(
            "posfreq attention: this model soft-caps its attention logits, which the position schemes do not. "
            "Fix: use rope (transformers' own attention)"
        )


def compute_dtype(value: Tensor) -> torch.dtype:
    """The dtype attention runs in: autocast's on this device while it is on, else the values' own."""
    device = value.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else value.dtype


def real_key_block(attention_mask: Tensor | None, batch: int, len_k: int) -> tuple[Tensor, Tensor]:
    """(first, end) of each row's real keys: the keys the last query may see. transformers pads left
    for generation and right for scoring; either leaves one contiguous block, anything else is refused."""
    if attention_mask is None:
        return torch.zeros(batch, dtype=torch.long), torch.full((batch,), len_k, dtype=torch.long)
    if attention_mask.dtype != torch.bool:
        raise ValueError(
            f"posfreq attention: a {attention_mask.dtype} attention mask (additive?) where a boolean one is "
            "expected (True: the key is seen). Fix: pass a 2-D 0/1 attention_mask and let transformers build it"
        )
    seen = attention_mask[:, 0, -1].cpu()  # (B, Lk)
    first = seen.int().argmax(-1)
    end = first + seen.sum(-1)
    block = torch.arange(len_k)[None]
    if not torch.equal(seen, (block >= first[:, None]) & (block < end[:, None])):
        raise ValueError(
            "posfreq attention: each row's keys must be one contiguous block (left or right padding); "
            "Fix: pad on one side, or pass no attention mask"
        )
    return first, end


def check_causal_rows(
    attention_mask: Tensor | None, first: Tensor, end: Tensor, len_q: int, len_k: int
) -> None:
    """ValueError unless each real query sees every real key up to its own position: a sliding window or chunked
    attention that a model expresses only through its mask (not the sliding_window argument) would be lost."""
    if attention_mask is None:
        return
    seen = attention_mask[:, 0].sum(-1).cpu()  # (B, Lq) keys each query sees
    at = torch.arange(len_k - len_q, len_k)[None]  # each query's cache position
    real = (at >= first[:, None]) & (at < end[:, None])
    if not torch.equal(seen[real], (at + 1 - first[:, None]).expand_as(real)[real]):
        raise ValueError(
            "posfreq attention: the attention mask hides keys a causal query would see (a sliding window or "
            "chunked attention), which the position schemes do not model. Fix: load the model without its "
            "window (sliding_window=None, or use_sliding_window=False), or use rope"
        )


@dataclass(frozen=True)
class PackedLayout:
    """Where each row's real queries and keys are and how they pack: the same for every layer of a forward.

    A row's real tokens sit at positions 0, 1, ... from its first real key, as transformers numbers them
    (position_ids from the attention mask's cumulative sum when it generates with left padding)."""

    first: Tensor  # (B,) each row's first real key (host)
    q_from: Tensor  # (B,) each row's first real query, in cache positions (host)
    rows_q: Tensor  # (B,) real queries per row (host)
    rows_k: Tensor  # (B,) real keys per row (host)
    starts: list[int]  # each row's first packed query
    cu_q: Tensor  # on the device, as every tensor below
    cu_k: Tensor
    pos_q: Tensor  # each packed query's position in its row
    pos_k: Tensor  # each packed key's position in its row
    zeros_q: Tensor  # position 0 for every query (for queries that arrive rotated), one tensor per forward
    zeros_k: Tensor
    max_q: int
    max_k: int


def packed_layout(
    attention_mask: Tensor | None, batch: int, len_q: int, len_k: int, device: torch.device
) -> PackedLayout:
    """The layout of a forward's rows: the queries are the last len_q of the len_k cache positions."""
    first, end = real_key_block(attention_mask, batch, len_k)
    if len_q < len_k and bool((end < len_k).any()):
        raise ValueError(
            "posfreq attention: the cache holds slots after the newest query (a static cache?); the queries must "
            "be the last cache positions. Fix: generate with the default DynamicCache"
        )
    check_causal_rows(attention_mask, first, end, len_q, len_k)
    q_from = torch.clamp(
        first, min=len_k - len_q
    )  # each row's first real query, in cache positions
    rows_q, rows_k = (end - q_from).clamp(min=0), end - first
    pos_q = torch.cat([torch.arange(n) + (a - f) for n, a, f in zip(rows_q, q_from, first)])
    pos_k = torch.cat([torch.arange(n) for n in rows_k])
    return PackedLayout(
        first=first,
        q_from=q_from,
        rows_q=rows_q,
        rows_k=rows_k,
        starts=cu_seqlens_of(rows_q).tolist(),
        cu_q=cu_seqlens_of(rows_q).to(device),
        cu_k=cu_seqlens_of(rows_k).to(device),
        pos_q=pos_q.to(device),
        pos_k=pos_k.to(device),
        zeros_q=torch.zeros(len(pos_q), dtype=torch.long, device=device),
        zeros_k=torch.zeros(len(pos_k), dtype=torch.long, device=device),
        max_q=int(rows_q.max()),
        max_k=int(rows_k.max()),
    )


LAYOUTS = LayoutMemo()
"""transformers hands every layer of a forward the same mask tensor: its packing is worked out once."""


def layout_of(attention_mask: Tensor | None, query: Tensor, len_k: int) -> PackedLayout:
    """The (memoized) layout of this forward, for queries (B, H, Lq, D) over len_k cache positions."""
    batch, _, len_q, _ = query.shape
    return LAYOUTS.get(
        (attention_mask,),
        (batch, len_q, len_k, query.device),
        lambda: packed_layout(attention_mask, batch, len_q, len_k, query.device),
    )


def pack_rows(x: Tensor, starts: Tensor, counts: Tensor) -> Tensor:
    """Rows [start, start + count) of each (H, L, D) sequence of x (B, H, L, D), packed as (T, H, D)."""
    parts = [x[b, :, int(a) : int(a + n)] for b, (a, n) in enumerate(zip(starts, counts))]
    return (parts[0] if len(parts) == 1 else torch.cat(parts, 1)).transpose(0, 1)


def unpack_queries(out: Tensor, layout: PackedLayout, query: Tensor, len_k: int) -> Tensor:
    """The packed attention output (Tq, H, D) as transformers wants it, (B, Lq, H, D), zeros for padding queries."""
    batch, heads, len_q, dim = query.shape
    if batch == 1 and int(layout.rows_q[0]) == len_q:  # one row, no padding: the output as it is
        return out.unsqueeze(0)
    result = out.new_zeros(batch, len_q, heads, dim)  # the compute dtype `packed` chose
    for b in range(batch):
        at = int(layout.q_from[b]) - (len_k - len_q)
        result[b, at : at + int(layout.rows_q[b])] = out[layout.starts[b] : layout.starts[b + 1]]
    return result


def packed(
    query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None
) -> tuple[PackedLayout, Tensor, Tensor, Tensor]:
    """(layout, q, k, v): each row's real queries and keys packed (T, H, D), all three in one compute dtype.

    Under autocast over float32 weights (the probe on a GPU) transformers rotates q and k in float32 while v
    comes from an autocast projection: one dtype for all three, so the backend is chosen for it (FlashAttention
    in bf16, not a dense float32 path) and no kernel meets mixed dtypes."""
    len_q, len_k = query.shape[2], key.shape[2]
    query, key, value = (x.to(compute_dtype(value)) for x in (query, key, value))
    layout = layout_of(attention_mask, query, len_k)
    q = pack_rows(query, layout.q_from - (len_k - len_q), layout.rows_q)
    k, v = (
        pack_rows(key, layout.first, layout.rows_k),
        pack_rows(value, layout.first, layout.rows_k),
    )
    return layout, q, k, v


def attention_inputs(
    layout: PackedLayout,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pos_q: Tensor,
    pos_k: Tensor,
    backend: str,
) -> AttentionInputs:
    """A scheme's inputs over the packed rows of `layout`, the queries and keys at `pos_q` and `pos_k`."""
    return AttentionInputs(
        q=q,
        keys=k,
        values=v,
        pos_q=pos_q,
        pos_k=pos_k,
        cu_seqlens_q=layout.cu_q,
        cu_seqlens_k=layout.cu_k,
        max_seqlen_q=layout.max_q,
        max_seqlen_k=layout.max_k,
        backend=backend,
    )


def scaled_queries(q: Tensor, scaling: float | None) -> Tensor:
    """q with the model's attention scaling folded in (Granite's attention_multiplier, Gemma's query_pre_attn_scalar),
    for the schemes, which score with 1/sqrt(head size): scores are linear in q, and so is a rotation."""
    factor = 1.0 if scaling is None else scaling * q.shape[-1] ** 0.5
    return q if abs(factor - 1.0) <= 1e-6 else q * factor


def uses_rope(module: torch.nn.Module) -> bool:
    """Whether this attention layer rotates q and k: not in a NoPE layer (every few of SmolLM3's, `use_rope`)."""
    return bool(getattr(module, "use_rope", True))


def plain_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None,
    backend: str,
) -> Tensor:
    """Causal attention over each row's real tokens, for a layer without positions (a NoPE layer), where no
    scheme changes anything; returns (B, Lq, H, D) as the attention functions do."""
    layout, q, k, v = packed(query, key, value, attention_mask)
    out = varlen_attention(
        q,
        k,
        v,
        layout.cu_q,
        layout.cu_k,
        layout.max_q,
        layout.max_k,
        backend=backend,
        scale=scaling,
    )
    return unpack_queries(out, layout, query, key.shape[2])

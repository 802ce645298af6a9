"""What every posfreq attention function inside a transformers model shares: the model's own rotary frequencies,
and the packing of each row's real queries and keys (left or right padding) into posfreq's varlen layout and back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from posfreq.train.model.attention import LayoutMemo
from posfreq.train.positions.merge import AttentionInputs, cu_seqlens_of


def rope_parameters(config: Any) -> dict:
    """The config's rope parameters (transformers' rope_parameters: rope_theta, rope_type and the scaling's keys)."""
    return dict(getattr(config, "rope_parameters", None) or {})


def rope_inv_freq(config: Any) -> Tensor:
    """The model's rotary inverse frequencies, as its rotary embedding computes them (rope scaling included)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = rope_parameters(config)
    rope_type = params.get("rope_type", "default")
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(
            f"posfreq attention: this model rotates only part of each head (partial_rotary_factor={partial}); "
            "position schemes rotate whole heads. Fix: use transformers' own sdpa attention (rope)"
        )
    if rope_type == "dynamic":
        raise ValueError(
            "posfreq attention: dynamic rope scaling changes the frequencies with the input length; "
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
    """ValueError for what the attention functions do not model: a sliding window, logit soft-capping."""
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
    seen = attention_mask[:, 0, -1].bool().cpu()  # (B, Lk)
    first = seen.int().argmax(-1)
    end = first + seen.sum(-1)
    block = torch.arange(len_k)[None]
    if not torch.equal(seen, (block >= first[:, None]) & (block < end[:, None])):
        raise ValueError(
            "posfreq attention: each row's keys must be one contiguous block (left or right padding); "
            "Fix: pad on one side, or pass no attention mask"
        )
    return first, end


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

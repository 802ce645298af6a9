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
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from posfreq.train.model.attention import LayoutMemo
from posfreq.train.model.hf_folder import refuse_custom_code
from posfreq.train.positions.merge import AttentionInputs, cu_seqlens_of
from posfreq.train.positions.rotary import Rotary
from posfreq.train.positions.schemes import ENGINE_SCHEMES
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
            "posfreq_string: each row's keys must be one contiguous block (left or right padding); "
            "Fix: pad on one side, or pass no attention mask"
        )
    return first, end


@dataclass(frozen=True)
class PackedLayout:
    """Where each row's real queries and keys are and how they pack: the same for every layer of a forward."""

    first: Tensor  # (B,) each row's first real key (host)
    q_from: Tensor  # (B,) each row's first real query, in cache positions (host)
    rows_q: Tensor  # (B,) real queries per row (host)
    rows_k: Tensor  # (B,) real keys per row (host)
    starts: list[int]  # each row's first packed query
    cu_q: Tensor  # on the device, as every tensor below
    cu_k: Tensor
    pos_q: Tensor  # zeros: the queries arrive rotated
    pos_k: Tensor
    max_q: int
    max_k: int


def _packed_layout(
    attention_mask: Tensor | None, batch: int, len_q: int, len_k: int, device: torch.device
) -> PackedLayout:
    first, end = real_key_block(attention_mask, batch, len_k)
    q_from = torch.clamp(
        first, min=len_k - len_q
    )  # each row's first real query, in cache positions
    rows_q, rows_k = (end - q_from).clamp(min=0), end - first
    return PackedLayout(
        first=first,
        q_from=q_from,
        rows_q=rows_q,
        rows_k=rows_k,
        starts=cu_seqlens_of(rows_q).tolist(),
        cu_q=cu_seqlens_of(rows_q).to(device),
        cu_k=cu_seqlens_of(rows_k).to(device),
        pos_q=torch.zeros(int(rows_q.sum()), dtype=torch.long, device=device),
        pos_k=torch.zeros(int(rows_k.sum()), dtype=torch.long, device=device),
        max_q=int(rows_q.max()),
        max_k=int(rows_k.max()),
    )


_LAYOUT = LayoutMemo()
"""transformers hands every layer of a forward the same mask tensor: its packing is worked out once."""


def _pack(x: Tensor, starts: Tensor, counts: Tensor) -> Tensor:
    """Rows [start, start + count) of each (H, L, D) sequence of x (B, H, L, D), packed as (T, H, D)."""
    parts = [x[b, :, int(a) : int(a + n)] for b, (a, n) in enumerate(zip(starts, counts))]
    return (parts[0] if len(parts) == 1 else torch.cat(parts, 1)).transpose(0, 1)


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
    settings = settings_of(module.config)
    backend = (getattr(module.config, CONFIG_KEY, None) or {}).get("backend", "auto")
    batch, heads, len_q, dim = query.shape
    len_k = key.shape[2]
    if len_q == 1:  # cached decoding: scores of one query are as small as the cache
        scale = dim**-0.5 if scaling is None else scaling
        return decode_step(
            query, key, value, attention_mask, _scheme(module, settings), scale
        ), None
    # Under autocast over float32 weights (the probe on a GPU) transformers rotates q and k in float32 while v
    # comes from an autocast projection: one compute dtype for all three, so the backend is chosen for it
    # (FlashAttention in bf16, not a dense float32 path) and no kernel meets mixed dtypes.
    query, key, value = (x.to(compute_dtype(value)) for x in (query, key, value))
    layout = _LAYOUT.get(
        (attention_mask,),
        (batch, len_q, len_k, query.device),
        lambda: _packed_layout(attention_mask, batch, len_q, len_k, query.device),
    )
    q = _pack(query, layout.q_from - (len_k - len_q), layout.rows_q)
    k, v = _pack(key, layout.first, layout.rows_k), _pack(value, layout.first, layout.rows_k)
    # posfreq's own STRING over the packed rows. Its queries are rotated from their positions; these
    # arrive rotated, so they sit at position 0: the near pass turns them by 0, the far pass by -(S - W).
    inputs = AttentionInputs(
        q=q,
        keys=k,
        values=v,
        pos_q=layout.pos_q,
        pos_k=layout.pos_k,
        cu_seqlens_q=layout.cu_q,
        cu_seqlens_k=layout.cu_k,
        max_seqlen_q=layout.max_q,
        max_seqlen_k=layout.max_k,
        backend=backend,
    )
    out = _scheme(module, settings).attend(inputs)
    if batch == 1 and int(layout.rows_q[0]) == len_q:  # one row, no padding: the output as it is
        return out.unsqueeze(0), None
    result = query.new_zeros(batch, len_q, heads, dim)
    for b in range(batch):
        at = int(layout.q_from[b]) - (len_k - len_q)
        result[b, at : at + int(layout.rows_q[b])] = out[layout.starts[b] : layout.starts[b + 1]]
    return result, None


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


def load_causal_lm(
    path: str | Path,
    positions: str = "rope",
    shift: int | None = None,
    window: int | None = None,
    train_len: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> Any:
    """A local transformers model in eval mode, with sdpa attention (`rope`) or STRING (`string`,
    as `apply_string`); the loader the probe's transformers engine and `posfreq ruler` share."""
    from transformers import AutoModelForCausalLM

    if positions not in ENGINE_SCHEMES["transformers"]:
        raise ValueError(
            f"positions {positions!r}: transformers models run {' or '.join(ENGINE_SCHEMES['transformers'])}"
        )
    refuse_custom_code(Path(path), "the model folder")
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="sdpa", trust_remote_code=False
    )
    if positions == "string":
        apply_string(model, shift, window, train_len)
    return model.eval()


register()

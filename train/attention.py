"""Per-document causal attention over packed sequences, one function with several backends.

`varlen_attention` takes packed queries, keys and values plus `cu_seqlens` (cumulative
sequence lengths, FlashAttention's varlen convention) and computes causal attention inside
each sequence, never across sequences. When a sequence has fewer queries than keys (cached
decoding, STRING's shifted pass) the causal mask is aligned bottom-right, as in flash-attn:
query i of a sequence with Lq queries and Lk keys sees keys j <= i + Lk - Lq.

Backends compute the same thing:
- ``sdpa``: torch's scaled_dot_product_attention, batched over sequences of equal length.
  Runs (and trains) everywhere; the reference the others are tested against.
- ``flash``: flash-attn's `flash_attn_varlen_func` (CUDA only; `pip install .[gpu]`).
- ``xformers``: a block-diagonal causal mask (CUDA only; no log-sum-exp).
- ``flex``: torch FlexAttention with a document mask (compiled on CUDA; forward-only on CPU).
- ``auto``: flash if installed and on CUDA, else flex on CUDA, else sdpa.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import warnings
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

BACKENDS = ("auto", "sdpa", "flash", "xformers", "flex")
LSE_BACKENDS = ("sdpa", "flash", "flex")


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def available_backends(device: torch.device | str) -> list[str]:
    """The concrete backends that can run on `device` with what is installed."""
    names = ["sdpa", "flex"]
    if torch.device(device).type == "cuda":
        names += [n for n, mod in (("flash", "flash_attn"), ("xformers", "xformers")) if _installed(mod)]
    return names


def resolve_backend(backend: str, device: torch.device | str, return_lse: bool = False) -> str:
    """Turn ``auto`` into a concrete backend and refuse combinations that cannot run."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
    on_cuda = torch.device(device).type == "cuda"
    if backend == "auto":
        if on_cuda and _installed("flash_attn"):
            return "flash"
        return "flex" if on_cuda else "sdpa"
    if backend in ("flash", "xformers") and not on_cuda:
        raise RuntimeError(f"attention backend {backend!r} needs a CUDA device; use 'sdpa' on CPU")
    if backend in ("flash", "xformers") and not _installed({"flash": "flash_attn"}.get(backend, backend)):
        raise RuntimeError(f"attention backend {backend!r} is not installed: pip install '.[gpu]'")
    if return_lse and backend not in LSE_BACKENDS:
        raise RuntimeError(f"attention backend {backend!r} cannot return the log-sum-exp; use one of {LSE_BACKENDS}")
    return backend


def varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    window: int | None = None,
    return_lse: bool = False,
    backend: str = "auto",
    scale: float | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Causal attention within each packed sequence.

    q: (Tq, H, D); k, v: (Tk, Hkv, D) with H a multiple of Hkv (grouped-query attention);
    cu_seqlens_*: int32 (n + 1,) starting at 0. `window=w` keeps only keys at distance < w
    from their query. Returns out (Tq, H, D), and with `return_lse` also the natural-log
    log-sum-exp of the scaled scores, (Tq, H) float32 (-inf for a query that sees no key).
    """
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    name = resolve_backend(backend, q.device, return_lse)
    impl: Callable = {"sdpa": _sdpa, "flash": _flash, "xformers": _xformers, "flex": _flex}[name]
    return impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window, return_lse, scale)


GROUPED_QUERIES = 64
"""Up to this many new queries per sequence, `cached_attention` scores them by plain matmuls (see there)."""


def cached_attention(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None) -> Tensor:
    """Bottom-right causal attention of B equal query blocks over B equal KV caches, on sdpa, without packing.

    q: (B, Lq, H, D), the last Lq positions of each sequence; k, v: (B, Lk, Hkv, D), typically
    strided views of a preallocated cache (packing them for `varlen_attention` would copy the
    whole cache at every decoding step). Returns (B, Lq, H, D). Up to GROUPED_QUERIES new
    queries (decoding), each KV head's G query heads and Lq queries form one (G * Lq, D) block
    scored by two matmuls against the cache (scores in the inputs' dtype, softmax in float32);
    on CPU the attention alone is 1.8-2.1x as fast as sdpa's grouped-query kernel for one
    query over 8K-32K keys. Longer blocks take sdpa's kernel.
    """
    batch, len_q, heads, dim = q.shape
    len_k, kv_heads = k.shape[1], k.shape[2]
    scale = scale if scale is not None else 1.0 / math.sqrt(dim)
    if len_q > GROUPED_QUERIES:
        causal = len_q == len_k  # a dense mask only where the kernel's own causal flag cannot say it
        mask = None if causal else causal_mask(len_q, len_k, None, q.device)
        out, _ = _attend_dense(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, causal, False, scale)
        return out.transpose(1, 2)
    groups = heads // kv_heads
    rows = q.reshape(batch, len_q, kv_heads, groups, dim).permute(0, 2, 3, 1, 4).reshape(batch, kv_heads, -1, dim)
    scores = torch.matmul(rows * scale, k.permute(0, 2, 3, 1))  # (B, Hkv, G * Lq, Lk)
    if len_q > 1:
        allowed = causal_mask(len_q, len_k, None, q.device)
        scores = scores.view(batch, kv_heads, groups, len_q, len_k).masked_fill(~allowed, -math.inf)
        scores = scores.view(batch, kv_heads, groups * len_q, len_k)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
    out = torch.matmul(probs, v.transpose(1, 2))  # (B, Hkv, G * Lq, D)
    return out.view(batch, kv_heads, groups, len_q, dim).permute(0, 3, 1, 2, 4).reshape(batch, len_q, heads, dim)


def causal_mask(len_q: int, len_k: int, window: int | None, device: torch.device) -> Tensor:
    """Boolean (len_q, len_k) mask of allowed keys: bottom-right causal, optionally windowed."""
    distance = torch.arange(len_q, device=device)[:, None] + (len_k - len_q) - torch.arange(len_k, device=device)
    allowed = distance >= 0
    if window is not None:
        allowed &= distance < window
    return allowed


def _group_by_shape(cu_q: Tensor, cu_k: Tensor) -> dict[tuple[int, int], list[int]]:
    """Indices of sequences grouped by (query length, key length), so each group is one batched call."""
    lens_q = (cu_q[1:] - cu_q[:-1]).tolist()
    lens_k = (cu_k[1:] - cu_k[:-1]).tolist()
    groups: dict[tuple[int, int], list[int]] = {}
    for i, shape in enumerate(zip(lens_q, lens_k)):
        groups.setdefault(shape, []).append(i)
    return groups


def _gather(x: Tensor, starts: list[int], length: int) -> Tensor:
    """Stack equal-length slices of a packed (T, H, D) tensor into (n, H, length, D)."""
    if all(b - a == length for a, b in zip(starts, starts[1:])):  # back to back: a view, no copy
        return x[starts[0] : starts[0] + len(starts) * length].reshape(len(starts), length, *x.shape[1:]).transpose(1, 2)
    index = (torch.tensor(starts, device=x.device)[:, None] + torch.arange(length, device=x.device)).reshape(-1)
    return x.index_select(0, index).view(len(starts), length, *x.shape[1:]).transpose(1, 2)


def _attend_dense(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, want_lse: bool, scale: float):
    """(n, H, Lq, D) attention for one shape group; returns (out, lse or None)."""
    groups = q.shape[1] // k.shape[1]
    if not want_lse:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=groups > 1)
        return out, None
    if q.device.type == "cpu" and not torch.is_grad_enabled():  # the fused CPU kernel takes grouped heads as they are
        bias = None if mask is None else torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, -math.inf)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)[:2]
        return out, lse.float()
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        mask = causal_mask(q.shape[2], k.shape[2], None, q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1).clamp_min(-1e30)).nan_to_num(0.0)
    return torch.matmul(probs, v.float()).to(q.dtype), lse


def _sdpa(q, k, v, cu_q, cu_k, max_q, max_k, window, return_lse, scale):
    out = q.new_empty(q.shape)
    lse = q.new_full(q.shape[:2], -math.inf, dtype=torch.float32) if return_lse else None
    starts_q, starts_k = cu_q[:-1].tolist(), cu_k[:-1].tolist()
    for (len_q, len_k), seqs in _group_by_shape(cu_q, cu_k).items():
        if len_q == 0:
            continue
        qs = _gather(q, [starts_q[i] for i in seqs], len_q)
        ks = _gather(k, [starts_k[i] for i in seqs], len_k)
        vs = _gather(v, [starts_k[i] for i in seqs], len_k)
        plain = window is None or window >= len_k
        causal = plain and len_q == len_k and len_q > 1
        needs_mask = not causal and not (plain and len_q == 1)
        mask = causal_mask(len_q, len_k, window, q.device) if needs_mask else None
        o, s = _attend_dense(qs, ks, vs, mask, causal, return_lse, scale)
        index = (torch.tensor([starts_q[i] for i in seqs], device=q.device)[:, None] + torch.arange(len_q, device=q.device)).reshape(-1)
        out.index_copy_(0, index, o.transpose(1, 2).reshape(-1, *q.shape[1:]))
        if return_lse:
            lse.index_copy_(0, index, s.transpose(1, 2).reshape(-1, q.shape[1]))
    return (out, lse) if return_lse else out


def _flash(q, k, v, cu_q, cu_k, max_q, max_k, window, return_lse, scale):
    from flash_attn import flash_attn_varlen_func

    result = flash_attn_varlen_func(
        q, k, v, cu_q.int(), cu_k.int(), max_q, max_k,
        softmax_scale=scale, causal=True,
        window_size=(window - 1, 0) if window is not None else (-1, -1),
        return_attn_probs=return_lse,
    )
    if not return_lse:
        return result
    out, lse = result[0], result[1]
    if lse.dim() == 3:  # flash-attn < 2.4 pads the lse per sequence: (n, H, max_q)
        lens = (cu_q[1:] - cu_q[:-1]).tolist()
        lse = torch.cat([lse[i, :, :n] for i, n in enumerate(lens)], dim=1)
    return out, lse.transpose(0, 1).float()


def _xformers(q, k, v, cu_q, cu_k, max_q, max_k, window, return_lse, scale):
    from xformers.ops import fmha

    lens_q, lens_k = (cu_q[1:] - cu_q[:-1]).tolist(), (cu_k[1:] - cu_k[:-1]).tolist()
    if window is None:
        bias = fmha.attn_bias.BlockDiagonalCausalFromBottomRightMask.from_seqlens(lens_q, lens_k)
    else:
        bias = fmha.attn_bias.BlockDiagonalCausalLocalAttentionFromBottomRightMask.from_seqlens(lens_q, lens_k, window_size=window)
    groups = q.shape[1] // k.shape[1]
    hkv = k.shape[1]
    q5 = q.view(1, q.shape[0], hkv, groups, q.shape[2])
    k5 = k.unsqueeze(2).expand(-1, -1, groups, -1).unsqueeze(0)
    v5 = v.unsqueeze(2).expand(-1, -1, groups, -1).unsqueeze(0)
    out = fmha.memory_efficient_attention_forward(q5, k5, v5, attn_bias=bias, scale=scale)
    return out.reshape(q.shape)


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _flex(q, k, v, cu_q, cu_k, max_q, max_k, window, return_lse, scale):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    device = q.device
    lens_q, lens_k = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    doc_q = torch.repeat_interleave(torch.arange(len(lens_q), device=device), lens_q.long())
    doc_k = torch.repeat_interleave(torch.arange(len(lens_k), device=device), lens_k.long())
    # Key position of each query's diagonal, so the mask is bottom-right causal per document.
    pos_q = torch.arange(q.shape[0], device=device) - cu_q[:-1].long()[doc_q] + (lens_k - lens_q).long()[doc_q]
    pos_k = torch.arange(k.shape[0], device=device) - cu_k[:-1].long()[doc_k]

    def mask_mod(b, h, qi, ki):
        distance = pos_q[qi] - pos_k[ki]
        allowed = (doc_q[qi] == doc_k[ki]) & (distance >= 0)
        return allowed & (distance < window) if window is not None else allowed

    block_mask = create_block_mask(mask_mod, 1, 1, q.shape[0], k.shape[0], device=device.type if device.type == "cpu" else device)
    fn = _compiled_flex() if device.type == "cuda" else flex_attention
    groups = q.shape[1] // k.shape[1]
    with warnings.catch_warnings():  # CPU runs flex unfused on purpose (it is forward-only there anyway)
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        result = fn(
            q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
            block_mask=block_mask, scale=scale, enable_gqa=groups > 1, return_lse=return_lse,
        )
    if not return_lse:
        return result[0].transpose(0, 1)
    out, lse = result
    return out[0].transpose(0, 1), lse[0].transpose(0, 1).float()

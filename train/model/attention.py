"""Per-document causal attention over packed sequences, one function with several backends.

`varlen_attention` takes packed queries, keys and values plus `cu_seqlens` (cumulative
sequence lengths, FlashAttention's varlen convention) and computes causal attention inside
each sequence, never across sequences. When a sequence has fewer queries than keys (cached
decoding, STRING's shifted pass) the causal mask is aligned bottom-right, as in flash-attn:
query i of a sequence with Lq queries and Lk keys sees keys j <= i + Lk - Lq.

Backends compute the same thing:
- ``sdpa``: torch's scaled_dot_product_attention, batched over sequences of equal length.
  Runs (and trains) everywhere, in every dtype; the reference the others are tested against.
- ``varlen``: torch's own variable-length FlashAttention (`torch.nn.attention.varlen`): CUDA
  (compute capability >= 8.0), bf16/fp16, nothing to build. The CUDA default.
- ``flash``: flash-attn's `flash_attn_varlen_func` (CUDA, bf16/fp16; an optional source build).
- ``xformers``: memory-efficient attention with a block-diagonal causal mask (CUDA; no log-sum-exp).
- ``flex``: torch FlexAttention with a document block mask (compiled on CUDA; forward-only on CPU).
- ``auto``: the first of varlen, flash, sdpa that can run the call (see `resolve_backend`).

flash and varlen return a log-sum-exp whose gradient their backward ignores, so a two-pass
merge (STRING, ReRoPE, Self-Extend, DCA) that needs gradients is refused on them.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from posfreq.train.model.attention_flex import flex_backend
from posfreq.train.model.attention_kernels import (
    BackendError,
    needs_backward,
    resolve_backend,
    varlen_api,
)


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
        raise ValueError(
            f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads"
        )
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    name = resolve_backend(
        backend,
        q.device,
        q.dtype,
        return_lse=return_lse,
        backward=needs_backward(q, k, v),
        window=window is not None,
    )
    impl: Callable = {
        "sdpa": _sdpa,
        "varlen": _varlen,
        "flash": _flash,
        "xformers": _xformers,
        "flex": flex_backend,
    }[name]
    return impl(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window, return_lse, scale
    )


class LayoutMemo:
    """A few slots: the values last computed from these very tensors (by identity) and settings.

    Every layer of a forward passes the same cu_seqlens tensors (or attention mask), so a layout read from
    them (a copy to the host, which on a GPU waits for every queued kernel and leaves the GPU idle while
    Python catches up) is computed once per forward instead of once per layer. A memo that sees several
    layouts per layer (a two-pass scheme's near and far passes) needs as many slots. The slots hold their key
    tensors weakly: a mask of gigabytes is not kept alive by the memo, and a freed tensor's id, reused by a
    new one, can never match. posfreq never changes such tensors in place.
    """

    def __init__(self, slots: int = 1) -> None:
        self._slots: list[tuple[tuple[weakref.ref | None, ...], tuple, object]] = []
        self._size = slots

    def get(self, tensors: tuple[Tensor | None, ...], settings: tuple, compute):
        """The memo for (tensors, settings), else compute() stored in the oldest slot's place."""
        for refs, held_settings, value in self._slots:
            if (
                held_settings == settings
                and len(refs) == len(tensors)
                and all(
                    (ref is None and t is None) or (ref is not None and ref() is t)
                    for ref, t in zip(refs, tensors)
                )
            ):
                return value
        value = compute()
        refs = tuple(None if t is None else weakref.ref(t) for t in tensors)
        self._slots = [(refs, settings, value), *self._slots[: self._size - 1]]
        return value


GROUPED_QUERIES = 64
"""Up to this many new queries per sequence, `cached_attention` scores them by plain matmuls (see there)."""


def cached_attention(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None) -> Tensor:
    """Bottom-right causal attention of B equal query blocks over B equal KV caches, on sdpa, without packing.

    q: (B, Lq, H, D), the last Lq positions of each sequence; k, v: (B, Lk, Hkv, D), typically
    strided views of a preallocated cache (packing them for `varlen_attention` would copy the
    whole cache at every decoding step). Returns (B, Lq, H, D). Up to GROUPED_QUERIES new
    queries (decoding), each KV head's G query heads and Lq queries form one (G * Lq, D) block
    scored by two matmuls against the cache (scores in the inputs' dtype, softmax in float32),
    which on CPU beats sdpa's grouped-query kernel for a few queries over a long cache
    (benchmarks/attention.py; docs/performance.md). Longer blocks take sdpa's kernel.
    """
    batch, len_q, heads, dim = q.shape
    len_k, kv_heads = k.shape[1], k.shape[2]
    scale = scale if scale is not None else 1.0 / math.sqrt(dim)
    if len_q > GROUPED_QUERIES:
        causal = (
            len_q == len_k
        )  # a dense mask only where the kernel's own causal flag cannot say it
        mask = None if causal else causal_mask(len_q, len_k, None, q.device)
        out, _ = attend_dense(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, causal, False, scale
        )
        return out.transpose(1, 2)
    groups = heads // kv_heads
    rows = (
        q.reshape(batch, len_q, kv_heads, groups, dim)
        .permute(0, 2, 3, 1, 4)
        .reshape(batch, kv_heads, -1, dim)
    )
    scores = torch.matmul(rows * scale, k.permute(0, 2, 3, 1))  # (B, Hkv, G * Lq, Lk)
    if len_q > 1:
        allowed = causal_mask(len_q, len_k, None, q.device)
        scores = scores.view(batch, kv_heads, groups, len_q, len_k).masked_fill(~allowed, -math.inf)
        scores = scores.view(batch, kv_heads, groups * len_q, len_k)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
    out = torch.matmul(probs, v.transpose(1, 2))  # (B, Hkv, G * Lq, D)
    return (
        out.view(batch, kv_heads, groups, len_q, dim)
        .permute(0, 3, 1, 2, 4)
        .reshape(batch, len_q, heads, dim)
    )


def causal_mask(len_q: int, len_k: int, window: int | None, device: torch.device) -> Tensor:
    """Boolean (len_q, len_k) mask of allowed keys: bottom-right causal, optionally windowed."""
    distance = (
        torch.arange(len_q, device=device)[:, None]
        + (len_k - len_q)
        - torch.arange(len_k, device=device)
    )
    allowed = distance >= 0
    if window is not None:
        allowed &= distance < window
    return allowed


def _rows_of(starts: list[int], length: int, device: torch.device) -> slice | Tensor:
    """The packed rows of equal-length sequences starting at `starts`: a slice when they lie back to back."""
    if all(b - a == length for a, b in zip(starts, starts[1:])):
        return slice(starts[0], starts[0] + len(starts) * length)
    return (
        torch.tensor(starts, device=device)[:, None] + torch.arange(length, device=device)
    ).reshape(-1)


def _gather(x: Tensor, rows: slice | Tensor, length: int) -> Tensor:
    """Stack equal-length sequences of a packed (T, H, D) tensor at `rows` (`_rows_of`) into (n, H, length, D)."""
    taken = x[rows] if isinstance(rows, slice) else x.index_select(0, rows)  # a slice is a view
    return taken.reshape(-1, length, *x.shape[1:]).transpose(1, 2)


def attend_dense(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, want_lse: bool, scale: float
):
    """(n, H, Lq, D) attention for one shape group; returns (out, lse or None)."""
    groups = q.shape[1] // k.shape[1]
    if not want_lse:
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=groups > 1
        )
        return out, None
    if (
        q.device.type == "cpu" and not torch.is_grad_enabled()
    ):  # the fused CPU kernel takes grouped heads as they are
        bias = (
            None
            if mask is None
            else torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, -math.inf)
        )
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=bias, scale=scale
        )[:2]
        return out, lse.float()
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    with torch.autocast(q.device.type, enabled=False):  # float32 scores even under bf16 autocast
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
        if causal:
            mask = causal_mask(q.shape[2], k.shape[2], None, q.device)
        if mask is not None:
            scores = scores.masked_fill(~mask, -math.inf)
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse.unsqueeze(-1).clamp_min(-1e30)).nan_to_num(0.0)
        out = torch.matmul(probs, v.float())
    return out.to(q.dtype), lse


@dataclass(frozen=True)
class _ShapeGroup:
    """Sequences of one (query length, key length) and their packed rows (`_rows_of`)."""

    len_q: int
    len_k: int
    rows_q: slice | Tensor
    rows_k: slice | Tensor


def _shape_groups(cu_q: Tensor, cu_k: Tensor, device: torch.device) -> list[_ShapeGroup]:
    """The sequences of cu_q/cu_k grouped by shape, each group one batched sdpa call (each read on the host once),
    their rows indexed on `device` (the queries')."""
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    starts: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
    for a, b, c, d in zip(bounds_q, bounds_q[1:], bounds_k, bounds_k[1:]):
        if b > a:
            group = starts.setdefault((b - a, d - c), ([], []))
            group[0].append(a)
            group[1].append(c)
    return [
        _ShapeGroup(len_q, len_k, _rows_of(sq, len_q, device), _rows_of(sk, len_k, device))
        for (len_q, len_k), (sq, sk) in starts.items()
    ]


_SDPA_GROUPS = LayoutMemo(slots=3)
"""Three slots: a split scheme on sdpa passes three layouts in every layer (a window's two block passes, the
far pass)."""


def _sdpa(q, k, v, cu_q, cu_k, max_q, max_k, window, return_lse, scale):
    out = q.new_empty(q.shape)
    lse = q.new_full(q.shape[:2], -math.inf, dtype=torch.float32) if return_lse else None
    # Read from cu_seqlens on the host once per forward (a GPU sync each), not once per layer.
    for g in _SDPA_GROUPS.get(
        (cu_q, cu_k), (q.device,), lambda: _shape_groups(cu_q, cu_k, q.device)
    ):
        qs = _gather(q, g.rows_q, g.len_q)
        ks = _gather(k, g.rows_k, g.len_k)
        vs = _gather(v, g.rows_k, g.len_k)
        plain = window is None or window >= g.len_k
        causal = plain and g.len_q == g.len_k and g.len_q > 1
        needs_mask = not causal and not (plain and g.len_q == 1)
        mask = causal_mask(g.len_q, g.len_k, window, q.device) if needs_mask else None
        o, s = attend_dense(qs, ks, vs, mask, causal, return_lse, scale)
        out[g.rows_q] = o.transpose(1, 2).reshape(-1, *q.shape[1:])
        if return_lse:
            lse[g.rows_q] = s.transpose(1, 2).reshape(-1, q.shape[1])
    return (out, lse) if return_lse else out


def _causal_window(window: int | None) -> tuple[int, int]:
    """FlashAttention's (left, right) window for bottom-right causal attention over keys at distance < window."""
    return (-1, 0) if window is None else (window - 1, 0)


def _lse_per_token(lse: Tensor, q: Tensor) -> Tensor:
    """A varlen kernel's log-sum-exp, (H, Tq) as FlashAttention returns it (or (Tq, H), as some torch releases
    document it), as (Tq, H) float32."""
    if lse.dim() == 2 and lse.shape == (q.shape[1], q.shape[0]):
        return lse.transpose(0, 1).float()
    if lse.dim() == 2 and lse.shape == q.shape[:2]:
        return lse.float()
    raise RuntimeError(
        f"unexpected log-sum-exp shape {tuple(lse.shape)} for queries {tuple(q.shape)}"
    )


def _varlen(q, k, v, cu_q, cu_k, max_q, max_k, window, return_lse, scale):
    """torch's varlen_attn through whichever signature this torch has (`varlen_api`): a scale the release
    lacks is folded into q, and a window it lacks was refused earlier. Grouped key/value heads go to the kernel
    as they are (with ``enable_gqa`` where the release has that guard): no repeated copies."""
    from torch.nn.attention import varlen

    api = varlen_api()
    refused = api.why_not(window is not None, return_lse)
    if refused:
        raise BackendError(f"attention backend 'varlen' cannot run this call: {refused}")
    options: dict = {}
    if api.causal == "window_size":
        options["window_size"] = _causal_window(window)
    else:
        options["is_causal"] = True
    if api.scale:
        options["scale"] = scale
    elif not math.isclose(factor := scale * math.sqrt(q.shape[-1]), 1.0, rel_tol=1e-9):
        q = q * factor  # the kernel's own scale is 1 / sqrt(D): fold the rest into q, a copy of it
    if q.shape[1] != k.shape[1] and api.gqa:
        options["enable_gqa"] = True
    if return_lse:
        options["return_aux"] = varlen.AuxRequest(lse=True)
    result = varlen.varlen_attn(q, k, v, cu_q.int(), cu_k.int(), max_q, max_k, **options)
    return (result[0], _lse_per_token(result[1], q)) if return_lse else result


def _flash(q, k, v, cu_q, cu_k, max_q, max_k, window, return_lse, scale):
    from flash_attn import flash_attn_varlen_func

    result = flash_attn_varlen_func(
        q,
        k,
        v,
        cu_q.int(),
        cu_k.int(),
        max_q,
        max_k,
        softmax_scale=scale,
        causal=True,
        window_size=_causal_window(window),
        return_attn_probs=return_lse,
    )
    if not return_lse:
        return result
    out, lse = result[0], result[1]
    if lse.dim() == 3:  # flash-attn < 2.4 pads the lse per sequence: (n, H, max_q)
        lens = (cu_q[1:] - cu_q[:-1]).tolist()
        lse = torch.cat([lse[i, :, :n] for i, n in enumerate(lens)], dim=1)
    return out, _lse_per_token(lse, q)


_XFORMERS_BIAS = LayoutMemo()


def _xformers(q, k, v, cu_q, cu_k, max_q, max_k, window, return_lse, scale):
    from xformers.ops import fmha

    def build_bias():
        lens_q, lens_k = (cu_q[1:] - cu_q[:-1]).tolist(), (cu_k[1:] - cu_k[:-1]).tolist()
        bias = fmha.attn_bias.BlockDiagonalCausalFromBottomRightMask.from_seqlens(lens_q, lens_k)
        if (
            window is not None
        ):  # keys at distance < window (xformers' local masks have no from_seqlens)
            bias = bias.make_local_attention_from_bottomright(window)
        return bias

    # Built from the lengths on the host, once per forward: every layer passes the same cu_seqlens.
    bias = _XFORMERS_BIAS.get((cu_q, cu_k), (window,), build_bias)
    groups, kv_heads = q.shape[1] // k.shape[1], k.shape[1]
    if groups == 1 or needs_backward(
        q, k, v
    ):  # (1, T, H, D), which every op and backward takes: K/V repeated
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        inputs = q[None], k[None], v[None]
    else:  # inference: the grouped (1, T, Hkv, G, D) layout, K/V broadcast over the group (it has no backward op)
        inputs = (
            q.view(1, q.shape[0], kv_heads, groups, q.shape[2]),
            *(x.unsqueeze(2).expand(-1, -1, groups, -1).unsqueeze(0) for x in (k, v)),
        )
    out = fmha.memory_efficient_attention(*inputs, attn_bias=bias, scale=scale)  # autograd-capable
    return out.reshape(q.shape)

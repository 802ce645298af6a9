"""Attention over parts of packed sequences, merged exactly through their log-sum-exp.

The position schemes that rewrite distances run several passes, each over its own rows of
queries and keys; these helpers cut those rows, run a pass, and fold one pass into another.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from posfreq.train.model.attention import LayoutMemo, attend_dense, varlen_attention
from posfreq.train.model.attention_kernels import needs_backward, resolve_backend


@dataclass
class AttentionInputs:
    """Everything a scheme needs for one layer's attention over packed sequences.

    Keys and values come packed, (Tk, Hkv, D), or, in cached decoding of B equal-length sequences,
    as the KV cache's (B, Lk, Hkv, D) views. Those are strided (a slice of a preallocated cache), so
    packing them is a copy of the whole cache: `k` and `v` make it only when a scheme asks for the
    packed form, and `cached_kv` hands the views over as they are.
    """

    q: Tensor  # (Tq, H, D), not yet rotated
    keys: Tensor  # (Tk, Hkv, D) or (B, Lk, Hkv, D), rotated at pos_k
    values: Tensor  # same layout as keys
    pos_q: Tensor  # (Tq,) true positions of the queries within their sequence
    pos_k: Tensor  # (Tk,)
    cu_seqlens_q: Tensor
    cu_seqlens_k: Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    backend: str = "auto"

    @functools.cached_property
    def k(self) -> Tensor:
        """Keys packed as (Tk, Hkv, D)."""
        return self.keys.reshape(-1, *self.keys.shape[-2:])

    @functools.cached_property
    def v(self) -> Tensor:
        """Values packed as (Tk, Hkv, D)."""
        return self.values.reshape(-1, *self.values.shape[-2:])

    @property
    def cached_kv(self) -> tuple[Tensor, Tensor] | None:
        """The KV cache's (B, Lk, Hkv, D) views, or None when keys and values came packed."""
        return (self.keys, self.values) if self.keys.dim() == 4 else None

    @property
    def total_k(self) -> int:
        """Number of keys over all sequences (Tk)."""
        return self.keys.shape[0] * (self.keys.shape[1] if self.keys.dim() == 4 else 1)


_NEAR_SEGMENTS = LayoutMemo()


def seq_lengths(cu: Tensor) -> Tensor:
    """Sequence lengths (int64) from cu_seqlens."""
    return (cu[1:] - cu[:-1]).long()


def cu_seqlens_of(lengths: Tensor) -> Tensor:
    """int32 cu_seqlens for `lengths`."""
    return torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)).to(torch.int32)


def _ranges(starts: Tensor, lengths: Tensor) -> Tensor | slice:
    """Indices of the concatenated ranges [start, start + length); a slice when there is one range."""
    if starts.numel() == 1:
        start = int(starts[0])
        return slice(start, start + int(lengths[0]))
    offsets = torch.cumsum(lengths, 0) - lengths
    return torch.repeat_interleave(starts - offsets, lengths) + torch.arange(
        int(lengths.sum()), device=starts.device
    )


@dataclass
class Segments:
    """Sub-sequences cut from packed queries and keys: rows to take and their varlen layout."""

    rows_q: Tensor | slice
    rows_k: Tensor | slice
    cu_q: Tensor
    cu_k: Tensor
    max_q: int
    max_k: int

    @staticmethod
    def of(starts_q: Tensor, lens_q: Tensor, starts_k: Tensor, lens_k: Tensor) -> "Segments | None":
        """Segments with lens_q[i] queries from starts_q[i] and lens_k[i] keys from starts_k[i]; None if empty."""
        keep = lens_q > 0
        if not bool(keep.any()):
            return None
        lens_q, lens_k = lens_q[keep], lens_k[keep]
        return Segments(
            _ranges(starts_q[keep], lens_q),
            _ranges(starts_k[keep], lens_k),
            cu_seqlens_of(lens_q),
            cu_seqlens_of(lens_k),
            int(lens_q.max()),
            int(lens_k.max()),
        )

    def attention(
        self, q: Tensor, k: Tensor, v: Tensor, window: int | None, backend: str
    ) -> tuple[Tensor, Tensor]:
        """Causal (bottom-right) attention of the segments' queries q over keys k, v; returns (out, lse)."""
        return varlen_attention(
            q,
            k,
            v,
            self.cu_q,
            self.cu_k,
            self.max_q,
            self.max_k,
            window=window,
            return_lse=True,
            backend=backend,
        )


def merge_into(
    out: Tensor, lse: Tensor, rows: Tensor | slice, out_b: Tensor, lse_b: Tensor
) -> None:
    """Fold a second pass (out_b, lse_b) for `rows` into (out, lse) in place: exact softmax over both key sets.

    The weighted sum is formed in float32 from the passes' own outputs (a half-precision output times a float32
    weight is computed in float32), with no float32 copy of either: on a long prefill these (rows, H, D) sweeps,
    not the arithmetic, are the merge's cost.
    """
    if isinstance(rows, slice) and torch.is_grad_enabled():
        # a slice's rows are views, which backward needs as they were: overwriting them in place below would
        # break it; indexed rows are copies
        rows = torch.arange(out.shape[0], device=out.device)[rows]
    lse_a = lse[rows]
    total = torch.logaddexp(lse_a, lse_b)
    weight_a = (
        torch.exp(lse_a - total).nan_to_num(0.0).unsqueeze(-1)
    )  # nan only where both saw no key (not in place: exp's backward needs its output)
    weight_b = torch.exp(lse_b - total).nan_to_num(0.0).unsqueeze(-1)
    merged = torch.addcmul(out_b * weight_b, out[rows], weight_a)  # float32 (weights are)
    if isinstance(rows, slice):
        out[rows] = merged
        lse[rows] = total
    else:
        out.index_copy_(0, rows, merged.to(out.dtype))
        lse.index_copy_(0, rows, total)


def windowed_attention(q: Tensor, x: AttentionInputs, window: int) -> tuple[Tensor, Tensor]:
    """Attention of rotated queries q over the keys at distance < window; returns (out, lse).

    flash and flex take the window natively, and so does sdpa for cached decoding (over the
    keys within reach only). For a prefill on sdpa, a window would mean a dense (L, L) mask
    (O(L^2) memory); instead each sequence is cut
    into blocks of `window` positions and the window splits, mask-free, into two causal passes
    merged by log-sum-exp: (1) each block over itself; (2) each block over the previous block's
    keys at distance < window, which in reversed order form a causal triangle.
    """
    lens_q, lens_k = seq_lengths(x.cu_seqlens_q), seq_lengths(x.cu_seqlens_k)
    blocked = (
        resolve_backend(
            x.backend,
            q.device,
            q.dtype,
            return_lse=True,
            backward=needs_backward(q, x.keys),
            window=True,
        )
        == "sdpa"
        and x.max_seqlen_q > window > 1
        and torch.equal(lens_q, lens_k)
    )
    if not blocked:  # only the last Lq + window - 1 keys of each sequence are within reach

        def near() -> Segments | None:
            first = (lens_k - lens_q - window + 1).clamp_min(0)
            return Segments.of(
                x.cu_seqlens_q[:-1].long(),
                lens_q,
                x.cu_seqlens_k[:-1].long() + first,
                lens_k - first,
            )

        seg = _NEAR_SEGMENTS.get((x.cu_seqlens_q, x.cu_seqlens_k), (window,), near)
        return seg.attention(q[seg.rows_q], x.k[seg.rows_k], x.v[seg.rows_k], window, x.backend)
    blocks = _WINDOW_BLOCKS.get(
        (x.cu_seqlens_q,), (window,), lambda: WindowBlocks.of(x.cu_seqlens_q, window)
    )
    out, lse = varlen_attention(
        q,
        x.k,
        x.v,
        blocks.cu,
        blocks.cu,
        blocks.longest,
        blocks.longest,
        return_lse=True,
        backend="sdpa",
    )
    if blocks.rows_q is None:  # every sequence fits in one block
        return out, lse
    out_prev, lse_prev = varlen_attention(
        q[blocks.rows_q],
        x.k[blocks.rows_k],
        x.v[blocks.rows_k],
        blocks.cu_prev_q,
        blocks.cu_prev_k,
        blocks.longest_prev,
        window - 1,
        return_lse=True,
        backend="sdpa",
    )
    merge_into(out, lse, blocks.rows_q, out_prev, lse_prev)
    return out, lse


@dataclass
class WindowBlocks:
    """The mask-free split of causal windowed attention (`windowed_attention` on sdpa) over packed sequences:
    blocks of `window` positions, each over itself, and each block after the first over its predecessor."""

    cu: Tensor  # the blocks as sequences
    longest: int
    rows_q: (
        Tensor | None
    )  # the queries of the pass over the previous block, reversed within each block
    rows_k: (
        Tensor | None
    )  # that pass's keys, the previous block's last window - 1 reversed (None: no
    cu_prev_q: Tensor | None  # sequence has a second block, when max_seqlen overstates the longest)
    cu_prev_k: Tensor | None
    longest_prev: int

    @staticmethod
    def of(cu_seqlens: Tensor, window: int) -> "WindowBlocks":
        """The blocks [j * window, (j + 1) * window) of every sequence of cu_seqlens; they tile the packed rows."""
        device = cu_seqlens.device
        lens = seq_lengths(cu_seqlens)
        n_blocks = (lens + window - 1) // window
        seq = torch.repeat_interleave(torch.arange(len(lens), device=device), n_blocks)
        index = torch.arange(int(n_blocks.sum()), device=device) - torch.repeat_interleave(
            torch.cumsum(n_blocks, 0) - n_blocks, n_blocks
        )
        block_start = cu_seqlens[:-1].long()[seq] + index * window
        block_len = torch.minimum(lens[seq] - index * window, torch.full_like(block_start, window))
        # Block j > 0 over block j - 1: query i sees previous-block key r iff r > i. Reversing
        # both (u = window - 2 - i, key window - 1 - u') makes that causal over window - 1 keys; a
        # short last block of n queries is the last n rows of that triangle, which is bottom-right
        # causal with n queries (no padded rows: a 2-query tail costs 2 rows, not a whole block).
        later = index > 0
        if not bool(later.any()):
            return WindowBlocks(
                cu_seqlens_of(block_len), int(block_len.max()), None, None, None, None, 0
            )
        start, length = block_start[later], torch.clamp(block_len[later], max=window - 1)
        u = torch.arange(window - 1, device=device)
        i = (window - 2 - u)[None, :]
        return WindowBlocks(
            cu=cu_seqlens_of(block_len),
            longest=int(block_len.max()),
            # per block, the last `length` reversed rows in order
            rows_q=(start[:, None] + i)[i < length[:, None]],
            rows_k=(start[:, None] - 1 - u[None, :]).reshape(-1),
            cu_prev_q=cu_seqlens_of(length),
            cu_prev_k=torch.arange(
                0, (len(start) + 1) * (window - 1), window - 1, device=device, dtype=torch.int32
            ),
            longest_prev=int(length.max()),
        )


_WINDOW_BLOCKS = LayoutMemo()


def full_attention(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Attention of every query in q (Lq, H, D) over every key in k, v (Lk, Hkv, D), no mask; returns (out, lse).

    The sdpa backend's dense attention: the fused CPU kernel at inference, float32 scores otherwise.
    """
    out, lse = attend_dense(
        *(t.transpose(0, 1)[None] for t in (q, k, v)), None, False, True, q.shape[-1] ** -0.5
    )
    return out[0].transpose(0, 1), lse[0].transpose(0, 1)

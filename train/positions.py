"""Position schemes: which relative distance the rotary embedding sees for each (query, key).

What the model needs from a scheme is two methods: `rotate_keys` (keys are rotated, and
cached, at their true positions with the scheme's `rotary`: its frequencies and cos/sin scale)
and `attend` (the scheme's attention over packed sequences, given the un-rotated queries: it
decides how to rotate them, and over which keys, so that each (query m, key n <= m) pair of a
document sees the scheme's distance). The model never asks which scheme it runs. Every scheme
also has `distances(L)`, the reference (L, L) matrix of those distances. Schemes are built by
`build_scheme` on the model's `RotaryBase` (train/rotary.py): all but ntk and yarn keep the
model's own frequencies, rope_scaling included; ntk and yarn replace them, so they refuse a
model that carries a rope_scaling.

- ``rope``: m - n.
- ``string`` (STRING, An et al. 2024): m - n below the shift S, m - n - S + W at or beyond it.
- ``rerope`` (Su 2023): min(m - n, w).
- ``self_extend`` (Jin et al. 2024): m - n below the neighbour window W_n, grouped
  m // G - n // G + W_n - W_n // G beyond it.
- ``dca`` (dual chunk attention, An et al. 2024a): intra-chunk, successive-chunk and
  inter-chunk distances over chunks of the document.
- ``ntk`` and ``yarn``: m - n with rescaled RoPE frequencies (and YaRN's temperature).

The schemes that rewrite distances run as several causal attention passes over packed
sequences (`varlen_attention`), each with its own query rotation and key set, merged exactly
through their log-sum-exp, so every key is counted once per query. STRING's cached decoding
(new queries after a KV cache) instead runs in one pass per layer (`StringScheme.decode`):
both query rotations scored against slices of the cached keys, one softmax, one matmul with V.

The extrapolation baselines (ntk, yarn, rerope, self_extend, dca) take ``protocol``:
``"paper"`` (default) is the STRING paper's evaluation protocol, which treats the training
length as 2/3 of the true one and the extension factor as 3/2 so the methods act inside the
training window; ``"native"`` keeps the true training length and factor 1 (ntk, yarn and
self_extend then equal rope).
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from posfreq.train.attention import (
    cached_attention,
    needs_backward,
    resolve_backend,
    varlen_attention,
)
from posfreq.train.rotary import Rotary, RotaryBase, ntk_inv_freq, yarn_parameters

DENSE_BLOCK = 256
"""Query block of DCA's cross-chunk pass, computed densely (see `DualChunkScheme`)."""

STRING_TEMPERATURE = 1.0 + 0.1 * math.log(2.0)
"""The official STRING code multiplies RoPE's cos/sin by this (not in the paper)."""


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


@dataclass
class PositionScheme:
    """Base scheme = RoPE: every pair sees distance m - n (ntk and yarn too, with their own `rotary`)."""

    name: str = "rope"
    rotary: Rotary = field(default=None)  # type: ignore[assignment]
    options: dict = field(default_factory=dict)  # the resolved options, for logs and plots

    def rotate_keys(self, k: Tensor, positions: Tensor) -> Tensor:
        """Keys (T, Hkv, D) rotated at their true `positions`, as the model computes and caches them."""
        return self.rotary.rotate(k, positions)

    def pair_distance(self, m: np.ndarray, n: np.ndarray) -> np.ndarray:
        """Distance seen by query position m and key position n <= m (broadcasting arrays)."""
        return m - n

    def distances(self, length: int) -> np.ndarray:
        """Reference: the (length, length) matrix of relative distances seen (-1 above the diagonal)."""
        m = np.arange(length)[:, None]
        n = np.arange(length)[None, :]
        return np.where(n <= m, self.pair_distance(m, n), -1)

    def attend(self, x: AttentionInputs) -> Tensor:
        """Attention output (Tq, H, D) of the un-rotated queries over the rotated keys, each pair at the scheme's distance."""
        q = self.rotary.rotate(x.q, x.pos_q)
        cached = x.cached_kv
        if (
            cached is not None
        ):  # decoding reads the cache in place on every backend (packing it copies it all)
            k, v = cached
            return cached_attention(q.reshape(k.shape[0], -1, *q.shape[1:]), k, v).reshape(q.shape)
        return varlen_attention(
            q,
            x.k,
            x.v,
            x.cu_seqlens_q,
            x.cu_seqlens_k,
            x.max_seqlen_q,
            x.max_seqlen_k,
            backend=x.backend,
        )


# ----------------------------------------------------------------------------- packing helpers


def _lengths(cu: Tensor) -> Tensor:
    """Sequence lengths (int64) from cu_seqlens."""
    return (cu[1:] - cu[:-1]).long()


def _cu(lengths: Tensor) -> Tensor:
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
class _Segments:
    """Sub-sequences cut from packed queries and keys: rows to take and their varlen layout."""

    rows_q: Tensor | slice
    rows_k: Tensor | slice
    cu_q: Tensor
    cu_k: Tensor
    max_q: int
    max_k: int

    @staticmethod
    def of(
        starts_q: Tensor, lens_q: Tensor, starts_k: Tensor, lens_k: Tensor
    ) -> "_Segments | None":
        """Segments with lens_q[i] queries from starts_q[i] and lens_k[i] keys from starts_k[i]; None if empty."""
        keep = lens_q > 0
        if not bool(keep.any()):
            return None
        lens_q, lens_k = lens_q[keep], lens_k[keep]
        return _Segments(
            _ranges(starts_q[keep], lens_q),
            _ranges(starts_k[keep], lens_k),
            _cu(lens_q),
            _cu(lens_k),
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


def _merge_into(
    out: Tensor, lse: Tensor, rows: Tensor | slice, out_b: Tensor, lse_b: Tensor
) -> None:
    """Fold a second pass (out_b, lse_b) for `rows` into (out, lse) in place: exact softmax over both key sets."""
    lse_a = lse[rows]
    total = torch.logaddexp(lse_a, lse_b)
    weight_a = (
        torch.exp(lse_a - total).nan_to_num_(0.0).unsqueeze(-1)
    )  # nan only where both saw no key
    weight_b = torch.exp(lse_b - total).nan_to_num_(0.0).unsqueeze(-1)
    merged = (
        out[rows].float().mul_(weight_a).addcmul_(out_b.float(), weight_b)
    )  # in place for float32 slices
    if isinstance(rows, slice):
        if merged.dtype != out.dtype:
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
    lens_q, lens_k = _lengths(x.cu_seqlens_q), _lengths(x.cu_seqlens_k)
    blocked = (
        resolve_backend(
            x.backend, q.device, q.dtype, return_lse=True, backward=needs_backward(q, x.keys)
        )
        == "sdpa"
        and x.max_seqlen_q > window > 1
        and torch.equal(lens_q, lens_k)
    )
    if not blocked:  # only the last Lq + window - 1 keys of each sequence are within reach
        first = (lens_k - lens_q - window + 1).clamp_min(0)
        seg = _Segments.of(
            x.cu_seqlens_q[:-1].long(), lens_q, x.cu_seqlens_k[:-1].long() + first, lens_k - first
        )
        return seg.attention(q[seg.rows_q], x.k[seg.rows_k], x.v[seg.rows_k], window, x.backend)
    # Blocks [j * window, (j + 1) * window) of every sequence; they tile the packed rows.
    n_blocks = (lens_q + window - 1) // window
    seq = torch.repeat_interleave(torch.arange(len(lens_q), device=q.device), n_blocks)
    index = torch.arange(int(n_blocks.sum()), device=q.device) - torch.repeat_interleave(
        torch.cumsum(n_blocks, 0) - n_blocks, n_blocks
    )
    block_start = x.cu_seqlens_q[:-1].long()[seq] + index * window
    block_len = torch.minimum(lens_q[seq] - index * window, torch.full_like(block_start, window))
    cu = _cu(block_len)
    out, lse = varlen_attention(
        q,
        x.k,
        x.v,
        cu,
        cu,
        int(block_len.max()),
        int(block_len.max()),
        return_lse=True,
        backend="sdpa",
    )
    # Block j > 0 over block j - 1: query i sees previous-block key r iff r > i. Reversing
    # both (u = window - 2 - i, key window - 1 - u') makes that causal over window - 1 keys; a
    # short last block of n queries is the last n rows of that triangle, which is bottom-right
    # causal with n queries (no padded rows: a 2-query tail costs 2 rows, not a whole block).
    later = index > 0
    start, length = block_start[later], torch.clamp(block_len[later], max=window - 1)
    u = torch.arange(window - 1, device=q.device)
    i = (window - 2 - u)[None, :]
    rows_q = (start[:, None] + i)[
        i < length[:, None]
    ]  # per block, the last `length` reversed rows in order
    rows_k = (start[:, None] - 1 - u[None, :]).reshape(-1)
    cu_k = torch.arange(
        0, (len(start) + 1) * (window - 1), window - 1, device=q.device, dtype=torch.int32
    )
    out_prev, lse_prev = varlen_attention(
        q[rows_q],
        x.k[rows_k],
        x.v[rows_k],
        _cu(length),
        cu_k,
        int(length.max()),
        window - 1,
        return_lse=True,
        backend="sdpa",
    )
    _merge_into(out, lse, rows_q, out_prev, lse_prev)
    return out, lse


# ----------------------------------------------------------------------------- two-pass schemes


@dataclass
class SplitScheme(PositionScheme):
    """RoPE for distances below `split`; a rewritten distance for distances >= split.

    Near pass: sliding-window attention (window = split) with ordinary query rotation. Far
    pass: the last min(Lq, Lk - split) queries of each sequence attend causally (bottom-right)
    to its first Lk - split keys, which are exactly the keys at distance >= split, with queries
    rotated at `far_query_positions` and keys optionally re-rotated by `far_key_shift`. The
    two are merged by their log-sum-exp, so each key is counted once.
    """

    split: int = 1

    def far_distance(self, m: np.ndarray, n: np.ndarray) -> np.ndarray:
        """Distance seen by query m and key n at m - n >= split (broadcasting arrays)."""
        raise NotImplementedError

    def far_query_positions(self, pos_q: Tensor) -> Tensor:
        """Positions the far pass rotates the queries at (against keys at their cached rotation, or shifted)."""
        raise NotImplementedError

    def far_key_shift(self, pos_k: Tensor) -> Tensor | None:
        """Extra rotation of the far keys (None: they keep their cached rotation)."""
        return None

    def pair_distance(self, m: np.ndarray, n: np.ndarray) -> np.ndarray:
        return np.where(m - n < self.split, m - n, self.far_distance(m, n))

    def attend(self, x: AttentionInputs) -> Tensor:
        if x.max_seqlen_k <= self.split:  # no pair reaches the split: plain RoPE, same code path
            return super().attend(x)
        out, lse = windowed_attention(self.rotary.rotate(x.q, x.pos_q), x, self.split)
        lens_q, lens_k = _lengths(x.cu_seqlens_q), _lengths(x.cu_seqlens_k)
        far_k = (lens_k - self.split).clamp_min(0)
        far_q = torch.minimum(lens_q, far_k)
        seg = _Segments.of(
            x.cu_seqlens_q[1:].long() - far_q, far_q, x.cu_seqlens_k[:-1].long(), far_k
        )
        if seg is None:
            return out
        q = self.rotary.rotate(x.q[seg.rows_q], self.far_query_positions(x.pos_q[seg.rows_q]))
        k = x.k[seg.rows_k]
        shift = self.far_key_shift(x.pos_k[seg.rows_k])
        if shift is not None:
            k = self.rotary.rerotate(k, shift)
        out_far, lse_far = seg.attention(q, k, x.v[seg.rows_k], None, x.backend)
        _merge_into(out, lse, seg.rows_q, out_far, lse_far)
        return out


@dataclass
class StringScheme(SplitScheme):
    """STRING: m - n below the shift S, m - n - S + W from S on (Eq. 4); split = S.

    Far queries are rotated at m - S + W against keys at their true positions (Algorithm 1),
    so the W nearest keys keep distances 0..W-1 and shifted distances start at W.
    """

    window: int = 0

    def far_distance(self, m: np.ndarray, n: np.ndarray) -> np.ndarray:
        return m - n - self.split + self.window

    def far_query_positions(self, pos_q: Tensor) -> Tensor:
        return pos_q - self.split + self.window

    def attend(self, x: AttentionInputs) -> Tensor:
        shape = _decode_shape(x)
        if shape is not None and x.max_seqlen_k > self.split:
            batch, _, len_k = shape
            k, v = x.cached_kv or (
                x.k.reshape(batch, len_k, *x.k.shape[1:]),
                x.v.reshape(batch, len_k, *x.v.shape[1:]),
            )
            return self.decode(x.q, k, v, x.pos_q, *shape)
        return super().attend(x)

    def decode(
        self, q: Tensor, k: Tensor, v: Tensor, pos_q: Tensor, batch: int, len_q: int, len_k: int
    ) -> Tensor:
        """Cached decoding in one pass: `batch` sequences, each with its last len_q queries over len_k keys.

        q: (batch * len_q, H, D) un-rotated, at positions pos_q; k, v: (batch, len_k, Hkv, D),
        k rotated at true positions (views of the KV cache). As in `SplitScheme.attend`, query i sits
        at m = len_k - len_q + i (bottom-right) and scores key n <= m with its ordinary rotation
        when m - n < S and with its shifted one (at m - S + W, Algorithm 1) when m - n >= S: the
        key at distance exactly S is far (distance W), each key counted once. The far keys of
        query m are the prefix n <= m - S and its near keys the suffix, so each rotation is one
        matmul against a slice of the cached keys (no re-rotation, no copy). For a chunk
        the n - 1 keys that are far for some queries and near for others are scored both ways
        and picked per query. Both score blocks form one row: one softmax (float32), one matmul
        with V. Queries go in blocks of DECODE_BLOCK, bounding the (H, block, len_k) scores.
        """
        heads, dim = q.shape[1], q.shape[2]
        kv_heads = k.shape[2]
        groups = heads // kv_heads
        split = self.split
        keys = k.transpose(1, 2)  # (B, Hkv, Lk, D), a view of the cache
        values = v.transpose(1, 2)
        queries = q.view(batch, len_q, heads, dim)
        positions = pos_q.view(batch, len_q)
        outs = []
        for b0 in range(0, len_q, DECODE_BLOCK):
            n = min(DECODE_BLOCK, len_q - b0)
            first = len_k - len_q + b0  # the block's first query
            reach = first + n  # keys [0, reach) are visible to some query of the block
            far_end = max(0, reach - split)  # keys [0, far_end) are far for some query (n <= m - S)
            near_start = max(
                0, first - split + 1
            )  # keys [near_start, reach) are near for some query
            block = queries[:, b0 : b0 + n].reshape(batch * n, heads, dim)
            pos = positions[:, b0 : b0 + n].reshape(-1)
            both = self.rotary.rotate(
                torch.cat((block, block)), torch.cat((pos, pos - (split - self.window)))
            )
            # (2, B, n, Hkv, G, D) -> (2, B, Hkv, G * n, D): rows of one KV head ordered (group, query)
            both = both.mul_(1.0 / math.sqrt(dim)).view(2, batch, n, kv_heads, groups, dim)
            both = both.permute(0, 1, 3, 4, 2, 5).reshape(2, batch, kv_heads, groups * n, dim)
            near = torch.matmul(both[0], keys[:, :, near_start:reach].transpose(-1, -2))
            if (
                n > 1
            ):  # a chunk: mask the keys after each query; the overlap takes each query's rotation
                cols = torch.arange(near_start, reach, device=q.device)
                dist = (
                    torch.arange(first, reach, device=q.device)[:, None] - cols[None, :]
                )  # (n, reach - near_start)
                near5 = near.view(batch, kv_heads, groups, n, -1)
                near5.masked_fill_(dist < 0, -math.inf)
            if far_end == 0:
                scores = near
            else:
                far = torch.matmul(both[1], keys[:, :, :far_end].transpose(-1, -2))
                overlap = (
                    far_end - near_start
                )  # n - 1 columns for a chunk away from the start; none for one query
                if overlap > 0:
                    far5 = far.view(batch, kv_heads, groups, n, -1)[..., near_start:]
                    near5[..., :overlap] = torch.where(
                        dist[:, :overlap] >= split, far5, near5[..., :overlap]
                    )
                    far = far[..., :near_start]
                scores = torch.cat((far, near), dim=-1)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
            o = torch.matmul(probs, values[:, :, :reach])  # (B, Hkv, G * n, D)
            outs.append(o.view(batch, kv_heads, groups, n, dim).permute(0, 3, 1, 2, 4))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        return out.reshape(q.shape)


DECODE_BLOCK = 64
"""Query block of STRING's one-pass cached decoding (see `StringScheme.decode`)."""


def _decode_shape(x: AttentionInputs) -> tuple[int, int, int] | None:
    """(batch, len_q, len_k) when x is cached decoding of equal sequences (len_q < len_k each), else None."""
    batch = x.cu_seqlens_q.numel() - 1
    len_q, len_k = x.max_seqlen_q, x.max_seqlen_k
    if len_q >= len_k or x.q.shape[0] != batch * len_q or x.total_k != batch * len_k:
        return None  # equal lengths follow from the totals: each sequence has at most max_seqlen
    return batch, len_q, len_k


@dataclass
class ReRoPEScheme(SplitScheme):
    """ReRoPE: min(m - n, w); split = w. Far queries sit at w, far keys are rotated back to 0."""

    def far_distance(self, m: np.ndarray, n: np.ndarray) -> np.ndarray:
        return np.full(np.broadcast(m, n).shape, self.split)

    def far_query_positions(self, pos_q: Tensor) -> Tensor:
        return torch.full_like(pos_q, self.split)

    def far_key_shift(self, pos_k: Tensor) -> Tensor:
        return -pos_k


@dataclass
class SelfExtendScheme(SplitScheme):
    """Self-Extend: m - n below the neighbour window W_n (= split), else m//G - n//G + W_n - W_n//G.

    As in the official code: grouped queries at m // G + W_n - W_n // G, grouped keys at n // G
    (cached keys are re-rotated by n // G - n).
    """

    group: int = 1

    def far_distance(self, m: np.ndarray, n: np.ndarray) -> np.ndarray:
        return m // self.group - n // self.group + self.split - self.split // self.group

    def far_query_positions(self, pos_q: Tensor) -> Tensor:
        return pos_q // self.group + self.split - self.split // self.group

    def far_key_shift(self, pos_k: Tensor) -> Tensor:
        return pos_k // self.group - pos_k


# ----------------------------------------------------------------------------- dual chunk attention


def _dense_attention(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor) -> tuple[Tensor, Tensor]:
    """Non-causal float32 attention of q (Lq, H, D) over k, v (Lk, Hkv, D) with a boolean (Lq, Lk) mask; returns (out, lse)."""
    hkv, groups = k.shape[1], q.shape[1] // k.shape[1]
    with torch.autocast(
        q.device.type, enabled=False
    ):  # float32 means float32 under the probe's bf16 autocast too
        qg = q.float().view(q.shape[0], hkv, groups, q.shape[2])
        scores = torch.einsum("qhgd,khd->qhgk", qg, k.float()) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(~allowed[:, None, None, :], -math.inf)
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
        out = torch.einsum("qhgk,khd->qhgd", probs, v.float())
    return out.reshape(q.shape).to(q.dtype), lse.reshape(q.shape[:2])


@dataclass
class DualChunkScheme(PositionScheme):
    """DCA (ChunkLlama's official formulation): chunks of c = chunk_size - local_window positions.

    Keys sit at n mod c. Same chunk: m - n. Key in the previous chunk: min(m mod c + c,
    chunk_size) - n mod c. Older chunks: min(2c - 1, chunk_size) - n mod c.

    Intra-chunk pass: causal varlen attention with each chunk as its own sequence (queries and
    keys at true positions). Cross-chunk pass (successive + inter): every query sees its whole
    previous chunk and all older ones, which is not causal, and `varlen_attention` is causal
    only; so this pass is computed densely in float32, in query blocks of DENSE_BLOCK, then
    merged by log-sum-exp like the other passes.
    """

    chunk_size: int = 1
    local_window: int = 0

    @property
    def chunk_len(self) -> int:
        """c = chunk_size - local_window: the positions one chunk covers."""
        return self.chunk_size - self.local_window

    def pair_distance(self, m: np.ndarray, n: np.ndarray) -> np.ndarray:
        c = self.chunk_len
        succ = np.minimum(m % c + c, self.chunk_size) - n % c
        inter = min(2 * c - 1, self.chunk_size) - n % c
        return np.where(m // c == n // c, m - n, np.where(m // c == n // c + 1, succ, inter))

    def attend(self, x: AttentionInputs) -> Tensor:
        c = self.chunk_len
        if x.max_seqlen_k <= c:
            return super().attend(x)
        q_rot = self.rotary.rotate(x.q, x.pos_q)
        out = q_rot.new_empty(q_rot.shape)
        lse = q_rot.new_empty(q_rot.shape[:2], dtype=torch.float32)
        lens_q, lens_k = _lengths(x.cu_seqlens_q), _lengths(x.cu_seqlens_k)
        starts_q, starts_k = x.cu_seqlens_q[:-1].long(), x.cu_seqlens_k[:-1].long()
        for chunk_start in range(0, x.max_seqlen_k, c):
            first_q = torch.maximum(lens_k - lens_q, torch.full_like(lens_k, chunk_start))
            end = lens_k.clamp(max=chunk_start + c)
            n_q = (end - first_q).clamp_min(0)
            seg = _Segments.of(
                starts_q + first_q - (lens_k - lens_q),
                n_q,
                starts_k + chunk_start,
                (end - chunk_start).clamp_min(0),
            )
            if seg is None:
                continue
            o, s = seg.attention(
                q_rot[seg.rows_q], x.k[seg.rows_k], x.v[seg.rows_k], None, x.backend
            )
            out[seg.rows_q], lse[seg.rows_q] = o, s
        self._cross_chunks(x, out, lse)
        return out

    def _cross_chunks(self, x: AttentionInputs, out: Tensor, lse: Tensor) -> None:
        """Successive- and inter-chunk attention, folded into (out, lse) in place."""
        c, size = self.chunk_len, self.chunk_size
        bounds = zip(
            x.cu_seqlens_q[:-1].tolist(),
            x.cu_seqlens_q[1:].tolist(),
            x.cu_seqlens_k[:-1].tolist(),
            x.cu_seqlens_k[1:].tolist(),
        )
        for q0, q1, k0, k1 in bounds:
            pos_q, pos_k = x.pos_q[q0:q1], x.pos_k[k0:k1]
            if q1 == q0 or int(pos_q.max()) < c:
                continue
            k_mod = self.rotary.rerotate(x.k[k0:k1], pos_k % c - pos_k)  # keys at n mod c
            for b0 in range(0, q1 - q0, DENSE_BLOCK):
                pos = pos_q[b0 : b0 + DENSE_BLOCK]
                reach = int(pos.max()) // c * c  # keys before the last query's chunk
                if reach == 0:
                    continue
                rows = slice(q0 + b0, q0 + b0 + pos.numel())
                k, v = k_mod[:reach], x.v[k0 : k0 + reach]
                q_chunk, k_chunk = (pos // c)[:, None], (pos_k[:reach] // c)[None, :]
                succ = self.rotary.rotate(x.q[rows], torch.clamp(pos % c + c, max=size))
                inter = self.rotary.rotate(x.q[rows], torch.full_like(pos, min(2 * c - 1, size)))
                o_s, l_s = _dense_attention(succ, k, v, k_chunk == q_chunk - 1)
                o_i, l_i = _dense_attention(inter, k, v, k_chunk < q_chunk - 1)
                _merge_into(o_s, l_s, slice(None), o_i, l_i)
                _merge_into(out, lse, rows, o_s, l_s)


# ----------------------------------------------------------------------------- construction


PROTOCOLS = ("paper", "native")


def extrapolation_setting(train_len: int, protocol: str, scale: float | None) -> tuple[int, float]:
    """(training length the method assumes, extension factor) under an evaluation protocol.

    "paper": 2/3 of the true training length and factor 3/2 (the STRING paper's baselines),
    so the test length equals the true training length. "native": the true length, factor 1.
    An explicit `scale` overrides the factor in both.
    """
    if protocol == "paper":
        return round(2 * train_len / 3), 1.5 if scale is None else scale
    if protocol == "native":
        return train_len, 1.0 if scale is None else scale
    raise ValueError(f"unknown protocol {protocol!r}; choose one of {PROTOCOLS}")


def _check(condition: bool, message: str) -> None:
    """Refuse an option value with `message` unless `condition` holds."""
    if not condition:
        raise ValueError(message)


def _own_frequencies(name: str, rope: RotaryBase) -> None:
    """Refuse a scheme that replaces RoPE's frequencies on a model whose frequencies carry a rope_scaling."""
    _check(
        not rope.scaled,
        f"{name} replaces RoPE's frequencies; it cannot be combined with this model's "
        f"rope_scaling {rope.scaling}",
    )


def _string(
    rope: RotaryBase,
    train_len: int,
    shift: int | None = None,
    window: int | None = None,
    temperature: bool = False,
) -> PositionScheme:
    """STRING over the model's frequencies; shift S = L // 3, window W = min(128, S // 2) by default."""
    shift = train_len // 3 if shift is None else int(shift)
    window = min(128, shift // 2) if window is None else int(window)
    _check(shift >= 1, f"string: shift must be >= 1, got {shift}")
    _check(
        0 <= window < shift, f"string: need 0 <= window < shift, got window={window}, shift={shift}"
    )
    scale = STRING_TEMPERATURE if temperature else 1.0
    options = dict(shift=shift, window=window, temperature=bool(temperature))
    return StringScheme(
        "string", Rotary(rope.inv_freq(), scale), options, split=shift, window=window
    )


def _rerope(
    rope: RotaryBase, train_len: int, window: int | None = None, protocol: str = "paper"
) -> PositionScheme:
    """ReRoPE over the model's frequencies; window min(512, L' // 4) by default."""
    length, _ = extrapolation_setting(train_len, protocol, None)
    window = min(512, length // 4) if window is None else int(window)
    _check(window >= 1, f"rerope: window must be >= 1, got {window}")
    options = dict(window=window, protocol=protocol)
    return ReRoPEScheme("rerope", rope.rotary(), options, split=window)


def _self_extend(
    rope: RotaryBase,
    train_len: int,
    group: int | None = None,
    window: int | None = None,
    protocol: str = "paper",
    scale: float | None = None,
) -> PositionScheme:
    """Self-Extend over the model's frequencies; window min(512, L' // 4), the smallest group that fits."""
    length, factor = extrapolation_setting(train_len, protocol, scale)
    window = min(512, length // 4) if window is None else int(window)
    _check(1 <= window < length, f"self_extend: need 1 <= window < {length}, got {window}")
    # Smallest group keeping every distance of a factor * length input below the assumed length.
    group = (
        max(1, math.ceil((factor * length - window) / (length - window)))
        if group is None
        else int(group)
    )
    _check(group >= 1, f"self_extend: group must be >= 1, got {group}")
    options = dict(group=group, window=window, protocol=protocol, scale=factor)
    return SelfExtendScheme("self_extend", rope.rotary(), options, split=window, group=group)


def _dca(
    rope: RotaryBase,
    train_len: int,
    chunk_size: int | None = None,
    local_window: int | None = None,
    protocol: str = "paper",
) -> PositionScheme:
    """Dual chunk attention over the model's frequencies; chunk_size 3L' // 4, local_window L' // 16 by default."""
    length, _ = extrapolation_setting(train_len, protocol, None)
    chunk_size = length * 3 // 4 if chunk_size is None else int(chunk_size)
    local_window = length // 16 if local_window is None else int(local_window)
    _check(
        0 <= local_window < chunk_size,
        f"dca: need 0 <= local_window < chunk_size, got {local_window}, {chunk_size}",
    )
    options = dict(chunk_size=chunk_size, local_window=local_window, protocol=protocol)
    return DualChunkScheme(
        "dca", rope.rotary(), options, chunk_size=chunk_size, local_window=local_window
    )


def _ntk(
    rope: RotaryBase, train_len: int, scale: float | None = None, protocol: str = "paper"
) -> PositionScheme:
    """RoPE distances with NTK-aware frequencies in place of the model's."""
    _own_frequencies("ntk", rope)
    _, factor = extrapolation_setting(train_len, protocol, scale)
    _check(factor >= 1, f"ntk: scale must be >= 1, got {factor}")
    inv_freq = ntk_inv_freq(rope.head_dim, rope.base, factor)
    return PositionScheme("ntk", Rotary(inv_freq), dict(scale=factor, protocol=protocol))


def _yarn(
    rope: RotaryBase,
    train_len: int,
    scale: float | None = None,
    protocol: str = "paper",
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
) -> PositionScheme:
    """RoPE distances with YaRN's frequencies and attention temperature in place of the model's."""
    _own_frequencies("yarn", rope)
    length, factor = extrapolation_setting(train_len, protocol, scale)
    _check(factor >= 1, f"yarn: scale must be >= 1, got {factor}")
    inv_freq, attention_factor = yarn_parameters(
        rope.head_dim, rope.base, factor, length, beta_fast, beta_slow
    )
    options = dict(
        scale=factor,
        original_len=length,
        beta_fast=beta_fast,
        beta_slow=beta_slow,
        protocol=protocol,
    )
    return PositionScheme("yarn", Rotary(inv_freq, attention_factor), options)


def _rope(rope: RotaryBase, train_len: int) -> PositionScheme:
    """Plain RoPE with the model's own frequencies."""
    return PositionScheme("rope", rope.rotary())


_BUILDERS = {
    "rope": _rope,
    "string": _string,
    "rerope": _rerope,
    "self_extend": _self_extend,
    "dca": _dca,
    "ntk": _ntk,
    "yarn": _yarn,
}

SCHEMES = tuple(_BUILDERS)
SINGLE_PASS_SCHEMES = ("rope", "ntk", "yarn")
"""Schemes whose attention is one causal pass; the others merge passes by their log-sum-exp."""


def build_scheme(name: str, rope: RotaryBase, train_len: int, **options) -> PositionScheme:
    """A position scheme by name with its options, on the model's rotary base; `train_len` (L) sets the defaults.

    rope: none. string: shift=L//3, window=min(128, shift//2), temperature=False.
    rerope: window=min(512, L'//4). self_extend: window=min(512, L'//4), group=smallest keeping
    distances of a scale*L' input below L', scale. dca: chunk_size=3L'//4, local_window=L'//16.
    ntk: scale. yarn: scale, beta_fast=32, beta_slow=1. The baselines also take protocol=
    "paper" (default: L' = 2L/3, scale 3/2) or "native" (L' = L, scale 1). ntk and yarn replace
    the model's frequencies, so they refuse a model whose `rope` carries a rope_scaling.
    """
    if name not in _BUILDERS:
        raise ValueError(f"unknown position scheme {name!r}; choose one of {SCHEMES}")
    builder = _BUILDERS[name]
    allowed = list(inspect.signature(builder).parameters)[2:]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"{name} does not take {unknown}; its options are {allowed}")
    return builder(rope, train_len, **options)

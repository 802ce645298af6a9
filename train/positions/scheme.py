"""The position-scheme API: `PositionScheme` (RoPE) and the two-pass `SplitScheme`s ReRoPE and Self-Extend.

A scheme rotates keys at their true positions (`rotate_keys`) and runs its own attention
(`attend`); `distances(L)` is the reference matrix of the distances it shows the rotary.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import ClassVar

import numpy as np
import torch
from torch import Tensor

from posfreq.train.model.attention import LayoutMemo, cached_attention, varlen_attention
from posfreq.train.positions.merge import (
    AttentionInputs,
    Segments,
    merge_into,
    seq_lengths,
    windowed_attention,
)
from posfreq.train.positions.rotary import Rotary


@dataclass
class PositionScheme:
    """Base scheme = RoPE: every pair sees distance m - n (ntk and yarn too, with their own `rotary`)."""

    name: str = "rope"
    rotary: Rotary = field(default=None)  # type: ignore[assignment]
    options: dict = field(default_factory=dict)  # the resolved options, for logs and plots
    single_pass: ClassVar[bool] = True
    """Attention is one causal pass; False: passes merged by their log-sum-exp (a backend must return it)."""

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


_FAR_SEGMENTS = LayoutMemo()
"""The far pass's segments, a function of cu_seqlens and the split alone: shared by every layer's scheme (the
transformers adapter makes one per attention module)."""

_FAR_POSITIONS = LayoutMemo()
"""The far queries' rotation positions, one tensor per forward: the rotary's cos/sin memo knows a positions
tensor by identity, so every layer after the first reuses the cos/sin computed at them."""

_FAR_KEY_SHIFTS = LayoutMemo()
"""Likewise the far keys' extra rotation (ReRoPE, Self-Extend), one tensor per forward."""


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
    single_pass: ClassVar[bool] = False  # a near and a far pass

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

    def _scalar_settings(self) -> tuple:
        """The scheme's number fields (split, window, group, ...): what its far positions depend on."""
        values = (getattr(self, f.name) for f in fields(self))
        return tuple(v for v in values if isinstance(v, (int, float, np.integer, np.floating)))

    def attend(self, x: AttentionInputs) -> Tensor:
        if x.max_seqlen_k <= self.split:  # no pair reaches the split: plain RoPE, same code path
            return super().attend(x)
        out, lse = windowed_attention(self.rotary.rotate(x.q, x.pos_q), x, self.split)

        def far() -> Segments | None:
            lens_q, lens_k = seq_lengths(x.cu_seqlens_q), seq_lengths(x.cu_seqlens_k)
            far_k = (lens_k - self.split).clamp_min(0)
            far_q = torch.minimum(lens_q, far_k)
            return Segments.of(
                x.cu_seqlens_q[1:].long() - far_q, far_q, x.cu_seqlens_k[:-1].long(), far_k
            )

        seg = _FAR_SEGMENTS.get((x.cu_seqlens_q, x.cu_seqlens_k), (self.split,), far)
        if seg is None:
            return out
        far_positions = _FAR_POSITIONS.get(
            (x.pos_q, x.cu_seqlens_q, x.cu_seqlens_k),
            (type(self), *self._scalar_settings()),
            lambda: self.far_query_positions(x.pos_q[seg.rows_q]),
        )
        q = self.rotary.rotate(x.q[seg.rows_q], far_positions)
        k = x.k[seg.rows_k]
        shift = _FAR_KEY_SHIFTS.get(
            (x.pos_k, x.cu_seqlens_q, x.cu_seqlens_k),
            (type(self), *self._scalar_settings()),
            lambda: self.far_key_shift(x.pos_k[seg.rows_k]),
        )
        if shift is not None:
            k = self.rotary.rerotate(k, shift)
        out_far, lse_far = seg.attention(q, k, x.v[seg.rows_k], None, x.backend)
        merge_into(out, lse, seg.rows_q, out_far, lse_far)
        return out


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

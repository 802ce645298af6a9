"""STRING (An et al. 2024): the split scheme with shifted far distances, and its one-pass cached decoding."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from posfreq.train.model.attention import LayoutMemo
from posfreq.train.positions.merge import AttentionInputs
from posfreq.train.positions.scheme import SplitScheme

STRING_TEMPERATURE = 1.0 + 0.1 * math.log(2.0)
"""The official STRING code multiplies RoPE's cos/sin by this (not in the paper)."""


def string_shift_window(
    train_len: int, shift: int | None = None, window: int | None = None
) -> tuple[int, int]:
    """STRING's (S, W): S = L // 3 and W = min(128, S // 2) unless given; raises ValueError unless 0 <= W < S."""
    shift = train_len // 3 if shift is None else int(shift)
    window = min(128, shift // 2) if window is None else int(window)
    if shift < 1:
        raise ValueError(f"string: shift must be >= 1, got {shift}")
    if not 0 <= window < shift:
        raise ValueError(f"string: need 0 <= window < shift, got window={window}, shift={shift}")
    return shift, window


def shift_from_effective_length(train_len: int, effective: int) -> int | None:
    """STRING's S from the model's own effective length E, measured at its training length L: S = min(L - E, L // 2).

    Why: STRING keeps a distance d < S and shows d >= S as d - S + W, so the largest distance an L-token input
    shows the model is max(S - 1, L - 1 - S + W) (`largest_distance_shown`). S = L - E brings it to E - 1 + W: every
    distance shown is one of the E the probe found the model to use (plus the window W), and E = 2L/3 gives the
    paper's S = L / 3. When E < L / 2 no S keeps every distance below E; the largest distance shown is then
    smallest near S = L / 2 (about L / 2 + W), while the former S = E showed distances up to L - E + W. None when E
    says nothing to base S on: 0 (no length passed) or L and above (the probe found no shortfall; its value is a
    lower bound)."""
    if effective <= 0 or effective >= train_len:
        return None
    return max(2, min(train_len - effective, train_len // 2))


def largest_distance_shown(train_len: int, shift: int, window: int) -> int:
    """The largest distance STRING with (S, W) shows the model over an input of `train_len` tokens."""
    last = train_len - 1
    return last if last < shift else max(shift - 1, last - shift + window)


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

    def _near_and_far(self, positions: Tensor) -> Tensor:
        """The queries' positions, then their far pass's (shifted by S - W), as one flat tensor."""
        flat = positions.reshape(-1)
        return torch.cat((flat, flat - (self.split - self.window)))

    def decode(
        self, q: Tensor, k: Tensor, v: Tensor, pos_q: Tensor, batch: int, len_q: int, len_k: int
    ) -> Tensor:
        """Cached decoding in one pass: the last len_q queries of `batch` sequences over len_k cached keys.

        Each query is rotated both ways and scored against the far prefix and the near suffix of
        the cache (no re-rotation, no copy); one softmax, one matmul with V, in DECODE_BLOCK queries.
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
            # the block's positions, then shifted: one tensor per forward, so that every layer after the first
            # finds the rotary's cos/sin for it
            both_positions = _DECODE_POSITIONS.get(
                (pos_q,),
                (b0, n, batch, split, self.window),
                functools.partial(self._near_and_far, positions[:, b0 : b0 + n]),
            )
            both = self.rotary.rotate(torch.cat((block, block)), both_positions)
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

_DECODE_POSITIONS = LayoutMemo()


def _decode_shape(x: AttentionInputs) -> tuple[int, int, int] | None:
    """(batch, len_q, len_k) when x is cached decoding of equal sequences (len_q < len_k each), else None."""
    batch = x.cu_seqlens_q.numel() - 1
    len_q, len_k = x.max_seqlen_q, x.max_seqlen_k
    if len_q >= len_k or x.q.shape[0] != batch * len_q or x.total_k != batch * len_k:
        return None  # equal lengths follow from the totals: each sequence has at most max_seqlen
    return batch, len_q, len_k

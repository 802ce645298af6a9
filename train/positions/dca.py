"""Dual chunk attention (DCA, An et al. 2024a): intra-, successive- and inter-chunk distances."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from torch import Tensor

from posfreq.train.positions.merge import (
    AttentionInputs,
    Segments,
    full_attention,
    merge_into,
    seq_lengths,
)
from posfreq.train.positions.scheme import PositionScheme

DENSE_BLOCK = 256
"""Queries per call of DCA's cross-chunk passes (see `DualChunkScheme`): bounds the scores a
non-fused kernel holds at once."""


@dataclass
class DualChunkScheme(PositionScheme):
    """DCA (ChunkLlama's official formulation): chunks of c = chunk_size - local_window positions.

    Keys sit at n mod c. Same chunk: m - n. Key in the previous chunk: min(m mod c + c,
    chunk_size) - n mod c. Older chunks: min(2c - 1, chunk_size) - n mod c.

    Intra-chunk pass: causal varlen attention with each chunk as its own sequence (queries and
    keys at true positions). Cross-chunk passes (successive, inter): every query sees its whole
    previous chunk and all older ones, which is not causal, and `varlen_attention` is causal
    only; so these are full attentions (`full_attention`) of each chunk's queries over one slice
    of keys, merged by log-sum-exp like the intra-chunk pass.
    """

    chunk_size: int = 1
    local_window: int = 0
    single_pass: ClassVar[bool] = False  # intra-chunk and cross-chunk passes

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
        lens_q, lens_k = seq_lengths(x.cu_seqlens_q), seq_lengths(x.cu_seqlens_k)
        starts_q, starts_k = x.cu_seqlens_q[:-1].long(), x.cu_seqlens_k[:-1].long()
        for chunk_start in range(0, x.max_seqlen_k, c):
            first_q = torch.maximum(lens_k - lens_q, torch.full_like(lens_k, chunk_start))
            end = lens_k.clamp(max=chunk_start + c)
            n_q = (end - first_q).clamp_min(0)
            seg = Segments.of(
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
        """Successive- and inter-chunk attention, folded into (out, lse) in place.

        Queries (the last ones of each sequence, keys from position 0) go chunk by chunk, in
        blocks of DENSE_BLOCK: a query in chunk j sees every key of chunk j - 1 (successive) and
        every key before it (inter), so each pass is a full attention over one slice of keys.
        """
        c, size = self.chunk_len, self.chunk_size
        bounds = zip(
            x.cu_seqlens_q[:-1].tolist(),
            x.cu_seqlens_q[1:].tolist(),
            x.cu_seqlens_k[:-1].tolist(),
            x.cu_seqlens_k[1:].tolist(),
        )
        for q0, q1, k0, k1 in bounds:
            first, end = k1 - k0 - (q1 - q0), k1 - k0  # the queries' positions: [first, end)
            if q1 == q0 or end <= c:
                continue
            # the passes read keys before the last query's chunk only, rotated to n mod c
            read = k0 + (end - 1) // c * c
            pos_k = x.pos_k[k0:read]
            k_mod = self.rotary.rerotate(x.k[k0:read], pos_k % c - pos_k)
            v = x.v[k0:read]
            for chunk in range(max(first // c, 1), (end - 1) // c + 1):
                prev = slice((chunk - 1) * c, chunk * c)
                for b0 in range(max(chunk * c, first), min(chunk * c + c, end), DENSE_BLOCK):
                    b1 = min(b0 + DENSE_BLOCK, chunk * c + c, end)
                    rows = slice(q0 + b0 - first, q0 + b1 - first)
                    pos = x.pos_q[rows]
                    succ = self.rotary.rotate(x.q[rows], torch.clamp(pos % c + c, max=size))
                    o, s = full_attention(succ, k_mod[prev], v[prev])
                    if torch.is_grad_enabled():  # views backward needs: merged into below, in place
                        o, s = o.clone(), s.clone()
                    if chunk > 1:
                        inter = self.rotary.rotate(
                            x.q[rows], torch.full_like(pos, min(2 * c - 1, size))
                        )
                        o_i, s_i = full_attention(inter, k_mod[: prev.start], v[: prev.start])
                        merge_into(o, s, slice(None), o_i, s_i)
                    merge_into(out, lse, rows, o, s)

"""Dual chunk attention (DCA, An et al. 2024a): intra-, successive- and inter-chunk distances."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from posfreq.train.positions.merge import (
    AttentionInputs,
    Segments,
    dense_attention,
    merge_into,
    seq_lengths,
)
from posfreq.train.positions.scheme import PositionScheme

DENSE_BLOCK = 256
"""Query block of DCA's cross-chunk pass, computed densely (see `DualChunkScheme`)."""


@dataclass
class DualChunkScheme(PositionScheme):
    """DCA (ChunkLlama's official formulation): chunks of c = chunk_size - local_window positions.

    Keys sit at n mod c. Same chunk: m - n. Key in the previous chunk: min(m mod c + c,
    chunk_size) - n mod c. Older chunks: min(2c - 1, chunk_size) - n mod c.

    Intra-chunk pass: causal varlen attention with each chunk as its own sequence (queries and
    keys at true positions). Cross-chunk pass (successive + inter): every query sees its whole
    previous chunk and all older ones, which is not causal, and `varlen_attention` is causal
    only; so this pass is computed densely in float32, in query blocks of DENSE_BLOCK, each over
    the keys its distances can reach (the previous chunk; the older ones, when there are any), then
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
                last = int(pos.max()) // c  # the block's last query chunk
                if last == 0:
                    continue
                rows = slice(q0 + b0, q0 + b0 + pos.numel())
                q_chunk = (pos // c)[:, None]
                # successive: only the chunks before the block's own (from the one before its first query's)
                near = slice(max(int(pos.min()) // c - 1, 0) * c, last * c)
                succ = self.rotary.rotate(x.q[rows], torch.clamp(pos % c + c, max=size))
                o, s = dense_attention(
                    succ,
                    k_mod[near],
                    x.v[k0 + near.start : k0 + near.stop],
                    (pos_k[near] // c)[None, :] == q_chunk - 1,
                )
                older = (last - 1) * c  # inter: the chunks before the last query's previous one
                if older > 0:
                    inter = self.rotary.rotate(
                        x.q[rows], torch.full_like(pos, min(2 * c - 1, size))
                    )
                    o_i, s_i = dense_attention(
                        inter,
                        k_mod[:older],
                        x.v[k0 : k0 + older],
                        (pos_k[:older] // c)[None, :] < q_chunk - 1,
                    )
                    merge_into(o, s, slice(None), o_i, s_i)
                merge_into(out, lse, rows, o, s)

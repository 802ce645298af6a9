"""The position tests' slow reference (every pair rotated at its scheme distance), random packed inputs and
the scheme settings they run over."""

from __future__ import annotations

import math

import numpy as np
import torch

from posfreq.train.model.transformer import positions_in_sequences
from posfreq.train.positions.merge import AttentionInputs
from posfreq.train.positions.rotary import RotaryBase
from posfreq.train.positions.scheme import PositionScheme
from posfreq.train.positions.schemes import build_scheme

HEAD_DIM = 16


# ----------------------------------------------------------------------------- slow reference


def reference_attend(scheme: PositionScheme, x: AttentionInputs) -> torch.Tensor:
    """Slow reference, independent of the fast passes: for every pair (m, n <= m) the query is
    rotated at n + d(m, n), with d read from `scheme.distances`, against the key cached at n,
    so the pair sees exactly distance d; softmax over the whole row, in float32."""
    q, k, v = x.q.float(), x.k.float(), x.v.float()
    heads, dim = q.shape[1], q.shape[2]
    groups = heads // k.shape[1]
    out = torch.zeros_like(q)
    cu_q, cu_k = x.cu_seqlens_q.tolist(), x.cu_seqlens_k.tolist()
    for i in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        lq, lk = q1 - q0, k1 - k0
        table = torch.from_numpy(scheme.distances(lk))
        m, n = x.pos_q[q0:q1], x.pos_k[k0:k1]
        dist = table[m][:, n]  # (lq, lk), -1 where n > m
        pair_pos = n[None, :] + dist.clamp_min(0)
        q_pairs = q[q0:q1, None].expand(lq, lk, heads, dim).reshape(lq * lk, heads, dim)
        q_pairs = scheme.rotary.rotate(q_pairs, pair_pos.reshape(-1)).view(lq, lk, heads, dim)
        keys = k[k0:k1].repeat_interleave(groups, dim=1)
        scores = (q_pairs * keys[None]).sum(-1) / math.sqrt(dim)  # (lq, lk, H)
        scores = scores.masked_fill((dist < 0)[..., None], -math.inf)
        probs = torch.softmax(scores, dim=1)
        out[q0:q1] = torch.einsum("qkh,khd->qhd", probs, v[k0:k1].repeat_interleave(groups, dim=1))
    return out.to(x.q.dtype)


class ReferenceScheme(PositionScheme):
    """A scheme that attends through `reference_attend`, to plug into a model."""

    def __init__(self, scheme: PositionScheme) -> None:
        super().__init__(
            name=f"reference-{scheme.name}", rotary=scheme.rotary, options=scheme.options
        )
        self.scheme = scheme

    def attend(self, x: AttentionInputs) -> torch.Tensor:
        return reference_attend(self.scheme, x)


# ----------------------------------------------------------------------------- inputs


def make_inputs(
    scheme, lens_k, lens_q=None, heads=4, kv_heads=2, dtype=torch.float32, seed=0
) -> AttentionInputs:
    """Random packed inputs; keys rotated at their true positions by the scheme's rotary, as the model does."""
    lens_q = lens_q or lens_k
    gen = torch.Generator().manual_seed(seed)
    cu_q = torch.tensor(np.cumsum([0, *lens_q]), dtype=torch.int32)
    cu_k = torch.tensor(np.cumsum([0, *lens_k]), dtype=torch.int32)
    pos_k = positions_in_sequences(cu_k, int(cu_k[-1]))
    pos_q = torch.cat([torch.arange(lk - lq, lk) for lq, lk in zip(lens_q, lens_k)])
    q = torch.randn(int(cu_q[-1]), heads, HEAD_DIM, generator=gen)
    k = scheme.rotary.rotate(torch.randn(int(cu_k[-1]), kv_heads, HEAD_DIM, generator=gen), pos_k)
    v = torch.randn(int(cu_k[-1]), kv_heads, HEAD_DIM, generator=gen)
    return AttentionInputs(
        q.to(dtype),
        k.to(dtype),
        v.to(dtype),
        pos_q,
        pos_k,
        cu_q,
        cu_k,
        max(lens_q),
        max(lens_k),
        "sdpa",
    )


SETTINGS = [
    ("rope", {}),
    ("string", {"shift": 7, "window": 2}),
    ("string", {"shift": 12, "window": 0}),
    ("string", {"shift": 5, "window": 4, "temperature": True}),
    ("string", {}),  # defaults for train_len 48: shift 16, window 8
    ("rerope", {"window": 5}),
    ("rerope", {"window": 1}),
    ("self_extend", {"group": 3, "window": 4}),
    ("self_extend", {"group": 2, "window": 9}),
    ("dca", {"chunk_size": 9, "local_window": 2}),
    ("dca", {"chunk_size": 16, "local_window": 5}),
    ("ntk", {}),
    ("yarn", {"scale": 2.0}),
]
IDS = [
    f"{name}-{'-'.join(f'{k}{v}' for k, v in opts.items()) or 'default'}" for name, opts in SETTINGS
]


def scheme_for(name: str, options: dict, train_len: int = 48) -> PositionScheme:
    return build_scheme(name, RotaryBase(HEAD_DIM), train_len, **options)

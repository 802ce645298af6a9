"""The ``flex`` backend of `varlen_attention`: torch FlexAttention over padded packed inputs.

The per-document bottom-right causal mask becomes a `BlockMask`, built slab by slab and kept per
layout; inputs are padded to few lengths so that few kernels are compiled.
"""

from __future__ import annotations

import collections
import functools
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

FLEX_BLOCK = 128
"""FlexAttention's sparse block size; padded lengths are multiples of it."""


FLEX_MAX_SHAPES = 64
"""Compiled flex kernels kept (one per padded (Tq, Tk)); past it a call fails instead of falling back to a path
that materialises the whole score matrix."""


def flex_padded_length(n: int) -> int:
    """Length a packed flex input is padded to: the next power of two >= FLEX_BLOCK, so the compiled kernel of one
    padded shape serves every length up to it (few shapes, few compilations)."""
    return max(FLEX_BLOCK, 1 << max(0, n - 1).bit_length())


def _document_positions(
    cu: Tensor, total: int, padded: int, offset: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """(document id, position within it) of each of `padded` slots; the padding slots get document -1."""
    lengths = (cu[1:] - cu[:-1]).long()
    doc = torch.full((padded,), -1, dtype=torch.int64, device=cu.device)
    doc[:total] = torch.repeat_interleave(
        torch.arange(len(lengths), device=cu.device), lengths, output_size=total
    )
    pos = torch.zeros(padded, dtype=torch.int64, device=cu.device)
    pos[:total] = torch.arange(total, device=cu.device) - cu[:-1].long()[doc[:total]]
    if offset is not None:
        pos[:total] += offset[doc[:total]]
    return doc, pos


@dataclass(frozen=True)
class _FlexLayout:
    """Document ids and positions of padded queries and keys, and the document-causal rule over them."""

    doc_q: Tensor
    pos_q: Tensor  # bottom-right: the key position of each query's diagonal
    doc_k: Tensor
    pos_k: Tensor
    window: int | None

    def allowed(self, qi: Tensor, ki: Tensor) -> Tensor:
        distance = self.pos_q[qi] - self.pos_k[ki]
        same = (self.doc_q[qi] == self.doc_k[ki]) & (self.doc_q[qi] >= 0) & (distance >= 0)
        return same & (distance < self.window) if self.window is not None else same


_FLEX_MASKS: collections.OrderedDict = collections.OrderedDict()


_FLEX_MASKS_KEPT = 8


def flex_block_mask(cu_q: Tensor, cu_k: Tensor, total_q: int, total_k: int, window: int | None):
    """The BlockMask of per-document bottom-right causal attention over padded flex inputs, built once per layout.

    Every layer of a forward (and activation checkpointing's recompute) passes the same cu_seqlens tensors, so
    the mask is kept, keyed by their identity, for the next call. It is built slab by slab of FLEX_BLOCK queries
    (memory ~ FLEX_BLOCK x Tk), never over the whole Tq x Tk grid.
    """
    from torch.nn.attention.flex_attention import BlockMask

    key = (id(cu_q), id(cu_k), total_q, total_k, window)
    hit = _FLEX_MASKS.get(key)
    if hit is not None and hit[0] is cu_q and hit[1] is cu_k:
        _FLEX_MASKS.move_to_end(key)
        return hit[2]
    padded_q, padded_k = flex_padded_length(total_q), flex_padded_length(total_k)
    lens_q, lens_k = (cu_q[1:] - cu_q[:-1]).long(), (cu_k[1:] - cu_k[:-1]).long()
    doc_q, pos_q = _document_positions(cu_q, total_q, padded_q, lens_k - lens_q)
    doc_k, pos_k = _document_positions(cu_k, total_k, padded_k)
    doc_k[
        total_k:
    ] = -2  # padding keys belong to no query's document, padding queries' (-1) included
    layout = _FlexLayout(doc_q, pos_q, doc_k, pos_k, window)
    n_k = padded_k // FLEX_BLOCK
    any_, full = [], []
    keys = torch.arange(padded_k, device=cu_q.device)
    for start in range(0, padded_q, FLEX_BLOCK):
        queries = torch.arange(start, start + FLEX_BLOCK, device=cu_q.device)
        slab = layout.allowed(queries[:, None], keys[None, :]).view(FLEX_BLOCK, n_k, FLEX_BLOCK)
        any_.append(slab.any(dim=(0, 2)))
        full.append(slab.all(dim=(0, 2)))
    any_t, full_t = torch.stack(any_), torch.stack(full)

    def blocks(
        chosen: Tensor,
    ) -> tuple[Tensor, Tensor]:  # per query block: how many kv blocks, and which first
        order = torch.argsort(chosen.int(), dim=1, descending=True, stable=True)
        return chosen.sum(1).int()[None, None], order.int()[None, None]

    def mask_mod(b, h, qi, ki):
        return layout.allowed(qi, ki)

    mask = BlockMask.from_kv_blocks(
        *blocks(any_t & ~full_t),
        *blocks(full_t),
        BLOCK_SIZE=FLEX_BLOCK,
        mask_mod=mask_mod,
        seq_lengths=(padded_q, padded_k),
    )
    _FLEX_MASKS[key] = (cu_q, cu_k, mask)
    while len(_FLEX_MASKS) > _FLEX_MASKS_KEPT:
        _FLEX_MASKS.popitem(last=False)
    return mask


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_backend(q, k, v, cu_q, cu_k, max_q, max_k, window, return_lse, scale):
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    total_q, total_k = q.shape[0], k.shape[0]
    block_mask = flex_block_mask(cu_q, cu_k, total_q, total_k, window)
    padded_q, padded_k = block_mask.seq_lengths

    def heads_first(x: Tensor, padded: int) -> Tensor:  # (T, H, D) -> (1, H, padded, D)
        return F.pad(x, (0, 0, 0, 0, 0, padded - x.shape[0])).transpose(0, 1).unsqueeze(0)

    args = (heads_first(q, padded_q), heads_first(k, padded_k), heads_first(v, padded_k))
    kwargs = dict(
        block_mask=block_mask,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
        return_aux=AuxRequest(lse=True) if return_lse else None,
    )
    if q.device.type == "cuda":
        with torch._dynamo.config.patch(
            recompile_limit=FLEX_MAX_SHAPES, fail_on_recompile_limit_hit=True
        ):
            result = _compiled_flex()(*args, **kwargs)
    else:
        with (
            warnings.catch_warnings()
        ):  # CPU runs flex unfused on purpose (it is forward-only there anyway)
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            result = flex_attention(*args, **kwargs)
    out, lse = (result[0], result[1].lse) if return_lse else (result, None)
    out = out[0, :, :total_q].transpose(0, 1)
    return (out, lse[0, :, :total_q].transpose(0, 1).float()) if return_lse else out

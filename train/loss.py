"""Memory-lean language-model loss: the output projection and cross-entropy, chunk by chunk of tokens.

The trainer's loss is the summed cross-entropy of ``logits = hidden @ W.T`` over the targets that
are not ``IGNORE_INDEX``. Computed plainly, a micro-batch's fp32 logits take T x V x 4 bytes (the
paper's 8 rows x 2048 tokens x 128,256 vocabulary: 8.4 GB), and as much again for their log-softmax
and their gradient. `linear_cross_entropy` never holds more than one chunk of them: its forward
walks over chunks of target tokens and, for each, computes the logits in fp32, the loss and at
once the gradients with respect to the hidden states and the weight (softmax - one-hot times W,
and times h), so backward needs no second pass over the vocabulary; only grad_hidden (T x d) and
grad_weight (V x d) are kept, and backward scales them by the incoming gradient. Loss and gradients
equal those of ``F.cross_entropy(hidden.float() @ W.float().T, targets, ignore_index, reduction="sum")``
up to fp32 rounding (the sums run in another order). Ignored tokens cost nothing: only the rows
with a target are projected. Memory besides the inputs: one chunk's logits (`chunk_tokens`, by
default within CHUNK_LOGITS_BYTES), grad_weight accumulated in fp32 (V x d x 4 bytes), grad_hidden,
an fp32 copy of bf16 weights, and in backward the scaled copies of the two gradients.

On CUDA with liger-kernel installed (the ``gpu`` extra), the same call runs liger's fused Triton
kernel instead (>= 0.6.2, for fp32 accumulation of the weight gradient), which computes the logits
in the inputs' dtype (bf16 under mixed precision, as the plain ``lm_head`` does) with an fp32
softmax, and picks its own chunks.

`head_returns_loss` puts the loss into a model without changing the model: while it is open, the
output head returns this loss instead of logits, so the model's forward yields the loss. Whatever
wraps that forward still applies to the head's weight: FSDP2 gathers the root's parameters, the
head's weight among them, only inside the root module's forward, and casts them for mixed
precision there.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch import Tensor, nn
from torch.autograd.function import FunctionCtx, once_differentiable

from posfreq.train.packing import IGNORE_INDEX

CHUNK_LOGITS_BYTES = (
    256 * 2**20
)  # default cap on one chunk's fp32 logits (523 tokens at V = 128,256)


def default_chunk_tokens(vocab_size: int, cap_bytes: int = CHUNK_LOGITS_BYTES) -> int:
    """Tokens per chunk so that a chunk's fp32 logits stay within `cap_bytes` (at least one token)."""
    return max(1, cap_bytes // (4 * vocab_size))


def _softmax_and_loss(h: Tensor, w: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
    """softmax(h @ w.T) (c, V) in one fp32 buffer, and the summed cross-entropy of its rows against t."""
    logits = h @ w.T
    target_logits = logits.gather(1, t[:, None])
    top = logits.amax(1, keepdim=True)
    probs = logits.sub_(top).exp_()
    total = probs.sum(1, keepdim=True)
    probs.div_(total)
    return probs, (top + total.log() - target_logits).sum()


def _loss_and_grads(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    ignore_index: int,
    chunk_tokens: int,
    need_hidden: bool,
    need_weight: bool,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Summed loss and, where needed, its gradients w.r.t. hidden (T, d) and weight (V, d) in their dtypes."""
    w = weight.float()
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.zeros_like(hidden) if need_hidden else None
    grad_weight = (
        torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        if need_weight
        else None
    )
    kept = (targets != ignore_index).nonzero().squeeze(1)
    for rows in kept.split(chunk_tokens):
        h, t = hidden[rows].float(), targets[rows]
        grad_logits, chunk_loss = _softmax_and_loss(h, w, t)
        loss += chunk_loss
        grad_logits[torch.arange(len(t), device=t.device), t] -= 1.0  # softmax - one-hot
        if grad_hidden is not None:
            grad_hidden.index_copy_(0, rows, (grad_logits @ w).to(hidden.dtype))
        if grad_weight is not None:
            grad_weight.addmm_(grad_logits.T, h)
    return loss, grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype)


def _scaled(grad: Tensor | None, grad_loss: Tensor) -> Tensor | None:
    return None if grad is None else grad * grad_loss


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of hidden (T, d) @ weight.T (V, d) against targets (T,), in chunks of tokens.

    Forward computes the gradients too and keeps only them; backward multiplies them by the
    gradient of the loss. Not twice differentiable.
    """

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        ignore_index: int,
        chunk_tokens: int,
    ) -> Tensor:
        loss, grad_hidden, grad_weight = _loss_and_grads(
            hidden, weight, targets, ignore_index, chunk_tokens, *ctx.needs_input_grad[:2]
        )
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_loss: Tensor) -> tuple[Tensor | None, ...]:
        grad_hidden, grad_weight = ctx.saved_tensors
        return _scaled(grad_hidden, grad_loss), _scaled(grad_weight, grad_loss), None, None, None


@functools.cache
def _liger_loss() -> Callable[..., Tensor] | None:
    """liger-kernel's fused linear cross-entropy, or None when it is not installed."""
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except ImportError:
        return None
    return liger_fused_linear_cross_entropy


def uses_liger(device_type: str, grad_enabled: bool) -> bool:
    """Whether the loss runs liger's kernel: on CUDA while training only. Its forward builds the gradient buffers
    whatever the grad mode (a V x d weight gradient: 1 GiB at a 128K vocabulary), so evaluation takes the
    chunked path, which computes the loss alone."""
    return device_type == "cuda" and grad_enabled


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    ignore_index: int = IGNORE_INDEX,
    chunk_tokens: int | None = None,
) -> Tensor:
    """Sum over targets != ignore_index of cross_entropy(hidden @ weight.T, target), an fp32 scalar.

    hidden (..., d), weight (V, d), targets (...) of ints. `chunk_tokens` (default: a chunk's fp32
    logits within CHUNK_LOGITS_BYTES) bounds the logits held at once; liger's kernel, used on CUDA
    when installed and gradients are on (`uses_liger`), chooses its own.
    """
    hidden, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    fused = _liger_loss() if uses_liger(hidden.device.type, torch.is_grad_enabled()) else None
    if fused is not None:
        return fused(
            hidden,
            weight,
            targets,
            ignore_index=ignore_index,
            reduction="sum",
            accum_dtype=torch.float32,
        ).float()
    chunk = chunk_tokens or default_chunk_tokens(weight.shape[0])
    if not torch.is_grad_enabled():  # evaluation: no gradients to compute
        return _loss_and_grads(hidden, weight, targets, ignore_index, chunk, False, False)[0]
    return ChunkedLinearCrossEntropy.apply(hidden, weight, targets, ignore_index, chunk)


@contextmanager
def head_returns_loss(
    head: nn.Linear,
    targets: Tensor,
    ignore_index: int = IGNORE_INDEX,
    chunk_tokens: int | None = None,
) -> Iterator[None]:
    """While open, `head(hidden)` returns `linear_cross_entropy(hidden, head.weight, targets)`, not logits.

    A model whose forward ends in `head` then returns its summed loss; the head's weight is looked
    up at call time, so a wrapper that swaps it in during forward (FSDP2) is honoured.
    """
    if head.bias is not None:
        raise ValueError("head_returns_loss needs a head without bias")
    head.forward = lambda hidden: linear_cross_entropy(
        hidden, head.weight, targets, ignore_index, chunk_tokens
    )
    try:
        yield
    finally:
        del head.forward

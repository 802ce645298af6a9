"""Memory-lean language-model loss: the output projection and cross-entropy, chunk by chunk of tokens.

The trainer's loss is the summed cross-entropy of ``logits = hidden @ W.T`` over the targets that
are not ``IGNORE_INDEX``. Computed plainly, a micro-batch's fp32 logits take T x V x 4 bytes (the
paper's 8 rows x 2048 tokens x 128,256 vocabulary: 8.4 GB), and as much again for their log-softmax
and their gradient. `linear_cross_entropy` never holds more than one chunk of them: its forward
walks over chunks of target tokens and, for each, computes the fp32 logits, the loss and at
once the gradients with respect to the hidden states and the weight (softmax - one-hot times W,
and times h), so backward needs no second pass over the vocabulary; only grad_hidden (T x d) and
grad_weight (V x d) are kept, and backward scales them by the incoming gradient. Float32 inputs
give the loss and gradients of ``F.cross_entropy(hidden @ W.T, targets, ignore_index, reduction="sum")``
up to fp32 rounding. Half-precision inputs (bf16 under mixed precision) stay half in the matmuls, as
in a plain bf16 head: the logits and the weight gradient still accumulate in fp32 (so the loss is that
of fp32 logits of the same values), the softmax gradient enters the gradient matmuls in bf16.
Ignored tokens cost nothing: only the rows with a target are projected. Memory besides the inputs:
one chunk's logits (`chunk_tokens`, by default within CHUNK_LOGITS_BYTES), grad_weight accumulated
in fp32 (V x d x 4 bytes), grad_hidden, and in backward the scaled copies of the two gradients.

On CUDA with liger-kernel installed (the ``gpu`` extra), the same call runs liger's fused Triton
kernel instead, which computes the logits in the inputs' dtype with an fp32 softmax and picks its
own chunks. A missing, broken or old liger (`liger_state`) is one warning at the start of a CUDA
run and a failed doctor check, never a silent slow loss.

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

from posfreq.train.data.packing import IGNORE_INDEX
from posfreq.train.model.attention_kernels import HALF

CHUNK_LOGITS_BYTES = (
    256 * 2**20
)  # default cap on one chunk's fp32 logits (523 tokens at V = 128,256)


def default_chunk_tokens(vocab_size: int, cap_bytes: int = CHUNK_LOGITS_BYTES) -> int:
    """Tokens per chunk so that a chunk's fp32 logits stay within `cap_bytes` (at least one token)."""
    return max(1, cap_bytes // (4 * vocab_size))


def _softmax_and_loss(logits: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
    """softmax of fp32 logits (c, V), in place, and the summed cross-entropy of its rows against t."""
    target_logits = logits.gather(1, t[:, None])
    top = logits.amax(1, keepdim=True)
    probs = logits.sub_(top).exp_()
    total = probs.sum(1, keepdim=True)
    probs.div_(total)
    return probs, (top + total.log() - target_logits).sum()


def _mm_fp32(a: Tensor, b: Tensor) -> Tensor:
    """a @ b as float32: half-precision inputs multiplied as they are with float32 output on CUDA (tensor cores,
    no rounded product), float32 inputs as float32."""
    if a.is_cuda and a.dtype in HALF:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def _addmm_fp32_(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """acc (float32) += a @ b, accumulated in float32 without a float32 copy of half-precision a or b on CUDA."""
    if acc.is_cuda and a.dtype in HALF:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.addmm_(a.float(), b.float())


def _loss_and_grads(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    ignore_index: int,
    chunk_tokens: int,
    need_hidden: bool,
    need_weight: bool,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Summed loss and, where needed, its gradients w.r.t. hidden (T, d) and weight (V, d) in their dtypes.

    Half-precision inputs stay half in every matmul (as liger's kernel and a plain bf16 head run them): logits
    and the weight gradient accumulate in float32, the softmax is float32, and its gradient enters the two
    gradient matmuls in the inputs' dtype. Float32 inputs run in float32 throughout.
    """
    half = hidden.dtype in HALF and weight.dtype == hidden.dtype
    w = weight if half else weight.float()
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.zeros_like(hidden) if need_hidden else None
    grad_weight = (
        torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        if need_weight
        else None
    )
    kept = (targets != ignore_index).nonzero().squeeze(1)
    for rows in kept.split(chunk_tokens):
        h, t = hidden[rows], targets[rows]
        h = h if half else h.float()
        grad_logits, chunk_loss = _softmax_and_loss(_mm_fp32(h, w.T), t)
        loss += chunk_loss
        grad_logits[torch.arange(len(t), device=t.device), t] -= 1.0  # softmax - one-hot
        grad_logits = grad_logits.to(h.dtype)
        if grad_hidden is not None:
            grad_hidden.index_copy_(0, rows, (grad_logits @ w).to(hidden.dtype))
        if grad_weight is not None:
            _addmm_fp32_(grad_weight, grad_logits.T, h)
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


LIGER_FLOOR = (0, 8, 1)
"""The first liger-kernel release whose weight gradient accumulates by addmm into float32 (0.8.0 and older add a
float copy of every chunk's product, a V x d temporary per chunk)."""

LIGER_FIX = "pip install 'liger-kernel>=0.8.1' (the gpu extra: pip install -e '.[gpu]')"


@functools.cache
def liger_state() -> tuple[Callable[..., Tensor] | None, str | None]:
    """(liger-kernel's fused linear cross-entropy or None, why it is not used or why it is slow, or None).

    Not installed, failing to import (a triton that does not match torch, say), or older than LIGER_FLOOR:
    each is a reason, which the trainer prints at start-up on CUDA and the doctor's loss check fails on.
    """
    import importlib.util
    from importlib import metadata

    if importlib.util.find_spec("liger_kernel") is None:
        return None, f"liger-kernel is not installed. Fix: {LIGER_FIX}"
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except Exception as err:  # a broken install raises whatever its imports raise
        return (
            None,
            f"liger-kernel failed to import ({type(err).__name__}: {err}). Fix: {LIGER_FIX}",
        )
    try:
        version = metadata.version("liger-kernel")
        release = tuple(int(x) for x in version.split("+")[0].split(".")[:3])
    except (metadata.PackageNotFoundError, ValueError):
        return liger_fused_linear_cross_entropy, None
    if release < LIGER_FLOOR:
        return liger_fused_linear_cross_entropy, (
            f"liger-kernel {version} copies a float V x d product per chunk into the weight gradient. "
            f"Fix: {LIGER_FIX}"
        )
    return liger_fused_linear_cross_entropy, None


def _liger_loss() -> Callable[..., Tensor] | None:
    """liger-kernel's fused linear cross-entropy, or None when it is not installed or does not import."""
    return liger_state()[0]


def loss_kernel_warning(device_type: str) -> str | None:
    """One line for the start of a CUDA run whose loss would not run liger's current kernel, else None.
    Without it the chunked loss runs: correct, and slower (a V x d float32 weight gradient per micro-batch)."""
    if device_type != "cuda":
        return None
    fused, reason = liger_state()
    if reason is None:
        return None
    fallback = (
        ""
        if fused is not None
        else " The loss falls back to posfreq's chunked kernel (correct, slower)."
    )
    return f"warning: {reason}.{fallback}"


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


def token_losses(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    ignore_index: int = IGNORE_INDEX,
    chunk_tokens: int | None = None,
) -> Tensor:
    """cross_entropy(hidden @ weight.T, target) of every target, float32 (T,), 0 where target == ignore_index.

    For evaluation (no gradients): chunk by chunk of tokens like the summed loss, in the same matmul dtypes,
    so the validation loss and the loss by distance come from one forward."""
    hidden, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    half = hidden.dtype in HALF and weight.dtype == hidden.dtype
    w = weight if half else weight.float()
    losses = torch.zeros(targets.shape, dtype=torch.float32, device=hidden.device)
    kept = (targets != ignore_index).nonzero().squeeze(1)
    for rows in kept.split(chunk_tokens or default_chunk_tokens(weight.shape[0])):
        h = hidden[rows] if half else hidden[rows].float()
        logits = _mm_fp32(h, w.T)
        target = logits.gather(1, targets[rows][:, None]).squeeze(1)
        losses[rows] = torch.logsumexp(logits, dim=1) - target
    return losses


@contextmanager
def head_returns_loss(
    head: nn.Linear,
    targets: Tensor,
    ignore_index: int = IGNORE_INDEX,
    chunk_tokens: int | None = None,
    per_token: bool = False,
) -> Iterator[None]:
    """While open, `head(hidden)` returns `linear_cross_entropy(hidden, head.weight, targets)`, not logits
    (`per_token`: `token_losses`, for evaluation).

    A model whose forward ends in `head` then returns its loss; the head's weight is looked
    up at call time, so a wrapper that swaps it in during forward (FSDP2) is honoured.
    """
    if head.bias is not None:
        raise ValueError("head_returns_loss needs a head without bias")
    loss = token_losses if per_token else linear_cross_entropy
    head.forward = lambda hidden: loss(hidden, head.weight, targets, ignore_index, chunk_tokens)
    try:
        yield
    finally:
        del head.forward

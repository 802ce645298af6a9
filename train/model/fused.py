"""The elementwise parts of a block (RMSNorm, the rotary rotation, SwiGLU's gate), fused by torch.compile on CUDA.

Eager PyTorch runs each of them as several kernels with a float32 round trip through memory (RMSNorm: cast,
square, mean, rsqrt, multiply, cast, scale), which costs a large share of a 1.3B model's step on a GPU. Each is
a pure tensor function here, so `torch.compile` can fuse it into one kernel without tracing the model's Python
(position schemes, caches, the attention backend's choice): no graph breaks, and one compilation per input
shape. `use_fused(True)` switches every model in the process to the compiled versions (the trainer does for
`model.compile`); the eager functions are the reference they are tested against.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

_ENABLED = False


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Llama's RMSNorm: normalised in float32, cast back to x's dtype, then scaled by the weight."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x * cos + rotate_half(x) * sin, Llama's half-split layout."""
    half = x.shape[-1] // 2
    rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1).mul_(sin)
    return (x * cos).add_(rotated_half)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up."""
    return F.silu(gate) * up


@functools.cache
def _compiled(function: Callable) -> Callable:
    return torch.compile(function)


def use_fused(enabled: bool) -> None:
    """Run the compiled versions (True) or the eager ones (False) from now on, in this process."""
    global _ENABLED
    _ENABLED = enabled


def fused(function: Callable) -> Callable:
    """`function` compiled when fused kernels are on, else as it is."""
    return _compiled(function) if _ENABLED else function


def resolve_compile(setting: str, accelerator: str) -> bool:
    """Whether `model.compile` (auto, on, off) fuses on this accelerator: auto means on CUDA only."""
    return setting == "on" or (setting == "auto" and accelerator == "cuda")

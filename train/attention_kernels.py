"""Which attention backend can run a call: the kernel table and the resolution of ``auto``.

`explain_backend` checks a named backend against the call (device, dtype, log-sum-exp,
backward) and says why it cannot run it; ``auto`` takes the first of `AUTO_ORDER` that can.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
from torch import Tensor

BACKENDS = ("auto", "sdpa", "varlen", "flash", "xformers", "flex")


AUTO_ORDER = {"cuda": ("varlen", "flash", "sdpa"), "cpu": ("sdpa",)}
"""What `auto` tries, in order, per device type: the first kernel that can run the call."""


HALF = (torch.bfloat16, torch.float16)


ANY_FLOAT = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Kernel:
    """What one backend can run: devices, dtypes, log-sum-exp, backward, and where it comes from."""

    devices: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    lse: bool
    """Whether it returns the log-sum-exp."""
    lse_backward: bool
    """Whether its backward uses the gradient of that log-sum-exp (a two-pass merge needs it to train)."""
    backward_devices: tuple[str, ...]
    install: str
    """How a user gets it."""


KERNELS = {
    "sdpa": Kernel(("cpu", "cuda"), ANY_FLOAT, True, True, ("cpu", "cuda"), "part of torch"),
    "varlen": Kernel(
        ("cuda",),
        HALF,
        True,
        False,
        ("cuda",),
        "part of torch >= 2.10 on CUDA GPUs of compute capability >= 8.0 (A100, H100)",
    ),
    "flash": Kernel(
        ("cuda",),
        HALF,
        True,
        False,
        ("cuda",),
        "pip install flash-attn==2.8.3 --no-build-isolation (a CUDA source build; see docs/cluster.md)",
    ),
    "xformers": Kernel(
        ("cuda",),
        ANY_FLOAT,
        False,
        False,
        ("cuda",),
        "pip install an xformers release built for your torch version (see docs/cluster.md)",
    ),
    "flex": Kernel(("cpu", "cuda"), ANY_FLOAT, True, True, ("cuda",), "part of torch"),
}


class BackendError(RuntimeError):
    """An attention backend that cannot run the requested call; the message names one that can."""


def _module_present(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _torch_flash_present() -> bool:
    """torch's FlashAttention kernels exist in this build and the current GPU can run them (sm80+)."""
    if not _module_present("torch.nn.attention.varlen"):  # torch >= 2.10
        return False
    if not torch.cuda.is_available() or not torch.backends.cuda.is_flash_attention_available():
        return False
    return torch.cuda.get_device_capability() >= (8, 0)


def kernel_present(name: str) -> bool:
    """Whether backend `name`'s kernel is installed and usable here (device and dtype aside)."""
    if name == "varlen":
        return _torch_flash_present()
    if name in ("flash", "xformers"):
        return _module_present({"flash": "flash_attn"}.get(name, name))
    return name in KERNELS


def available_backends(device: torch.device | str) -> list[str]:
    """The concrete backends whose kernels are present and run on `device`."""
    kind = torch.device(device).type
    return [n for n, k in KERNELS.items() if kind in k.devices and kernel_present(n)]


def why_not(
    name: str, device: str, dtype: torch.dtype, return_lse: bool = False, backward: bool = False
) -> str | None:
    """Why concrete backend `name` cannot run this call, or None when it can."""
    kernel = KERNELS[name]
    if device not in kernel.devices:
        return f"it runs on {'/'.join(kernel.devices)} only, not {device}"
    if not kernel_present(name):
        return f"its kernel is not available here ({kernel.install})"
    if dtype not in kernel.dtypes:
        return f"it takes {'/'.join(str(d).removeprefix('torch.') for d in kernel.dtypes)} only, not {str(dtype).removeprefix('torch.')}"
    if return_lse and not kernel.lse:
        return "it cannot return the log-sum-exp a two-pass position scheme merges"
    if backward and device not in kernel.backward_devices:
        return f"it has no backward on {device}"
    if backward and return_lse and not kernel.lse_backward:
        return "its backward ignores the log-sum-exp's gradient, so a two-pass merge would train on wrong gradients"
    return None


def explain_backend(
    backend: str,
    device: torch.device | str,
    dtype: torch.dtype = torch.float32,
    *,
    return_lse: bool = False,
    backward: bool = False,
) -> tuple[str, str]:
    """(concrete backend, why) for `backend` on this call; BackendError naming an alternative if it cannot run it."""
    if backend not in BACKENDS:
        raise BackendError(
            f"unknown attention backend {backend!r}; choose one of {', '.join(BACKENDS)}"
        )
    kind = torch.device(device).type
    need = dict(device=kind, dtype=dtype, return_lse=return_lse, backward=backward)
    what = (
        f"{kind}, {str(dtype).removeprefix('torch.')}"
        + (", log-sum-exp" if return_lse else "")
        + (", backward" if backward else "")
    )
    if backend == "auto":
        skipped = []
        for name in AUTO_ORDER.get(kind, ("sdpa",)):
            reason = why_not(name, **need)
            if reason is None:
                passed = "".join(f"; not {n}: {r}" for n, r in skipped)
                return name, f"auto -> {name} ({what}{passed})"
            skipped.append((name, reason))
        raise BackendError(
            f"no attention backend can run {what}"
        )  # unreachable: sdpa runs everything
    reason = why_not(backend, **need)
    if reason is not None:
        alternative, _ = explain_backend(
            "auto", device, dtype, return_lse=return_lse, backward=backward
        )
        raise BackendError(
            f"attention backend {backend!r} cannot run this call ({what}): {reason}. "
            f"Fix: choose {alternative!r} (what auto picks here) or 'sdpa', which runs everything"
        )
    return backend, f"{backend} (as asked; {what})"


def resolve_backend(
    backend: str,
    device: torch.device | str,
    dtype: torch.dtype = torch.float32,
    *,
    return_lse: bool = False,
    backward: bool = False,
) -> str:
    """The concrete backend for this call: `auto` picks one that can run it, a named one is checked."""
    return explain_backend(backend, device, dtype, return_lse=return_lse, backward=backward)[0]


def needs_backward(*tensors: Tensor) -> bool:
    """Whether autograd will differentiate through an op on these tensors."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)

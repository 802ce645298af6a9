"""Which attention backend can run a call: the kernel table and the resolution of ``auto``.

`explain_backend` checks a named backend against the call (device, dtype, log-sum-exp,
backward) and says why it cannot run it; ``auto`` takes the first of `AUTO_ORDER` that can.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from posfreq.train.model.backend_names import BACKENDS

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


@functools.lru_cache(maxsize=None)
def _module_present(module: str) -> bool:
    """Whether `module` can be imported (asked once per process: every attention call checks its kernel)."""
    return importlib.util.find_spec(module) is not None


def _torch_flash_present() -> bool:
    """torch's FlashAttention kernels exist in this build and the current GPU can run them (sm80+)."""
    if not _module_present("torch.nn.attention.varlen"):  # torch >= 2.10
        return False
    if not torch.cuda.is_available() or not torch.backends.cuda.is_flash_attention_available():
        return False
    return _current_capability() >= (8, 0)


@functools.lru_cache(maxsize=16)
def _capability_of(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _current_capability() -> tuple[int, int]:
    """The current GPU's compute capability, asked of the driver once per GPU (every attention call checks it)."""
    return _capability_of(torch.cuda.current_device())


@dataclass(frozen=True)
class VarlenApi:
    """What this torch's `torch.nn.attention.varlen.varlen_attn` takes: its signature changed in every release.

    torch 2.10 says causal by ``is_causal`` and has no scale or window; 2.11 says causal by ``window_size=(-1,
    0)`` and adds ``scale``; 2.12 adds ``enable_gqa``, a guard that must be set for grouped key/value heads. Every
    release runs the same FlashAttention-2 kernel (`aten._flash_attention_forward`/`_backward`), which takes
    grouped heads as they are, so before 2.12 they are passed unrepeated (`make gpu-check`'s varlen-native-gqa
    stage checks that on the GPU's own torch). A scale the release lacks is folded into q; a window it lacks
    cannot be made up.
    """

    causal: str | None
    """The keyword that makes it causal: "window_size", "is_causal", or None (no way to say causal)."""
    scale: bool
    window: bool
    gqa: bool
    """Whether it has ``enable_gqa`` (which must then be set for grouped heads)."""
    lse: bool
    """Whether it can return the log-sum-exp (``return_aux``)."""

    def why_not(self, window: bool, return_lse: bool) -> str | None:
        """Why this signature cannot run the call, or None."""
        version = torch.__version__.split("+")[0]
        if self.causal is None:
            return f"torch {version}'s varlen_attn has no causal mask (neither is_causal nor window_size)"
        if window and not self.window:
            return (
                f"torch {version}'s varlen_attn has no sliding window (window_size: torch >= 2.11)"
            )
        if return_lse and not self.lse:
            return f"torch {version}'s varlen_attn cannot return the log-sum-exp (return_aux)"
        return None


@functools.lru_cache(maxsize=8)
def _varlen_api_of(function: Callable) -> VarlenApi:
    names = set(inspect.signature(function).parameters)
    causal = (
        "window_size" if "window_size" in names else "is_causal" if "is_causal" in names else None
    )
    return VarlenApi(
        causal=causal,
        scale="scale" in names,
        window="window_size" in names,
        gqa="enable_gqa" in names,
        lse="return_aux" in names,
    )


def varlen_api() -> VarlenApi:
    """The installed `varlen_attn`'s features, read from its signature (needs torch >= 2.10)."""
    from torch.nn.attention import varlen

    return _varlen_api_of(varlen.varlen_attn)


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
    name: str,
    device: str,
    dtype: torch.dtype,
    return_lse: bool = False,
    backward: bool = False,
    window: bool = False,
) -> str | None:
    """Why concrete backend `name` cannot run this call (`window`: a sliding window), or None when it can."""
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
    if name == "varlen":
        return varlen_api().why_not(window, return_lse)
    return None


def explain_backend(
    backend: str,
    device: torch.device | str,
    dtype: torch.dtype = torch.float32,
    *,
    return_lse: bool = False,
    backward: bool = False,
    window: bool = False,
) -> tuple[str, str]:
    """(concrete backend, why) for `backend` on this call; BackendError naming an alternative if it cannot run it."""
    if backend not in BACKENDS:
        raise BackendError(
            f"unknown attention backend {backend!r}; choose one of {', '.join(BACKENDS)}"
        )
    kind = torch.device(device).type
    need = dict(device=kind, dtype=dtype, return_lse=return_lse, backward=backward, window=window)
    what = (
        f"{kind}, {str(dtype).removeprefix('torch.')}"
        + (", log-sum-exp" if return_lse else "")
        + (", backward" if backward else "")
        + (", window" if window else "")
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
            "auto", device, dtype, return_lse=return_lse, backward=backward, window=window
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
    window: bool = False,
) -> str:
    """The concrete backend for this call: `auto` picks one that can run it, a named one is checked."""
    return explain_backend(
        backend, device, dtype, return_lse=return_lse, backward=backward, window=window
    )[0]


def needs_backward(*tensors: Tensor) -> bool:
    """Whether autograd will differentiate through an op on these tensors."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)

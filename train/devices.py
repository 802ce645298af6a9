"""The device a command runs on: one reading of `--device auto|cpu|cuda|cuda:N` for every posfreq command."""

from __future__ import annotations

import torch


def resolve_device(name: str) -> torch.device:
    """`auto` -> cuda when torch sees a GPU, else cpu; another name as torch reads it, refused if it names a GPU torch cannot see."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(
            f"--device {name}: not a device name. Fix: use auto, cpu, cuda or cuda:N"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"--device {name}, but torch sees no CUDA GPU. Fix: run on a GPU node, or use --device cpu"
        )
    if (
        device.type == "cuda"
        and device.index is not None
        and device.index >= torch.cuda.device_count()
    ):
        raise ValueError(
            f"--device {name}, but torch sees {torch.cuda.device_count()} GPU(s). "
            "Fix: pick an index below that, or use --device cuda"
        )
    return device

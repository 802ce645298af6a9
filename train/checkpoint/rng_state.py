"""The random states of one process (python, numpy, torch, its CUDA device), for exact resume.

Captured in types ``torch.load(weights_only=True)`` accepts, so a checkpoint's RNG files load
without unpickling arbitrary objects.
"""

from __future__ import annotations

import random

import numpy as np
import torch


def capture_rng() -> dict:
    """Python, numpy, torch (and CUDA) RNG states, in types `torch.load(weights_only=True)` accepts."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # this rank's GPU only: a node of another size can resume it (one generator per rank is used)
        state["cuda_device"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict) -> None:
    """Inverse of `capture_rng`."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if not torch.cuda.is_available():
        return
    if "cuda_device" in state:
        torch.cuda.set_rng_state(state["cuda_device"])
    elif "cuda" in state:
        # older checkpoints: every visible GPU's state; this rank's device is the one it used
        index = torch.cuda.current_device()
        if index < len(state["cuda"]):
            torch.cuda.set_rng_state(state["cuda"][index])

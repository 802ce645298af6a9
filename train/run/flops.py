"""Training FLOPs of a step, the GPUs' peak bf16 FLOP/s and a device's measured matmul rate: one owner for each,
shared by the trainer's MFU, the planner's days, `make gpu-check` and the benchmarks.

FLOPs per optimizer step ("model FLOPs"):
    6 * N * tokens  +  6 * n_layers * d_model * sum over attention segments s of s * (s + 1)
with N the matmul parameters (all but the input embedding; the output head counts), and the
second term the causal per-document attention: a query at position p attends to p + 1 keys,
QK^T and AV cost 4 * d_model * (p + 1) FLOPs forward per layer, x3 for forward + backward.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from posfreq.train.model.config import ModelConfig

if TYPE_CHECKING:
    import torch

PEAK_BF16_FLOPS = {  # dense (no sparsity) bf16 tensor-core FLOP/s, from NVIDIA's datasheets
    "a100": 312e12,
    "h100-sxm": 989e12,
    "h100-pcie": 756e12,
    "h100-nvl": 835e12,
    "h200": 989e12,
    "gh200": 989e12,
    "l40s": 362e12,
    "l4": 121e12,
    "a10g": 125e12,
}
DEVICE_NAMES = [  # torch.cuda.get_device_name patterns, most specific first -> PEAK_BF16_FLOPS key
    (r"GH200", "gh200"),
    (r"H200", "h200"),
    (r"H100.*PCIe", "h100-pcie"),
    (r"H100.*NVL", "h100-nvl"),
    (r"H100", "h100-sxm"),
    (r"A100", "a100"),
    (r"L40S", "l40s"),
    (r"\bL4\b", "l4"),
    (r"A10G", "a10g"),
]


def peak_of_device_name(name: str) -> float | None:
    """A GPU's dense bf16 peak from the name torch reports ("NVIDIA H100 PCIe"), or None when unknown."""
    for pattern, key in DEVICE_NAMES:
        if re.search(pattern, name):
            return PEAK_BF16_FLOPS[key]
    return None


def peak_flops(device: torch.device, override: float | None) -> float | None:
    """Peak FLOP/s of one device: the config value, else a known GPU's dense bf16 peak, else None."""
    if override:
        return override
    if device.type == "cuda":
        import torch

        return peak_of_device_name(torch.cuda.get_device_name(device))
    return None


def matmul_params(config: ModelConfig) -> int:
    """Parameters that take part in matmuls: everything but the input embedding (norms are negligible)."""
    return config.num_params(include_embeddings=False) + config.vocab_size * config.d_model


def step_flops(config: ModelConfig, tokens: int, sum_s_s1: float) -> float:
    """Training FLOPs of a step: 6 N tokens + 6 n_layers d sum s(s+1) (see the module docstring)."""
    return 6.0 * matmul_params(config) * tokens + 6.0 * config.n_layers * config.d_model * sum_s_s1


def measured_matmul_flops(
    device: torch.device | str, n: int, dtype: torch.dtype, samples: int = 5, products: int = 50
) -> float:
    """The device's sustained FLOP/s on n x n x n products of random `dtype` matrices (2 n^3 FLOPs each): the median
    of `samples` timings of `products` back-to-back products each, after one untimed sample, synchronized; the
    measured-matmul ceiling an MFU is set beside (the datasheet peak is `PEAK_BF16_FLOPS`)."""
    import statistics
    import time

    import torch

    device = torch.device(device)
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))

    def sample() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(products):
            a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    sample()  # warm-up: kernel selection, clocks
    return products * 2 * n**3 / statistics.median(sample() for _ in range(samples))

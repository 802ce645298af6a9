"""The FLOP count of a step and the GPUs' peak FLOP/s (train/run/flops.py)."""

from __future__ import annotations

import numpy as np

from posfreq.train.model.config import model_preset
from posfreq.train.run.flops import matmul_params, step_flops


def test_attention_flops_term_counts_every_query_key_pair():
    config = model_preset("tiny-2l-128", vocab_size=258)
    segments = np.array([5, 1, 10])
    pairs = sum(p + 1 for s in segments for p in range(s))  # causal (query, key) pairs
    expected = 6 * matmul_params(config) * 16 + 3 * 4 * config.d_model * config.n_layers * pairs
    assert step_flops(config, 16, float((segments * (segments + 1)).sum())) == expected


def test_gpu_names_map_to_their_own_peak():
    from posfreq.train.run.flops import peak_of_device_name

    assert peak_of_device_name("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_of_device_name("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_of_device_name("NVIDIA H100 PCIe") == 756e12  # not the SXM part's peak
    assert peak_of_device_name("NVIDIA L40S") == 362e12  # not the L4's
    assert peak_of_device_name("NVIDIA L4") == 121e12
    assert peak_of_device_name("NVIDIA GeForce RTX 4090") is None  # unknown: MFU is not guessed


def test_the_matmul_rate_is_the_median_of_five_samples_of_fifty_products(monkeypatch):
    """The field's measured-matmul ceiling: one untimed sample, then the median (not the best, not the mean) of 5
    timings of 50 back-to-back products, each 2 n^3 FLOPs."""
    import time

    import torch

    from posfreq.train.run import flops

    durations = iter([0.5, 1.0, 5.0, 2.0, 100.0, 3.0])  # the warm-up, then five samples
    clock = {"now": 0.0, "start": True}
    calls = []

    def perf_counter() -> float:
        if clock["start"]:
            clock["start"] = False
            return clock["now"]
        clock["start"] = True
        clock["now"] += next(durations)
        return clock["now"]

    real_matmul = torch.Tensor.__matmul__

    def counted(a, b):
        calls.append(a.shape)
        return real_matmul(a, b)

    monkeypatch.setattr(time, "perf_counter", perf_counter)
    monkeypatch.setattr(torch.Tensor, "__matmul__", counted)
    rate = flops.measured_matmul_flops("cpu", 8, torch.float32)
    assert len(calls) == 6 * 50 and set(calls) == {(8, 8)}
    assert rate == 50 * 2 * 8**3 / 3.0  # median of 1, 5, 2, 100, 3

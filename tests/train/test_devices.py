"""`--device`: one reading for every command (train.devices.resolve_device)."""

from __future__ import annotations

import pytest
import torch

from posfreq.train import devices
from posfreq.train.devices import resolve_device


def test_auto_is_the_gpu_when_torch_sees_one_else_the_cpu() -> None:
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert resolve_device("cpu") == torch.device("cpu")


def test_a_name_torch_cannot_read_is_refused_with_the_spellings() -> None:
    with pytest.raises(ValueError, match="not a device name. Fix: use auto, cpu, cuda or cuda:N"):
        resolve_device("gpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_cuda_without_a_gpu_is_refused_before_anything_loads() -> None:
    for name in ("cuda", "cuda:0"):
        with pytest.raises(ValueError, match="torch sees no CUDA GPU. Fix: run on a GPU node"):
            resolve_device(name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_index_past_the_last_is_refused() -> None:
    with pytest.raises(ValueError, match="GPU\\(s\\)"):
        resolve_device(f"cuda:{torch.cuda.device_count()}")


HEADER = """
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 535.104.05             Driver Version: 535.104.05   CUDA Version: 12.2     |
|-----------------------------------------+------------------------+----------------------+
"""


def test_the_driver_and_its_cuda_are_read_from_nvidia_smis_header() -> None:
    from posfreq.train.devices import driver_from_header

    assert driver_from_header(HEADER) == ("535.104.05", "12.2")
    assert driver_from_header("NVIDIA-SMI has failed because it couldn't communicate") is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where torch sees no GPU")
def test_a_cuda_build_newer_than_the_driver_is_named_in_one_line() -> None:
    from posfreq.train.devices import gpu_visibility_problem

    newer = gpu_visibility_problem("13.0", ("535.104.05", "12.2"))
    assert "built for CUDA 13.0, but NVIDIA driver 535.104.05 supports CUDA 12.2 at most" in newer
    assert "Fix: install a torch built for a CUDA version the driver supports" in newer
    assert "\n" not in newer
    assert "is a CPU build" in gpu_visibility_problem("", ("535.104.05", "12.2"))
    assert "CUDA_VISIBLE_DEVICES" in gpu_visibility_problem("12.1", ("535.104.05", "12.2"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where torch sees no GPU")
def test_the_doctor_fails_a_gpu_node_whose_torch_sees_none_unless_the_cpu_was_asked_for(
    monkeypatch,
):
    from posfreq.train import devices
    from posfreq.train.preflight.checks import environment

    monkeypatch.setattr(devices, "nvidia_driver", lambda: ("535.104.05", "12.2"))
    with pytest.raises(AssertionError, match="is a CPU build|built for CUDA|CUDA_VISIBLE_DEVICES"):
        environment(torch.device("cpu"))  # --device auto on a GPU node: the first thing to fix
    assert "no CUDA GPU" in environment(torch.device("cpu"), expect_gpu=False)  # --device cpu


def test_gpu_memory_counts_what_the_caching_allocator_holds_unused_as_free(monkeypatch):
    """A double of torch.cuda with the real functions' contracts: the driver's free bytes leave out the blocks
    torch's allocator reserved and no tensor uses; this process can reuse them, so they count as free. Off CUDA
    there is nothing to read."""
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (30 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 40 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 4 * gib)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    assert devices.gpu_memory(torch.device("cuda:0")) == (
        66 * gib,
        80 * gib,
        "NVIDIA H100 80GB HBM3",
    )
    assert devices.gpu_memory(torch.device("cpu")) is None

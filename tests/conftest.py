"""Fixtures shared by several test modules."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module: on a shared 2-core machine more threads make tiny steps ~10x slower, and
    OMP_NUM_THREADS=1 stops Fabric's launcher from giving each process cpu_count // processes threads."""
    before, env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    yield
    torch.set_num_threads(before)
    if env is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = env


class DeviceTensor(torch.Tensor):
    """A tensor with a CUDA tensor's host rule: no numpy view (nor np.asarray) until `.cpu()` or `.to("cpu")`.

    What NCCL collectives return through Fabric is on the GPU; `.tolist()`, `.item()` and `float()` copy to host
    and work, `.numpy()` raises (torch's own message).
    """

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.numpy, torch.Tensor.__array__):
            raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor "
                            "to host memory first.")
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        to_host = func is torch.Tensor.cpu or (func is torch.Tensor.to and any(
            str(a) == "cpu" for a in list(args[1:]) + [kwargs.get("device")]))
        if isinstance(result, torch.Tensor):  # a host copy is a plain tensor; anything else stays on the device
            return result.as_subclass(torch.Tensor if to_host else DeviceTensor)
        return result


def _on_device(value):
    if isinstance(value, torch.Tensor):
        return value.as_subclass(DeviceTensor)
    if isinstance(value, (list, tuple)):
        return type(value)(_on_device(v) for v in value)
    if isinstance(value, dict):
        return {k: _on_device(v) for k, v in value.items()}
    return value


@pytest.fixture
def device_collectives(monkeypatch):
    """Fabric's collectives return their tensors as `DeviceTensor`s, as they do on NCCL (gloo returns host ones)."""
    from lightning.fabric import Fabric

    for name in ("all_reduce", "all_gather", "broadcast"):
        real = getattr(Fabric, name)
        monkeypatch.setattr(Fabric, name, lambda self, *a, _real=real, **k: _on_device(_real(self, *a, **k)))
    return DeviceTensor

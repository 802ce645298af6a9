"""Fixtures shared by several test modules."""

from __future__ import annotations

import os

import pytest
import torch

# The trainer tests' run fixtures (data_dir, resumable, uninterrupted), made once per session; the markers' rule
# (e2e is slow); pytester, to run a small suite in a test.
pytest_plugins = ("helpers.trainer", "helpers.markers", "pytester")

if os.environ.get(
    "PYTEST_XDIST_WORKER"
):  # make test-fast: one worker per core, so one thread per worker
    torch.set_num_threads(1)


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
    """A tensor with a CUDA tensor's rules toward the host: no numpy view (nor np.asarray) until `.cpu()` or
    `.to("cpu")`, and no op mixing it with a host tensor of one or more dimensions (CUDA refuses those too).

    What NCCL collectives return through Fabric is on the GPU; `.tolist()`, `.item()` and `float()` copy to host
    and work, `.numpy()` raises (torch's own message). Results of ops on it stay on the device, tuples included;
    copies into a host tensor (`host.copy_(dev)`, `host[...] = dev`) are host tensors, as on CUDA.
    """

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_flatten, tree_map

        kwargs = kwargs or {}
        if func in (torch.Tensor.numpy, torch.Tensor.__array__):
            raise TypeError(
                "can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor "
                "to host memory first."
            )
        copies_in = func in (torch.Tensor.copy_, torch.Tensor.__setitem__)
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if not copies_in and any(type(t) is torch.Tensor and t.dim() > 0 for t in tensors):
            raise RuntimeError(
                f"{getattr(func, '__name__', func)}: Expected all tensors to be on the same device, "
                "but found at least two devices, cuda:0 and cpu!"
            )
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        to_host = func is torch.Tensor.cpu or (
            func is torch.Tensor.to
            and any(str(a) == "cpu" for a in list(args[1:]) + [kwargs.get("device")])
        )
        host_self = (
            copies_in and type(args[0]) is torch.Tensor
        )  # writing into a host tensor leaves it on the host
        kind = torch.Tensor if to_host or host_self else DeviceTensor
        return tree_map(lambda t: t.as_subclass(kind) if isinstance(t, torch.Tensor) else t, result)


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
        monkeypatch.setattr(
            Fabric, name, lambda self, *a, _real=real, **k: _on_device(_real(self, *a, **k))
        )
    return DeviceTensor


def _restored_environment():
    """Yield once, then put os.environ back as it was."""
    saved = os.environ.copy()
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def restore_environment():
    """Put os.environ back after each test: an in-process Fabric launch sets WORLD_SIZE, LOCAL_RANK, MASTER_PORT...,
    which a later test's library (lm-eval's accelerate) would take for a distributed job."""
    yield from _restored_environment()


@pytest.fixture(autouse=True, scope="module")
def restore_environment_after_module():
    """The same for each test module: a module-scoped fixture's in-process run is set up before any test's own
    snapshot, so what it leaves would otherwise outlive its module."""
    yield from _restored_environment()

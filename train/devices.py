"""The device a command runs on: one reading of `--device auto|cpu|cuda|cuda:N` for every posfreq command, and
why torch sees no GPU on a machine that has one (a CPU build, or a CUDA build newer than the driver)."""

from __future__ import annotations

import re
import shutil
import subprocess

import torch

DRIVER_FIX = (
    "install a torch built for a CUDA version the driver supports, or update the driver "
    "(docs/cluster.md, 'Drivers and torch builds')"
)


def nvidia_driver() -> tuple[str, str] | None:
    """(driver version, highest CUDA version it supports) from nvidia-smi's header, or None without one."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        header = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return driver_from_header(header)


def driver_from_header(header: str) -> tuple[str, str] | None:
    """(driver version, CUDA version) from nvidia-smi's table header ("Driver Version: 535.104.05  CUDA Version: 12.2")."""
    driver = re.search(r"Driver Version:\s*([\d.]+)", header)
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", header)
    return (driver.group(1), cuda.group(1)) if driver and cuda else None


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in version.split(".")[:2])


def gpu_visibility_problem(
    built_for: str | None = None, driver: tuple[str, str] | None = None
) -> str | None:
    """Why torch sees no GPU although the machine has an NVIDIA driver, in one line; None when torch sees one or
    the machine has no driver. `built_for` (torch.version.cuda) and `driver` (nvidia_driver()) for tests."""
    if torch.cuda.is_available():
        return None
    built_for = torch.version.cuda if built_for is None else built_for
    driver = nvidia_driver() if driver is None else driver
    if driver is None:
        return None
    version, supports = driver
    if not built_for:
        return (
            f"this torch ({torch.__version__}) is a CPU build, on a machine with NVIDIA driver {version}. "
            f"Fix: {DRIVER_FIX}"
        )
    if _release(built_for) > _release(supports):
        return (
            f"this torch ({torch.__version__}) is built for CUDA {built_for}, but NVIDIA driver {version} "
            f"supports CUDA {supports} at most, so torch sees no GPU. Fix: {DRIVER_FIX}"
        )
    return (
        f"torch ({torch.__version__}, CUDA {built_for}) sees no GPU although NVIDIA driver {version} "
        f"(CUDA {supports}) is installed: check CUDA_VISIBLE_DEVICES and the job's GPU request"
    )


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
        why = gpu_visibility_problem()
        raise ValueError(
            f"--device {name}, but torch sees no CUDA GPU: {why}"
            if why
            else f"--device {name}, but torch sees no CUDA GPU. Fix: run on a GPU node, or use --device cpu"
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


def gpu_memory(device: torch.device) -> tuple[int, int, str] | None:
    """(free bytes, total bytes, name) of a CUDA device, or None off CUDA. Free is what this process can still
    use: the driver's free memory plus what torch's caching allocator holds unallocated (the driver counts that
    as used, though this process reuses it: an earlier stage of the same process must not shrink the figure)."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free + cached, total, torch.cuda.get_device_name(device)

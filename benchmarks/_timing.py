"""Side-by-side measuring shared by the benchmarks: interleaved repeats, their median and spread, peak memory."""

from __future__ import annotations

import gc
import re
import statistics
from pathlib import Path
from typing import Callable, Sequence


def interleaved(
    run: Callable[[str], float], names: Sequence[str], repeats: int, warm_up: bool = True
) -> dict[str, list[float]]:
    """Seconds of `run(name)` per name: one untimed warm-up each (unless the caller warmed up), then `repeats`
    rounds, order alternating, so that machine noise and cache effects hit every name alike."""
    for name in names if warm_up else ():
        run(name)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            times[name].append(run(name))
    return times


def median(times: list[float]) -> float:
    """The median of the repeats."""
    return statistics.median(times)


def spread(times: list[float]) -> str:
    """min-max of the repeats, as +/- percent of the median."""
    mid = median(times)
    return f"-{100 * (mid - min(times)) / mid:.0f}/+{100 * (max(times) - mid) / mid:.0f}%"


def _status_kib(field: str) -> int:
    return int(
        re.search(rf"^{field}:\s+(\d+)", Path("/proc/self/status").read_text(), re.M).group(1)
    )


def extra_peak_bytes(call: Callable[[], object]) -> int:
    """The extra peak resident memory of one `call` (Linux): the kernel's peak-RSS mark is reset first.
    Run it in a process started with MALLOC_MMAP_THRESHOLD_=65536, so that every sizeable tensor is
    mapped on allocation and unmapped when freed, and resident memory follows live tensors."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS mark to the current RSS
    before = _status_kib("VmRSS")
    call()
    return (_status_kib("VmHWM") - before) * 1024

"""Side-by-side timing shared by the benchmarks: interleaved repeats, their median and spread."""

from __future__ import annotations

import statistics
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

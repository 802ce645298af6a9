"""Length-aware sampling: how many copies of each document an epoch holds, by its length (and source).

Fu et al. 2024 ('Data Engineering for Scaling Language Models to 128K Context') keep the source
mixture and upsample long documents within each source. Here a weight w per length bucket is the
expected number of copies of a document per epoch: floor(w) copies, plus one more with
probability w - floor(w), drawn afresh every epoch from a seeded generator (so 0.5 keeps about
half of a bucket's documents, a different half each epoch; 2 repeats each document twice).

Weights are written as a mapping from bucket keys to weights::

    {"0-1024": 0.5, "4096-": 2.0, "RedPajamaArXiv:8192-": 3.0}

``LO-HI`` is a document length (tokens, EOS included) in [LO, HI); ``LO-`` has no upper bound;
``SOURCE:LO-HI`` applies to that source's documents only and takes precedence over the
source-free buckets for them. Buckets of one scope may not overlap; lengths no bucket names keep
weight 1. Numpy only: the packing schedule (train/data/packing_schedule.py) and the run config use it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

_KEY = re.compile(r"^(?:(?P<source>[^:]+):)?(?P<lo>\d+)-(?P<hi>\d*)$")


@dataclass(frozen=True)
class Bucket:
    """One weighted range of document lengths, optionally of one source only."""

    key: str
    """The key it was written as (for messages and the canonical mapping)."""
    source: str | None
    """The source it applies to; None: every source."""
    lo: int
    """Shortest length in the bucket (inclusive)."""
    hi: int | None
    """Length at which the bucket ends (exclusive); None: no upper bound."""
    weight: float
    """Expected copies per epoch of a document in the bucket."""

    def contains(self, lengths: np.ndarray) -> np.ndarray:
        """Which of `lengths` fall in [lo, hi)."""
        inside = lengths >= self.lo
        return inside if self.hi is None else inside & (lengths < self.hi)


@dataclass(frozen=True)
class LengthUpsample:
    """Weights per length bucket (and source) giving each document's copies per epoch; empty: one copy each."""

    buckets: tuple[Bucket, ...] = ()
    """The weighted buckets, source-free ones first, then per source (each group by `lo`)."""

    @classmethod
    def parse(
        cls, weights: Mapping[str, float] | None, where: str = "length_upsample"
    ) -> "LengthUpsample":
        """Check and parse a {key: weight} mapping (module docstring); ValueError names the offending key."""
        buckets = []
        for key, weight in (weights or {}).items():
            match = _KEY.match(str(key))
            if match is None:
                raise ValueError(
                    f"{where}[{key!r}]: a key is LO-HI, LO- or SOURCE:LO-HI with token lengths LO < HI, "
                    "e.g. '0-1024', '4096-', 'RedPajamaArXiv:8192-'"
                )
            lo, hi = int(match["lo"]), int(match["hi"]) if match["hi"] else None
            if hi is not None and hi <= lo:
                raise ValueError(f"{where}[{key!r}]: empty range, HI={hi} must be > LO={lo}")
            if (
                isinstance(weight, bool)
                or not isinstance(weight, (int, float))
                or not math.isfinite(weight)
                or weight < 0
            ):
                raise ValueError(
                    f"{where}[{key!r}]={weight!r}: a weight is a finite number >= 0 (expected copies "
                    "of a document per epoch)"
                )
            buckets.append(Bucket(str(key), match["source"], lo, hi, float(weight)))
        buckets.sort(key=lambda b: (b.source is not None, b.source or "", b.lo))
        for a, b in zip(buckets, buckets[1:]):
            if a.source == b.source and (a.hi is None or a.hi > b.lo):
                raise ValueError(
                    f"{where}[{b.key!r}] overlaps {where}[{a.key!r}]: the buckets of one scope must be "
                    "disjoint"
                )
        reach = 1  # the source-free zero-weight buckets cover every length from 1 up to here
        for b in buckets:
            if b.source is None and b.weight == 0 and b.lo <= reach:
                reach = math.inf if b.hi is None else b.hi
        if reach == math.inf and not any(b.source is not None and b.weight > 0 for b in buckets):
            raise ValueError(
                f"{where}: every document length has weight 0, so an epoch would hold no document"
            )
        return cls(tuple(buckets))

    def __bool__(self) -> bool:
        """Whether any bucket is set (an empty upsample keeps every document once)."""
        return bool(self.buckets)

    @property
    def sources(self) -> tuple[str, ...]:
        """The sources that have buckets of their own, sorted."""
        return tuple(sorted({b.source for b in self.buckets if b.source is not None}))

    def as_dict(self) -> dict[str, float]:
        """The canonical {key: weight} mapping (recorded in sampler states and checkpoints)."""
        return {b.key: b.weight for b in self.buckets}

    def weights(
        self,
        lengths: np.ndarray,
        sources: np.ndarray | None = None,
        source_names: Sequence[str] = (),
    ) -> np.ndarray:
        """Expected copies per epoch of each document; `sources[k]` indexes `source_names` (None: no sources)."""
        lengths = np.asarray(lengths, dtype=np.int64)
        out = np.ones(len(lengths), dtype=np.float64)
        for bucket in self.buckets:
            selected = bucket.contains(lengths)
            if bucket.source is not None:
                if sources is None or bucket.source not in source_names:
                    raise ValueError(
                        f"length_upsample[{bucket.key!r}]: no documents of source {bucket.source!r} "
                        + (
                            f"(the corpus's sources: {sorted(source_names)})"
                            if sources is not None
                            else "(these documents carry no source)"
                        )
                    )
                selected &= np.asarray(sources) == list(source_names).index(bucket.source)
            out[selected] = (
                bucket.weight
            )  # source buckets come last, so they override the source-free ones
        return out

    def copies(
        self,
        lengths: np.ndarray,
        rng: np.random.Generator,
        sources: np.ndarray | None = None,
        source_names: Sequence[str] = (),
    ) -> np.ndarray:
        """Copies of each document in one epoch: floor(w), plus one with probability w - floor(w) (draws from `rng`)."""
        w = self.weights(lengths, sources, source_names)
        whole = np.floor(w)
        return (whole + (rng.random(len(w)) < w - whole)).astype(np.int64)

"""What a trainer trains from a corpus, per packing strategy: the trainer's own packing plan
(train/data/packing_schedule.py) over the corpus's document lengths, one epoch, no tokens.

A histogram has no document order, so the documents are laid out in a seeded random order: the
prediction is exact in distribution, not row by row. best_fit and padded train exactly the corpus f
(with their padding); concat cuts the pieces again at every row boundary; stream cuts documents only at row
boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from posfreq.analysis.corpus.frequency import position_frequency, position_shares, scale_to_budget
from posfreq.analysis.corpus.histogram import LengthHistogram
from posfreq.train.data.packing_schedule import (
    EpochPrediction,
    RowPacking,
    predict_trained_histogram,
)
from posfreq.train.data.packing_strategies import STRATEGIES, Documents
from posfreq.train.data.records import CorpusError
from posfreq.train.data.upsample import LengthUpsample
from posfreq.train.run.config import DataSection, TrainConfig


@dataclass(frozen=True)
class PackingSettings:
    """The trainer's settings that decide what one epoch trains (its `data.*` keys, `seed`, `global_batch_tokens`)."""

    strategies: tuple[str, ...] = STRATEGIES
    """Packing strategies to predict (data.packing)."""
    length_upsample: Mapping[str, float] = field(default_factory=dict)
    """Expected copies per epoch of a document by its length (and source), as data.length_upsample."""
    seed: int = 0
    """The run's seed: the documents' order (a histogram has none) and the plan's shuffles."""
    shuffle_block: int = DataSection.shuffle_block
    """Documents per shuffle block (data.shuffle_block; best_fit's packing buffer)."""
    global_batch_tokens: int = TrainConfig.global_batch_tokens
    """Tokens per optimizer step, padding included: tokens lost per step = padding share x this."""

    def as_dict(self) -> dict:
        """The settings as summary.json records them."""
        return {
            "strategies": list(self.strategies),
            "length_upsample": dict(self.length_upsample),
            "seed": self.seed,
            "shuffle_block": self.shuffle_block,
            "global_batch_tokens": self.global_batch_tokens,
        }


Predictions = Mapping[int, Mapping[str, EpochPrediction]]
"""One epoch's trained-length histogram per training length L and packing strategy."""


def predict_packing(
    histogram: LengthHistogram, train_lens: Sequence[int], settings: PackingSettings
) -> Predictions:
    """One epoch's trained-length histogram per L and strategy: the trainer's packing plan over the corpus's
    document lengths, laid out in a seeded random order (exact in distribution; module docstring)."""
    upsample = LengthUpsample.parse(settings.length_upsample, where="--length-upsample")
    missing = sorted(set(upsample.sources) - set(histogram.sources))
    if missing:
        raise CorpusError(
            f"--length-upsample names sources this corpus does not have: {missing} (its sources: "
            f"{histogram.sources})"
        )
    documents = Documents.from_histogram(
        histogram.by_source if upsample.sources else histogram.counts(), seed=settings.seed
    )
    return {
        L: {
            strategy: predict_trained_histogram(
                documents,
                L,
                seed=settings.seed,
                packing=RowPacking(
                    strategy=strategy, shuffle_block=settings.shuffle_block, upsample=upsample
                ),
            )
            for strategy in settings.strategies
        }
        for L in train_lens
    }


def packing_stats(prediction: EpochPrediction, train_len: int, global_batch_tokens: int) -> dict:
    """One strategy's numbers at one L: where its trained position occurrences sit and what its padding costs."""
    segments = prediction.histogram
    return {
        **position_shares(position_frequency(segments, train_len)),
        "share_segments_at_L": float(segments[train_len] / segments.sum()),
        "padding_share": prediction.padding_share,
        "tokens_lost_per_step": prediction.padding_share * global_batch_tokens,
        "rows_per_epoch": prediction.rows,
        "tokens_per_epoch": prediction.tokens,
    }


def trained_at_budget(
    prediction: EpochPrediction, train_len: int, total_tokens: float
) -> np.ndarray:
    """A strategy's trained f after `total_tokens` training tokens (steps x tokens per step, padding included)."""
    return scale_to_budget(
        position_frequency(prediction.histogram, train_len),
        total_tokens,
        positions=prediction.rows * train_len,
    )

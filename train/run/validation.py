"""Validation loss on held-out shards, in total and by distance: the same rows every time and for any world size,
split over ranks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posfreq.train.data.packing import PackedBatch, PackedSampler
from posfreq.train.data.packing_schedule import RowPacking
from posfreq.train.data.tokens.shards import TokenDataset
from posfreq.train.run.config import TrainConfig
from posfreq.train.run.loss_by_distance import LossByDistance, add_batch, rows_in_one_pass


def validation_sampler(dataset: TokenDataset, cfg: TrainConfig) -> PackedSampler:
    """Validation's rows: data.val_len tokens (default train_len), packed as training packs, in order. One per run:
    it counts the rows (`validation_rows`) and builds them (`ValidationBatches`) from one planned schedule."""
    return PackedSampler(
        dataset,
        cfg.data.val_len or cfg.data.train_len,
        cfg.micro_batch_rows,
        seed=0,
        packing=RowPacking(cfg.data.packing, cfg.data.attention, shuffle=False),
    )


def validation_rows(sampler: PackedSampler, wanted: int) -> int:
    """The rows validation scores: `wanted` (data.val_rows), or fewer when the held-out shards hold fewer in one
    pass (more would score the same tokens twice); 0 when they hold not one row."""
    return rows_in_one_pass(sampler.schedule, wanted)


@dataclass(frozen=True)
class ValidationBatches:
    """One rank's share of the validation rows, as batches built once and kept: the same rows at every validation
    (rebuilding them planned the held-out set's first block each time, opening every one of its shards)."""

    length: int  # tokens per row
    batches: list[
        tuple[PackedBatch, bool]
    ]  # (batch, whether its rows count: a rank past the last row still runs)

    @classmethod
    def build(
        cls, sampler: PackedSampler, micro: int, total: int, world_size: int, rank: int
    ) -> ValidationBatches:
        """The first `total` rows (`validation_rows`) of the validation `sampler`, `micro` (micro_batch_rows) at a
        time, dealt over ranks; every rank gets the same number of batches (FSDP's collectives need one forward
        each)."""
        batches = []
        for step in range(-(-total // (world_size * micro))):
            first = (step * world_size + rank) * micro
            rows = min(micro, total - first)
            batches.append((sampler.make_batch(first if rows > 0 else 0, max(rows, 1)), rows > 0))
        return cls(sampler.train_len, batches)


def validation_loss(model, fabric, rows: ValidationBatches) -> tuple[float, int, LossByDistance]:
    """(mean token loss, targets, loss by distance) over the validation rows, split over ranks: one forward per
    batch gives both (train/run/loss_by_distance.py).

    No shuffle and its own sampler, so values compare across steps and runs; the training stream,
    the RNG and the model's mode are left as they were.
    """
    table = LossByDistance.empty(rows.length - 1)
    model.eval()
    with torch.no_grad():
        for batch, counted in rows.batches:
            # a rank past the last row still runs the forward its peers' collectives need
            add_batch(table if counted else LossByDistance.empty(1), model, batch.to(fabric.device))
    model.train()
    table = table.with_totals(fabric.all_reduce(table.as_tensor(fabric.device), reduce_op="sum"))
    targets = int(table.tokens.sum())
    return float(table.loss_sum.sum()) / max(targets, 1), targets, table


def validation_due(cfg: TrainConfig, run_tokens: int, last_step: bool) -> bool:
    """Validate after this step: every data.val_every_tokens tokens, and at the last step of the run."""
    every = cfg.data.val_every_tokens
    crossed = every > 0 and run_tokens // every > (run_tokens - cfg.global_batch_tokens) // every
    return crossed or last_step

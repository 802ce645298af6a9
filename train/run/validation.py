"""Validation loss on held-out shards, in total and by distance: the same rows every time and for any world size,
split over ranks."""

from __future__ import annotations

import torch

from posfreq.train.data.packing import PackedSampler
from posfreq.train.data.shards import TokenDataset
from posfreq.train.run.config import TrainConfig
from posfreq.train.run.loss_by_distance import LossByDistance, add_batch, rows_in_one_pass


def _sampler(dataset: TokenDataset, cfg: TrainConfig) -> PackedSampler:
    """Validation's rows: data.val_len tokens (default train_len), packed as training packs, in order."""
    return PackedSampler(
        dataset,
        cfg.data.val_len or cfg.data.train_len,
        cfg.micro_batch_rows,
        seed=0,
        packing=cfg.data.packing,
        attention=cfg.data.attention,
        shuffle=False,
    )


def validation_rows(dataset: TokenDataset, cfg: TrainConfig) -> int:
    """The rows validation scores: data.val_rows, or fewer when the held-out shards hold fewer in one pass (more
    would score the same tokens twice); 0 when they hold not one row."""
    return rows_in_one_pass(_sampler(dataset, cfg).schedule, cfg.data.val_rows)


def validation_loss(
    model, fabric, dataset: TokenDataset, cfg: TrainConfig, total: int
) -> tuple[float, int, LossByDistance]:
    """(mean token loss, targets, loss by distance) over the first `total` rows (`validation_rows`) of `dataset`,
    split over ranks: one forward per batch gives both (train/run/loss_by_distance.py).

    No shuffle and its own sampler, so values compare across steps and runs; the training stream,
    the RNG and the model's mode are left as they were.
    """
    micro = cfg.micro_batch_rows
    sampler = _sampler(dataset, cfg)
    table = LossByDistance.empty(sampler.train_len - 1)
    model.eval()
    with torch.no_grad():
        # the same count on every rank (FSDP)
        for step in range(-(-total // (fabric.world_size * micro))):
            first = (step * fabric.world_size + fabric.global_rank) * micro
            rows = min(micro, total - first)
            batch = sampler.make_batch(first if rows > 0 else 0, max(rows, 1)).to(fabric.device)
            # a rank past the last row still runs the forward its peers' collectives need
            add_batch(table if rows > 0 else LossByDistance.empty(1), model, batch)
    model.train()
    table = table.with_totals(fabric.all_reduce(table.as_tensor(fabric.device), reduce_op="sum"))
    targets = int(table.tokens.sum())
    return float(table.loss_sum.sum()) / max(targets, 1), targets, table


def validation_due(cfg: TrainConfig, run_tokens: int, last_step: bool) -> bool:
    """Validate after this step: every data.val_every_tokens tokens, and at the last step of the run."""
    every = cfg.data.val_every_tokens
    crossed = every > 0 and run_tokens // every > (run_tokens - cfg.global_batch_tokens) // every
    return crossed or last_step

"""Loss by distance: the mean next-token loss at each position within its document, from evaluation forwards.

A target predicted from the token at offset d of its attention segment (d tokens after the segment's first,
so the prediction can reach back over d relative positions) counts at distance d. Distances below
EXACT_DISTANCES have a bucket each; beyond, BUCKETS_PER_OCTAVE log-spaced buckets per doubling. Each bucket
keeps its token count and loss sum (float64), so tables of several batches, ranks or runs add exactly.
The validation forward of the trainer fills one (train/run/validation.py), and so does `posfreq
loss-by-distance` on any model and token shards; analysis joins it with f(i) of the same distances.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from posfreq.train.data.packing import IGNORE_INDEX, PackedSampler
from posfreq.train.data.packing_schedule import RowPacking
from posfreq.train.data.packing_strategies import TOKEN_STREAMS
from posfreq.train.data.tokens.shards import TokenDataset
from posfreq.train.model.loss import default_chunk_tokens, head_returns_loss

EXACT_DISTANCES = 64
BUCKETS_PER_OCTAVE = 8


class RowsBeyondData(ValueError):
    """More rows asked for than the token shards hold once at that length: the rest would re-read the same tokens."""


def distance_edges(max_distance: int) -> np.ndarray:
    """Bucket edges [e_0 = 0, e_1, ...] covering distances 0..max_distance: width 1 below EXACT_DISTANCES, then
    BUCKETS_PER_OCTAVE geometric steps per doubling (rounded, strictly increasing); bucket k holds
    e_k <= d < e_{k+1}."""
    edges = list(range(min(EXACT_DISTANCES, max_distance + 1) + 1))
    step = 2 ** (1 / BUCKETS_PER_OCTAVE)
    while edges[-1] <= max_distance:
        edges.append(max(edges[-1] + 1, int(round(edges[-1] * step))))
    return np.array(edges, dtype=np.int64)


def segment_offsets(cu_seqlens: Tensor, total: int) -> Tensor:
    """The offset of each of `total` packed tokens within its segment of `cu_seqlens`."""
    starts = cu_seqlens[:-1].long()
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.arange(total, device=cu_seqlens.device) - torch.repeat_interleave(starts, lengths)


@dataclass
class LossByDistance:
    """Per-bucket token counts and loss sums over `edges` (distance_edges)."""

    edges: np.ndarray
    tokens: np.ndarray
    loss_sum: np.ndarray

    @classmethod
    def empty(cls, max_distance: int) -> LossByDistance:
        edges = distance_edges(max_distance)
        return cls(edges, np.zeros(len(edges) - 1, np.int64), np.zeros(len(edges) - 1, np.float64))

    def add(self, losses: Tensor, distances: Tensor, counted: Tensor) -> None:
        """Add per-token `losses` at `distances` where `counted` (a target that is not ignored)."""
        bucket = np.searchsorted(self.edges, distances[counted].cpu().numpy(), side="right") - 1
        values = losses[counted].double().cpu().numpy()
        self.tokens += np.bincount(bucket, minlength=len(self.tokens))[: len(self.tokens)]
        self.loss_sum += np.bincount(bucket, weights=values, minlength=len(self.tokens))[
            : len(self.tokens)
        ]

    def as_tensor(self, device: torch.device) -> Tensor:
        """(2, buckets) float64: counts and sums, for an all-reduce across ranks."""
        return torch.tensor(
            np.stack([self.tokens.astype(np.float64), self.loss_sum]), device=device
        )

    def with_totals(self, totals: Tensor) -> LossByDistance:
        """This table's edges with the counts and sums of `totals` (as_tensor's layout, after a reduction)."""
        values = totals.cpu().numpy()
        return LossByDistance(self.edges, values[0].round().astype(np.int64), values[1])

    def mean(self) -> np.ndarray:
        """Mean loss per bucket (NaN where a bucket holds no token)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.tokens > 0, self.loss_sum / np.maximum(self.tokens, 1), np.nan)

    def to_dict(self) -> dict:
        """The JSON a checkpoint and a results folder store: edges, tokens and loss sums per bucket."""
        return {
            "edges": self.edges.tolist(),
            "tokens": self.tokens.tolist(),
            "loss_sum": self.loss_sum.tolist(),
        }

    @classmethod
    def from_dict(cls, data: dict) -> LossByDistance:
        edges = np.asarray(data["edges"], dtype=np.int64)
        tokens = np.asarray(data["tokens"], dtype=np.int64)
        loss_sum = np.asarray(data["loss_sum"], dtype=np.float64)
        if not (len(edges) == len(tokens) + 1 == len(loss_sum) + 1 and np.all(np.diff(edges) > 0)):
            raise ValueError(
                "a loss-by-distance table needs increasing edges and one count and sum per bucket"
            )
        return cls(edges, tokens, loss_sum)


def add_batch(table: LossByDistance, model, batch) -> None:
    """One evaluation forward of a packed batch: its per-token losses added to `table` by distance."""
    with head_returns_loss(model.lm_head, batch.targets, per_token=True):
        losses = model(batch.input_ids, batch.cu_seqlens, batch.max_seqlen)
    distances = segment_offsets(batch.cu_seqlens, batch.input_ids.shape[0])
    table.add(losses, distances, batch.targets != IGNORE_INDEX)


def add_segments(table: LossByDistance, causal_lm, batch) -> None:
    """What `add_batch` adds, for a model that cannot attend within packed documents (any transformers causal
    LM): each segment of the packed batch is its own forward from position 0, which is what within-document
    attention computes."""
    bounds = batch.cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        targets = batch.targets[start:end]
        if not bool((targets != IGNORE_INDEX).any()):  # a padding segment
            continue
        logits = causal_lm(input_ids=batch.input_ids[None, start:end]).logits[0]
        # float32 cross-entropy a chunk of rows at a time: no second (L, V) tensor beside the logits
        rows = default_chunk_tokens(logits.shape[-1])
        losses = torch.cat(
            [
                F.cross_entropy(part.float(), t, ignore_index=IGNORE_INDEX, reduction="none")
                for part, t in zip(logits.split(rows), targets.split(rows))
            ]
        )
        distances = torch.arange(end - start, device=targets.device)
        table.add(losses, distances, targets != IGNORE_INDEX)


def rows_in_one_pass(schedule, rows: int) -> int:
    """`rows` if the first `rows` rows of `schedule` (train/data/packing_schedule.py) lie within its first epoch,
    else how many do: the rows a single pass over the data fills, wholly (no row wrapping into the next epoch)."""
    upr = schedule.units_per_row
    cursor, _ = schedule.locate(rows * upr - 1)  # walks only as far as the rows asked for
    if cursor.epoch == 0:
        return rows
    return schedule.epoch_start(1) // upr


@dataclass(frozen=True)
class ScoredRows:
    """The rows `measure` scores: the first `count` rows of `train_len` tokens packed (`packing`) from a token-shard
    `dataset`, in order (no shuffle), `batch_rows` rows per forward; the trainer's validation rows are such rows."""

    dataset: TokenDataset
    train_len: int
    count: int
    batch_rows: int = 4
    packing: str = "concat"


def check_rows(scored: ScoredRows) -> PackedSampler:
    """The in-order sampler of `scored`; RowsBeyondData when one pass over its dataset holds fewer than its
    `count` rows (more would count the same tokens again), ValueError for no rows or rows of no tokens. Rows that
    the data's token count already cannot hold are refused before any packing plan (a huge --train-len at once)."""
    dataset, train_len, rows, packing = (
        scored.dataset,
        scored.train_len,
        scored.count,
        scored.packing,
    )
    if train_len < 1 or rows < 1:
        raise ValueError(f"need train_len >= 1 and rows >= 1; got {train_len} and {rows}")
    bound = dataset.num_tokens // train_len  # no packing fits more rows of train_len into one pass
    sampler = None
    if rows > bound:
        held, exact = bound, packing in TOKEN_STREAMS  # a token stream fills exactly that many
    else:
        in_order = RowPacking(packing, shuffle=False)
        sampler = PackedSampler(dataset, train_len, scored.batch_rows, seed=0, packing=in_order)
        held, exact = rows_in_one_pass(sampler.schedule, rows), True
    if held < rows:
        fix = (
            f"ask for at most {held} rows (--rows), or shorter rows (--train-len)"
            if held
            else f"ask for rows shorter than its {dataset.num_tokens:,} tokens (--train-len)"
        )
        raise RowsBeyondData(
            f"{dataset.directory} holds {'' if exact else 'at most '}{held} rows of {train_len} tokens "
            f"({packing} packing), not the {rows} asked for: more would read the same tokens again. Fix: {fix}, "
            "or prepare more data"
        )
    return sampler


def measure(
    model,
    scored: ScoredRows,
    device: torch.device | str = "cpu",
    per_segment: bool = False,
    sampler: PackedSampler | None = None,
) -> LossByDistance:
    """The loss by distance of `model` (eval mode) over the rows `scored` names: any checkpoint, imported model or
    corpus, with the rows and buckets the trainer's validation uses. per_segment=True: `model` is a transformers
    causal LM, run a segment at a time (`add_segments`). Rows beyond one pass over the data (the sampler's first
    epoch) are refused with RowsBeyondData: they would count the same tokens again. `sampler`: `check_rows`'s
    answer for `scored` where the caller already has it (planning the rows reads the data)."""
    if sampler is None:
        sampler = check_rows(scored)
    table = LossByDistance.empty(scored.train_len - 1)
    add = add_segments if per_segment else add_batch
    rows, batch_rows = scored.count, scored.batch_rows
    with torch.no_grad():
        for first in range(0, rows, batch_rows):
            batch = sampler.make_batch(first, min(batch_rows, rows - first)).to(device)
            add(table, model, batch)
    return table

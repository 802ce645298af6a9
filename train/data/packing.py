"""Packed batches of rows of L tokens with cu_seqlens, and the resumable, rank-aware sampler that makes them.

Which pieces of which documents fill each row is the packing schedule's (train/data/packing_schedule.py:
epochs, shuffle blocks, length upsampling; train/data/packing_strategies.py: ``concat``, ``best_fit``,
``padded``, ``stream``), computed from document lengths alone; this module reads those rows' tokens and turns them into batches.

Targets are the next token inside the same attention segment; the last position of every
segment (and every padding position) gets -100, so no target lies across a boundary the
attention cannot see. Rotary position ids restart at 0 at every segment start. Padding (token
``pad_id``, default the data's EOS) is its own attention segment.

Ranks: the global row stream is cut into global batches of ``rows_per_batch * world_size``
rows; rank r takes the r-th contiguous block of ``rows_per_batch`` rows of each. The sampler's
state is the index of the next global row plus the plan's cursor of the block it lies in, so
resuming reads no row twice and plans at most the blocks from that cursor on.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np
import torch

from posfreq.train.data.packing_schedule import Cursor, PackingSchedule, RowPacking
from posfreq.train.data.packing_strategies import RowLayout
from posfreq.train.data.tokens.shards import PREPARE_HINT, TokenDataset, concat_ranges

IGNORE_INDEX = -100
"""Target of positions that have none (a segment's last token, padding): skipped by the loss."""


@dataclass(frozen=True)
class PackedBatch:
    """`rows` rows of `train_len` tokens, flattened, with the attention segments of each row.

    `segment_lengths` are the lengths of the segments that hold document tokens (what the
    trainer bincounts into the trained-length histogram); padding segments are in `cu_seqlens`
    but not in `segment_lengths`, so the two agree exactly when there is no padding (always
    under ``concat`` and ``stream``).
    """

    input_ids: torch.Tensor  # (rows * train_len,) int64
    targets: torch.Tensor  # (rows * train_len,) int64, IGNORE_INDEX where there is no target
    position_ids: torch.Tensor  # (rows * train_len,) int64, 0 at every segment start
    cu_seqlens: torch.Tensor  # (n_segments + 1,) int32 over the flattened batch
    max_seqlen: int
    segment_lengths: np.ndarray  # int64 lengths of the non-padding segments
    rows: int
    train_len: int

    @property
    def num_tokens(self) -> int:
        """Tokens in the batch (rows * train_len), padding included."""
        return self.rows * self.train_len

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "PackedBatch":
        """The same batch with its tensors on `device`."""
        move = lambda t: t.to(device, non_blocking=non_blocking)  # noqa: E731
        return replace(
            self,
            input_ids=move(self.input_ids),
            targets=move(self.targets),
            position_ids=move(self.position_ids),
            cu_seqlens=move(self.cu_seqlens),
        )


def assemble(layout: RowLayout, dataset: TokenDataset, pad_id: int) -> PackedBatch:
    """The batch of a row layout: its runs' tokens read from `dataset`, padding, targets, position ids."""
    total, cuts = layout.rows * layout.train_len, layout.cuts
    tokens = dataset.read_runs(dataset.token_offsets(layout.docs) + layout.starts, layout.lengths)
    seg_lengths = np.diff(cuts)
    padded = not layout.real.all()
    if padded:  # the runs are scattered over their rows; the rest is padding
        placed, tokens = tokens, np.full(total, pad_id, dtype=np.int64)
        tokens[concat_ranges(layout.dest, layout.lengths)] = placed
    targets = np.empty(total, dtype=np.int64)
    targets[:-1] = tokens[1:]
    targets[cuts[1:] - 1] = IGNORE_INDEX
    if padded:
        targets[np.repeat(~layout.real, seg_lengths)] = IGNORE_INDEX
    positions = np.arange(total, dtype=np.int64) - np.repeat(cuts[:-1], seg_lengths)
    return PackedBatch(
        input_ids=torch.from_numpy(tokens),
        targets=torch.from_numpy(targets),
        position_ids=torch.from_numpy(positions),
        cu_seqlens=torch.from_numpy(cuts.astype(np.int32)),
        max_seqlen=int(seg_lengths.max()),
        segment_lengths=layout.segment_lengths().astype(np.int64),
        rows=layout.rows,
        train_len=layout.train_len,
    )


class PackedSampler:
    """Endless, deterministic, rank-aware stream of `PackedBatch`es with exact mid-epoch resume.

    Each `next()` returns this rank's `rows_per_batch` rows of the next global batch, the rows
    of `self.schedule` (train/data/packing_schedule.py). `state_dict()` is the same on every rank and can be
    loaded into a sampler with another world size or batch size: the stream continues at the
    next global row.
    """

    def __init__(
        self,
        dataset: TokenDataset,
        train_len: int,
        rows_per_batch: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        *,
        packing: RowPacking | None = None,
        pad_id: int | None = None,
    ) -> None:
        if rows_per_batch < 1:
            raise ValueError(f"need rows_per_batch >= 1; got {rows_per_batch}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        if dataset.num_tokens == 0:
            raise ValueError(f"{dataset.directory} holds no tokens. {PREPARE_HINT}")
        self.schedule = PackingSchedule(dataset, train_len, packing or RowPacking(), seed=seed)
        self.dataset = dataset
        self.train_len, self.rows_per_batch, self.seed = train_len, rows_per_batch, seed
        self.rank, self.world_size = rank, world_size
        self.pad_id = dataset.eos_id if pad_id is None else pad_id
        self.next_row = 0  # index of the first row of the next global batch

    def make_batch(self, first_row: int, rows: int) -> PackedBatch:
        """Rows [first_row, first_row + rows) of the global stream, as one batch."""
        return assemble(self.schedule.layout(first_row, rows), self.dataset, self.pad_id)

    # -- iteration and state -------------------------------------------------------------------

    @property
    def rows_per_global_batch(self) -> int:
        """Rows that one step consumes over all ranks."""
        return self.rows_per_batch * self.world_size

    def _cursor(self) -> Cursor:
        """The plan's cursor of the block that the next global batch starts in."""
        return self.schedule.locate(self.next_row * self.schedule.units_per_row)[0]

    @property
    def epoch(self) -> int:
        """The epoch that the next batch starts in."""
        return self._cursor().epoch

    def __iter__(self) -> Iterator[PackedBatch]:
        """The sampler is its own (endless) iterator."""
        return self

    def __next__(self) -> PackedBatch:
        """This rank's rows of the next global batch; advances the stream by one global batch."""
        batch = self.make_batch(
            self.next_row + self.rank * self.rows_per_batch, self.rows_per_batch
        )
        self.next_row += self.rows_per_global_batch
        return batch

    def _stream_identity(self) -> dict:
        """Settings that define the row stream; a saved state is only valid for the same ones."""
        rows = self.schedule.row_packing
        return {
            "seed": self.seed,
            "train_len": self.train_len,
            "packing": rows.strategy,
            "attention": rows.attention,
            "shuffle": rows.shuffle,
            "shuffle_block": rows.shuffle_block,
            "length_upsample": rows.upsample.as_dict(),
            "num_docs": self.dataset.num_docs,
            "num_tokens": self.dataset.num_tokens,
            "pad_id": self.pad_id,
        }

    def state_dict(self) -> dict:
        """Where the stream stands (identical on every rank): the next global row, the cursor of its block, its
        epoch and unit offset in that epoch (tokens under concat and stream, else rows), plus the settings that define it."""
        cursor = self._cursor()
        return {
            "next_row": self.next_row,
            "epoch": cursor.epoch,
            "position_in_epoch": self.next_row * self.schedule.units_per_row
            - cursor.epoch_first_unit,
            "cursor": list(cursor),
            **self._stream_identity(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue the stream where `state` left it; refuses a state from another stream. A state saved before the
        training length had one name calls it `seq_len`."""
        if "seq_len" in state and "train_len" not in state:
            state = {("train_len" if k == "seq_len" else k): v for k, v in state.items()}
        mine = self._stream_identity()
        diff = {k: (state.get(k), v) for k, v in mine.items() if state.get(k) != v}
        if diff:
            detail = ", ".join(f"{k}: saved {a!r} vs now {b!r}" for k, (a, b) in diff.items())
            raise ValueError(
                f"sampler state belongs to a different data stream ({detail}). Fix: resume "
                "with the data directory and data settings of the saved run."
            )
        self.schedule.remember(Cursor(*state["cursor"]))
        self.next_row = int(state["next_row"])

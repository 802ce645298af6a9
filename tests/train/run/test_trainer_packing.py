"""The trainer's packing end to end: tiny models trained for one epoch train exactly the predicted
histogram (and brute-force Eq. 2), skip target-free steps, and resume the packed stream exactly.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.packing import PIECE_RULES, naive_f, naive_pieces

from posfreq.analysis.corpus.frequency import position_frequency
from posfreq.train.checkpoint import layout as ckpt
from posfreq.train.checkpoint.load import model_state_dict
from posfreq.train.data.packing import IGNORE_INDEX, PackedSampler
from posfreq.train.data.packing_schedule import (
    PackingSchedule,
    RowPacking,
    predict_trained_histogram,
)
from posfreq.train.data.packing_strategies import STRATEGIES
from posfreq.train.data.tokens.shard_files import ShardWriter
from posfreq.train.data.tokens.shards import TokenDataset
from posfreq.train.model.transformer import Transformer
from posfreq.train.run import pretrain
from posfreq.train.run.config import config_from_dict

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


L_TRAIN = 16


def byte_shards(directory: Path, lengths: list[int]) -> Path:
    """Byte-tokenized documents of these lengths (EOS included; a length-1 document is just EOS), two shards."""
    for s, part in enumerate((lengths[::2], lengths[1::2])):
        with ShardWriter(
            directory, f"s{s}", tokenizer="bytes", vocab_size=258, eos_id=257
        ) as writer:
            for n in part:
                writer.add([97 + (k * 7 + n) % 26 for k in range(n - 1)] + [257])
    return directory


@pytest.fixture(scope="module")
def train_dir(tmp_path_factory) -> Path:
    """Documents of 1..3L+1 tokens: 1-token documents and 1-token pieces (L + 1), full pieces, everything between."""
    rng = np.random.default_rng(1)
    lengths = [1, 1, L_TRAIN + 1, 2 * L_TRAIN, 3 * L_TRAIN + 1] + rng.integers(
        1, 2 * L_TRAIN, size=25
    ).tolist()
    return byte_shards(tmp_path_factory.mktemp("train"), lengths)


def one_row_steps(data_dir: Path, out: Path, steps: int, **data) -> dict:
    """A tiny CPU run of `steps` optimizer steps of one row of L_TRAIN tokens each."""
    return {
        "out": str(out),
        "seed": 3,
        "total_tokens": steps * L_TRAIN,
        "global_batch_tokens": L_TRAIN,
        "micro_batch_rows": 1,
        "accelerator": "cpu",
        "devices": 1,
        "precision": "32-true",
        "resume": "auto",
        "model": {
            "preset": "tiny-2l-128",
            "attention_backend": "sdpa",
            "overrides": {
                "n_layers": 1,
                "d_model": 32,
                "n_heads": 2,
                "n_kv_heads": 1,
                "ffn_dim": 64,
            },
        },
        "data": {"dir": str(data_dir), "train_len": L_TRAIN, "shuffle_block": 7, **data},
        "optim": {"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 2},
        "checkpoint": {"every_tokens": 10**9, "latest_every_steps": 0, "latest_every_minutes": 0},
        "logging": {"progress_bar": False},
    }


def final_lengths(out: Path, steps: int) -> np.ndarray:
    return ckpt.load_trained_lengths(out / "checkpoints" / ckpt.milestone_name(steps * L_TRAIN))


@pytest.mark.slow
@pytest.mark.parametrize(
    "packing,upsample",
    [("concat", {}), ("best_fit", {}), ("padded", {}), ("best_fit", {"1-2": 0.5, "17-": 2.0})],
)
def test_one_epoch_trains_exactly_the_predicted_histogram(
    train_dir, tmp_path, packing, upsample
) -> None:
    prediction = predict_trained_histogram(
        TokenDataset(train_dir),
        L_TRAIN,
        seed=3,
        packing=RowPacking(strategy=packing, shuffle_block=7, upsample=upsample),
    )
    history = pretrain.train(
        config_from_dict(
            one_row_steps(
                train_dir, tmp_path, prediction.rows, packing=packing, length_upsample=upsample
            )
        )
    )
    assert len(history) == prediction.rows
    trained = final_lengths(tmp_path, prediction.rows)
    assert np.array_equal(trained, prediction.histogram)
    assert np.array_equal(
        position_frequency(trained, L_TRAIN), position_frequency(prediction.histogram, L_TRAIN)
    )
    if packing in PIECE_RULES and not upsample:
        pieces = naive_pieces(TokenDataset(train_dir).doc_lengths(), L_TRAIN)
        assert np.array_equal(position_frequency(trained, L_TRAIN), naive_f(pieces, L_TRAIN))
    empty = [r for r in history if r["skipped"]]
    assert all(r["skip_reason"] == "no_targets" and math.isnan(r["loss"]) for r in empty)
    if packing == "padded":  # the 1-token pieces are rows without a target
        assert len(empty) == int(prediction.histogram[1])


@pytest.mark.slow
@pytest.mark.parametrize("packing", STRATEGIES)
def test_steps_without_targets_skip_cleanly_and_are_counted(tmp_path, packing) -> None:
    data = byte_shards(
        tmp_path / "data", [1] * 40
    )  # every document is a lone EOS: no row has a target
    cfg = one_row_steps(data, tmp_path / "run", 3, packing=packing, shuffle_block=64)  # one block
    history = pretrain.train(config_from_dict(cfg))
    assert [(r["skipped"], r["skip_reason"]) for r in history] == [(True, "no_targets")] * 3
    assert all(math.isnan(r["loss"]) for r in history)
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [r["skip_reason"] for r in rows if "skip_reason" in r] == ["no_targets"] * 3
    start = ckpt.milestone_name(3 * L_TRAIN)
    saved = model_state_dict(tmp_path / "run/checkpoints" / start)
    torch.manual_seed(3)
    fresh = Transformer(ckpt.load_model_config(tmp_path / "run/checkpoints" / start)).state_dict()
    assert all(torch.equal(saved[k], fresh[k]) for k in fresh), (
        "a step without targets changed the weights"
    )
    # concat and stream: one-token documents end to end, 3 rows of them; best_fit: rows of 16, 16, 8
    expected = {"concat": 3 * L_TRAIN, "stream": 3 * L_TRAIN, "best_fit": 40, "padded": 3}[packing]
    assert np.array_equal(
        final_lengths(tmp_path / "run", 3), np.bincount([1] * expected, minlength=L_TRAIN + 1)
    )


@pytest.mark.slow
def test_a_one_block_model_validates_then_saves(tmp_path) -> None:
    """Validation is a forward without backward, after which FSDP2's root and last block kept their gathered
    parameters: with one block no parameter was sharded at the save, and Fabric refused the checkpoint ("Could
    not find a distributed model"). Every module is resharded after validation now."""
    data = byte_shards(tmp_path / "data", [30] * 20)
    cfg = one_row_steps(data, tmp_path / "run", 3)  # one block (n_layers 1)
    cfg["data"].update(val_dir=str(data), val_rows=2)
    history = pretrain.train(config_from_dict(cfg))
    assert len(history) == 3 and all(math.isfinite(r["loss"]) for r in history)
    end = tmp_path / "run/checkpoints" / ckpt.milestone_name(3 * L_TRAIN)
    assert model_state_dict(end)  # saved after the last step's validation, and readable


@pytest.mark.slow
def test_trainer_resume_with_best_fit_and_upsampling_matches_an_uninterrupted_run(
    train_dir, tmp_path
) -> None:
    data = {"packing": "best_fit", "length_upsample": {"1-2": 0.5, "17-": 2.0}}
    steps = (
        predict_trained_histogram(
            TokenDataset(train_dir),
            L_TRAIN,
            seed=3,
            packing=RowPacking(
                strategy="best_fit", shuffle_block=7, upsample=data["length_upsample"]
            ),
        ).rows
        + 5
    )  # into the second epoch
    full = pretrain.train(
        config_from_dict(one_row_steps(train_dir, tmp_path / "full", steps, **data))
    )
    first = pretrain.train(
        config_from_dict(
            {
                **one_row_steps(train_dir, tmp_path / "split", steps, **data),
                "stop_at_step": steps // 2,
            }
        )
    )
    second = pretrain.train(
        config_from_dict(one_row_steps(train_dir, tmp_path / "split", steps, **data))
    )
    assert np.array_equal(
        [r["loss"] for r in first + second], [r["loss"] for r in full], equal_nan=True
    )
    assert np.array_equal(
        final_lengths(tmp_path / "split", steps), final_lengths(tmp_path / "full", steps)
    )
    state = ckpt.read_trainer_state(tmp_path / "split/checkpoints/latest")["sampler"]
    assert state["packing"] == "best_fit" and state["length_upsample"] == {"1-2": 0.5, "17-": 2.0}


def test_sampler_state_of_the_old_spelling_resumes_and_another_stream_is_refused(tmp_path):
    """A state saved when the training length was called seq_len continues the same rows; a state of another
    training length is refused, naming the setting."""
    ds = TokenDataset(byte_shards(tmp_path, [5, 17, 40, 3, 64, 9, 33]))
    first = PackedSampler(ds, 16, 2, seed=4)
    next(first)
    legacy = {("seq_len" if k == "train_len" else k): v for k, v in first.state_dict().items()}
    resumed = PackedSampler(ds, 16, 2, seed=4)
    resumed.load_state_dict(legacy)
    assert torch.equal(next(resumed).input_ids, next(first).input_ids)
    with pytest.raises(ValueError, match="train_len: saved 16 vs now 8"):
        PackedSampler(ds, 8, 2, seed=4).load_state_dict(first.state_dict())


def test_an_epoch_whose_draws_keep_no_document_is_passed_not_fatal(tmp_path):
    """Weight 0.5 on a 3-document corpus: some epoch draws no copy at all (the review found epoch 6 for seed 0);
    the stream goes on with the next epoch, every row still a real row; weights that give every present document 0
    are refused."""
    ds = TokenDataset(byte_shards(tmp_path, [9, 12, 7]))
    plan = PackingSchedule(
        ds, 8, seed=0, packing=RowPacking(strategy="concat", upsample={"0-": 0.5})
    )
    empty = [e for e in range(40) if plan.predict_epoch(e).tokens == 0]
    assert empty, "no empty epoch drawn: pick another seed for this test"
    sampler = PackedSampler(ds, 8, 2, seed=0, packing=RowPacking(upsample={"0-": 0.5}))
    for _ in range(60):  # walks well past the first empty epoch
        batch = next(sampler)
        assert (batch.targets != IGNORE_INDEX).any()
    with pytest.raises(ValueError, match="gives every document weight 0"):
        next(PackedSampler(ds, 8, 2, seed=0, packing=RowPacking(upsample={"0-100": 0.0})))

"""Loss by distance (train/run/loss_by_distance.py) against an independent per-token computation: a plain forward,
log-softmax in float64, and every target's distance counted by hand over packed rows of several documents."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers.hf import save_tiny_hf
from helpers.trainer import run, tiny

from posfreq.train.checkpoint import layout as ckpt
from posfreq.train.checkpoint.load import load_model
from posfreq.train.data.packing import IGNORE_INDEX
from posfreq.train.model.config import model_preset
from posfreq.train.model.loss import head_returns_loss, token_losses
from posfreq.train.model.transformer import Transformer
from posfreq.train.run.loss_by_distance import (
    EXACT_DISTANCES,
    LossByDistance,
    distance_edges,
    segment_offsets,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_edges_are_exact_near_and_log_spaced_far():
    edges = distance_edges(4095)
    assert edges[: EXACT_DISTANCES + 1].tolist() == list(range(EXACT_DISTANCES + 1))
    assert np.all(np.diff(edges) > 0) and edges[-1] > 4095 and edges[-2] <= 4095
    far = edges[edges >= 256]
    assert np.allclose(far[1:] / far[:-1], 2 ** (1 / 8), rtol=0.01)  # 8 buckets per doubling
    assert distance_edges(9).tolist() == list(
        range(11)
    )  # short rows: every distance its own bucket


def test_token_losses_equal_cross_entropy_of_full_logits():
    torch.manual_seed(0)
    hidden, weight = torch.randn(37, 16), torch.randn(50, 16)
    targets = torch.randint(0, 50, (37,))
    targets[[3, 20]] = IGNORE_INDEX
    expected = F.cross_entropy(
        (hidden @ weight.T).double(), targets, ignore_index=IGNORE_INDEX, reduction="none"
    )
    got = token_losses(hidden, weight, targets, chunk_tokens=8)
    assert torch.allclose(got.double(), expected, atol=1e-5) and got[3] == got[20] == 0


def naive_table(logits: torch.Tensor, targets: torch.Tensor, segments: list[int], edges) -> tuple:
    """Per-bucket token counts and mean loss, by loops: each target's distance is its predicting token's offset
    in its document, found by walking the documents one by one."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    counts, sums = np.zeros(len(edges) - 1, np.int64), np.zeros(len(edges) - 1)
    position = 0
    for length in segments:
        for offset in range(length):
            target = int(targets[position])
            if target != IGNORE_INDEX:
                bucket = max(k for k in range(len(edges) - 1) if edges[k] <= offset)
                counts[bucket] += 1
                sums[bucket] -= float(logp[position, target])
            position += 1
    return counts, sums / np.maximum(counts, 1)


def test_loss_by_distance_equals_a_plain_forward_counted_by_hand():
    torch.manual_seed(0)
    model = Transformer(model_preset("tiny-2l-128", vocab_size=97, train_len=96)).eval()
    segments = [
        40,
        7,
        1,
        48,
        96,
        3,
        61,
        32,
    ]  # three rows of 96: several documents each, one whole row
    tokens = torch.randint(0, 97, (sum(segments),))
    cu = torch.tensor(np.cumsum([0, *segments]), dtype=torch.int32)
    targets = torch.full_like(tokens, IGNORE_INDEX)
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        targets[start : end - 1] = tokens[start + 1 : end]  # next token within the document
    with torch.no_grad():
        logits = model(tokens, cu, max(segments))
        with head_returns_loss(model.lm_head, targets, per_token=True):
            losses = model(tokens, cu, max(segments))
    table = LossByDistance.empty(95)
    table.add(losses, segment_offsets(cu, len(tokens)), targets != IGNORE_INDEX)
    counts, means = naive_table(logits, targets, segments, table.edges)
    assert table.tokens.tolist() == counts.tolist()
    assert sum(counts) == sum(s - 1 for s in segments)
    held = counts > 0
    assert (
        np.allclose(table.mean()[held], means[held], atol=1e-5)
        and np.isnan(table.mean()[~held]).all()
    )
    again = LossByDistance.from_dict(json.loads(json.dumps(table.to_dict())))
    assert again.tokens.tolist() == table.tokens.tolist() and np.allclose(
        again.loss_sum, table.loss_sum
    )


@pytest.mark.slow  # a subprocess or a training run
def test_every_milestone_stores_the_validation_loss_by_distance_and_a_resume_gives_the_same(
    data_dir, tmp_path
):
    val = {"data.val_dir": str(data_dir), "data.val_every_tokens": 10**9, "data.val_rows": 6}
    run(tiny(data_dir, tmp_path / "whole", **val))
    run(tiny(data_dir, tmp_path / "resumed", stop_at_step=5, **val))
    run(tiny(data_dir, tmp_path / "resumed", **val))
    for tokens in (4096, 8192):
        name = ckpt.milestone_name(tokens)
        stored = [
            json.loads(
                (tmp_path / r / "checkpoints" / name / ckpt.LOSS_BY_DISTANCE_FILE).read_text()
            )
            for r in ("whole", "resumed")
        ]
        assert (
            stored[0] == stored[1]
        )  # validation at every milestone, even when val_every_tokens is not due
        assert stored[0]["tokens_trained"] == tokens and sum(stored[0]["tokens"]) > 0
    metrics = (tmp_path / "whole/metrics.jsonl").read_text().splitlines()
    last = [json.loads(r) for r in metrics if "val_loss" in r][-1]
    table = LossByDistance.from_dict(stored[0])
    assert last["val_targets"] == int(table.tokens.sum())
    assert last["val_loss"] == pytest.approx(table.loss_sum.sum() / table.tokens.sum(), rel=1e-12)


def test_a_transformers_model_a_segment_at_a_time_equals_packed_rows_of_the_imported_model(
    data_dir, tmp_path, monkeypatch
):
    """`add_segments` (any causal LM, one forward per document piece) against posfreq's packed forward with
    within-document attention, on the same Llama weights: the same tokens in every bucket, the same losses.
    The segments' cross-entropy runs 7 rows at a time, so chunk edges fall inside segments."""
    transformers = pytest.importorskip("transformers")
    from posfreq.train.data.tokens.shards import TokenDataset
    from posfreq.train.model.hf import load_hf_model
    from posfreq.train.run import loss_by_distance
    from posfreq.train.run.loss_by_distance import ScoredRows, measure

    monkeypatch.setattr(loss_by_distance, "default_chunk_tokens", lambda vocab_size: 7)

    save_tiny_hf(
        tmp_path,
        tokenizer=False,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        max_position_embeddings=256,
    )
    dataset = TokenDataset(data_dir)
    rows = ScoredRows(dataset, 128, 6, batch_rows=3)
    packed = measure(load_hf_model(tmp_path).eval(), rows)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    one_by_one = measure(hf.eval(), rows, per_segment=True)
    assert one_by_one.tokens.tolist() == packed.tokens.tolist() and packed.tokens.sum() > 500
    assert np.allclose(one_by_one.loss_sum, packed.loss_sum, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # a training run
def test_validation_rows_of_another_length_score_the_same_tokens_as_measure(data_dir, tmp_path):
    """data.val_len: a run validates on rows of that length, distances past its training length included, and the
    stored table is `measure` of the milestone's model on the same rows."""
    from posfreq.train.data.tokens.shards import TokenDataset
    from posfreq.train.run.loss_by_distance import ScoredRows, measure

    cfg = tiny(data_dir, tmp_path / "run", **{"data.val_dir": str(data_dir), "data.val_rows": 4})
    train_len = cfg["data"]["train_len"]
    cfg["data"]["val_len"] = 2 * train_len
    run(cfg)
    milestone = sorted((tmp_path / "run" / "checkpoints").glob("tokens-*"))[-1]
    stored = LossByDistance.from_dict(
        json.loads((milestone / ckpt.LOSS_BY_DISTANCE_FILE).read_text())
    )
    assert stored.edges[-2] <= 2 * train_len - 1 < stored.edges[-1]
    assert stored.tokens[stored.edges[:-1] >= train_len].sum() > 0  # distances it never trained
    model, _, _ = load_model(milestone)
    packing = cfg["data"].get("packing", "concat")
    again = measure(
        model.eval(),
        ScoredRows(TokenDataset(data_dir), 2 * train_len, 4, cfg["micro_batch_rows"], packing),
    )
    assert stored.tokens.tolist() == again.tokens.tolist()
    assert np.allclose(stored.loss_sum, again.loss_sum, rtol=1e-6)

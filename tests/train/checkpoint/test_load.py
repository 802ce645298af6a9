"""train/checkpoint/load.py: what a checkpoint says about its model, read without building it (`CheckpointInfo`),
checked field by field against the files written into a consolidated directory by hand."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from posfreq.train.checkpoint import layout as ckpt
from posfreq.train.checkpoint.load import model_fingerprint, read_checkpoint_info
from posfreq.train.model.config import ModelConfig
from posfreq.train.model.transformer import Transformer

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def consolidated(directory: Path, **files: dict | np.ndarray) -> Path:
    """A random tiny model as a consolidated directory, plus `files` (name -> JSON dict or .npy array)."""
    from safetensors.torch import save_file

    config = ModelConfig(
        vocab_size=258, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32, train_len=64
    )
    torch.manual_seed(0)
    directory.mkdir(parents=True)
    state = {k: v.clone() for k, v in Transformer(config).state_dict().items()}
    save_file(state, str(directory / ckpt.CONSOLIDATED_WEIGHTS))
    (directory / "model_config.json").write_text(json.dumps(config.to_dict()))
    for name, content in files.items():
        if isinstance(content, np.ndarray):
            np.save(directory / name, content, allow_pickle=False)
        else:
            (directory / name).write_text(json.dumps(content))
    return directory


def test_read_checkpoint_info_reads_every_field(tmp_path):
    lengths = np.arange(65, dtype=np.int64)
    path = consolidated(
        tmp_path / "model",
        **{
            "tokenizer_spec.json": {"spec": "bytes", "bos_in_training": True},
            "trained_lengths.npy": lengths,
            "trainer.json": {"run_tokens": 4096, "tokens_trained": 5120},
            "meta.json": {"run_tokens": 1},  # trainer.json wins
        },
    )
    info = read_checkpoint_info(str(path))
    assert info.path == path and info.config == ckpt.load_model_config(path)
    assert info.tokenizer_spec == "bytes" and info.bos_in_training is True
    np.testing.assert_array_equal(info.trained_lengths, lengths)
    assert (info.run_tokens, info.tokens_trained) == (4096, 5120)
    assert info.fingerprint == model_fingerprint(path)


def test_read_checkpoint_info_defaults_for_absent_files(tmp_path):
    bare = read_checkpoint_info(consolidated(tmp_path / "bare"))
    assert bare.tokenizer_spec is None and bare.bos_in_training is False
    assert bare.trained_lengths is None
    assert (bare.run_tokens, bare.tokens_trained) == (None, None)
    meta = read_checkpoint_info(consolidated(tmp_path / "meta", **{"meta.json": {"run_tokens": 7}}))
    assert (meta.run_tokens, meta.tokens_trained) == (7, 7)


def test_token_counts_of_checkpoints_written_before_the_rename(tmp_path):
    """Older trainer.json files hold the run's tokens as tokens_seen and the warm-up's as tokens_before."""
    older = {"trainer.json": {"tokens_seen": 4096, "tokens_before": 1024}}
    info = read_checkpoint_info(consolidated(tmp_path / "older", **older))
    assert (info.run_tokens, info.tokens_trained) == (4096, 5120)
    meta = ckpt.with_token_names({"step": 3, "tokens_seen": 30})
    assert meta == {"step": 3, "run_tokens": 30, "tokens_trained": 30}
    assert ckpt.with_token_names(meta) is meta  # today's names pass through


def test_read_checkpoint_info_names_the_path_and_the_fix(tmp_path):
    with pytest.raises(ckpt.CheckpointError, match=r"missing does not exist\. Fix: pass RUN/"):
        read_checkpoint_info(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        ckpt.CheckpointError, match=r"empty is not a checkpoint \(no model_config.json\)\. Fix:"
    ):
        read_checkpoint_info(tmp_path / "empty")


class FakeFabric:
    """One rank of a job: `broadcast` hands every rank what rank 0 sent (`from_rank_0` on the others)."""

    def __init__(self, rank: int, from_rank_0=None) -> None:
        self.global_rank, self.from_rank_0, self.sent = rank, from_rank_0, []

    def broadcast(self, value, src: int = 0):
        self.sent.append(value)
        return value if self.global_rank == 0 else self.from_rank_0


def test_only_rank_0_reads_the_checksums_and_every_rank_gets_its_verdict(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from posfreq.train.checkpoint import load

    path = consolidated(tmp_path / "model")
    config = ckpt.load_model_config(path)
    state = load.verified_on_rank_0(path, config, FakeFabric(0), "model.init_from")
    expected = load_file(str(path / ckpt.CONSOLIDATED_WEIGHTS))
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[k], expected[k]) for k in expected)

    def damaged(_path):
        raise ckpt.CheckpointError(f"{_path}/state.pt: its sha256 differs")

    monkeypatch.setattr(load, "verify_before_reading", damaged)
    rank0 = FakeFabric(0)
    with pytest.raises(
        ckpt.CheckpointError, match=r"^model.init_from: .*state.pt: its sha256 differs"
    ):
        load.verified_on_rank_0(path, config, rank0, "model.init_from")
    assert rank0.sent == [f"model.init_from: {path}/state.pt: its sha256 differs"]
    # another rank never reads the checksums: it raises rank 0's verdict
    monkeypatch.setattr(load, "verify_before_reading", lambda _path: pytest.fail("rank 1 hashed"))
    with pytest.raises(ckpt.CheckpointError, match="^model.init_from: damaged$"):
        load.verified_on_rank_0(path, config, FakeFabric(1, "model.init_from: damaged"), "x")

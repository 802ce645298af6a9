"""Trainer tests on CPU: loss falls, exact resume, atomic checkpoints, length histogram, accumulation."""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from train import checkpoint as ckpt
from train import pretrain
from train.data import PackedSampler, ShardWriter, TokenDataset
from train.run_config import ConfigError, config_from_dict, parse_args

ROOT = Path(__file__).resolve().parent.parent
WORDS = "the cat sat on a mat and then it ran to the red house where a dog slept all day".split()


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: on a shared 2-core machine, more threads make these tiny steps 10x slower."""
    before, env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"  # else Fabric's launcher sets cpu_count // processes threads
    yield
    torch.set_num_threads(before)
    if env is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = env


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """Two byte-tokenized shards of short, learnable synthetic documents (5-600 bytes)."""
    out = tmp_path_factory.mktemp("shards")
    rng = np.random.default_rng(0)
    for s in range(2):
        with ShardWriter(out, f"shard-{s:03d}", tokenizer="bytes", vocab_size=258, eos_id=257) as writer:
            for d in range(150):
                n = int(rng.integers(1, 100))
                text = " ".join(WORDS[(3 * i + d) % len(WORDS)] for i in range(n)) + "."
                writer.add(list(text.encode()) + [257])
    return out


def tiny(data_dir: Path, out: Path, **overrides) -> dict:
    """A config dict small enough for a step in a fraction of a second."""
    cfg = {
        "out_dir": str(out), "seed": 1, "total_tokens": 8 * 1024, "global_batch_tokens": 1024,
        "micro_batch_rows": 4, "accelerator": "cpu", "devices": 1, "precision": "32-true", "resume": "auto",
        "model": {"preset": "tiny-2l-128", "overrides": {"d_model": 64, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128},
                  "attention_backend": "sdpa"},
        "data": {"dir": str(data_dir), "seq_len": 128},
        "optim": {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2},
        "checkpoint": {"every_tokens": 4096, "latest_every_steps": 2, "latest_every_minutes": 0},
        "logging": {"progress_bar": False},
    }
    for key, value in overrides.items():
        node = cfg
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return cfg


def run(cfg: dict) -> list[dict]:
    return pretrain.train(config_from_dict(cfg))


def weights(directory: Path) -> dict[str, torch.Tensor]:
    return ckpt.model_state_dict(directory)


def test_loss_falls(data_dir, tmp_path):
    history = run(tiny(data_dir, tmp_path, total_tokens=20 * 1024, **{"checkpoint.latest_every_steps": 0,
                                                                         "checkpoint.every_tokens": 10**9}))
    losses = [row["loss"] for row in history]
    assert len(losses) == 20 and all(math.isfinite(x) for x in losses)
    assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:3]), losses
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, 21))
    assert {"loss", "lr", "grad_norm", "tokens", "tokens_per_s", "mfu"} <= set(lines[0])


def test_resume_is_bitwise_identical_and_histogram_matches(data_dir, tmp_path):
    full = run(tiny(data_dir, tmp_path / "full"))
    first = run(tiny(data_dir, tmp_path / "split", stop_at_step=3))
    assert (tmp_path / "split/checkpoints/latest").is_dir()
    second = run(tiny(data_dir, tmp_path / "split"))
    assert [r["step"] for r in first + second] == list(range(1, 9))
    assert [r["loss"] for r in first + second] == [r["loss"] for r in full]
    assert [r["grad_norm"] for r in first + second] == [r["grad_norm"] for r in full]
    end = ckpt.milestone_name(8 * 1024)
    a, b = weights(tmp_path / "full/checkpoints" / end), weights(tmp_path / "split/checkpoints" / end)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    logged = [json.loads(x)["loss"] for x in (tmp_path / "split/metrics.jsonl").read_text().splitlines()]
    assert logged == [r["loss"] for r in full]

    # Independent count: a fresh sampler, one global batch of 8 rows per step, lengths from cu_seqlens.
    sampler = PackedSampler(TokenDataset(data_dir), 128, 8, seed=1)
    expected = np.zeros(129, dtype=np.int64)
    for step in range(8):
        expected += np.bincount(np.diff(next(sampler).cu_seqlens.numpy()), minlength=129)
        if step == 3:  # the milestone at 4096 tokens holds the first 4 steps
            got = ckpt.load_trained_lengths(tmp_path / "split/checkpoints" / ckpt.milestone_name(4096))
            assert np.array_equal(got, expected)
    for run_dir in ("full", "split"):
        assert np.array_equal(ckpt.load_trained_lengths(tmp_path / run_dir / "checkpoints" / end), expected)
    assert expected.sum() > 8 * 8 and expected[128] > 0  # many segments, some full rows


def test_init_from_carries_weights_and_trained_lengths(data_dir, tmp_path):
    run(tiny(data_dir, tmp_path / "warm", total_tokens=4096))
    warm = tmp_path / "warm/checkpoints" / ckpt.milestone_name(4096)
    # Continued at a longer training length, with lr 0: the single step changes nothing, so the
    # weights must be the warm-up's, and the histogram the warm-up's plus this step's segments.
    run(tiny(data_dir, tmp_path / "next", total_tokens=1024, **{"model.init_from": str(warm), "optim.lr": 0.0,
                                                                "optim.min_lr": 0.0, "data.seq_len": 256}))
    final = tmp_path / "next/checkpoints" / ckpt.milestone_name(1024)
    a, b = weights(warm), weights(final)
    assert all(torch.equal(a[k], b[k]) for k in a)
    own = np.bincount(np.diff(next(PackedSampler(TokenDataset(data_dir), 256, 4, seed=1)).cu_seqlens.numpy()),
                      minlength=257)
    carried = np.zeros(257, dtype=np.int64)
    carried[:129] = ckpt.load_trained_lengths(warm)
    assert np.array_equal(ckpt.load_trained_lengths(final), carried + own)
    # Each checkpoint records the length it was trained at (STRING's defaults derive from it).
    assert [json.loads((d / "model_config.json").read_text())["max_seq_len"] for d in (warm, final)] == [128, 256]
    other = tiny(data_dir, tmp_path / "bad", **{"model.init_from": str(warm), "model.overrides.d_model": 128})
    with pytest.raises(ConfigError, match="init_from"):
        run(other)
    shorter = tiny(data_dir, tmp_path / "short", **{"model.init_from": str(final), "data.seq_len": 128})
    with pytest.raises(ConfigError, match="longer than data.seq_len"):
        run(shorter)


def test_gradient_accumulation_matches_one_big_batch(data_dir, tmp_path):
    cfg = dict(total_tokens=2 * 1024, **{"checkpoint.latest_every_steps": 0})
    micro = run(tiny(data_dir, tmp_path / "micro", micro_batch_rows=2, **cfg))  # 4 micro-batches
    big = run(tiny(data_dir, tmp_path / "big", micro_batch_rows=8, **cfg))  # one batch of 8 rows
    for m, b in zip(micro, big):
        assert m["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert m["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    end = ckpt.milestone_name(2048)
    a, b = weights(tmp_path / "micro/checkpoints" / end), weights(tmp_path / "big/checkpoints" / end)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5)


def test_crash_while_writing_never_leaves_a_resumable_partial(data_dir, tmp_path, monkeypatch):
    cfg = tiny(data_dir, tmp_path, total_tokens=6 * 1024, **{"checkpoint.every_tokens": 10**9})
    real_publish = ckpt.publish
    calls = []

    def crashing_publish(tmp: Path, final: Path) -> None:
        calls.append(final)
        if len(calls) == 2:  # the second save dies after writing everything, before the rename
            raise KeyboardInterrupt("simulated kill")
        real_publish(tmp, final)

    monkeypatch.setattr(ckpt, "publish", crashing_publish)
    with pytest.raises(KeyboardInterrupt):
        run(cfg)
    root = tmp_path / "checkpoints"
    assert (root / "latest.tmp" / ckpt.TRAINER_FILE).is_file()  # complete-looking, but .tmp
    assert ckpt.find_resume_checkpoint(tmp_path) == root / "latest"
    assert ckpt.read_trainer_state(root / "latest")["step"] == 2

    # A kill between the two renames of a replacement leaves `latest.old`, which is complete.
    os.replace(root / "latest", root / "latest.old")
    assert ckpt.find_resume_checkpoint(tmp_path) == root / "latest.old"
    # A half-written directory (state without trainer.json) is never picked.
    shutil.copytree(root / "latest.old", root / "tokens-000000000999999")
    (root / "tokens-000000000999999" / ckpt.TRAINER_FILE).unlink()
    assert ckpt.find_resume_checkpoint(tmp_path) == root / "latest.old"

    monkeypatch.setattr(ckpt, "publish", real_publish)
    history = run(cfg)  # resumes from step 2, removes the stale .tmp
    assert [r["step"] for r in history] == [3, 4, 5, 6]
    assert not (root / "latest.tmp").exists()


def test_consolidate_and_load_model(data_dir, tmp_path):
    run(tiny(data_dir, tmp_path, total_tokens=2048))
    src = tmp_path / "checkpoints" / ckpt.milestone_name(2048)
    out = ckpt.consolidate(src, tmp_path / "model")
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "model.safetensors", "model_config.json",
                                                    "tokenizer_spec.json", "trained_lengths.npy"]
    m1, tok, meta = ckpt.load_model(src)
    m2, tok2, meta2 = ckpt.load_model(out, dtype=torch.float32)
    assert tok == tok2 == {"spec": "bytes", "vocab_size": 258, "bos_id": 256, "eos_id": 257}
    assert meta["tokens_seen"] == meta2["tokens_seen"] == 2048
    ids = torch.arange(40) % 258
    torch.testing.assert_close(m1(ids), m2(ids), rtol=0, atol=0)
    assert m1.generate(ids[None, :8], 4) == m2.generate(ids[None, :8], 4)


def test_nonfinite_loss_stops_with_resume_hint_or_skips(data_dir, tmp_path):
    cfg = tiny(data_dir, tmp_path / "stop", total_tokens=6 * 1024, **{"optim.lr": 1e30, "optim.warmup_steps": 1,
                                                                        "optim.grad_clip": 0.0,
                                                                        "checkpoint.latest_every_steps": 1})
    with pytest.raises(FloatingPointError, match=r"non-finite loss or gradient norm .* at step \d+ .*resume from .*latest"):
        run(cfg)
    cfg = tiny(data_dir, tmp_path / "skip", total_tokens=6 * 1024, on_nonfinite="skip",
               **{"optim.lr": 1e30, "optim.warmup_steps": 1, "optim.grad_clip": 0.0})
    history = run(cfg)
    assert len(history) == 6 and history[-1]["skipped"]


def test_signal_saves_latest_and_requeues(data_dir, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setattr(pretrain.subprocess, "run", lambda cmd, check: calls.append(cmd))
    real_step = pretrain.Trainer._train_step

    def step_then_signal(self, batches, n):
        out = real_step(self, batches, n)
        if self.step == 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        return out

    monkeypatch.setattr(pretrain.Trainer, "_train_step", step_then_signal)
    history = run(tiny(data_dir, tmp_path, **{"checkpoint.latest_every_steps": 0}))
    assert [r["step"] for r in history] == [1, 2, 3]  # seen at the next step's all-reduce, then saved
    assert ckpt.read_trainer_state(tmp_path / "checkpoints/latest")["step"] == 3
    assert calls == [["scontrol", "requeue", "4242"]]
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def test_bad_configs_fail_before_compute(data_dir, tmp_path):
    cases = [
        (tiny(data_dir, tmp_path, optim={"lrr": 1.0}), "unknown config keys \\['optim.lrr'\\]"),
        (tiny(data_dir, tmp_path, data={"dir": str(tmp_path / "missing"), "seq_len": 128}), "does not exist"),
        (tiny(data_dir, tmp_path, data={"dir": "", "seq_len": 128}), "data.dir is empty"),
        (tiny(data_dir, tmp_path, global_batch_tokens=1000), "not a whole number of micro-batches"),
        (tiny(data_dir, tmp_path, micro_batch_rows=3), "not a whole number of micro-batches"),
        (tiny(data_dir, tmp_path, **{"data.seq_len": 8192, "global_batch_tokens": 8192 * 4,
                                     "model.overrides.max_seq_len": 4096}), "exceeds the model's max_seq_len"),
        (tiny(data_dir, tmp_path, seed="x"), "seed='x' should be of type int"),
    ]
    (tmp_path / "empty").mkdir()
    cases.append((tiny(data_dir, tmp_path, data={"dir": str(tmp_path / "empty"), "seq_len": 128}), "no token shards"))
    for cfg, message in cases:
        with pytest.raises(ConfigError, match=message):
            pretrain.Plan(config_from_dict(cfg), world_size=1)

    run(tiny(data_dir, tmp_path / "a", total_tokens=1024, **{"checkpoint.latest_every_steps": 1}))
    changed = tiny(data_dir, tmp_path / "a", **{"optim.lr": 1e-3})
    with pytest.raises(ConfigError, match="different config:\n  optim.lr: checkpoint 0.003 vs now 0.001"):
        pretrain.Plan(config_from_dict(changed), world_size=1)
    # Run-time settings may change on resume.
    pretrain.Plan(config_from_dict(tiny(data_dir, tmp_path / "a", micro_batch_rows=2, total_tokens=4096)), 1)


def test_cli_overrides_and_schedule(data_dir):
    cfg = parse_args(["--config", str(ROOT / "configs/pretrain_2k.yaml"), "--optim.lr", "1e-3",
                      "--data.dir", str(data_dir), "--checkpoint.sharded", "false"])
    assert cfg.optim.lr == 1e-3 and cfg.data.dir == str(data_dir) and cfg.checkpoint.sharded is False
    assert cfg.global_batch_tokens == 4_194_304 and cfg.total_tokens == 10**12
    lrs = [pretrain.lr_at(s, cfg, 238_419) for s in (0, 1999, 2000, 120_000, 238_418, 300_000)]
    assert lrs[0] == pytest.approx(1e-3 / 2000) and lrs[1] == pytest.approx(1e-3) and lrs[2] == pytest.approx(1e-3)
    assert cfg.optim.min_lr < lrs[3] < 1e-3 and lrs[4] == pytest.approx(cfg.optim.min_lr, rel=1e-6)
    assert lrs[5] == cfg.optim.min_lr


def test_attention_flops_term_counts_every_query_key_pair():
    config = pretrain.model_preset("tiny-2l-128", vocab_size=258)
    segments = np.array([5, 1, 10])
    pairs = sum(p + 1 for s in segments for p in range(s))  # causal (query, key) pairs
    expected = 6 * pretrain.matmul_params(config) * 16 + 3 * 4 * config.d_model * config.n_layers * pairs
    assert pretrain.step_flops(config, 16, float((segments * (segments + 1)).sum())) == expected


def test_two_gloo_processes_match_one_process(data_dir, tmp_path):
    single = run(tiny(data_dir, tmp_path / "one", micro_batch_rows=2))
    base = [sys.executable, str(ROOT / "train/pretrain.py")]
    cfg_path = tmp_path / "two.json"
    cfg_path.write_text(json.dumps(tiny(data_dir, tmp_path / "two", devices=2, micro_batch_rows=2)))
    # Fresh rendezvous: drop what the in-process run above left in os.environ (MASTER_PORT, ...).
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK",
                                                             "WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE")}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    for extra in (["--stop_at_step", "5"], []):  # interrupted after step 5, then resumed
        proc = subprocess.run(base + ["--config", str(cfg_path)] + extra, env=env, capture_output=True, text=True,
                              timeout=300, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-3000:]
    logged = [json.loads(x) for x in (tmp_path / "two/metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in logged] == list(range(1, 9))
    np.testing.assert_allclose([x["loss"] for x in logged], [r["loss"] for r in single], rtol=1e-5)
    end = ckpt.milestone_name(8 * 1024)
    assert (tmp_path / "two/checkpoints" / end / "state/__1_0.distcp").is_file()  # really sharded over 2 ranks
    a, b = weights(tmp_path / "one/checkpoints" / end), weights(tmp_path / "two/checkpoints" / end)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(ckpt.load_trained_lengths(tmp_path / "one/checkpoints" / end),
                                  ckpt.load_trained_lengths(tmp_path / "two/checkpoints" / end))


# --------------------------------------------------------------------------------------------
# Resuming never runs code from a checkpoint's files; a torn metrics line never breaks a restart
# --------------------------------------------------------------------------------------------


class Payload:
    """Unpickling this creates `marker`: it stands in for any code a crafted checkpoint would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture(scope="module")
def resumable(data_dir, tmp_path_factory) -> dict[str, Path]:
    """Run directories stopped after one step with a resumable `latest`: sharded (DCP) and one full file."""
    runs = {}
    for kind, sharded in (("sharded", True), ("full", False)):
        runs[kind] = tmp_path_factory.mktemp(kind)
        run(tiny(data_dir, runs[kind], stop_at_step=1, **{"checkpoint.sharded": sharded}))
    return runs


def plant_pickle(file: Path, payload: Payload) -> None:
    file.write_bytes(pickle.dumps(payload))


def plant_torch(file: Path, payload: Payload) -> None:
    torch.save({"x": torch.zeros(2), "y": payload}, file)


def plant_object_array(file: Path, payload: Payload) -> None:
    np.save(file, np.array([payload], dtype=object), allow_pickle=True)


def plant_byte_item(file: Path, payload: Payload) -> None:
    """Append a crafted optimizer param_groups item to a .distcp file and point the metadata at it."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    with open(file.parent / ".metadata", "rb") as f:
        metadata = ckpt._MetadataUnpickler(f).load()
    blob = io.BytesIO()
    torch.save(payload, blob)
    offset = file.stat().st_size
    with open(file, "ab") as f:
        f.write(blob.getvalue())
    index = next(i for i in metadata.storage_data if i.fqn == "optimizer.param_groups.0.lr")
    metadata.storage_data[index] = _StorageInfo(file.name, offset, len(blob.getvalue()))
    with open(file.parent / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


@pytest.mark.parametrize("kind, name, plant", [
    ("sharded", "state/.metadata", plant_pickle),
    ("sharded", "state/__0_0.distcp", plant_byte_item),
    ("sharded", "state/meta.pt", plant_torch),
    ("sharded", "rng/rank-00000.pt", plant_torch),
    ("sharded", "trained_lengths.npy", plant_object_array),
    ("full", "state.pt", plant_torch),
    ("full", "rng/rank-00000.pt", plant_pickle),
])
def test_resume_never_runs_code_from_checkpoint_files(resumable, data_dir, tmp_path, kind, name, plant):
    out = tmp_path / "run"
    shutil.copytree(resumable[kind], out)
    latest = out / "checkpoints" / ckpt.LATEST
    marker = tmp_path / "payload-ran"
    plant(latest / name, Payload(marker))
    config = tmp_path / "config.json"
    config.write_text(json.dumps(tiny(data_dir, out, **{"checkpoint.sharded": kind == "sharded"})))
    with pytest.raises(SystemExit) as exit_info:
        pretrain.main(["--config", str(config)])
    message = str(exit_info.value.code)
    assert message.startswith(f"error: {latest / name}") and "refusing to load" in message, message
    assert "Fix: resume from another checkpoint" in message
    if name.endswith(".distcp"):  # loading the weights for evaluation checks the same items
        with pytest.raises(ckpt.CheckpointError, match="optimizer.param_groups.0.lr"):
            ckpt.load_model(latest)
    assert not marker.exists()


def test_checkpoint_item_outside_its_directory_is_refused(resumable, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(resumable["sharded"], out)
    state = out / "checkpoints" / ckpt.LATEST / "state"
    with open(state / ".metadata", "rb") as f:
        metadata = ckpt._MetadataUnpickler(f).load()
    index = next(iter(metadata.storage_data))
    metadata.storage_data[index].relative_path = "../../../../outside.distcp"
    with open(state / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(ckpt.CheckpointError, match=r"\.metadata: file name '\.\./.*' points outside"):
        ckpt.verify_resume_files(state.parent)


def test_torn_metrics_line_is_set_aside_on_resume(data_dir, tmp_path):
    cfg = tiny(data_dir, tmp_path, total_tokens=3 * 1024, **{"checkpoint.latest_every_steps": 1})
    run({**cfg, "stop_at_step": 2})
    metrics = tmp_path / "metrics.jsonl"
    with open(metrics, "a") as f:
        f.write('{"step": 3, "tokens": 3072, "lo')  # killed mid-write
    history = run(cfg)
    assert [r["step"] for r in history] == [3]
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 3]
    assert (tmp_path / "metrics.jsonl.unreadable").read_text() == '{"step": 3, "tokens": 3072, "lo\n'
    assert not ckpt.temporary(metrics).exists()

"""Trainer tests on CPU: loss falls, exact resume, atomic checkpoints, length histogram, accumulation; damaged
checkpoints, kills mid-save, the run lock, signals, other data and out-of-range values, as the user sees them."""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from posfreq.train import (
    atomic,
    checkpoint_save,
    consolidate,
    loggers,
    pretrain,
    retention,
    run_control,
    safe_load,
)
from posfreq.train import checkpoint as ckpt
from posfreq.train.config import model_preset
from posfreq.train.flops import matmul_params, step_flops
from posfreq.train.model import Transformer
from posfreq.train.optim import lr_at
from posfreq.train.packing import PackedSampler
from posfreq.train.parallel import attention_choice
from posfreq.train.resolved_run import ResolvedRun
from posfreq.train.rng_state import capture_rng, restore_rng
from posfreq.train.run_config import ConfigError, config_from_dict, parse_args
from posfreq.train.run_control import EXIT_NOT_REQUEUED, StopSignals
from posfreq.train.safe_load import CheckpointError
from posfreq.train.shards import ShardWriter, TokenDataset
from posfreq.train.trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """Two byte-tokenized shards of short, learnable synthetic documents (5-600 bytes): the doctor's corpus."""
    from posfreq.train.doctor import write_tiny_corpus

    return write_tiny_corpus(tmp_path_factory.mktemp("shards"), max_words=100)


def tiny(data_dir: Path, out: Path, **overrides) -> dict:
    """A config dict small enough for a step in a fraction of a second."""
    cfg = {
        "out": str(out),
        "seed": 1,
        "total_tokens": 8 * 1024,
        "global_batch_tokens": 1024,
        "micro_batch_rows": 4,
        "accelerator": "cpu",
        "devices": 1,
        "precision": "32-true",
        "resume": "auto",
        "model": {
            "preset": "tiny-2l-128",
            "overrides": {"d_model": 64, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128},
            "attention_backend": "sdpa",
        },
        "data": {"dir": str(data_dir), "train_len": 128},
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
    history = run(
        tiny(
            data_dir,
            tmp_path,
            total_tokens=20 * 1024,
            **{"checkpoint.latest_every_steps": 0, "checkpoint.every_tokens": 10**9},
        )
    )
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
    a, b = (
        weights(tmp_path / "full/checkpoints" / end),
        weights(tmp_path / "split/checkpoints" / end),
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    logged = [
        json.loads(x)["loss"] for x in (tmp_path / "split/metrics.jsonl").read_text().splitlines()
    ]
    assert logged == [r["loss"] for r in full]

    # Independent count: a fresh sampler, one global batch of 8 rows per step, lengths from cu_seqlens.
    sampler = PackedSampler(TokenDataset(data_dir), 128, 8, seed=1)
    expected = np.zeros(129, dtype=np.int64)
    for step in range(8):
        expected += np.bincount(np.diff(next(sampler).cu_seqlens.numpy()), minlength=129)
        if step == 3:  # the milestone at 4096 tokens holds the first 4 steps
            got = ckpt.load_trained_lengths(
                tmp_path / "split/checkpoints" / ckpt.milestone_name(4096)
            )
            assert np.array_equal(got, expected)
    for run_dir in ("full", "split"):
        assert np.array_equal(
            ckpt.load_trained_lengths(tmp_path / run_dir / "checkpoints" / end), expected
        )
    assert expected.sum() > 8 * 8 and expected[128] > 0  # many segments, some full rows


def test_init_from_carries_weights_and_trained_lengths(data_dir, tmp_path):
    run(tiny(data_dir, tmp_path / "warm", total_tokens=4096))
    warm = tmp_path / "warm/checkpoints" / ckpt.milestone_name(4096)
    # Continued at a longer training length, with lr 0: the single step changes nothing, so the
    # weights must be the warm-up's, and the histogram the warm-up's plus this step's segments.
    run(
        tiny(
            data_dir,
            tmp_path / "next",
            total_tokens=1024,
            **{
                "model.init_from": str(warm),
                "optim.lr": 0.0,
                "optim.min_lr": 0.0,
                "data.train_len": 256,
            },
        )
    )
    final = tmp_path / "next/checkpoints" / ckpt.milestone_name(1024)
    a, b = weights(warm), weights(final)
    assert all(torch.equal(a[k], b[k]) for k in a)
    own = np.bincount(
        np.diff(next(PackedSampler(TokenDataset(data_dir), 256, 4, seed=1)).cu_seqlens.numpy()),
        minlength=257,
    )
    carried = np.zeros(257, dtype=np.int64)
    carried[:129] = ckpt.load_trained_lengths(warm)
    assert np.array_equal(ckpt.load_trained_lengths(final), carried + own)
    # Each checkpoint records the length it was trained at (STRING's defaults derive from it).
    assert [
        json.loads((d / "model_config.json").read_text())["train_len"] for d in (warm, final)
    ] == [128, 256]
    other = tiny(
        data_dir, tmp_path / "bad", **{"model.init_from": str(warm), "model.overrides.d_model": 128}
    )
    with pytest.raises(ConfigError, match="init_from"):
        run(other)
    shorter = tiny(
        data_dir, tmp_path / "short", **{"model.init_from": str(final), "data.train_len": 128}
    )
    with pytest.raises(ConfigError, match="longer than data.train_len"):
        run(shorter)


def test_gradient_accumulation_matches_one_big_batch(data_dir, tmp_path):
    cfg = dict(total_tokens=2 * 1024, **{"checkpoint.latest_every_steps": 0})
    micro = run(tiny(data_dir, tmp_path / "micro", micro_batch_rows=2, **cfg))  # 4 micro-batches
    big = run(tiny(data_dir, tmp_path / "big", micro_batch_rows=8, **cfg))  # one batch of 8 rows
    for m, b in zip(micro, big):
        assert m["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert m["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    end = ckpt.milestone_name(2048)
    a, b = (
        weights(tmp_path / "micro/checkpoints" / end),
        weights(tmp_path / "big/checkpoints" / end),
    )
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5)


def test_crash_while_writing_never_leaves_a_resumable_partial(data_dir, tmp_path, monkeypatch):
    cfg = tiny(data_dir, tmp_path, total_tokens=6 * 1024, **{"checkpoint.every_tokens": 10**9})
    real_publish = atomic.publish_dir
    calls = []

    def crashing_publish(tmp: Path, final: Path) -> None:
        calls.append(final)
        if len(calls) == 2:  # the second save dies after writing everything, before the rename
            raise KeyboardInterrupt("simulated kill")
        real_publish(tmp, final)

    monkeypatch.setattr(atomic, "publish_dir", crashing_publish)
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

    monkeypatch.setattr(atomic, "publish_dir", real_publish)
    history = run(cfg)  # resumes from step 2, removes the stale .tmp
    assert [r["step"] for r in history] == [3, 4, 5, 6]
    assert not (root / "latest.tmp").exists()


def test_consolidate_and_load_model(data_dir, tmp_path):
    run(tiny(data_dir, tmp_path, total_tokens=2048))
    src = tmp_path / "checkpoints" / ckpt.milestone_name(2048)
    out = consolidate.consolidate(src, tmp_path / "model")
    assert sorted(p.name for p in out.iterdir()) == [
        ".posfreq-output.json",
        "meta.json",
        "model.safetensors",
        "model_config.json",
        "tokenizer_spec.json",
        "trained_lengths.npy",
    ]
    m1, tok, meta = ckpt.load_model(src)
    m2, tok2, meta2 = ckpt.load_model(out, dtype=torch.float32)
    assert tok == tok2 == {"spec": "bytes", "vocab_size": 258, "bos_id": 256, "eos_id": 257}
    assert meta["tokens_seen"] == meta2["tokens_seen"] == 2048
    ids = torch.arange(40) % 258
    torch.testing.assert_close(m1(ids), m2(ids), rtol=0, atol=0)
    assert m1.generate(ids[None, :8], 4) == m2.generate(ids[None, :8], 4)


def test_nonfinite_loss_stops_with_resume_hint_or_skips(data_dir, tmp_path):
    cfg = tiny(
        data_dir,
        tmp_path / "stop",
        total_tokens=6 * 1024,
        **{
            "optim.lr": 1e30,
            "optim.warmup_steps": 1,
            "optim.grad_clip": 0.0,
            "checkpoint.latest_every_steps": 1,
        },
    )
    with pytest.raises(
        FloatingPointError,
        match=r"non-finite loss or gradient norm .* at step \d+ .*resume from .*latest",
    ):
        run(cfg)
    cfg = tiny(
        data_dir,
        tmp_path / "skip",
        total_tokens=6 * 1024,
        on_nonfinite="skip",
        **{"optim.lr": 1e30, "optim.warmup_steps": 1, "optim.grad_clip": 0.0},
    )
    history = run(cfg)
    assert len(history) == 6 and history[-1]["skipped"]


def test_nonfinite_loss_error_names_a_command_that_continues(data_dir, tmp_path, monkeypatch):
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            tiny(
                data_dir,
                tmp_path / "run",
                total_tokens=4 * 1024,
                **{"checkpoint.latest_every_steps": 1},
            )
        )
    )
    real_step = Trainer._train_step

    def nan_at_step_3(self, batches, n):
        loss, grad_norm = real_step(self, batches, n)
        return (loss * float("nan"), grad_norm) if self.step == 2 else (loss, grad_norm)

    monkeypatch.setattr(Trainer, "_train_step", nan_at_step_3)
    with pytest.raises(SystemExit) as stopped:
        pretrain.main(["--config", str(config)])
    message = str(stopped.value.code)
    latest = tmp_path / "run/checkpoints" / ckpt.LATEST
    assert (
        message.startswith("error: non-finite loss or gradient norm (loss nan")
        and "\n" not in message
    ), message
    assert (
        f"at step 3 (tokens 2,048-3,072); the weights were not updated. To continue: resume from {latest}"
        in message
    )
    command = shlex.split(message.split(" Command: ")[1])
    assert command == [
        "posfreq",
        "pretrain",
        "--config",
        str(config),
        "--resume",
        "auto",
        "--resume-override",
        "{optim.lr: 0.0003}",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "posfreq.scripts.cli", *command[1:]],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {latest} at step 2" in proc.stdout
    assert (
        "resume_override: optim.lr: 0.003 -> 0.0003; schedule from step 2: next LR 0.003 -> 0.0003"
        in proc.stdout
    )
    assert ckpt.read_trainer_state(latest)["config"]["optim"]["lr"] == 0.0003


def test_schedule_changes_on_resume_need_resume_override(data_dir, tmp_path, capsys):
    out = tmp_path / "run"
    run(tiny(data_dir, out, stop_at_step=2))
    config = tmp_path / "config.json"
    config.write_text(json.dumps(tiny(data_dir, out)))
    refusals = [
        (
            ["--optim.lr", "1e-3"],
            "optim.lr: checkpoint 0.003 vs now 0.001 (to change it on resume: "
            '--resume-override "{optim.lr: 0.001}")',
        ),
        (
            ["--total_tokens", "16384"],
            "total_tokens: checkpoint 8192 vs now 16384 (to change it on resume: "
            '--resume-override "{total_tokens: 16384}")',
        ),
        (["--optim.beta2", "0.99"], "optim.beta2: checkpoint 0.95 vs now 0.99\n"),
        (
            ["--resume-override", "{optim.beta2: 0.99}"],
            "resume_override: ['optim.beta2'] cannot change on resume; "
            "only ['optim.lr', 'optim.min_lr', 'optim.warmup_steps', "
            "'total_tokens'] can",
        ),
    ]
    for flags, expected in refusals:
        with pytest.raises(SystemExit) as refused:
            pretrain.main(["--config", str(config), *flags])
        assert str(refused.value.code).startswith("error: ") and expected in str(
            refused.value.code
        ), flags
    capsys.readouterr()
    pretrain.main(
        [
            "--config",
            str(config),
            "--optim.lr",
            "1e-3",
            "--resume-override",
            "{optim.lr: 2e-3, total_tokens: 12288}",
            "--stop-at-step",
            "3",
        ]
    )
    printed = capsys.readouterr().out
    assert (
        "resume_override: optim.lr: 0.003 -> 0.002; total_tokens: 8192 -> 12288; schedule from step 2: "
        "next LR 0.003 -> 0.002, total steps 8 -> 12"
    ) in printed  # the override wins over --optim.lr
    assert "; 12 steps" in printed
    latest = ckpt.read_trainer_state(out / "checkpoints" / ckpt.LATEST)
    assert latest["step"] == 3 and latest["schedule"]["total_steps"] == 12
    assert latest["config"]["resume_override"] == {"optim.lr": 0.002, "total_tokens": 12288}
    logged = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert logged[-1]["step"] == 3 and logged[-1]["lr"] == pytest.approx(0.002)
    # The checkpoint now holds the new values: resuming with the old file alone is refused, naming the flag.
    with pytest.raises(SystemExit) as back:
        pretrain.main(["--config", str(config)])
    assert (
        'optim.lr: checkpoint 0.002 vs now 0.003 (to change it on resume: --resume-override "{optim.lr: 0.003}")'
        in str(back.value.code)
    )


def test_keep_full_reduces_older_milestones_to_weights(data_dir, tmp_path, capsys, monkeypatch):
    every = {"checkpoint.every_tokens": 2048, "checkpoint.latest_every_steps": 1}
    run(tiny(data_dir, tmp_path / "whole", **every))
    out = tmp_path / "kept"
    root = out / "checkpoints"
    kept = tiny(data_dir, out, **every, **{"checkpoint.keep_full": 1})
    run({**kept, "stop_at_step": 5})
    resumable = lambda: {p.name: m["resumable"] for p, m in ckpt.list_checkpoints(out)}  # noqa: E731
    name = ckpt.milestone_name
    assert resumable() == {name(2048): False, name(4096): True, ckpt.LATEST: True}
    capsys.readouterr()
    run(kept)
    assert f"resumed from {root / ckpt.LATEST} at step 5" in capsys.readouterr().out
    assert resumable() == {
        name(2048): False,
        name(4096): False,
        name(6144): False,
        name(8192): True,
        ckpt.LATEST: True,
    }
    for tokens in (2048, 4096, 6144, 8192):
        expected = weights(tmp_path / "whole/checkpoints" / name(tokens))
        model, tokenizer, meta = ckpt.load_model(root / name(tokens))
        got = model.state_dict()
        assert meta["tokens_seen"] == tokens and tokenizer["spec"] == "bytes"
        assert expected.keys() == got.keys() and all(
            torch.equal(expected[k], got[k]) for k in expected
        )
        np.testing.assert_array_equal(
            ckpt.load_trained_lengths(root / name(tokens)),
            ckpt.load_trained_lengths(tmp_path / "whole/checkpoints" / name(tokens)),
        )
    reduced = root / name(2048)
    assert sorted(p.name for p in reduced.iterdir()) == [
        "config.json",
        "manifest.json",
        "model.safetensors",
        "model_config.json",
        "tokenizer_spec.json",
        "trained_lengths.npy",
        "trainer.json",
    ]
    meta = ckpt.read_trainer_state(reduced)
    ckpt.verify_checkpoint(reduced, meta)  # the manifest lists exactly what remains
    assert meta["reduced_to_weights"] and not meta["resumable"]
    with pytest.raises(ConfigError, match="holds model weights only"):
        ResolvedRun(config_from_dict({**kept, "resume": str(reduced)}), 1)
    # A kill while reducing leaves the full milestone whole (and resumable), never a half-reduced one.
    newest = root / name(8192)
    monkeypatch.setattr(
        atomic, "publish_dir", lambda tmp, final: (_ for _ in ()).throw(KeyboardInterrupt("kill"))
    )
    with pytest.raises(KeyboardInterrupt):
        retention.reduce_to_weights(newest)
    meta = ckpt.read_trainer_state(newest)
    assert meta["resumable"] and (newest / "state" / ".metadata").is_file()
    ckpt.verify_checkpoint(newest, meta)
    assert ckpt.find_resume_checkpoint(out) == newest


def test_wandb_run_id_is_reused_and_mode_follows_credentials(data_dir, tmp_path, monkeypatch):
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    netrc_file = tmp_path / "netrc"
    monkeypatch.setenv("NETRC", str(netrc_file))
    cfg = config_from_dict(tiny(data_dir, tmp_path / "run", **{"logging.logger": "wandb"}))
    first = loggers.fabric_loggers(cfg)[0]
    run_id = (tmp_path / "run" / loggers.WANDB_ID_FILE).read_text().strip()
    assert re.fullmatch("[0-9a-f]{8}", run_id)
    assert (
        first._wandb_init["id"] == run_id
        and first._wandb_init["resume"] == "allow"
        and first._offline
    )
    assert (
        loggers.fabric_loggers(cfg)[0]._wandb_init["id"] == run_id
    )  # a requeued job: the same wandb run
    assert (
        f"wandb: offline (no credentials: WANDB_API_KEY is unset and {netrc_file} has no login for "
        f"api.wandb.ai); upload later with `wandb sync {tmp_path / 'run/wandb'}`; run id {run_id}"
    ) in loggers.wandb_report(cfg)
    netrc_file.write_text("machine api.wandb.ai\n  login user\n  password secret\n")
    assert loggers.wandb_mode() == (
        False,
        f"{netrc_file} has a login for api.wandb.ai (wandb login)",
    )
    assert not loggers.fabric_loggers(cfg)[0]._offline
    netrc_file.unlink()
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert loggers.wandb_mode() == (False, "WANDB_API_KEY is set")
    assert loggers.wandb_report(cfg).startswith(
        f"wandb: online (WANDB_API_KEY is set); run id {run_id}"
    )
    monkeypatch.setenv(
        "WANDB_MODE", "disabled"
    )  # an explicit choice wins; a whole run with it logs nowhere
    assert loggers.wandb_mode() == (True, "WANDB_MODE=disabled is set")
    run(tiny(data_dir, tmp_path / "run", stop_at_step=1, **{"logging.logger": "wandb"}))
    assert (tmp_path / "run" / loggers.WANDB_ID_FILE).read_text().strip() == run_id


def sigusr1_in_a_slurm_job(monkeypatch, job: str, at_step: int) -> list:
    """SIGUSR1 arrives during the train step after `at_step` steps of a SLURM job; returns the commands run
    (`scontrol requeue` is recorded, not run)."""
    calls = []
    monkeypatch.setenv("SLURM_JOB_ID", job)
    monkeypatch.setattr(
        run_control.subprocess,
        "run",
        lambda cmd, **kwargs: calls.append(cmd) or subprocess.CompletedProcess(cmd, 0),
    )
    real_step = Trainer._train_step

    def step_then_signal(self, batches, n):
        out = real_step(self, batches, n)
        if self.step == at_step:
            os.kill(os.getpid(), signal.SIGUSR1)
        return out

    monkeypatch.setattr(Trainer, "_train_step", step_then_signal)
    return calls


def test_signal_saves_latest_and_requeues(data_dir, tmp_path, monkeypatch):
    calls = sigusr1_in_a_slurm_job(monkeypatch, "4242", at_step=1)
    history = run(tiny(data_dir, tmp_path, **{"checkpoint.latest_every_steps": 0}))
    assert [r["step"] for r in history] == [
        1,
        2,
        3,
    ]  # seen at the next step's all-reduce, then saved
    assert ckpt.read_trainer_state(tmp_path / "checkpoints/latest")["step"] == 3
    assert calls == [["scontrol", "requeue", "4242"]]
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # train() puts the handlers back


def test_bad_configs_fail_before_compute(data_dir, tmp_path):
    cases = [
        (
            tiny(data_dir, tmp_path, optim={"lrr": 1.0}),
            "Group 'optim' does not accept option 'lrr'",
        ),
        (
            tiny(data_dir, tmp_path, data={"dir": str(tmp_path / "missing"), "train_len": 128}),
            "does not exist",
        ),
        (tiny(data_dir, tmp_path, data={"dir": "", "train_len": 128}), "data.dir is empty"),
        (tiny(data_dir, tmp_path, global_batch_tokens=1000), "not a whole number of micro-batches"),
        (tiny(data_dir, tmp_path, micro_batch_rows=3), "not a whole number of micro-batches"),
        (
            tiny(data_dir, tmp_path, **{"model.overrides.train_len": 4096}),
            "the training length has one name",
        ),
        (
            tiny(data_dir, tmp_path, **{"data.length_upsample": {"0-100000": 0.0}}),
            "gives every document of data.dir",
        ),
        (
            tiny(data_dir, tmp_path, seed="x"),
            "Parser key \"seed\":\n  Expected a <class 'int'>. Got value: x",
        ),
    ]
    (tmp_path / "empty").mkdir()
    cases.append(
        (
            tiny(data_dir, tmp_path, data={"dir": str(tmp_path / "empty"), "train_len": 128}),
            "no token shards",
        )
    )
    cases.append(
        (
            tiny(data_dir, tmp_path, **{"data.val_dir": str(tmp_path / "empty")}),
            "data.val_dir: .*no token shards",
        )
    )
    cases.append(
        (
            tiny(data_dir, tmp_path, **{"data.val_dir": str(tmp_path / "missing")}),
            "data.val_dir: .*does not exist",
        )
    )
    for cfg, message in cases:
        with pytest.raises(ConfigError, match=message):
            ResolvedRun(config_from_dict(cfg), world_size=1)

    run(tiny(data_dir, tmp_path / "a", total_tokens=1024, **{"checkpoint.latest_every_steps": 1}))
    changed = tiny(data_dir, tmp_path / "a", total_tokens=1024, **{"optim.lr": 1e-3})
    with pytest.raises(
        ConfigError, match="different config:\n  optim.lr: checkpoint 0.003 vs now 0.001"
    ):
        ResolvedRun(config_from_dict(changed), world_size=1)
    # Run-time settings may change on resume; the schedule only through resume_override.
    ResolvedRun(
        config_from_dict(tiny(data_dir, tmp_path / "a", micro_batch_rows=2, total_tokens=1024)), 1
    )
    with pytest.raises(
        ConfigError,
        match=r"total_tokens: checkpoint 1024 vs now 4096 \(to change it on resume: "
        r"--resume-override \"\{total_tokens: 4096\}\"\)",
    ):
        ResolvedRun(config_from_dict(tiny(data_dir, tmp_path / "a", total_tokens=4096)), 1)
    ResolvedRun(
        config_from_dict(tiny(data_dir, tmp_path / "a", resume_override={"total_tokens": 4096})), 1
    )


def test_cli_overrides_and_schedule(data_dir):
    cfg = parse_args(
        [
            "--config",
            str(ROOT / "configs/pretrain_2k.yaml"),
            "--optim.lr",
            "1e-3",
            "--data.dir",
            str(data_dir),
            "--checkpoint.sharded",
            "false",
        ]
    )
    assert (
        cfg.optim.lr == 1e-3 and cfg.data.dir == str(data_dir) and cfg.checkpoint.sharded is False
    )
    assert cfg.global_batch_tokens == 4_194_304 and cfg.total_tokens == 10**12
    lrs = [lr_at(s, cfg, 238_419) for s in (0, 1999, 2000, 120_000, 238_418, 300_000)]
    assert (
        lrs[0] == pytest.approx(1e-3 / 2000)
        and lrs[1] == pytest.approx(1e-3)
        and lrs[2] == pytest.approx(1e-3)
    )
    assert cfg.optim.min_lr < lrs[3] < 1e-3 and lrs[4] == pytest.approx(cfg.optim.min_lr, rel=1e-6)
    assert lrs[5] == cfg.optim.min_lr


def test_attention_flops_term_counts_every_query_key_pair():
    config = model_preset("tiny-2l-128", vocab_size=258)
    segments = np.array([5, 1, 10])
    pairs = sum(p + 1 for s in segments for p in range(s))  # causal (query, key) pairs
    expected = 6 * matmul_params(config) * 16 + 3 * 4 * config.d_model * config.n_layers * pairs
    assert step_flops(config, 16, float((segments * (segments + 1)).sum())) == expected


def subprocess_env(**extra: str) -> dict[str, str]:
    """os.environ for a trainer subprocess: a fresh rendezvous (without what in-process runs left, MASTER_PORT,
    ...), no SLURM job, unbuffered output, one thread."""
    drop = (
        "MASTER_ADDR",
        "MASTER_PORT",
        "LOCAL_RANK",
        "NODE_RANK",
        "WORLD_SIZE",
        "RANK",
        "LOCAL_WORLD_SIZE",
        "SLURM_JOB_ID",
    )
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **extra)
    return env


def test_two_gloo_processes_match_one_process(data_dir, tmp_path):
    val = {
        "data.val_dir": str(data_dir),
        "data.val_rows": 5,
    }  # rank 1 runs out of rows in the second round
    single = run(tiny(data_dir, tmp_path / "one", micro_batch_rows=2, **val))
    base = [sys.executable, str(ROOT / "train/pretrain.py")]
    cfg_path = tmp_path / "two.json"
    cfg_path.write_text(
        json.dumps(tiny(data_dir, tmp_path / "two", devices=2, micro_batch_rows=2, **val))
    )
    env = subprocess_env()
    for extra in (["--stop_at_step", "5"], []):  # interrupted after step 5, then resumed
        proc = subprocess.run(
            base + ["--config", str(cfg_path)] + extra,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            cwd=ROOT,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
    logged = [json.loads(x) for x in (tmp_path / "two/metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in logged if "loss" in x] == list(range(1, 9))
    np.testing.assert_allclose(
        [x["loss"] for x in logged if "loss" in x], [r["loss"] for r in single], rtol=1e-5
    )
    one_val = [
        json.loads(x)
        for x in (tmp_path / "one/metrics.jsonl").read_text().splitlines()
        if "val_loss" in x
    ]
    two_val = [x for x in logged if "val_loss" in x]
    assert [x["step"] for x in two_val] == [8] and two_val[0]["val_targets"] == one_val[0][
        "val_targets"
    ]
    assert two_val[0]["val_loss"] == pytest.approx(one_val[0]["val_loss"], rel=1e-5)
    end = ckpt.milestone_name(8 * 1024)
    assert (
        tmp_path / "two/checkpoints" / end / "state/__1_0.distcp"
    ).is_file()  # really sharded over 2 ranks
    a, b = weights(tmp_path / "one/checkpoints" / end), weights(tmp_path / "two/checkpoints" / end)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(
        ckpt.load_trained_lengths(tmp_path / "one/checkpoints" / end),
        ckpt.load_trained_lengths(tmp_path / "two/checkpoints" / end),
    )


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


def reseal(checkpoint: Path) -> None:
    """Rewrite the manifest (and trainer.json's record of it) to match the files as they are: a crafted checkpoint
    would come with a matching manifest, so the unpickling checks must hold without it."""
    meta = json.loads((checkpoint / ckpt.TRAINER_FILE).read_text())
    meta["manifest_sha256"] = checkpoint_save.write_manifest(checkpoint)
    (checkpoint / ckpt.TRAINER_FILE).write_text(json.dumps(meta))


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
        metadata = safe_load._MetadataUnpickler(f).load()
    blob = io.BytesIO()
    torch.save(payload, blob)
    offset = file.stat().st_size
    with open(file, "ab") as f:
        f.write(blob.getvalue())
    index = next(i for i in metadata.storage_data if i.fqn == "optimizer.param_groups.0.lr")
    metadata.storage_data[index] = _StorageInfo(file.name, offset, len(blob.getvalue()))
    with open(file.parent / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


@pytest.mark.parametrize(
    "kind, name, plant",
    [
        ("sharded", "state/.metadata", plant_pickle),
        ("sharded", "state/__0_0.distcp", plant_byte_item),
        ("sharded", "state/meta.pt", plant_torch),
        ("sharded", "rng/rank-00000.pt", plant_torch),
        ("sharded", "trained_lengths.npy", plant_object_array),
        ("full", "state.pt", plant_torch),
        ("full", "rng/rank-00000.pt", plant_pickle),
    ],
)
def test_resume_never_runs_code_from_checkpoint_files(
    resumable, data_dir, tmp_path, kind, name, plant
):
    out = tmp_path / "run"
    shutil.copytree(resumable[kind], out)
    latest = out / "checkpoints" / ckpt.LATEST
    marker = tmp_path / "payload-ran"
    plant(latest / name, Payload(marker))
    reseal(latest)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(tiny(data_dir, out, **{"checkpoint.sharded": kind == "sharded"})))
    with pytest.raises(SystemExit) as exit_info:
        pretrain.main(["--config", str(config)])
    message = str(exit_info.value.code)
    assert message.startswith(f"error: {latest / name}") and "refusing to load" in message, message
    assert "Fix: resume from another checkpoint" in message
    if name.endswith(".distcp"):  # loading the weights for evaluation checks the same items
        with pytest.raises(CheckpointError, match="optimizer.param_groups.0.lr"):
            ckpt.load_model(latest)
    assert not marker.exists()


def test_checkpoint_item_outside_its_directory_is_refused(resumable, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(resumable["sharded"], out)
    state = out / "checkpoints" / ckpt.LATEST / "state"
    with open(state / ".metadata", "rb") as f:
        metadata = safe_load._MetadataUnpickler(f).load()
    index = next(iter(metadata.storage_data))
    metadata.storage_data[index].relative_path = "../../../../outside.distcp"
    with open(state / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(CheckpointError, match=r"\.metadata: file name '\.\./.*' points outside"):
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
    assert (
        tmp_path / "metrics.jsonl.unreadable"
    ).read_text() == '{"step": 3, "tokens": 3072, "lo\n'
    assert not list(tmp_path.glob(".metrics.jsonl.*.tmp"))  # the atomic rewrite left no temporary


# --------------------------------------------------------------------------------------------
# Weeks-long jobs: damaged checkpoints, kills mid-save, a second job, signals, other data, bad values
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def uninterrupted(data_dir, tmp_path_factory) -> dict[str, torch.Tensor]:
    """Final weights (tokens-8192) of the 8-step run that the interrupted runs below must reproduce."""
    out = tmp_path_factory.mktemp("uninterrupted")
    run(tiny(data_dir, out))
    return weights(out / "checkpoints" / ckpt.milestone_name(8 * 1024))


@pytest.fixture(scope="module")
def stopped_at_6(data_dir, tmp_path_factory) -> dict[str, Path]:
    """Runs stopped after step 6: `latest` (step 6) and the milestone tokens-4096 (step 4); sharded and full."""
    runs = {}
    for kind, sharded in (("sharded", True), ("full", False)):
        runs[kind] = tmp_path_factory.mktemp(f"stopped-{kind}")
        run(tiny(data_dir, runs[kind], stop_at_step=6, **{"checkpoint.sharded": sharded}))
    return runs


def empty(file: Path) -> None:
    file.write_bytes(b"")


def truncate(file: Path) -> None:
    os.truncate(file, file.stat().st_size // 2)


def flip_a_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def delete(file: Path) -> None:
    file.unlink()


@pytest.mark.parametrize(
    "kind, name, damage, reason",
    [
        (
            "sharded",
            "state/__0_0.distcp",
            empty,
            r"state/__0_0\.distcp has 0 bytes, manifest\.json records \d+ ",
        ),
        (
            "sharded",
            "state/__0_0.distcp",
            flip_a_byte,
            r"state/__0_0\.distcp: its sha256 differs from manifest\.json",
        ),
        (
            "sharded",
            "rng/rank-00000.pt",
            delete,
            r"rng/rank-00000\.pt is missing \(listed in manifest\.json\)",
        ),
        ("sharded", "state/.metadata", delete, r"latest: not a complete checkpoint"),
        ("sharded", "trainer.json", empty, r"latest: not a complete checkpoint"),
        ("sharded", "manifest.json", delete, r"manifest\.json is missing"),
        (
            "full",
            "state.pt",
            truncate,
            r"state\.pt has \d+ bytes, manifest\.json records \d+ \(truncated",
        ),
    ],
)
def test_damaged_newest_checkpoint_is_skipped_and_the_run_matches(
    stopped_at_6, uninterrupted, data_dir, tmp_path, capsys, kind, name, damage, reason
):
    out = tmp_path / "run"
    shutil.copytree(stopped_at_6[kind], out)
    root = out / "checkpoints"
    damage(root / ckpt.LATEST / name)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(tiny(data_dir, out, **{"checkpoint.sharded": kind == "sharded"})))
    pretrain.main(["--config", str(config)])
    printed = capsys.readouterr().out
    skipped = next(
        line.split(" ", 2)[2] for line in printed.splitlines() if " skipped checkpoint " in line
    )
    assert skipped.startswith(f"skipped checkpoint {root / ckpt.LATEST}: ") and re.search(
        reason, skipped
    ), skipped
    assert f"resumed from {root / ckpt.milestone_name(4096)} at step 4" in printed
    final = weights(root / ckpt.milestone_name(8 * 1024))
    assert final.keys() == uninterrupted.keys() and all(
        torch.equal(final[k], uninterrupted[k]) for k in final
    )


def test_no_checkpoint_that_verifies_is_an_error_not_a_fresh_start(resumable, data_dir, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(resumable["sharded"], out)
    latest = out / "checkpoints" / ckpt.LATEST
    empty(latest / "state/__0_0.distcp")
    metrics = (out / "metrics.jsonl").read_text()
    config = tmp_path / "config.json"
    config.write_text(json.dumps(tiny(data_dir, out)))
    with pytest.raises(SystemExit) as auto:
        pretrain.main(["--config", str(config)])
    assert str(auto.value.code).startswith(
        f"error: resume=auto: no checkpoint under {out / 'checkpoints'} can be "
        f"resumed:\n  {latest}: {latest / 'state/__0_0.distcp'} has 0 bytes"
    )
    assert "Fix: restore a good copy" in str(auto.value.code)
    with pytest.raises(SystemExit) as named:
        pretrain.main(["--config", str(config), "--resume", str(latest)])
    assert str(named.value.code).startswith(
        f"error: resume={latest}: {latest / 'state/__0_0.distcp'} has 0 bytes"
    )
    assert "Fix: restore a good copy of it, or use --resume auto" in str(named.value.code)
    assert (
        out / "metrics.jsonl"
    ).read_text() == metrics and latest.is_dir()  # nothing trained, nothing deleted


KILL_DURING_RENAME = """
import os, signal
from pathlib import Path

when, name = os.environ["KILL_AT"].split(":")  # e.g. after:latest.old = SIGKILL right after renaming onto latest.old
real_replace = os.replace


def replace(src, dst, *args, **kwargs):
    if when == "before" and Path(dst).name == name:
        os.kill(os.getpid(), signal.SIGKILL)
    real_replace(src, dst, *args, **kwargs)
    if when == "after" and Path(dst).name == name:
        os.kill(os.getpid(), signal.SIGKILL)


os.replace = replace
from posfreq.train import pretrain
pretrain.main()
"""


def run_trainer_process(code: str, config: Path, **env: str) -> subprocess.CompletedProcess:
    """`python -c code --config config` from the repository root (code ends by calling pretrain.main())."""
    return subprocess.run(
        [sys.executable, "-c", code, "--config", str(config)],
        env=subprocess_env(**env),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )


def test_sigkill_between_the_renames_of_a_save_then_resume(uninterrupted, data_dir, tmp_path):
    root = tmp_path / "checkpoints"
    config = tmp_path / "config.json"
    config.write_text(json.dumps(tiny(data_dir, tmp_path, **{"checkpoint.every_tokens": 10**9})))
    # Killed inside the second save of `latest` (step 4), just after `latest -> latest.old`.
    first = run_trainer_process(KILL_DURING_RENAME, config, KILL_AT="after:latest.old")
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    assert (
        not (root / "latest").exists() and ckpt.read_trainer_state(root / "latest.old")["step"] == 2
    )
    # Resumed from latest.old, then killed in its next save just before `latest.tmp -> latest`: latest.old must
    # still be there (it is the only complete copy), not deleted to make room.
    second = run_trainer_process(KILL_DURING_RENAME, config, KILL_AT="before:latest")
    assert second.returncode == -signal.SIGKILL, second.stderr[-3000:]
    assert f"resumed from {root / 'latest.old'} at step 2" in second.stdout
    assert (
        not (root / "latest").exists() and ckpt.read_trainer_state(root / "latest.old")["step"] == 2
    )
    third = run_trainer_process("from train import pretrain; pretrain.main()", config)
    assert third.returncode == 0, third.stderr[-3000:]
    assert f"resumed from {root / 'latest.old'} at step 2" in third.stdout
    assert "taking over a stale lock" in third.stderr  # the killed process could not release it
    final = weights(root / ckpt.milestone_name(8 * 1024))
    assert all(torch.equal(final[k], uninterrupted[k]) for k in uninterrupted)
    assert sorted(p.name for p in root.iterdir()) == ["latest", ckpt.milestone_name(8 * 1024)]


def test_second_job_on_a_locked_out_dir_is_refused_and_a_stale_lock_taken_over(
    data_dir, tmp_path, capsys, monkeypatch
):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    out = tmp_path / "run"
    in_flight = out / "checkpoints" / "latest.tmp"  # the first job's save in progress
    in_flight.mkdir(parents=True)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(tiny(data_dir, out, total_tokens=2048)))
    lock = out / "run.lock"
    owner = {"job": None, "host": socket.gethostname(), "started": "2026-01-01T00:00:00"}
    first_job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        lock.write_text(json.dumps({**owner, "pid": first_job.pid}))
        with pytest.raises(SystemExit) as same_host:
            pretrain.main(["--config", str(config)])
        assert str(same_host.value.code).startswith(
            f"error: {out} is in use by job (not SLURM), pid {first_job.pid} on host {owner['host']}"
        )
        assert "still running. Fix: wait for it to end, or pass another --out" in str(
            same_host.value.code
        )
        assert in_flight.is_dir()  # untouched
        lock.write_text(json.dumps({**owner, "host": "node-elsewhere", "pid": first_job.pid}))
        with pytest.raises(SystemExit) as other_host:
            pretrain.main(["--config", str(config)])
        assert "from this host" in str(other_host.value.code) and f"(rm {lock})" in str(
            other_host.value.code
        )
        assert in_flight.is_dir()
    finally:
        first_job.kill()
        first_job.wait()
    lock.write_text(json.dumps({**owner, "pid": first_job.pid}))  # its owner has ended
    capsys.readouterr()
    pretrain.main(["--config", str(config)])
    assert (
        f"{lock}: taking over a stale lock (pid {first_job.pid} no longer runs"
        in capsys.readouterr().err
    )
    assert (
        not lock.exists() and not in_flight.exists()
    )  # released at exit; the dead job's write cleared
    # A SLURM job that was requeued (perhaps onto another node) takes over its own lock.
    lock.write_text(json.dumps({**owner, "job": "4242", "host": "node-elsewhere", "pid": 1}))
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    from posfreq.train.run_lock import RunLock

    RunLock.acquire(out).release()
    assert not lock.exists()


SIGNAL_DURING_STARTUP = """
import os, signal
from posfreq.train import pretrain
from posfreq.train.resolved_run import ResolvedRun

real_plan_init = ResolvedRun.__init__


def plan_init(self, *args, **kwargs):
    os.kill(os.getpid(), signal.SIGUSR1)  # arrives while the run starts up, before the training loop
    real_plan_init(self, *args, **kwargs)


ResolvedRun.__init__ = plan_init
pretrain.main()
"""


def test_signal_during_startup_saves_and_exits_not_requeued(data_dir, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(tiny(data_dir, tmp_path)))
    proc = run_trainer_process(SIGNAL_DURING_STARTUP, config)
    assert proc.returncode == EXIT_NOT_REQUEUED == 3, proc.stderr[-3000:]
    latest = tmp_path / "checkpoints" / ckpt.LATEST
    assert (
        f"signal received: saved {latest} at step 1; the job was NOT requeued (no SLURM job (SLURM_JOB_ID "
        "unset)): exiting with code 3. Continue with --resume auto."
    ) in proc.stdout
    assert (
        ckpt.find_resume_checkpoint(tmp_path) == latest
        and ckpt.read_trainer_state(latest)["step"] == 1
    )
    assert not (tmp_path / "run.lock").exists()


def test_resume_refuses_other_documents_with_the_same_counts(resumable, data_dir, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(resumable["sharded"], out)
    moved = shutil.copytree(data_dir, tmp_path / "moved")  # the same shards elsewhere: fine
    other = tmp_path / "other"  # same shard names, document and token counts; other documents
    shutil.copytree(data_dir, other)
    docs = TokenDataset(data_dir)
    with ShardWriter(other, "shard-000", tokenizer="bytes", vocab_size=258, eos_id=257) as writer:
        for i in reversed(range(150)):
            writer.add(docs.document(i))
    assert (TokenDataset(other).num_docs, TokenDataset(other).num_tokens) == (
        docs.num_docs,
        docs.num_tokens,
    )
    assert (
        ResolvedRun(
            config_from_dict(tiny(data_dir, out, **{"data.dir": str(moved)})), 1
        ).resume_from
        == out / "checkpoints" / ckpt.LATEST
    )
    config = tmp_path / "config.json"
    config.write_text(json.dumps(tiny(data_dir, out, **{"data.dir": str(other)})))
    with pytest.raises(SystemExit) as refused:
        pretrain.main(["--config", str(config)])
    message = str(refused.value.code)
    assert message.startswith(
        f"error: resume: {out / 'checkpoints' / ckpt.LATEST} was trained on data.dir "
        f"{data_dir} (data fingerprint "
    ), message
    assert (
        f"but data.dir {other} holds other documents" in message
        and "Fix: set --data.dir" in message
    )


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--micro_batch_rows", "0", "micro_batch_rows=0 is out of range: it must be >= 1"),
        ("--logging.every_steps", "0", "logging.every_steps=0 is out of range: it must be >= 1"),
        ("--total_tokens", "0", "total_tokens=0 is out of range: it must be >= 1"),
        ("--total_tokens", "-5", "total_tokens=-5 is out of range: it must be >= 1"),
        ("--optim.lr", "-1", "optim.lr=-1.0 is out of range: it must be >= 0"),
        ("--model.overrides", "{d_model: x}", "model.overrides.d_model='x' should be a number"),
        (
            "--model.overrides",
            "{n_heads: 0}",
            "model.overrides (preset 'tiny-2l-128'): n_heads=0 is out of range: it must be >= 1",
        ),
    ],
)
def test_out_of_range_values_are_named_before_anything_runs(
    data_dir, tmp_path, flag, value, message
):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(tiny(data_dir, tmp_path / "run")))
    with pytest.raises(SystemExit) as exit_info:
        pretrain.main(["--config", str(config), flag, value])
    assert exit_info.value.code == f"error: {config} + command-line overrides: {message}"
    assert not (tmp_path / "run").exists()


def test_cluster_log_is_plain_timestamped_lines_with_a_summary(data_dir, tmp_path):
    """stdout to a file (a SLURM .out): no progress bar, one parseable line per logged step, then a summary."""
    from posfreq.train.run_log import parse_line

    config = tmp_path / "config.json"
    config.write_text(json.dumps(tiny(data_dir, tmp_path / "run", **{"logging.every_steps": 2})))
    log = tmp_path / "job.out"
    with log.open("w") as sink:
        proc = subprocess.run(
            [sys.executable, "-m", "posfreq.scripts.cli", "pretrain", "--config", str(config)],
            stdout=sink,
            stderr=subprocess.PIPE,
            text=True,
            env=subprocess_env(),
            timeout=300,
            cwd=ROOT,
        )
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = log.read_text()
    assert "\r" not in text and "pretrain:" not in text  # no tqdm
    lines = [parse_line(line) for line in text.splitlines()]
    stamp = re.compile(r"^\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}$")
    assert all(stamp.match(line["time"]) for line in lines), text
    steps = [line for line in lines if "step" in line]
    assert [line["step"] for line in steps] == ["2/8", "4/8", "6/8", "8/8"]
    metrics = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [float(line["loss"]) for line in steps] == pytest.approx(
        [m["loss"] for m in metrics], abs=5e-5
    )
    assert all(m["time"].endswith("+00:00") for m in metrics)
    summary = lines[-1]
    assert (summary["summary"], summary["steps"], summary["tokens"]) == (
        "finished",
        "1-8/8",
        "8.2k",
    ), summary
    assert float(summary["loss"]) == pytest.approx(metrics[-1]["loss"], abs=5e-5)
    assert summary["checkpoints"].split(",") == [
        "latest",
        "tokens-000000000004096",
        "tokens-000000000008192",
    ]


def test_validation_loss_equals_a_full_logits_cross_entropy_of_the_final_weights(
    data_dir, tmp_path
):
    """data.val_dir: the logged val_loss is the mean token cross-entropy of the held-out rows under the weights of
    that step, computed here independently from full logits; training is unchanged by validating."""
    val = {"data.val_dir": str(data_dir), "data.val_every_tokens": 4096, "data.val_rows": 6}
    history = run(tiny(data_dir, tmp_path / "val", **val))
    rows = [json.loads(x) for x in (tmp_path / "val/metrics.jsonl").read_text().splitlines()]
    checks = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in checks] == [4, 8] and all(r["val_targets"] > 0 for r in checks)
    plain = run(tiny(data_dir, tmp_path / "plain"))
    assert [r["loss"] for r in history] == [
        r["loss"] for r in plain
    ]  # validating does not disturb training

    config = ckpt.load_model_config(tmp_path / "val/checkpoints" / ckpt.milestone_name(8192))
    model = Transformer(config).eval()
    model.load_state_dict(weights(tmp_path / "val/checkpoints" / ckpt.milestone_name(8192)))
    batch = next(PackedSampler(TokenDataset(data_dir), 128, 6, seed=0, shuffle=False))
    with torch.no_grad():
        logits = model(batch.input_ids, batch.cu_seqlens, batch.max_seqlen)
    expected = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).double(), batch.targets.reshape(-1), ignore_index=-100
    )
    assert checks[-1]["val_targets"] == int((batch.targets != -100).sum())
    assert checks[-1]["val_loss"] == pytest.approx(float(expected), rel=1e-5)


def test_the_last_step_of_an_invocation_is_logged_whatever_every_steps_says(data_dir, tmp_path):
    run(tiny(data_dir, tmp_path, stop_at_step=5, **{"logging.every_steps": 3}))
    logged = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert logged == [3, 5]  # step 5 ends this job (stop_at_step): a requeue must not leave it out


def test_saves_validation_requeue_and_resume_with_collectives_that_return_device_tensors(
    data_dir, tmp_path, monkeypatch, device_collectives
):
    """NCCL hands Fabric's collectives back on the GPU: every save, validation and requeue path must copy to host."""
    probe = device_collectives(torch.ones(2))
    with pytest.raises(TypeError, match="cuda:0 device type tensor to numpy"):
        probe.numpy()
    assert probe.tolist() == [1.0, 1.0] and probe.cpu().numpy().tolist() == [
        1.0,
        1.0,
    ]  # the double is strict, not broken
    with pytest.raises(TypeError, match="to numpy"):
        probe.unbind()[0].numpy()  # tuples of results stay on the device
    with pytest.raises(RuntimeError, match="same device"):
        torch.ones(2) + probe  # CUDA refuses host and device operands together
    host = torch.zeros(2)
    host.copy_(probe)  # a copy into host memory is legal
    assert host.numpy().tolist() == [1.0, 1.0]
    val = {"data.val_dir": str(data_dir), "data.val_every_tokens": 2048, "data.val_rows": 4}
    real_step = Trainer._train_step
    calls = sigusr1_in_a_slurm_job(monkeypatch, "77", at_step=4)
    cfg = tiny(data_dir, tmp_path / "run", **val)
    first = run(
        cfg
    )  # milestone at step 4, latest every 2 steps, validation every 2 steps, SIGUSR1 -> requeue save
    assert calls == [["scontrol", "requeue", "77"]] and first[-1]["step"] == 6
    assert ckpt.read_trainer_state(tmp_path / "run/checkpoints/latest")["step"] == 6
    monkeypatch.setattr(Trainer, "_train_step", real_step)
    second = run(cfg)  # --resume auto from the requeue's save
    assert [r["step"] for r in first + second] == list(range(1, 9))
    full = run(tiny(data_dir, tmp_path / "full", **val))
    assert [r["loss"] for r in first + second] == [r["loss"] for r in full]
    end = ckpt.milestone_name(8 * 1024)
    assert np.array_equal(
        ckpt.load_trained_lengths(tmp_path / "run/checkpoints" / end),
        ckpt.load_trained_lengths(tmp_path / "full/checkpoints" / end),
    )
    validated = [
        json.loads(x)
        for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()
        if "val_loss" in x
    ]
    assert validated, "validation ran"


def test_attention_backend_is_checked_before_launch_and_named_at_start(
    data_dir, tmp_path, monkeypatch, capsys
):
    import posfreq.train.attention as attention

    monkeypatch.setattr(
        attention, "kernel_present", lambda name: True
    )  # as on a GPU node with everything built
    gpu = {"accelerator": "cuda", "model.attention_backend": "auto"}
    assert attention_choice(
        config_from_dict(tiny(data_dir, tmp_path, **gpu, precision="bf16-mixed"))
    ).startswith("attention: auto -> varlen (cuda, bfloat16, backward")
    fp32 = config_from_dict(tiny(data_dir, tmp_path, **gpu, precision="32-true"))
    assert "auto -> sdpa" in attention_choice(fp32)  # no FlashAttention kernel takes float32
    for backend in ("flash", "varlen"):
        with pytest.raises(
            ConfigError,
            match=f"model.attention_backend: attention backend '{backend}' .*float32.*"
            "Fix: choose 'sdpa'",
        ):
            attention_choice(
                config_from_dict(
                    tiny(
                        data_dir,
                        tmp_path,
                        **{**gpu, "model.attention_backend": backend},
                        precision="32-true",
                    )
                )
            )
    monkeypatch.undo()
    run(tiny(data_dir, tmp_path / "cpu", stop_at_step=1, **{"model.attention_backend": "auto"}))
    assert "attention: auto -> sdpa (cpu, float32, backward)" in capsys.readouterr().out


def test_bf16_mixed_with_activation_checkpointing_trains_and_resumes_exactly(data_dir, tmp_path):
    """The production precision (configs/pretrain_2k.yaml): FSDP2's bf16 policy must leave the blocks' non-tensor
    inputs (the forward context, its position scheme) alone, and a resumed run equals an uninterrupted one."""
    bf16 = {
        "precision": "bf16-mixed",
        "model.activation_checkpointing": True,
        "total_tokens": 4 * 1024,
    }
    full = run(tiny(data_dir, tmp_path / "full", **bf16))
    first = run(tiny(data_dir, tmp_path / "split", stop_at_step=2, **bf16))
    second = run(tiny(data_dir, tmp_path / "split", **bf16))
    losses = [r["loss"] for r in full]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    assert [r["loss"] for r in first + second] == losses
    fp32 = run(tiny(data_dir, tmp_path / "fp32", total_tokens=4 * 1024, stop_at_step=1))
    assert fp32[0]["loss"] == pytest.approx(
        full[0]["loss"], rel=2e-2
    )  # bf16 compute of the same first step
    state = weights(tmp_path / "full/checkpoints" / ckpt.milestone_name(4 * 1024))
    assert all(
        t.dtype == torch.float32 for t in state.values()
    )  # fp32 master weights are what is saved


def test_cuda_rng_is_saved_per_rank_device_and_restores_on_a_node_of_another_size(monkeypatch):
    """Each rank drives one GPU: its state alone is saved, and an older all-GPU list restores this rank's entry
    (not an IndexError on a node with fewer GPUs)."""
    set_calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(
        torch.cuda, "get_rng_state", lambda device="cuda": torch.tensor([7], dtype=torch.uint8)
    )
    monkeypatch.setattr(
        torch.cuda, "get_rng_state_all", lambda: pytest.fail("every GPU's state saved by one rank")
    )
    monkeypatch.setattr(
        torch.cuda, "set_rng_state", lambda state, device="cuda": set_calls.append(state.tolist())
    )
    monkeypatch.setattr(
        torch.cuda, "set_rng_state_all", lambda states: pytest.fail("restores every GPU")
    )
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    state = capture_rng()
    assert state["cuda_device"].tolist() == [7]
    restore_rng(state)
    older = {
        **{k: v for k, v in state.items() if k != "cuda_device"},
        "cuda": [torch.tensor([i], dtype=torch.uint8) for i in range(8)],
    }
    restore_rng(older)  # saved on 8 GPUs, restored by rank 1 of a smaller node
    assert set_calls == [[7], [1]]


def test_gpu_names_map_to_their_own_peak():
    from posfreq.train.flops import peak_of_device_name

    assert peak_of_device_name("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_of_device_name("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_of_device_name("NVIDIA H100 PCIe") == 756e12  # not the SXM part's peak
    assert peak_of_device_name("NVIDIA L40S") == 362e12  # not the L4's
    assert peak_of_device_name("NVIDIA L4") == 121e12
    assert peak_of_device_name("NVIDIA GeForce RTX 4090") is None  # unknown: MFU is not guessed


def test_a_fresh_start_into_a_run_directory_is_refused_and_changes_nothing(data_dir, tmp_path):
    run(tiny(data_dir, tmp_path, stop_at_step=2))
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(
        ConfigError, match="holds a run .*checkpoints.*--resume auto to continue it"
    ):
        run(tiny(data_dir, tmp_path, resume=None))
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_ctrl_c_saves_latest_like_sigterm_and_a_second_one_stops_at_once(
    data_dir, tmp_path, monkeypatch
):
    real_step = Trainer._train_step

    def step_then_ctrl_c(self, batches, n):
        out = real_step(self, batches, n)
        if self.step == 1:
            os.kill(os.getpid(), signal.SIGINT)
        return out

    monkeypatch.setattr(Trainer, "_train_step", step_then_ctrl_c)
    with pytest.raises(SystemExit) as stop:
        run(tiny(data_dir, tmp_path, **{"checkpoint.latest_every_steps": 0}))
    assert stop.value.code == EXIT_NOT_REQUEUED
    assert ckpt.read_trainer_state(tmp_path / "checkpoints/latest")["step"] == 3
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    signals = StopSignals()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert signals.received == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        signals.restore()


def snapshot(root: Path) -> dict:
    """Every file under `root` with its bytes (directories implied): to prove a refused command changed nothing."""
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_consolidate_never_replaces_a_directory_it_did_not_write(data_dir, tmp_path, capsys):
    run_dir = tmp_path / "run"
    run(tiny(data_dir, run_dir, total_tokens=2048))
    src = run_dir / "checkpoints" / ckpt.milestone_name(2048)
    (
        tmp_path / "model.old"
    ).mkdir()  # a user's directories that happen to sit where publish() would work
    (tmp_path / "model.old" / "notes.txt").write_text("mine")
    before = snapshot(tmp_path)
    for out in (run_dir, tmp_path / "model"):
        with pytest.raises(
            SystemExit,
            match="error: --out.* holds files `posfreq checkpoint consolidate` did not "
            "write .*nothing was changed",
        ):
            consolidate.main(["consolidate", "--checkpoint", str(src), "--out", str(out)])
        assert snapshot(tmp_path) == before
    (tmp_path / "model.old" / "notes.txt").unlink()
    (tmp_path / "model.old").rmdir()
    first = consolidate.consolidate(src, tmp_path / "model")
    again = consolidate.consolidate(src, tmp_path / "model")  # its own: replaced whole
    assert (
        first == again
        and (again / "model.safetensors").is_file()
        and not (tmp_path / "model.old").exists()
    )
    (
        again / ".posfreq-output.json"
    ).unlink()  # as an older posfreq left it: its files, meta.json naming the source
    assert (
        consolidate.main(
            ["consolidate", "--checkpoint", str(src), "--out", str(again), "--dtype", "bf16"]
        )
        == 0
    )
    with pytest.raises(
        FileNotFoundError
    ):  # a wrong --checkpoint writes nothing, not even the temporary
        consolidate.consolidate(run_dir / "nope", tmp_path / "other")
    assert not (tmp_path / "other").exists() and not (tmp_path / "other.tmp").exists()


def test_a_full_disk_during_a_save_is_named_as_such(data_dir, tmp_path, monkeypatch):
    """safetensors words a short write as 'unexpected pos 704 vs 598': the error must say the disk is full."""
    import shutil
    from collections import namedtuple

    def short_write(*args, **kwargs):
        raise RuntimeError("unexpected pos 704 vs 598")

    monkeypatch.setattr(checkpoint_save, "save_checkpoint", short_write)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 10**12 - 4096, 4096))
    with pytest.raises(
        SystemExit,
        match=r"error: saving .*latest failed: the disk holding .* is full \(0 MiB free\) "
        r"\(RuntimeError: unexpected pos 704 vs 598\)\. Fix: free space",
    ):
        config = tmp_path / "run.json"
        config.write_text(json.dumps(tiny(data_dir, tmp_path / "run", stop_at_step=1)))
        pretrain.main(["--config", str(config)])
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 0, 10**12))
    with pytest.raises(
        RuntimeError, match="unexpected pos"
    ):  # with room on the disk, the error is not reworded
        run(tiny(data_dir, tmp_path / "other", stop_at_step=1))


def test_overwrite_starts_afresh_deleting_only_the_runs_own_files(data_dir, tmp_path):
    run(tiny(data_dir, tmp_path, stop_at_step=2))
    (tmp_path / "notes.md").write_text("mine")
    with pytest.raises(ConfigError, match="--overwrite starts afresh, --resume auto continues"):
        run(tiny(data_dir, tmp_path, overwrite=True))
    history = run(tiny(data_dir, tmp_path, resume=None, overwrite=True, stop_at_step=1))
    assert [r["step"] for r in history] == [1]
    logged = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert logged == [1] and (tmp_path / "notes.md").read_text() == "mine"
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["latest"]
    assert ckpt.read_trainer_state(tmp_path / "checkpoints/latest")["step"] == 1


def test_overwrite_never_requeues_and_never_deletes_its_own_starting_weights(
    data_dir, tmp_path, monkeypatch
):
    first = tmp_path / "first"
    run(tiny(data_dir, first, total_tokens=2048))
    start = first / "checkpoints" / ckpt.milestone_name(2048)
    with pytest.raises(ConfigError, match="lies in the run files --overwrite would delete"):
        run(tiny(data_dir, first, resume=None, overwrite=True, **{"model.init_from": str(start)}))
    assert start.is_dir()
    calls = sigusr1_in_a_slurm_job(monkeypatch, "99", at_step=1)
    with pytest.raises(
        SystemExit
    ) as stop:  # a requeued job would run --overwrite again and delete this run
        run(
            tiny(
                data_dir, first, resume=None, overwrite=True, **{"checkpoint.latest_every_steps": 0}
            )
        )
    assert stop.value.code == EXIT_NOT_REQUEUED and calls == []
    assert ckpt.read_trainer_state(first / "checkpoints/latest")["step"] == 3

"""Shared by the trainer's tests: the tiny corpus and config, a run in this process or a child, and the run
fixtures (a pytest plugin of tests/conftest.py: each is made once per session, whichever module asks first)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from posfreq.scripts.commands import pretrain
from posfreq.train.checkpoint import layout as ckpt
from posfreq.train.checkpoint.load import model_state_dict
from posfreq.train.run import control as run_control
from posfreq.train.run.config import config_from_dict
from posfreq.train.run.parallel import local_launch_env
from posfreq.train.run.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    """Two byte-tokenized shards of short, learnable synthetic documents (5-600 bytes): the doctor's corpus."""
    from posfreq.train.preflight.pretrain_check import write_tiny_corpus

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
    return model_state_dict(directory)


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


def subprocess_env(**extra: str) -> dict[str, str]:
    """os.environ for a trainer subprocess: a fresh rendezvous (without what in-process runs left, MASTER_PORT,
    ...), no SLURM job, unbuffered output, one thread."""
    env = local_launch_env(os.environ)
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **extra)
    return env


@pytest.fixture(scope="session")
def resumable(data_dir, tmp_path_factory) -> dict[str, Path]:
    """Run directories stopped after one step with a resumable `latest`: sharded (DCP) and one full file."""
    runs = {}
    for kind, sharded in (("sharded", True), ("full", False)):
        runs[kind] = tmp_path_factory.mktemp(kind)
        run(tiny(data_dir, runs[kind], stop_at_step=1, **{"checkpoint.sharded": sharded}))
    return runs


@pytest.fixture(scope="session")
def uninterrupted(data_dir, tmp_path_factory) -> dict[str, torch.Tensor]:
    """Final weights (tokens-8192) of the 8-step run that the interrupted runs below must reproduce."""
    out = tmp_path_factory.mktemp("uninterrupted")
    run(tiny(data_dir, out))
    return weights(out / "checkpoints" / ckpt.milestone_name(8 * 1024))


def run_trainer_process(code: str, config: Path, **env: str) -> subprocess.CompletedProcess:
    """`python -c code --config config` from the repository root (code ends by exiting with pretrain.main()'s code)."""
    return subprocess.run(
        [sys.executable, "-c", code, "--config", str(config)],
        env=subprocess_env(**env),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )

"""The doctor's pretraining check: a tiny run on this machine's GPUs (or CPU), uninterrupted and stopped then
resumed, in child processes; losses, validation and the trained-length histogram must match. Its tiny corpus
is also the tests' shard fixture."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from posfreq.train.atomic import write_json_atomic, write_text_atomic
from posfreq.train.run.parallel import local_launch_env

L = 128  # the tiny run's training length


WORDS = "the cat sat on a mat and then it ran to the red house where a dog slept all day".split()


def write_tiny_corpus(directory: Path, max_words: int = 60) -> Path:
    """Two byte-tokenized shards of 150 short, learnable synthetic documents each (1 to max_words - 1 words)."""
    from posfreq.train.data.tokens.shard_files import ShardWriter

    rng = np.random.default_rng(0)
    for s in range(2):
        with ShardWriter(
            directory, f"shard-{s:03d}", tokenizer="bytes", vocab_size=258, eos_id=257
        ) as writer:
            for d in range(150):
                n = int(rng.integers(1, max_words))
                text = " ".join(WORDS[(3 * i + d) % len(WORDS)] for i in range(n)) + "."
                writer.add(list(text.encode()) + [257])
    return directory


def tiny_run_config(
    data: Path, out: Path, device: torch.device, precision: str, processes: int
) -> dict:
    """4 optimizer steps of 2 micro-batches per process; a milestone, a validation and a `latest` every 2 steps."""
    rows = (
        2 * processes
    )  # one row per micro-batch and process, 2 micro-batches (exercises no_backward_sync)
    step_tokens = rows * L
    return {
        "out": str(out),
        "seed": 1,
        "total_tokens": 4 * step_tokens,
        "global_batch_tokens": step_tokens,
        "micro_batch_rows": 1,
        "accelerator": device.type,
        "devices": processes,
        "precision": precision,
        "resume": "auto",
        "model": {
            "preset": "tiny-2l-128",
            "overrides": {"d_model": 128, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 256},
        },
        "data": {
            "dir": str(data),
            "train_len": L,
            "val_dir": str(data),
            "val_rows": 2 * processes,
            "val_every_tokens": 2 * step_tokens,
        },
        "optim": {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 1},
        "checkpoint": {
            "every_tokens": 2 * step_tokens,
            "latest_every_steps": 1,
            "latest_every_minutes": 0,
        },
        "logging": {"progress_bar": False},
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SIGNAL_AT_STEP = """
import json, os, signal, sys
import torch.distributed as dist
from posfreq.scripts.commands.pretrain import main
from posfreq.train.run.trainer import Trainer
optimize = Trainer._optimize
def signalling(self, *args, **kwargs):
    out = optimize(self, *args, **kwargs)
    if self.step + 1 == int(os.environ["POSFREQ_CHECK_SIGNAL_AT"]):
        os.kill(os.getpid(), signal.SIGUSR1)
        with open(os.environ["POSFREQ_CHECK_RECORD"], "w") as record:
            json.dump({"environment": type(self.fabric.strategy.cluster_environment).__name__,
                       "backend": dist.get_backend() if dist.is_initialized() else None,
                       "world_size": self.fabric.world_size}, record)
    return out
Trainer._optimize = signalling
sys.exit(main(sys.argv[1:]))
"""
"""`posfreq pretrain` that sends itself SIGUSR1 (SLURM's warning before the time limit) during step
POSFREQ_CHECK_SIGNAL_AT and records, into POSFREQ_CHECK_RECORD, the cluster environment and process-group
backend the run uses: the signal then takes the trainer's own path (agree, save, requeue)."""


def run_pretrain(
    config: dict,
    path: Path,
    *extra: str,
    env: dict[str, str] | None = None,
    signal_at: int | None = None,
) -> None:
    """`posfreq pretrain --config PATH` in a child process (Fabric starts the other local ranks from it), with
    `env` added to a local launch's environment, sending itself SIGUSR1 during step `signal_at` if given."""
    write_json_atomic(path, config)
    child = local_launch_env(os.environ)  # a local launch by Fabric, not srun's or torchrun's
    child.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), PYTHONWARNINGS="ignore")
    child.update(env or {})
    entry = ["-m", "posfreq.scripts.commands.pretrain"]
    if signal_at is not None:
        entry = ["-c", SIGNAL_AT_STEP]
        child.update(
            POSFREQ_CHECK_SIGNAL_AT=str(signal_at),
            POSFREQ_CHECK_RECORD=str(path.parent / f"{path.stem}.record.json"),
        )
    proc = subprocess.run(
        [sys.executable, *entry, "--config", str(path), *extra],
        env=child,
        capture_output=True,
        text=True,
        timeout=480,
    )
    write_text_atomic(path.parent / f"{path.stem}.log", proc.stdout + proc.stderr)
    if proc.returncode != 0:
        lines = [x for x in (proc.stderr or proc.stdout).strip().splitlines() if x.strip()]
        raise RuntimeError(
            f"posfreq pretrain exited {proc.returncode} (log: {path.parent / (path.stem + '.log')}): "
            f"{lines[-1] if lines else ''}"
        )


def _metrics(run: Path) -> tuple[list[float], list[float]]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r["loss"] for r in rows if "loss" in r], [
        r["val_loss"] for r in rows if "val_loss" in r
    ]


def _same_run(
    whole: Path, split: Path, device: torch.device, config: dict
) -> tuple[float, list[float]]:
    """(the largest relative difference of losses and validations, the uninterrupted losses) of two runs of
    `config` that must match: 4 steps and 2 validations each, equal to a tolerance, and equal histograms."""
    from posfreq.train.checkpoint import layout as ckpt

    (loss_a, val_a), (loss_b, val_b) = _metrics(whole), _metrics(split)
    if len(loss_a) != 4 or len(loss_b) != 4 or len(val_a) != 2 or len(val_b) != 2:
        raise AssertionError(
            f"expected 4 steps and 2 validations, got {len(loss_a)}/{len(val_a)} uninterrupted, "
            f"{len(loss_b)}/{len(val_b)} resumed"
        )
    # Bitwise on CPU; on GPUs FlashAttention's backward accumulates with atomics, so runs differ in the last bits.
    tolerance = 0.0 if device.type == "cpu" else 1e-3
    worst = max(abs(a - b) / abs(a) for a, b in zip(loss_a + val_a, loss_b + val_b))
    if not all(map(math.isfinite, loss_a + val_a)) or worst > tolerance:
        raise AssertionError(
            f"resumed losses {loss_b} / val {val_b} differ from uninterrupted {loss_a} / val {val_a} "
            f"(max relative difference {worst:.2e} > {tolerance:g})"
        )
    end = ckpt.milestone_name(config["total_tokens"])
    if not np.array_equal(
        ckpt.load_trained_lengths(ckpt.checkpoint_root(whole) / end),
        ckpt.load_trained_lengths(ckpt.checkpoint_root(split) / end),
    ):
        raise AssertionError(f"trained-length histograms of {end} differ between the two runs")
    return worst, loss_a


def pretrain_check(
    work: Path, data: Path, device: torch.device, precision: str, processes: int
) -> str:
    """The tiny run uninterrupted, and stopped at step 2 then resumed: same losses, validation and histogram."""
    from posfreq.train.checkpoint import layout as ckpt

    work.mkdir(parents=True)
    whole, split = work / "uninterrupted", work / "resumed"
    run_pretrain(
        tiny_run_config(data, whole, device, precision, processes), work / "uninterrupted.json"
    )
    config = tiny_run_config(data, split, device, precision, processes)
    run_pretrain(config, work / "resumed.json", "--stop-at-step", "2")
    if not (ckpt.checkpoint_root(split) / ckpt.LATEST).is_dir():
        raise AssertionError("the run stopped at step 2 wrote no checkpoints/latest")
    run_pretrain(config, work / "resumed.json")
    worst, loss_a = _same_run(whole, split, device, config)
    return (
        f"{processes} process(es), {precision}: losses {', '.join(f'{x:.4f}' for x in loss_a)}; resumed at "
        f"step 2, max relative difference {worst:.1e}; histograms equal"
    )


SLURM_JOB = "4242"
"""The fake job id of `requeue_check`'s one task."""


def requeue_check(work: Path, data: Path, device: torch.device, precision: str) -> str:
    """One task as SLURM's srun starts it (SLURM_* variables, slurm/pretrain_common.sh's POSFREQ_SRUN_TASK, a fake
    `scontrol` on PATH): Lightning's SLURMEnvironment with the device's process group (NCCL on a GPU), a SIGUSR1
    during step 2, the save and the `scontrol requeue` it makes, then the requeued job (SLURM_RESTART_COUNT=1):
    the same losses, validation and histogram as the tiny run uninterrupted."""
    from posfreq.train.run.parallel import SRUN_TASK

    work.mkdir(parents=True)
    whole, requeued = work / "uninterrupted", work / "requeued"
    run_pretrain(tiny_run_config(data, whole, device, precision, 1), work / "uninterrupted.json")
    bin_dir, calls = work / "bin", work / "scontrol.calls"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> "{calls}"\n')
    scontrol.chmod(0o755)
    slurm = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        SRUN_TASK: "1",
        "SLURM_JOB_ID": SLURM_JOB,
        "SLURM_JOB_NAME": "posfreq-gpu-check",
        "SLURM_NTASKS": "1",
        "SLURM_NTASKS_PER_NODE": "1",
        "SLURM_NNODES": "1",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_NODELIST": "127.0.0.1",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
    }
    config = tiny_run_config(data, requeued, device, precision, 1)
    run_pretrain(config, work / "requeued.json", env=slurm, signal_at=2)
    record = json.loads((work / "requeued.record.json").read_text())
    expected = {
        "environment": "SLURMEnvironment",
        "backend": "nccl" if device.type == "cuda" else "gloo",
        "world_size": 1,
    }
    if record != expected:
        raise AssertionError(f"the task ran under {record}, not {expected}")
    asked = calls.read_text().split("\n") if calls.is_file() else []
    if asked[:1] != [f"requeue {SLURM_JOB}"]:
        raise AssertionError(
            f"after SIGUSR1 the run asked scontrol {asked}, not 'requeue {SLURM_JOB}'"
        )
    log = (work / "requeued.log").read_text()
    if f"requeued SLURM job {SLURM_JOB}" not in log:
        raise AssertionError(
            f"the signalled run did not say it requeued the job (log: {work / 'requeued.log'})"
        )
    run_pretrain(config, work / "requeued.json", env={**slurm, "SLURM_RESTART_COUNT": "1"})
    worst, _ = _same_run(whole, requeued, device, config)
    return (
        f"SLURMEnvironment, {record['backend']}, {precision}: SIGUSR1 during step 2, saved, and asked "
        f"`scontrol requeue {SLURM_JOB}`; the requeued job finished with the uninterrupted run's losses (max "
        f"relative difference {worst:.1e}) and histogram"
    )

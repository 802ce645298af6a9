"""`make gpu-check`'s training stage (train/preflight/gpu_check.py runs it): the 1.3B model at L = 2048 through one
rank's real accumulation loop, a stop with the sharded save and a resume, against the USR1 margin and the memory
plan."""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

PRETRAIN_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "pretrain_2k.yaml"


def random_shards(directory: Path, vocab: int, eos: int, documents: int) -> None:
    """Random documents of 16 to 4,000 tokens (log-uniform), one token shard."""
    from posfreq.train.data.tokens.shard_files import ShardWriter

    rng = np.random.default_rng(0)
    with ShardWriter(
        directory, "random", tokenizer="llama3", vocab_size=vocab, eos_id=eos
    ) as writer:
        for _ in range(documents):
            n = int(np.exp(rng.uniform(np.log(16), np.log(4000))))
            writer.add(np.append(rng.integers(0, eos, n), eos))


USR1_MARGIN_SECONDS = 300
"""slurm/pretrain_*.sh's `--signal=USR1@300`: a step and the save it triggers must end within it."""


@contextlib.contextmanager
def _timed(owner: type, method: str, into: list[float]) -> Iterator[None]:
    """Record the wall seconds of each call of `owner.method` (synchronized on CUDA) into `into`, for the block."""
    original = getattr(owner, method)

    def timed(*args, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            into.append(time.perf_counter() - started)

    setattr(owner, method, timed)
    try:
        yield
    finally:
        setattr(owner, method, original)


@dataclass(frozen=True)
class TrainStageSize:
    """The training stage's sizes: the 1.3B paper run's by default; the CPU test shrinks them to a tiny model."""

    preset: str = "tinyllama-1.3b"
    length: int = 2048
    micro_batches: int = 16
    """Per step, as on 16 GPUs."""
    steps: int = 4
    save_at: int = 2
    """The step after which the stop's sharded save is made and the run resumed."""
    matmul_size: int = 8192
    compile: str = "auto"
    vocab: int = 128_256
    """The data's vocabulary (Llama-3's), which sizes the model's."""


def stage_config(work: Path, device: torch.device, size: TrainStageSize) -> dict:
    """The stage's run config: the pretraining config's micro-batch, activation checkpointing and packing, on one
    rank, with random shards written under `work`; no checkpoint but the stop's save and the end's weights."""
    import yaml

    paper = yaml.safe_load(PRETRAIN_CONFIG.read_text())
    rows = paper["micro_batch_rows"]
    data = work / "data"
    eos = size.vocab - 255  # Llama-3's EOS: 128,001
    random_shards(data, size.vocab, eos, documents=size.micro_batches * rows * 3)
    step_tokens = size.micro_batches * rows * size.length
    return {
        "out": str(work / "run"),
        "total_tokens": size.steps * step_tokens,
        "global_batch_tokens": step_tokens,
        "micro_batch_rows": rows,
        "accelerator": device.type,
        "devices": 1,
        "precision": "bf16-mixed",
        "resume": "auto",
        "model": {
            "preset": size.preset,
            "attention_backend": "auto",
            "activation_checkpointing": paper["model"].get("activation_checkpointing", False),
            "compile": size.compile,
        },
        "data": {"dir": str(data), "train_len": size.length, "packing": paper["data"]["packing"]},
        "optim": {"warmup_steps": 1},
        "checkpoint": {
            "every_tokens": 10**15,
            "latest_every_steps": 0,
            "latest_every_minutes": 0,
            "milestone_weights_only": True,  # the end-of-run save: weights only
        },
        "logging": {"progress_bar": False},
    }


def train_stage(device: torch.device, work: Path, size: TrainStageSize = TrainStageSize()) -> dict:
    """`size.preset` at L = `size.length` through one rank's real accumulation loop: `size.save_at` steps, then the
    sharded resumable save a stop makes (model and optimizer), then a resume to `size.steps`. Step time, MFU against
    the datasheet peak and the measured bf16 matmul rate, peak memory, and save and load times against the USR1
    margin."""
    from posfreq.train.model.fused import resolve_compile, use_fused
    from posfreq.train.run.config import config_from_dict
    from posfreq.train.run.flops import measured_matmul_flops
    from posfreq.train.run.pretrain import train
    from posfreq.train.run.trainer import Trainer

    config = stage_config(work, device, size)
    measured = measured_matmul_flops(device, size.matmul_size, torch.bfloat16)
    saves: list[float] = []
    loads: list[float] = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        with _timed(Trainer, "save", saves), _timed(Trainer, "_load", loads):
            first = train(config_from_dict({**config, "stop_at_step": size.save_at}))
            resumed = train(config_from_dict(config))
    finally:
        use_fused(
            False
        )  # the trainer switched the process to fused kernels; the stages after compare eager
    if len(first) != size.save_at or len(resumed) != size.steps - size.save_at or not loads:
        raise AssertionError(
            f"expected {size.save_at} steps, a save, a load and {size.steps - size.save_at} more; got {len(first)} "
            f"steps, {len(saves)} saves, {len(loads)} loads and {len(resumed)} steps"
        )
    timed = first[1:] + resumed[1:]  # each process's first step compiles
    step_s = statistics.median(r["step_time_s"] for r in timed)
    if step_s + saves[0] > USR1_MARGIN_SECONDS:
        raise AssertionError(
            f"a step ({step_s:.0f} s) and the save it triggers ({saves[0]:.0f} s) take longer than the "
            f"{USR1_MARGIN_SECONDS} s between SLURM's USR1 and the time limit"
        )
    planned = _planned_gib(
        config_from_dict(config), size.vocab, resolve_compile(size.compile, device.type)
    )
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return _stage_figures(config, timed, step_s, measured, (saves[0], loads[0]), peak, planned)


def _stage_figures(
    config: dict,
    timed: list[dict],
    step_s: float,
    measured: float,
    save_load_s: tuple[float, float],
    peak: float | None,
    planned: float,
) -> dict:
    """The stage's figures, and the line that states them: medians over the `timed` steps' records."""
    save_s, load_s = save_load_s
    flops = statistics.median(r["flops_per_s"] for r in timed)
    tokens_per_s = statistics.median(r["tokens_per_s"] for r in timed)
    row = timed[0]  # the trainer's MFU is against the datasheet peak: that peak is its flops / mfu
    datasheet = row["mfu"] and row["flops_per_s"] / row["mfu"]
    rows, length = config["micro_batch_rows"], config["data"]["train_len"]
    micro_batches = config["global_batch_tokens"] // (rows * length)
    model = config["model"]
    return {
        "detail": (
            f"{micro_batches} x {rows} rows x {length} per step: {step_s:.2f} s/step, "
            f"{tokens_per_s:,.0f} tokens/s, "
            + (f"MFU {flops / datasheet:.1%} of the datasheet peak, " if datasheet else "")
            + f"{flops / measured:.1%} of the measured bf16 matmul ({measured / 1e12:.0f} TFLOP/s, "
            f"{flops / 1e12:.0f} TFLOP/s here)"
            + (f"; peak {peak:.1f} GiB" if peak is not None else "")
            + f" (posfreq plan: {planned:.1f} GiB)"
            + f"; sharded save {save_s:.1f} s, load {load_s:.1f} s (step + save within the "
            f"{USR1_MARGIN_SECONDS} s USR1 margin); activation checkpointing "
            f"{model['activation_checkpointing']}, model.compile {model['compile']}"
        ),
        "tokens_per_s": tokens_per_s,
        "step_s": step_s,
        "flops_per_s": flops,
        "matmul_flops_per_s": measured,
        "mfu_measured": flops / measured,
        "mfu_datasheet": flops / datasheet if datasheet else None,
        "save_s": save_s,
        "load_s": load_s,
        "peak_gib": peak,
        "planned_gib": planned,
    }


def _planned_gib(cfg, vocab: int, compiled: bool) -> float:
    """train/run/memory.py's figure for one rank of this stage's run, to set beside the measured peak."""
    from posfreq.train.run.geometry import resolve_model_config
    from posfreq.train.run.memory import GIB, configured, meta_model

    return configured(meta_model(resolve_model_config(cfg, vocab)), cfg, 1, compiled).total / GIB

"""Training throughput: tokens/s and FLOP/s of the trainer vs this machine's matmul FLOP/s and a bare loop.

    python benchmarks/train_throughput.py [--steps 12] [--threads 1] [--presets tiny-2l-128 tiny-4l-256]

For each small preset (byte vocabulary, L = 256, 8,192-token steps in 2 micro-batches) it runs
the real trainer (`train.run.pretrain.train`: Fabric, FSDP2 on one process, sampler, logging,
clipping) and a bare PyTorch loop over the same model, the same packed batches and the same
AdamW, and reports median step times after warm-up. Achieved FLOP/s uses the trainer's formula
(6 N tokens + causal attention, see train/run/flops.py) and is printed as a fraction of the dense
fp32 matmul FLOP/s measured in the same run with the same thread count. The goal for the
trainer's overhead over the bare loop is 5%. With a CUDA GPU it also reports the MFU of
tinyllama-1.3b at L = 2048 (bf16) against the GPU's measured matmul rate (make gpu-check's train stage).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from posfreq.train.data.packing import IGNORE_INDEX, PackedSampler  # noqa: E402
from posfreq.train.data.tokens.shard_files import ShardWriter  # noqa: E402
from posfreq.train.data.tokens.shards import TokenDataset  # noqa: E402
from posfreq.train.model.config import model_preset  # noqa: E402
from posfreq.train.model.transformer import Transformer  # noqa: E402
from posfreq.train.run.config import config_from_dict  # noqa: E402
from posfreq.train.run.flops import measured_matmul_flops  # noqa: E402
from posfreq.train.run.optim import build_optimizer  # noqa: E402
from posfreq.train.run.pretrain import train  # noqa: E402


def make_shards(directory: Path, vocab: int, eos: int, tokenizer: str, docs: int = 400) -> None:
    """Random documents with a natural-ish length spread (16 to 2,000 tokens)."""
    rng = np.random.default_rng(0)
    with ShardWriter(
        directory, "bench", tokenizer=tokenizer, vocab_size=vocab, eos_id=eos
    ) as writer:
        for _ in range(docs):
            n = int(np.exp(rng.uniform(np.log(16), np.log(2000))))
            writer.add(np.append(rng.integers(0, eos, n), eos))


def config(
    preset: str, data: Path, out: Path, steps: int, train_len: int, rows: int, micro: int, gpu: bool
) -> dict:
    return {
        "out": str(out),
        "total_tokens": steps * rows * train_len,
        "global_batch_tokens": rows * train_len,
        "micro_batch_rows": micro,
        "accelerator": "cuda" if gpu else "cpu",
        "devices": 1,
        "precision": "bf16-mixed" if gpu else "32-true",
        "model": {"preset": preset, "attention_backend": "auto" if gpu else "sdpa"},
        "data": {"dir": str(data), "train_len": train_len},
        "optim": {"warmup_steps": 2},
        "checkpoint": {"every_tokens": 10**15, "latest_every_steps": 0, "latest_every_minutes": 0},
        "logging": {"progress_bar": False},
    }


def bare_loop(cfg: dict, steps: int) -> list[float]:
    """Step times of a plain PyTorch loop over the same model, batches and optimizer."""
    run = config_from_dict(cfg)
    dataset = TokenDataset(run.data.dir)
    model = Transformer(
        model_preset(run.model.preset, vocab_size=dataset.vocab_size), attention_backend="sdpa"
    )
    optimizer = build_optimizer(model, run)
    sampler = PackedSampler(dataset, run.data.train_len, run.micro_batch_rows, seed=run.seed)
    accumulation = run.global_batch_tokens // (run.data.train_len * run.micro_batch_rows)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        batches = [next(sampler) for _ in range(accumulation)]
        n = sum(int((b.targets != IGNORE_INDEX).sum()) for b in batches)
        for batch in batches:
            logits = model(batch.input_ids, batch.cu_seqlens, batch.max_seqlen)
            (
                F.cross_entropy(
                    logits.float(), batch.targets, ignore_index=IGNORE_INDEX, reduction="sum"
                )
                / n
            ).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return times


def cpu_report(presets: list[str], steps: int, warmup: int) -> None:
    peak = measured_matmul_flops("cpu", 1024, torch.float32)
    print(
        f"matmul (1024^3, fp32, {torch.get_num_threads()} threads, median of 5 x 50 products): "
        f"{peak / 1e9:.1f} GFLOP/s"
    )
    print(
        f"{'preset':14} {'tokens/s':>10} {'GFLOP/s':>9} {'of matmul':>10} {'bare tok/s':>11} {'overhead':>9}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        make_shards(data, vocab=258, eos=257, tokenizer="bytes")
        for preset in presets:
            cfg = config(
                preset, data, Path(tmp) / preset, steps, train_len=256, rows=32, micro=16, gpu=False
            )
            bare = statistics.median(bare_loop(cfg, steps)[warmup:])
            history = train(config_from_dict(cfg))[warmup:]
            trainer = statistics.median(r["step_time_s"] for r in history)
            flops = (
                statistics.median(r["flops_per_s"] * r["step_time_s"] for r in history) / trainer
            )
            tokens = cfg["global_batch_tokens"]
            print(
                f"{preset:14} {tokens / trainer:10.0f} {flops / 1e9:9.2f} {flops / peak:10.1%} "
                f"{tokens / bare:11.0f} {trainer / bare - 1:+9.1%}"
            )


def gpu_report(steps: int) -> None:
    """tinyllama-1.3b at L = 2048 on this GPU: make gpu-check's train stage (MFU against the datasheet and the
    measured matmul rate; each process's first step, which compiles, is left out of its medians)."""
    from posfreq.train.preflight.gpu_training import TrainStageSize, train_stage

    with tempfile.TemporaryDirectory() as tmp:
        result = train_stage(torch.device("cuda"), Path(tmp), TrainStageSize(steps=max(steps, 4)))
    print(f"GPU {torch.cuda.get_device_name()}: tinyllama-1.3b L=2048: {result['detail']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the medians")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads (1 keeps timings stable on shared machines)",
    )
    parser.add_argument("--presets", nargs="+", default=["tiny-2l-128", "tiny-4l-256"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(
        args.threads
    )  # Fabric's launcher would pick its own thread count
    cpu_report(args.presets, args.steps, args.warmup)
    if torch.cuda.is_available():
        gpu_report(args.steps)


if __name__ == "__main__":
    main()

"""A plan before a cluster job: parameters, per-GPU memory under FSDP2, batch geometry, days to the budget.

Run ``posfreq plan --config configs/pretrain_2k.yaml --num-nodes 2 --devices 8 --gpu a100-80gb
[--mfu 0.4] [--section.key value ...]``. The run config and
flags are read by the trainer's own parser (train.run.config.build_parser), and the model is built on
the meta device, so a plan for a 1.3B model takes no memory and no GPU. Why: a job that does not fit, or that would take
twice the expected days, should be known before it waits in a queue.

Memory per GPU: train/run/memory.py's model (the trainer checks the same figure against the GPU's free memory
before its first step), eager as the upper bound and under model.compile as calibrated.

Time: FLOPs per optimizer step are the trainer's own (train.run.flops.step_flops, the formula its
logged MFU uses): 6 N tokens + 6 n_layers d sum over segments s(s + 1), with N the matmul
parameters (all but the input embedding; the head counts), evaluated for full rows of L tokens
(one document per row, the upper bound of per-document attention), i.e. per token
6 N + 6 n_layers d (L + 1). Step time = FLOPs / (GPUs x peak bf16 FLOP/s x MFU).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from posfreq.train.model.config import ModelConfig, model_preset
from posfreq.train.run.config import TrainConfig
from posfreq.train.run.flops import PEAK_BF16_FLOPS, step_flops
from posfreq.train.run.geometry import batch_geometry, resolve_model_config
from posfreq.train.run.memory import (
    GIB,
    MARGIN,
    Memory,
    configured,
    fsdp_shards,
    largest_rows,
    largest_valid_rows,
    memory,
    meta_model,
)
from posfreq.train.run.memory import usable_bytes as memory_usable_bytes


@dataclass(frozen=True)
class Gpu:
    """A GPU model as the plan needs it."""

    peak_bf16_flops: float
    """Dense bf16 FLOP/s (the datasheet's peak without sparsity)."""
    memory_gib: float
    """Memory in GiB."""


GPUS = {
    "a100-40gb": Gpu(PEAK_BF16_FLOPS["a100"], 40),
    "a100-80gb": Gpu(PEAK_BF16_FLOPS["a100"], 80),
    "h100-sxm": Gpu(PEAK_BF16_FLOPS["h100-sxm"], 80),
    "h100-pcie": Gpu(PEAK_BF16_FLOPS["h100-pcie"], 80),
    "h200": Gpu(PEAK_BF16_FLOPS["h200"], 141),
}
MEASURED_MFU = {"h200": (0.446, "2026-11-26 and -27"), "h100-sxm": (0.421, "2026-11-27")}
"""tinyllama-1.3b at L = 2048 on one GPU (model.compile on, 2 micro-batches of 8 rows): the trainer's MFU
against the datasheet peak, as `make gpu-check` measured it (docs/cluster.md), with the dates."""
GpuName = Literal[tuple(GPUS)]
# TinyLlama's published throughput: 24k tokens/s per A100 for TinyLlama-1.1B (this architecture
# with the Llama-2 vocabulary of 32,000) at L = 2048, without activation checkpointing.
TINYLLAMA = model_preset("tinyllama-1.3b", vocab_size=32_000, train_len=2048)
TINYLLAMA_TOKENS_PER_S = 24_000


def flops_per_token(config: ModelConfig, train_len: int) -> float:
    """The trainer's step_flops for one full row of `train_len` tokens, per token."""
    return step_flops(config, train_len, train_len * (train_len + 1)) / train_len


def tinyllama_mfu(gpu: Gpu) -> float:
    """The MFU that TinyLlama's 24k tokens/s per A100 implies under flops_per_token."""
    return (
        TINYLLAMA_TOKENS_PER_S
        * flops_per_token(TINYLLAMA, TINYLLAMA.train_len)
        / gpu.peak_bf16_flops
    )


def expected_mfu(gpu_name: str) -> tuple[float, str]:
    """(MFU to plan with, where it comes from: measured by posfreq on this GPU, or assumed) per GPU model."""
    if gpu_name in MEASURED_MFU:
        mfu, dates = MEASURED_MFU[gpu_name]
        return (
            mfu,
            f"measured: make gpu-check on one {gpu_name}, {dates}, one GPU without communication",
        )
    if gpu_name.startswith("h100"):
        return (
            MEASURED_MFU["h100-sxm"][0],
            f"assumed: the H100 SXM's measured MFU; not measured on an {gpu_name}",
        )
    return (
        tinyllama_mfu(GPUS[gpu_name]),
        "assumed: TinyLlama-1.1B's published 24k tokens/s per A100 under this FLOP count; posfreq has "
        "not run on an A100",
    )


def step_seconds(cfg: TrainConfig, config: ModelConfig, world: int, gpu: Gpu, mfu: float) -> float:
    """Seconds per optimizer step at `mfu`."""
    flops = cfg.global_batch_tokens * flops_per_token(config, cfg.data.train_len)
    return flops / (world * gpu.peak_bf16_flops * mfu)


def usable_bytes(gpu: Gpu) -> float:
    """The GPU's memory less MARGIN (train/run/memory.py's usable_bytes of a GPU wholly free)."""
    return memory_usable_bytes(gpu.memory_gib * GIB, gpu.memory_gib * GIB)


def _gib(n: float) -> str:
    """Bytes as GiB, right-aligned for the report's columns."""
    return f"{n / GIB:6.2f} GiB"


def _memory_lines(mem: Memory, compiled: Memory, label: str) -> list[str]:
    """The report's lines of one memory breakdown (eager), with the total under model.compile."""
    return [
        f"  {label}",
        f"    parameters (fp32 shard)      {_gib(mem.parameters)}",
        f"    gradients (fp32 shard)       {_gib(mem.gradients)}",
        f"    AdamW (2 fp32 moments)       {_gib(mem.optimizer)}",
        f"    gathered compute copy        {_gib(mem.gathered)}",
        f"    activations (eager)          {_gib(mem.activations)}",
        f"    loss (chunked, lean)         {_gib(mem.loss)}",
        f"    accumulated grads (unshard.) {_gib(mem.accumulated_gradients)}",
        f"    total, eager (upper bound)   {_gib(mem.total)}",
        f"    total, model.compile         {_gib(compiled.total)}  (activations {_gib(compiled.activations).strip()}, calibrated)",
    ]


def _time_lines(
    cfg: TrainConfig, config: ModelConfig, world: int, gpu: Gpu, mfu: float, label: str
) -> list[str]:
    """The report's line of step time, throughput and days at `mfu`."""
    seconds = step_seconds(cfg, config, world, gpu, mfu)
    steps = batch_geometry(cfg, world).total_steps
    per_gpu = cfg.global_batch_tokens / seconds / world
    return [
        f"  {label}: MFU {mfu:.3f}: {seconds:.2f} s/step, {per_gpu:,.0f} tokens/s/GPU, "
        f"{steps * seconds / 86400:.1f} days for {cfg.total_tokens:,} tokens ({steps:,} steps)"
    ]


def _data_vocabulary(cfg: TrainConfig) -> tuple[int | None, str]:
    """(vocabulary size, where it comes from): the token shards' in data.dir, as the trainer takes it, or None and
    why the preset's stands in (a plan is often made where the data is not)."""
    from posfreq.train.data.tokens.shards import TokenDataset

    if not cfg.data.dir or not Path(cfg.data.dir).is_dir():
        return (
            None,
            f"the preset's: data.dir {cfg.data.dir or '(unset)'} is not here; the trainer takes the data's",
        )
    try:
        return TokenDataset(
            cfg.data.dir, tokenizer=cfg.data.tokenizer
        ).vocab_size, f"the data's, {cfg.data.dir}"
    except (FileNotFoundError, ValueError) as err:
        return (
            None,
            f"the preset's: data.dir cannot be read ({str(err)[:200]}); the trainer takes the data's",
        )


def report(
    cfg: TrainConfig, nodes: int, gpus_per_node: int, gpu_name: str, mfu: float | None = None
) -> str:
    """The plan, as printed: step time and days at `mfu` if given, and at the GPU's MFU figure (`expected_mfu`)."""
    gpu, world = GPUS[gpu_name], nodes * gpus_per_node
    data_vocab, vocab_from = _data_vocabulary(cfg)
    config = resolve_model_config(cfg, data_vocab)  # as the trainer resolves it
    if "vocab_size" in cfg.model.overrides:
        vocab_from = "model.overrides.vocab_size"
    model = meta_model(config)
    L, rows, ckpt = cfg.data.train_len, cfg.micro_batch_rows, cfg.model.activation_checkpointing
    total = sum(p.numel() for p in model.parameters())
    embeddings = total - config.num_params(include_embeddings=False)
    lines = [
        f"plan: {cfg.model.preset}, L = {L}, {nodes} x {gpus_per_node} {gpu_name} ({world} GPUs), "
        f"{cfg.precision}, vocab {config.vocab_size:,} ({vocab_from})",
        f"parameters: {total:,} total, {embeddings:,} embeddings, {total - embeddings:,} non-embedding",
        f"batch: {cfg.global_batch_tokens:,} tokens/step = {world} GPUs x {batch_geometry(cfg, world).accumulation} micro-batches "
        f"x {rows} rows x {L} tokens",
    ]
    shards = fsdp_shards(cfg, world)
    sharding = (
        f"full sharding over {world}"
        if shards == world
        else f"hybrid: sharded over each node's {shards}, replicated over {world // shards} nodes"
    )
    lines.append(
        f"memory per GPU (FSDP2 {sharding}; {rows} rows = {rows * L:,} tokens/micro-batch):"
    )
    for checkpointing in (False, True):
        label = f"activation checkpointing {'on' if checkpointing else 'off'}" + (
            " (config)" if checkpointing == ckpt else ""
        )
        lines += _memory_lines(
            memory(model, cfg, world, rows, checkpointing),
            memory(model, cfg, world, rows, checkpointing, compiled=True),
            label,
        )
    usable = usable_bytes(gpu)
    for compiled in (True, False):
        mem = configured(model, cfg, world, compiled)
        verdict = "fits" if mem.total <= usable else "DOES NOT FIT"
        mode = "model.compile (on GPUs by default)" if compiled else "eager"
        lines.append(
            f"fit, {mode}: {verdict}: {_gib(mem.total).strip()} of {_gib(usable).strip()} usable "
            f"({gpu.memory_gib:g} GiB less {MARGIN:.0%} margin)"
        )
    for checkpointing in (False, True):
        most = [largest_rows(model, cfg, world, usable, checkpointing, c) for c in (False, True)]
        lines.append(
            f"  largest micro-batch, checkpointing {'on' if checkpointing else 'off'}: {most[0]} rows eager "
            f"({largest_valid_rows(most[0], cfg, world)} dividing the step's rows per GPU), {most[1]} under "
            f"model.compile ({largest_valid_rows(most[1], cfg, world)})"
        )
    lines.append(
        f"time (FLOPs/token {flops_per_token(config, L) / 1e9:.2f} G = 6 N + 6 n_layers d (L + 1), "
        f"N = {step_flops(config, 1, 0) / 6:,.0f} matmul params; peak {gpu.peak_bf16_flops / 1e12:g} TFLOP/s):"
    )
    table, source = expected_mfu(gpu_name)
    if mfu is not None:
        lines += _time_lines(cfg, config, world, gpu, mfu, "at --mfu")
    lines += _time_lines(cfg, config, world, gpu, table, f"{gpu_name} ({source})")
    return "\n".join(lines)

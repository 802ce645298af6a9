"""A plan before a cluster job: parameters, per-GPU memory under FSDP2, batch geometry, days to the budget.

Run ``posfreq plan --config configs/pretrain_2k.yaml --num-nodes 2 --devices 8 --gpu a100-80gb
[--mfu 0.4] [--section.key value ...]``. The run config and
flags are read by the trainer's own parser (train.run.config.build_parser), and the model is built on
the meta device, so a plan for a 1.3B model takes no memory and no GPU. Why: a job that does not fit, or that would take
twice the expected days, should be known before it waits in a queue.

Memory per GPU (bytes; P_r = this rank's shard of every parameter, ceil(dim0 / shards) x the rest,
as FSDP2 pads it, with shards = world under `fsdp: full` and the GPUs of one node under hybrid sharding;
a = 2 under bf16-mixed, 4 under 32-true):
- parameters: 4 P_r (fp32 master weights); gradients: 4 P_r (fp32, reduce_dtype);
- accumulated gradients: 4 P (every parameter, unsharded, fp32) when a step has several micro-batches: the
  trainer's `no_backward_sync` makes FSDP2 skip the reduce-scatter and keep whole gradients until the last;
- AdamW: 8 P_r (two fp32 moments) + 4 bytes of `step` per parameter tensor;
- gathered compute copy: a x (root's parameters: embeddings, final norm, head, gathered for the whole
  step) + a x GATHERED_BLOCKS blocks (the block computing and the one FSDP2 prefetches; the last
  block also stays gathered from forward into backward); a P, the whole model, when a step has several
  micro-batches: the trainer keeps every block gathered from the first forward to the last backward
  (train.run.parallel.reshard_for_micro_batch) so that a step all-gathers each block once;
- activations per micro-batch of T = micro_batch_rows x L tokens, from what autograd saves:
  per block (d model width, f FFN width, H heads, h head width, k = n_kv_heads x h):
      T d (8 + 6a)      two RMSNorms (fp32 copy of the input 4, normed a, output a each), rotated q,
                        attention output (flash keeps q, k, v, out; the o_proj input is out)
    + 2 a T k           rotated k and v
    + 4 T H + 8 T       flash's fp32 log-sum-exp; the RMSNorms' fp32 reciprocal RMS
    + 4 a T f           SwiGLU: gate, silu(gate), up, their product
  Attention is FlashAttention-2's (memory linear in T, no L^2 scores). Outside the blocks: the
  rotary cos and sin tables (2 a T h: computed once per forward, every block's q and k rotations
  share them), the final norm (4 T d + a T d + 4 T) and the token ids (8 T). With activation checkpointing each
  block keeps only its input (a T d) and one block's full activations are recomputed at a time.
- loss (train.model.loss.linear_cross_entropy, its peak at the end of forward, when every activation is
  also held): one chunk of fp32 logits and its fp32 hidden rows (4 c V + 4 c d, c =
  default_chunk_tokens(V)), the fp32 weight gradient (4 V d), grad_hidden (a T d), and under bf16
  the fp32 copy of the weight (4 V d) and the gradient cast back to bf16 (a V d).
The gradients of activations in backward (about one block's worth) and fragmentation are left to
the margin (MARGIN of the GPU's memory, with the CUDA context).

Time: FLOPs per optimizer step are the trainer's own (train.run.flops.step_flops, the formula its
logged MFU uses): 6 N tokens + 6 n_layers d sum over segments s(s + 1), with N the matmul
parameters (all but the input embedding; the head counts), evaluated for full rows of L tokens
(one document per row, the upper bound of per-document attention), i.e. per token
6 N + 6 n_layers d (L + 1). Step time = FLOPs / (GPUs x peak bf16 FLOP/s x MFU).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from posfreq.train.model.config import ModelConfig, model_preset
from posfreq.train.model.loss import default_chunk_tokens
from posfreq.train.model.transformer import Transformer
from posfreq.train.run.config import TrainConfig
from posfreq.train.run.flops import PEAK_BF16_FLOPS, step_flops
from posfreq.train.run.geometry import batch_geometry, resolve_model_config


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
MARGIN = (
    0.10  # of the GPU's memory, kept for the CUDA context, the allocator and backward's transients
)
GATHERED_BLOCKS = 2  # the block computing plus the one FSDP2's implicit prefetch gathers
# TinyLlama's published throughput: 24k tokens/s per A100 for TinyLlama-1.1B (this architecture
# with the Llama-2 vocabulary of 32,000) at L = 2048, without activation checkpointing.
TINYLLAMA = model_preset("tinyllama-1.3b", vocab_size=32_000, train_len=2048)
TINYLLAMA_TOKENS_PER_S = 24_000
GIB = 2**30


@dataclass(frozen=True)
class Memory:
    """Bytes per GPU, by kind."""

    parameters: int
    """This rank's fp32 shard of the weights."""
    gradients: int
    """This rank's fp32 shard of the gradients."""
    optimizer: int
    """AdamW's two fp32 moments of the shard and its step counters."""
    gathered: int
    """The unsharded compute copy FSDP2 gathers (root parameters and GATHERED_BLOCKS blocks, or all of them)."""
    activations: int
    """What autograd saves for backward in one micro-batch."""
    loss: int
    """The chunked loss's own buffers at its peak."""
    accumulated_gradients: int = 0
    """Unsharded fp32 gradients FSDP2 keeps between micro-batches while it skips their reduce-scatter."""

    @property
    def total(self) -> int:
        """All of the above."""
        return sum(getattr(self, f.name) for f in fields(self))


def meta_model(config: ModelConfig) -> Transformer:
    """The model on the meta device: shapes only, no memory."""
    with torch.device("meta"):
        return Transformer(config)


def compute_bytes(cfg: TrainConfig) -> int:
    """Bytes per element of the compute copy and activations: bf16 under bf16-mixed, else fp32."""
    return 2 if cfg.precision == "bf16-mixed" else 4


def shard_numel(param: nn.Parameter, world: int) -> int:
    """Elements of one rank's FSDP2 shard of `param` (dim 0 split in ceil(dim0 / world) rows, padded)."""
    rows = -(-param.shape[0] // world)
    return rows * (param.numel() // param.shape[0])


def state_bytes(model: nn.Module, shards: int) -> tuple[int, int, int]:
    """(fp32 parameters, fp32 gradients, AdamW state) on one rank of `shards` sharing the model."""
    params = list(model.parameters())
    shard = sum(shard_numel(p, shards) for p in params)
    return 4 * shard, 4 * shard, 8 * shard + 4 * len(params)


def gathered_bytes(model: Transformer, element_bytes: int, accumulating: bool = False) -> int:
    """The unsharded compute copy: the root's own parameters plus GATHERED_BLOCKS blocks, or every parameter when
    the step accumulates micro-batches (kept gathered through the step)."""
    block = sum(p.numel() for p in model.layers[0].parameters())
    root = sum(p.numel() for p in model.parameters()) - len(model.layers) * block
    blocks = len(model.layers) if accumulating else min(GATHERED_BLOCKS, len(model.layers))
    return element_bytes * (root + blocks * block)


def block_activation_bytes(config: ModelConfig, tokens: int, a: int) -> int:
    """Bytes one block saves for backward (the module docstring's formula)."""
    t, d, f, h = tokens, config.d_model, config.ffn_dim, config.head_dim
    return (
        t * d * (8 + 6 * a)
        + 2 * a * t * config.n_kv_heads * h
        + 4 * t * config.n_heads
        + 8 * t
        + 4 * a * t * f
    )


def activation_bytes(config: ModelConfig, tokens: int, a: int, checkpointing: bool) -> int:
    """Peak saved activations of one micro-batch of `tokens` tokens, with or without activation checkpointing."""
    t, d = tokens, config.d_model
    block = block_activation_bytes(config, t, a)
    blocks = config.n_layers * a * t * d + block if checkpointing else config.n_layers * block
    return blocks + 2 * a * t * config.head_dim + 4 * t * d + a * t * d + 4 * t + 8 * t


def loss_bytes(config: ModelConfig, tokens: int, a: int) -> int:
    """Peak of train.model.loss.linear_cross_entropy's own buffers for `tokens` tokens (module docstring)."""
    v, d = config.vocab_size, config.d_model
    chunk = min(tokens, default_chunk_tokens(v))
    lean = 4 * chunk * (v + d) + 4 * v * d + a * tokens * d
    return lean + (4 * v * d + a * v * d if a < 4 else 0)


def accumulates(cfg: TrainConfig, world: int, rows: int) -> bool:
    """Whether a step of `world` ranks with `rows` rows per micro-batch has several micro-batches."""
    return cfg.global_batch_tokens // cfg.data.train_len > rows * world


def accumulated_gradient_bytes(model: nn.Module, cfg: TrainConfig, world: int, rows: int) -> int:
    """4 bytes per parameter when a step has several micro-batches: under `no_backward_sync` FSDP2 skips the
    reduce-scatter and keeps every parameter's whole gradient, in the fp32 reduce dtype, until the last one."""
    return 4 * sum(p.numel() for p in model.parameters()) if accumulates(cfg, world, rows) else 0


def fsdp_shards(cfg: TrainConfig, world: int) -> int:
    """Ranks sharing one copy of the model's state: `world`, or one node's under hybrid sharding."""
    return cfg.fsdp_mesh_shape(world // cfg.num_nodes)[1]


def memory(
    model: Transformer, cfg: TrainConfig, world: int, rows: int, checkpointing: bool
) -> Memory:
    """Per-GPU memory of the run with `rows` rows per micro-batch."""
    a, tokens = compute_bytes(cfg), rows * cfg.data.train_len
    params, grads, optim = state_bytes(model, fsdp_shards(cfg, world))
    return Memory(
        params,
        grads,
        optim,
        gathered_bytes(model, a, accumulates(cfg, world, rows)),
        activation_bytes(model.config, tokens, a, checkpointing),
        loss_bytes(model.config, tokens, a),
        accumulated_gradient_bytes(model, cfg, world, rows),
    )


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
    """The GPU's memory less MARGIN."""
    return (1 - MARGIN) * gpu.memory_gib * GIB


def largest_rows(
    model: Transformer, cfg: TrainConfig, world: int, gpu: Gpu, checkpointing: bool
) -> int:
    """The most rows per micro-batch before the first count that does not fit (0 if not even one does).

    Memory grows with the rows except where a step stops accumulating micro-batches (the whole-gradient and
    gathered-copy terms drop): on each side of that count it is monotone, so each side is searched by doubling
    and bisection (a small model's count runs to the hundred thousands; one memory sum per count took minutes)."""

    def fits(rows: int) -> bool:
        return memory(model, cfg, world, rows, checkpointing).total <= usable_bytes(gpu)

    step_rows = cfg.global_batch_tokens // cfg.data.train_len
    single = -(-step_rows // world)  # the fewest rows per micro-batch with one micro-batch per step
    first = _first_not_fitting(fits, 1, single)
    if first < single:
        return first - 1
    return _first_not_fitting(fits, single, None) - 1


def _first_not_fitting(fits, start: int, stop: int | None) -> int:
    """The smallest count in [start, stop) that does not fit, or `stop` if all do; `fits` is monotone there
    (true, then false). `stop` None: unbounded."""
    if stop is not None and start >= stop:
        return stop
    if not fits(start):
        return start
    good, step = start, 1
    while True:  # double until a count fails or the segment ends
        probe = start + step if stop is None else min(start + step, stop - 1)
        if not fits(probe):
            bad = probe
            break
        good = probe
        if stop is not None and probe == stop - 1:
            return stop
        step *= 2
    while bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if fits(middle) else (good, middle)
    return bad


def largest_valid_rows(rows: int, cfg: TrainConfig, world: int) -> int:
    """The most rows <= `rows` that divide a step's rows per GPU (the trainer needs whole micro-batches)."""
    per_gpu = batch_geometry(cfg, world).global_rows // world
    return max((r for r in range(1, rows + 1) if per_gpu % r == 0), default=0)


def _gib(n: float) -> str:
    """Bytes as GiB, right-aligned for the report's columns."""
    return f"{n / GIB:6.2f} GiB"


def _memory_lines(mem: Memory, label: str) -> list[str]:
    """The report's lines of one memory breakdown."""
    return [
        f"  {label}",
        f"    parameters (fp32 shard)      {_gib(mem.parameters)}",
        f"    gradients (fp32 shard)       {_gib(mem.gradients)}",
        f"    AdamW (2 fp32 moments)       {_gib(mem.optimizer)}",
        f"    gathered compute copy        {_gib(mem.gathered)}",
        f"    activations                  {_gib(mem.activations)}",
        f"    loss (chunked, lean)         {_gib(mem.loss)}",
        f"    accumulated grads (unshard.) {_gib(mem.accumulated_gradients)}",
        f"    total                        {_gib(mem.total)}",
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
    from posfreq.train.data.shards import TokenDataset

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
        lines += _memory_lines(memory(model, cfg, world, rows, checkpointing), label)
    mem = memory(model, cfg, world, rows, ckpt)
    verdict = "fits" if mem.total <= usable_bytes(gpu) else "DOES NOT FIT"
    lines.append(
        f"fit: {verdict}: {_gib(mem.total).strip()} of {_gib(usable_bytes(gpu)).strip()} usable "
        f"({gpu.memory_gib:g} GiB less {MARGIN:.0%} margin)"
    )
    for checkpointing in (False, True):
        most = largest_rows(model, cfg, world, gpu, checkpointing)
        lines.append(
            f"  largest micro-batch, checkpointing {'on' if checkpointing else 'off'}: {most} rows "
            f"({largest_valid_rows(most, cfg, world)} dividing the step's rows per GPU)"
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

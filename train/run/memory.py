"""The per-GPU memory model of a run: what `posfreq plan` reports and what the trainer checks against the GPU's
free memory before the first step (`refusal`), one formula for both.

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

Under `model.compile` the fused RMSNorm, rotary and SwiGLU kernels save fewer tensors than the eager modules
counted above. The plan scales each block's saved activations by COMPILED_BLOCK_ACTIVATIONS, calibrated on the
1.3B step `make gpu-check` measured (docs/cluster.md, "How far posfreq plan's memory is from these peaks"); the
eager figure stays the upper bound.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import NamedTuple

import torch
from torch import nn

from posfreq.train.model.config import ModelConfig
from posfreq.train.model.loss import default_chunk_tokens
from posfreq.train.model.transformer import Transformer
from posfreq.train.run.config import TrainConfig
from posfreq.train.run.geometry import batch_geometry

MARGIN = (
    0.10  # of the GPU's memory, kept for the allocator's fragmentation and backward's transients
)
GATHERED_BLOCKS = 2  # the block computing plus the one FSDP2's implicit prefetch gathers
COMPILED_BLOCK_ACTIVATIONS = 0.53
"""Of a block's eager saved activations, what it saves under model.compile: (measured peak - the plan's other
terms) / the plan's block activations, from the highest compiled peak of the 1.3B gpu-check step (rounded up)."""
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


def block_activation_bytes(config: ModelConfig, tokens: int, a: int, compiled: bool = False) -> int:
    """Bytes one block saves for backward (the module docstring's formula), scaled by COMPILED_BLOCK_ACTIVATIONS
    under model.compile."""
    t, d, f, h = tokens, config.d_model, config.ffn_dim, config.head_dim
    eager = (
        t * d * (8 + 6 * a)
        + 2 * a * t * config.n_kv_heads * h
        + 4 * t * config.n_heads
        + 8 * t
        + 4 * a * t * f
    )
    return round(eager * COMPILED_BLOCK_ACTIVATIONS) if compiled else eager


def activation_bytes(
    config: ModelConfig, tokens: int, a: int, checkpointing: bool, compiled: bool = False
) -> int:
    """Peak saved activations of one micro-batch of `tokens` tokens, with or without activation checkpointing."""
    t, d = tokens, config.d_model
    block = block_activation_bytes(config, t, a, compiled)
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
    model: Transformer,
    cfg: TrainConfig,
    world: int,
    rows: int,
    checkpointing: bool,
    compiled: bool = False,
) -> Memory:
    """Per-GPU memory of the run with `rows` rows per micro-batch (eager, or under model.compile)."""
    a, tokens = compute_bytes(cfg), rows * cfg.data.train_len
    params, grads, optim = state_bytes(model, fsdp_shards(cfg, world))
    return Memory(
        params,
        grads,
        optim,
        gathered_bytes(model, a, accumulates(cfg, world, rows)),
        activation_bytes(model.config, tokens, a, checkpointing, compiled),
        loss_bytes(model.config, tokens, a),
        accumulated_gradient_bytes(model, cfg, world, rows),
    )


def usable_bytes(free: float, total: float) -> float:
    """Of a GPU with `free` of `total` bytes free, what a run may plan to use: the free bytes less MARGIN of the
    total (the plan's GPU counts as wholly free)."""
    return free - MARGIN * total


def configured(model: Transformer, cfg: TrainConfig, world: int, compiled: bool) -> Memory:
    """The run's memory as configured: its micro-batch rows and activation checkpointing."""
    return memory(
        model, cfg, world, cfg.micro_batch_rows, cfg.model.activation_checkpointing, compiled
    )


def largest_rows(
    model: Transformer,
    cfg: TrainConfig,
    world: int,
    usable: float,
    checkpointing: bool,
    compiled: bool = False,
) -> int:
    """The most rows per micro-batch before the first count whose memory exceeds `usable` bytes (0 if not even one
    fits).

    Memory grows with the rows except where a step stops accumulating micro-batches (the whole-gradient and
    gathered-copy terms drop): on each side of that count it is monotone, so each side is searched by doubling
    and bisection (a small model's count runs to the hundred thousands; one memory sum per count took minutes)."""

    def fits(rows: int) -> bool:
        return memory(model, cfg, world, rows, checkpointing, compiled).total <= usable

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


class StartCheck(NamedTuple):
    """The start-time memory verdict: a refusal (the run would not fit) or a warning (it fits only as compiled)."""

    refusal: str | None
    warning: str | None


def _fixes(
    model: Transformer, cfg: TrainConfig, world: int, usable: float, compiled: bool, gpu_bytes: int
) -> list[str]:
    """The changes that make the run fit in `usable` bytes, each with the global batch unchanged."""

    def fitting_rows(checkpointing: bool) -> int:  # the most whole micro-batch rows that fit
        return largest_valid_rows(
            largest_rows(model, cfg, world, usable, checkpointing, compiled), cfg, world
        )

    fixes = []
    checkpointing = cfg.model.activation_checkpointing
    rows = fitting_rows(checkpointing)
    if 0 < rows < cfg.micro_batch_rows:
        fixes.append(f"--micro-batch-rows {rows} (the same global batch in more micro-batches)")
        if gpu_bytes < 48 * GIB and cfg.data.train_len == 2048:
            fixes.append(
                "on an A100-40GB, --config configs/pretrain_2k_a100_40gb.yaml (the paper's run so split)"
            )
    if not checkpointing:
        ckpt_rows = fitting_rows(True)
        if ckpt_rows >= cfg.micro_batch_rows:
            fixes.append(
                "--model.activation-checkpointing true (recomputes each block in backward)"
            )
        elif ckpt_rows > 0:
            fixes.append(
                f"--model.activation-checkpointing true --micro-batch-rows {ckpt_rows} "
                "(recomputes each block in backward)"
            )
    return fixes or [
        "more GPUs per copy of the model (fsdp: full, or more GPUs per node): even one row with activation "
        "checkpointing does not fit"
    ]


def start_check(
    model: Transformer,
    cfg: TrainConfig,
    world: int,
    free_bytes: int,
    gpu_bytes: int,
    compiled: bool,
    gpu_name: str = "this GPU",
) -> StartCheck:
    """The plan's memory for this run against a GPU's free memory less MARGIN of its size, before the first step.

    Under model.compile the calibrated estimate decides and the eager upper bound only warns: refusing on the
    upper bound would turn away runs that fit (the plan over-counts a compiled step's activations)."""
    usable = usable_bytes(free_bytes, gpu_bytes)
    checkpointing = cfg.model.activation_checkpointing
    needed = configured(model, cfg, world, compiled).total
    mode = "under model.compile (calibrated)" if compiled else "eager"
    setting = (
        f"{cfg.micro_batch_rows} rows of {cfg.data.train_len} tokens per micro-batch, activation checkpointing "
        f"{'on' if checkpointing else 'off'}, {world} GPUs"
    )
    room = (
        f"{gpu_name} has {free_bytes / GIB:.1f} GiB free of {gpu_bytes / GIB:.1f}, {usable / GIB:.1f} usable after a "
        f"{MARGIN:.0%} margin"
    )
    if needed > usable:
        fixes = "; or ".join(_fixes(model, cfg, world, usable, compiled, gpu_bytes))
        return StartCheck(
            f"the run needs about {needed / GIB:.1f} GiB per GPU {mode} ({setting}) and {room}. Fix: {fixes}. "
            "(posfreq plan shows the breakdown; --memory-check false skips this check)",
            None,
        )
    eager = configured(model, cfg, world, False).total
    if compiled and eager > usable:
        fixes = "; or ".join(_fixes(model, cfg, world, usable, False, gpu_bytes))
        return StartCheck(
            None,
            f"the run fits by the compiled estimate ({needed / GIB:.1f} GiB per GPU, {setting}) but not by the eager "
            f"upper bound ({eager / GIB:.1f} GiB) and {room}. The compiled figure is calibrated on one GPU model "
            f"(docs/cluster.md); if this run runs out of memory: {fixes}",
        )
    return StartCheck(None, None)

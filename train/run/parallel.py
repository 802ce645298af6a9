"""Where and how a run executes: accelerator, compute dtype, attention backend check, and Lightning Fabric
with ModelParallelStrategy applying FSDP2 (`fully_shard` per block and on the root, over every process or, hybrid,
within each node; optional activation checkpointing), and FSDP2's resharding across a step's micro-batches."""

from __future__ import annotations

import logging
import os
import warnings
from typing import Mapping

import torch
from torch import nn

from posfreq.train.devices import resolve_device
from posfreq.train.model.attention_kernels import BackendError, explain_backend
from posfreq.train.model.fused import resolve_compile, use_fused
from posfreq.train.model.transformer import Transformer
from posfreq.train.run.config import ConfigError, TrainConfig
from posfreq.train.run.loggers import fabric_loggers

# What srun, torchrun or an earlier in-process Fabric launch leave in the environment (prefixes).
LAUNCHER_VARIABLES = (
    "SLURM_",
    "TORCHELASTIC_",
    "LOCAL_RANK",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "POSFREQ_SRUN_TASK",
)


def local_launch_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` without any launcher's variables, so a child `posfreq pretrain` starts a rendezvous of its own
    instead of joining (or colliding with) another job's port and ranks."""
    return {k: v for k, v in env.items() if not k.startswith(LAUNCHER_VARIABLES)}


def _checkpointed(block: nn.Module) -> None:
    """Make a block recompute its activations in backward (keeps parameter names unchanged)."""
    forward = block.forward

    def run(x, ctx, cache=None):
        return torch.utils.checkpoint.checkpoint(forward, x, ctx, cache, use_reentrant=False)

    block.forward = run


def hybrid_mesh(mesh, replicas: int):
    """A 2-D ("replicate", "shard") mesh over the data-parallel ranks of Lightning's `mesh`: `replicas` rows of
    consecutive ranks, i.e. one row per node, as Lightning numbers ranks node by node."""
    from torch.distributed.device_mesh import init_device_mesh

    shards = mesh["data_parallel"].size() // replicas
    return init_device_mesh(
        mesh.device_type, (replicas, shards), mesh_dim_names=("replicate", "shard")
    )


def make_parallelize(
    mixed_precision: bool, activation_checkpointing: bool, replicas: int = 1, fuse: bool = False
):
    """Fabric parallelize_fn: FSDP2 `fully_shard` on every block, then on the root; with `replicas` > 1, HSDP
    (sharded within each of `replicas` groups of ranks, replicated across them)."""

    def parallelize(model: Transformer, mesh) -> Transformer:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        use_fused(
            fuse
        )  # in each process: torch.compile'd RMSNorm, rotary and SwiGLU (model.compile)

        # Lightning's mesh is 1-D over data parallelism (its tensor-parallel dim has size 1): HSDP gets its own.
        dp_mesh = mesh["data_parallel"] if replicas == 1 else hybrid_mesh(mesh, replicas)
        # cast_forward_inputs=False: FSDP2 would rebuild every dataclass among a block's inputs to cast its tensors
        # (the ForwardContext, its scheme and Rotary: a crash on Rotary's init=False memo, and bf16 RoPE frequencies).
        # The blocks' activations are bf16 anyway: they come from the bf16 embedding.
        policy = (
            MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False
            )
            if mixed_precision
            else MixedPrecisionPolicy()
        )
        for i, block in enumerate(model.layers):
            if activation_checkpointing:
                _checkpointed(block)
            # The last block's parameters are needed again at once by backward: keep them gathered.
            fully_shard(
                block,
                mesh=dp_mesh,
                mp_policy=policy,
                reshard_after_forward=i < len(model.layers) - 1,
            )
        fully_shard(model, mesh=dp_mesh, mp_policy=policy)
        return model

    return parallelize


def synchronize_replicas(model: nn.Module) -> None:
    """Under HSDP, copy the first replica's parameter shards into the others, as DDP broadcasts rank 0's weights.

    Why: every process initialises the model itself and FSDP2 broadcasts nothing; nodes whose CPUs draw the
    initial weights differently would hold different replicas, which the gradient all-reduce never reconciles
    and a checkpoint would save mixed (each replicated shard written by one rank)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for param in model.parameters():
            if not isinstance(param, DTensor) or "replicate" not in (
                param.device_mesh.mesh_dim_names or ()
            ):
                continue
            group = param.device_mesh.get_group("replicate")
            # ranks of one replicate group hold the same shard index, so they agree on an empty shard
            if dist.get_world_size(group) > 1 and param.to_local().numel() > 0:
                dist.broadcast(param.to_local(), src=dist.get_global_rank(group, 0), group=group)


def set_resharding(model: nn.Module, after_forward: bool, after_backward: bool) -> None:
    """Set when FSDP2 frees the gathered parameters of `model` (the parallelized Transformer): `after_forward` for
    every block but the last (which, like the root, always keeps them from forward into its backward) and
    `after_backward` for every module (FSDPModule's setters, in torch since 2.7)."""
    last = len(model.layers) - 1
    for i, block in enumerate(model.layers):
        block.set_reshard_after_forward(after_forward and i < last, recurse=False)
    model.set_reshard_after_forward(False, recurse=False)
    model.set_reshard_after_backward(after_backward, recurse=True)


def reshard_for_micro_batch(model: nn.Module, index: int, count: int) -> None:
    """FSDP2's resharding for micro-batch `index` of a step's `count`. Several: every module stays gathered from its
    first all-gather until the last micro-batch's backward reshards it, so a step all-gathers each module once
    instead of once or twice per micro-batch, for a compute copy of the whole model held through the step (as
    train/preflight/plan.py counts). One: FSDP2's defaults (`default_resharding`)."""
    set_resharding(model, after_forward=count == 1, after_backward=index == count - 1)


def default_resharding(model: nn.Module) -> None:
    """Reshard after forward (blocks but the last) and after backward (all): sharded parameters between steps, for
    validation, checkpoints and the optimizer."""
    set_resharding(model, after_forward=True, after_backward=True)


def reshard_all(model: nn.Module) -> None:
    """Free every gathered parameter of `model` after a forward without backward (validation): the root and the
    last block keep theirs from forward into a backward that never comes, and a checkpoint saved then found no
    sharded parameter in a one-block model (Fabric refused it) and held a gathered copy in any other."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def resolved_accelerator(cfg: TrainConfig) -> str:
    """`cpu` or `cuda`: the config's accelerator, `auto` meaning cuda when a GPU is visible."""
    return cfg.accelerator if cfg.accelerator != "auto" else resolve_device("auto").type


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype attention sees: bf16 parameters under FSDP2's bf16-mixed policy, float32 under 32-true."""
    return torch.bfloat16 if precision == "bf16-mixed" else torch.float32


def attention_choice(cfg: TrainConfig) -> str:
    """The attention backend this run trains with and why, checked before launch (ConfigError if it cannot run)."""
    try:
        _, why = explain_backend(
            cfg.model.attention_backend,
            resolved_accelerator(cfg),
            compute_dtype(cfg.precision),
            backward=True,
        )
    except BackendError as err:
        raise ConfigError(f"model.attention_backend: {err}") from None
    return f"attention: {why}"


SRUN_TASK = "POSFREQ_SRUN_TASK"
"""Set to 1 by slurm/pretrain_common.sh's srun line (--export) in each task it starts."""


def cluster_plugins(world: int) -> list:
    """SLURM's cluster environment, named explicitly in a task our srun line started; else Lightning's detection.

    Why: Lightning takes an allocation whose job name is bash or interactive (an salloc shell) for a local
    run, and each srun task would then start devices - 1 more processes of its own."""
    if os.environ.get(SRUN_TASK) != "1":
        return []
    tasks = int(os.environ.get("SLURM_NTASKS", world))
    if tasks != world:  # Lightning checks this only outside an salloc shell, and then later
        raise ConfigError(
            f"srun started {tasks} tasks, but the run asks for {world} (devices x num_nodes). Fix: allocate "
            "--ntasks-per-node equal to the GPUs per node (sbatch/salloc --ntasks-per-node=8 --gpus-per-node=8)"
        )
    from lightning.fabric.plugins.environments import SLURMEnvironment
    from lightning.fabric.utilities.warnings import PossibleUserWarning

    with warnings.catch_warnings():  # "srun ... is not used": it is, under an allocation named bash
        warnings.simplefilter("ignore", PossibleUserWarning)
        return [SLURMEnvironment(auto_requeue=False)]


def build_fabric(cfg: TrainConfig):
    """Fabric with ModelParallelStrategy(FSDP2) for this config (not yet launched)."""
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy

    accelerator = resolved_accelerator(cfg)
    devices = (
        cfg.devices
        if cfg.devices != "auto"
        else (torch.cuda.device_count() if accelerator == "cuda" else 1)
    )
    world = int(devices) * cfg.num_nodes
    mixed = cfg.precision == "bf16-mixed"
    replicas, _ = cfg.fsdp_mesh_shape(int(devices))
    strategy = ModelParallelStrategy(
        make_parallelize(
            mixed,
            cfg.model.activation_checkpointing,
            replicas,
            resolve_compile(cfg.model.compile, accelerator),
        ),
        data_parallel_size=world,
        tensor_parallel_size=1,
        save_distributed_checkpoint=cfg.checkpoint.sharded,
    )
    return Fabric(
        accelerator=accelerator,
        devices=devices,
        num_nodes=cfg.num_nodes,
        strategy=strategy,
        precision="32-true",
        plugins=cluster_plugins(world),
        loggers=fabric_loggers(cfg),
    )


def launch(fabric) -> None:
    """fabric.launch(), without Lightning's distributed banner on a one-process run (a CPU run, one GPU), where it
    says nothing; a multi-process run keeps it."""
    # Lightning logs under both names (its rank-zero helpers log as lightning.pytorch once that is imported)
    loggers = [logging.getLogger(name) for name in ("lightning.fabric", "lightning.pytorch")]
    levels = [logger.level for logger in loggers]
    if fabric.world_size == 1:
        for logger in loggers:
            logger.setLevel(logging.WARNING)
    try:
        fabric.launch()
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)

"""One pretraining run from its config: every check, Fabric's processes launched, the Trainer run, the lock
released; what `posfreq pretrain` calls.

One code path on CPU (gloo) and GPU (NCCL): Fabric's `ModelParallelStrategy` with FSDP2
(train/run/parallel.py). Signals, requeue and exit codes: train/run/control.py.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import torch

from posfreq.train import devices
from posfreq.train.checkpoint import save as checkpoint_save
from posfreq.train.model.fused import resolve_compile
from posfreq.train.model.loss import loss_kernel_warning
from posfreq.train.run.config import ConfigError, TrainConfig
from posfreq.train.run.control import StopSignals, lock_run_dir, overwrite_run
from posfreq.train.run.log import LOG, start_console
from posfreq.train.run.loggers import wandb_report
from posfreq.train.run.memory import meta_model, start_check
from posfreq.train.run.parallel import attention_choice, build_fabric, launch, resolved_accelerator
from posfreq.train.run.resolved import ResolvedRun, agree_on_resume
from posfreq.train.run.trainer import Trainer


class RunStopped(Exception):
    """A signal stopped the run after saving; `exit_code` is what the job must exit with (train/run/control.py)."""

    def __init__(self, exit_code: int) -> None:
        super().__init__(f"the run stopped on a signal (exit code {exit_code})")
        self.exit_code = exit_code


def _start(cfg: TrainConfig, fabric, run: ResolvedRun, attention: str) -> None:
    """Rank 0: clear interrupted writes (safe: this job holds the lock) and report the run and its resume point."""
    if cfg.overwrite:
        overwrite_run(Path(cfg.out), fabric)
    for path in checkpoint_save.remove_stale_temporaries(cfg.out):
        LOG.info(f"removed an interrupted checkpoint write: {path}")
    for reason in run.skipped:
        LOG.info(f"skipped checkpoint {reason}")
    if run.schedule_change:
        LOG.info(run.schedule_change)
    if cfg.logging.logger == "wandb":
        LOG.info(wandb_report(cfg))
    LOG.info(attention)
    slow_loss = loss_kernel_warning(resolved_accelerator(cfg))
    if slow_loss:
        LOG.warning(slow_loss)
    if run.val_dataset is not None and run.val_rows < cfg.data.val_rows:
        LOG.warning(
            f"data.val_dir {cfg.data.val_dir} holds {run.val_rows} rows of {cfg.data.val_len or cfg.data.train_len} "
            f"tokens, fewer than data.val_rows={cfg.data.val_rows}: each validation scores those {run.val_rows} "
            "(more would score the same tokens twice)"
        )
    if cfg.optim.warmup_steps > run.total_steps:
        LOG.warning(
            f"optim.warmup_steps={cfg.optim.warmup_steps} is more than the run's {run.total_steps} steps: the "
            f"learning rate never reaches optim.lr={cfg.optim.lr:g}"
        )
    LOG.info(
        f"{run.model_config.num_params():,} parameters; {fabric.world_size} processes x "
        f"{run.accumulation} micro-batches x {cfg.micro_batch_rows} rows x {cfg.data.train_len} tokens "
        f"= {cfg.global_batch_tokens:,} tokens/step; {run.total_steps:,} steps"
    )


def check_memory(cfg: TrainConfig, fabric, run: ResolvedRun) -> None:
    """Every rank, before the model is built: the plan's memory against its GPU's free memory (train/run/memory.py).
    A rank that would not fit raises its one-line refusal; the others raise a line naming how many did."""
    if not cfg.memory_check:
        return
    reading = devices.gpu_memory(fabric.device)
    check = None
    if reading is not None:
        free, total, name = reading
        compiled = resolve_compile(cfg.model.compile, fabric.device.type)
        check = start_check(
            meta_model(run.model_config), cfg, fabric.world_size, free, total, compiled, name
        )
    refused = check is not None and check.refusal is not None
    count = fabric.all_reduce(torch.tensor(float(refused), device=fabric.device), reduce_op="sum")
    if refused:
        raise ConfigError(f"rank {fabric.global_rank}: {check.refusal}")
    if float(count) > 0:
        raise ConfigError(
            f"{int(count)} rank(s) found too little GPU memory for this run; their lines say how much and the fix"
        )
    if check is not None and check.warning and fabric.global_rank == 0:
        LOG.warning(check.warning)


def train(cfg: TrainConfig) -> list[dict]:
    """Validate, launch processes, train; returns the logged metrics of this process's run.

    Raises RunStopped(EXIT_NOT_REQUEUED) when a signal stopped the run and no SLURM requeue follows.
    """
    signals = StopSignals()  # before the slow start-up (opening shards, verifying checkpoints)
    lock = None
    try:
        fabric = build_fabric(cfg)
        # Every check before any process or compute starts; a resume checkpoint's checksums and data fingerprint
        # after launch, by rank 0.
        run = ResolvedRun(cfg, fabric.world_size, hashes=False)
        attention = attention_choice(cfg)
        launch(fabric)
        start_console(fabric.global_rank == 0)
        # The lock first: another job's retention must not delete the checkpoint rank 0 reads next.
        lock = lock_run_dir(cfg, fabric)
        run = agree_on_resume(run, fabric)
        check_memory(cfg, fabric, run)
        if cfg.overwrite and fabric.broadcast(signals.received is not None, src=0):
            raise ConfigError(
                "a stop signal (Ctrl-C, SIGTERM) arrived during start-up; --overwrite deleted nothing"
            )
        if fabric.global_rank == 0:
            _start(cfg, fabric, run, attention)
        fabric.barrier()
        trainer = Trainer(cfg, fabric, run, signals)
        history = trainer.fit()
        if trainer.exit_code:
            raise RunStopped(trainer.exit_code)
        return history
    finally:
        if lock is not None:
            lock.release()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        signals.restore()


def continue_command(argv: list[str], lr: float) -> str:
    """The command that continues this invocation from its newest checkpoint (or afresh) with learning rate `lr`."""
    return shlex.join(
        [
            "posfreq",
            "pretrain",
            *argv,
            "--resume",
            "auto",
            "--resume-override",
            f"{{optim.lr: {lr:g}}}",
        ]
    )

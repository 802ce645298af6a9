"""`posfreq pretrain`: check the run, launch Fabric's processes, run the Trainer (train/trainer.py), report errors.

Run ``posfreq pretrain --config configs/pretrain_2k.yaml [--section.key value ...]``
(``--help`` lists every key). One code path on CPU (gloo) and GPU (NCCL): Fabric's
`ModelParallelStrategy` with FSDP2 (train/parallel.py).

Signals, requeue and exit codes: train/run_control.py. Errors a user can fix (config, checkpoint,
a run directory locked by another job, a non-finite loss) print ``error: ...`` naming the key or
file and the fix, and exit 1; after a non-finite loss the fix is the exact command that continues
with a lower LR (``--resume-override "{optim.lr: ...}"``).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

if __package__ in (None, ""):
    # run as a file: import the installed posfreq package, never this folder's files by bare name
    sys.path.pop(0)

import torch

from posfreq.train import checkpoint_save, run_config
from posfreq.train.loggers import wandb_report
from posfreq.train.loss import loss_kernel_warning
from posfreq.train.parallel import attention_choice, build_fabric, resolved_accelerator
from posfreq.train.resolved_run import ResolvedRun, agree_on_resume
from posfreq.train.run_config import ConfigError, TrainConfig, parse_args
from posfreq.train.run_control import StopSignals, lock_run_dir, overwrite_run
from posfreq.train.run_lock import RunLockError
from posfreq.train.run_log import LOG, start_console
from posfreq.train.safe_load import CheckpointError
from posfreq.train.shards import DamagedShard
from posfreq.train.trainer import NonFiniteLoss, Trainer


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
    LOG.info(
        f"{run.model_config.num_params():,} parameters; {fabric.world_size} processes x "
        f"{run.accumulation} micro-batches x {cfg.micro_batch_rows} rows x {cfg.data.train_len} tokens "
        f"= {cfg.global_batch_tokens:,} tokens/step; {run.total_steps:,} steps"
    )


def train(cfg: TrainConfig) -> list[dict]:
    """Validate, launch processes, train; returns the logged metrics of this process's run.

    Raises SystemExit(EXIT_NOT_REQUEUED) when a signal stopped the run and no SLURM requeue follows.
    """
    signals = StopSignals()  # before the slow start-up (opening shards, verifying checkpoints)
    lock = None
    try:
        fabric = build_fabric(cfg)
        # Every check before any process or compute starts; a resume checkpoint's checksums after launch, by rank 0.
        run = ResolvedRun(cfg, fabric.world_size, hashes=False)
        attention = attention_choice(cfg)
        fabric.launch()
        start_console(fabric.global_rank == 0)
        # The lock first: another job's retention must not delete the checkpoint rank 0 reads next.
        lock = lock_run_dir(cfg, fabric)
        run = agree_on_resume(run, fabric)
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
            sys.exit(trainer.exit_code)
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


def build_parser():
    """`posfreq pretrain`'s parser: the run config's (a --config YAML plus one flag per TrainConfig field)."""
    return run_config.build_parser()


def main(argv: list[str] | None = None) -> int:
    """The command line: run `train`, printing `error: ...` (exit 1) for a config, checkpoint or lock error, or a
    non-finite loss (with the command that continues the run at a lower LR)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        train(parse_args(argv))
        return 0
    except (ConfigError, CheckpointError, RunLockError, DamagedShard) as err:
        sys.exit(f"error: {err}")
    except NonFiniteLoss as err:
        sys.exit(f"error: {err} Command: {continue_command(argv, err.lower_lr)}")
    except KeyboardInterrupt:
        print(
            "interrupted by a second Ctrl-C: nothing saved since the last checkpoint; continue with --resume auto",
            file=sys.stderr,
        )
        return 130


if __name__ == "__main__":
    sys.exit(main())

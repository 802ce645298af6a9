"""Run control: stop signals, SLURM requeue, the run directory's lock and what --overwrite deletes.

SIGUSR1, SIGTERM and SIGINT are recorded from the start of `train` on, so one that arrives while
the run starts up is not fatal; the step after it ends with a save. After SIGUSR1 in a SLURM job
(with ``requeue_on_signal``) the trainer runs ``scontrol requeue``; otherwise it exits with
``EXIT_NOT_REQUEUED``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from posfreq.train.atomic import write_text_atomic
from posfreq.train.checkpoint import layout as ckpt
from posfreq.train.run.config import TrainConfig
from posfreq.train.run.log import LOG
from posfreq.train.run.loggers import WANDB_ID_FILE
from posfreq.train.run_lock import RunLock, RunLockError

EXIT_NOT_REQUEUED = 3  # a signal stopped the run after a save, and no SLURM requeue will restart it
# SIGINT: Ctrl-C saves `latest` as SIGTERM does
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """Records SIGUSR1 / SIGTERM / SIGINT from start-up on (Python's default would end the process), for the loop
    to act on: the run saves `latest` and stops. A second Ctrl-C stops at once, saving nothing."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.previous = {signum: signal.signal(signum, self._record) for signum in STOP_SIGNALS}

    def _record(self, signum: int, frame) -> None:
        if signum == signal.SIGINT and self.received == signal.SIGINT:
            raise KeyboardInterrupt
        if signum == signal.SIGINT:
            print(
                "\nCtrl-C: saving checkpoints/latest after this step (Ctrl-C again stops without saving)",
                file=sys.stderr,
                flush=True,
            )
        self.received = signum

    def restore(self) -> None:
        """Put back the handlers that were installed before."""
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)


def why_not_requeued(received: int | None, usr1: bool, cfg: TrainConfig) -> str | None:
    """Why a signal's stop will not requeue the SLURM job, or None if `requeue` should be tried."""
    job = os.environ.get("SLURM_JOB_ID")
    if received == signal.SIGINT:
        return "stopped by Ctrl-C"
    if not usr1:
        return "only SIGUSR1 requeues"
    if not job:
        return "no SLURM job (SLURM_JOB_ID unset)"
    if not cfg.requeue_on_signal:
        return "requeue_on_signal is false"
    if cfg.overwrite:
        return "--overwrite is set: a requeued job would delete this run again"
    return None


def requeue(job: str) -> str | None:
    """`scontrol requeue JOB`; None if it worked, else why not."""
    try:
        proc = subprocess.run(
            ["scontrol", "requeue", job], capture_output=True, text=True, check=False
        )
    except OSError as err:
        return f"scontrol requeue {job} could not run: {err}"
    return (
        None
        if proc.returncode == 0
        else f"scontrol requeue {job} failed: {(proc.stderr or '').strip()}"
    )


def lock_run_dir(cfg: TrainConfig, fabric) -> RunLock | None:
    """Rank 0 takes OUT's run lock (the lock it returns); every rank raises RunLockError if it could not."""
    lock, refusal = None, None
    if fabric.global_rank == 0:
        try:
            lock = RunLock.acquire(cfg.out)
        except RunLockError as err:
            refusal = str(err)
    refusal = fabric.broadcast(refusal, src=0)
    if refusal:
        raise RunLockError(refusal)
    return lock


def run_files(out: Path) -> list[Path]:
    """What a pretraining run writes into its OUT (all that --overwrite deletes; the run lock aside)."""
    return [
        ckpt.checkpoint_root(out),
        out / "metrics.jsonl",
        out / "metrics.jsonl.unreadable",
        out / "csv",
    ]


def overwrite_run(out: Path, fabric) -> None:
    """Delete the trainer's own files in OUT (--overwrite with resume null; this job holds the lock), and record
    the new wandb run's id."""
    for external in fabric.loggers:
        if type(external).__name__ == "WandbLogger":
            write_text_atomic(out / WANDB_ID_FILE, f"{external.version}\n")
    for path in run_files(out):
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        else:
            continue
        LOG.info(f"--overwrite: deleted {path}")

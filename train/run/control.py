"""Run control: stop signals, SLURM requeue, the run directory's lock and what --overwrite deletes.

SIGUSR1, SIGTERM and SIGINT are recorded from the start of `train` on, so one that arrives while
the run starts up is not fatal; the step after it ends with a save. After SIGUSR1 in a SLURM job
(with ``requeue_on_signal``) the trainer runs ``scontrol requeue``; otherwise it exits with
``EXIT_NOT_REQUEUED``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from posfreq.train.atomic import write_text_atomic
from posfreq.train.checkpoint import layout as ckpt
from posfreq.train.journal import is_record, record_written, remove_recorded
from posfreq.train.outdir import OutputDirError, check_output_dir, claim_output_dir, owner_of
from posfreq.train.run.config import TrainConfig
from posfreq.train.run.log import LOG
from posfreq.train.run.loggers import WANDB_ID_FILE
from posfreq.train.run_lock import LOCK_FILE as RUN_LOCK_FILE
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
            claim_run_dir(cfg)
            lock = RunLock.acquire(cfg.out)
        except (RunLockError, OutputDirError) as err:
            refusal = str(err)
    refusal = fabric.broadcast(refusal, src=0)
    if refusal:
        raise RunLockError(refusal)
    return lock


PRETRAIN = "pretrain"
"""The command a run directory's owner record names (train/outdir.py)."""

RUN_ENTRIES = (
    ckpt.CHECKPOINTS,
    "metrics.jsonl",
    "metrics.jsonl.unreadable",
    "csv",
    "wandb",
    WANDB_ID_FILE,
    RUN_LOCK_FILE,
)
"""Every name a pretraining run writes directly in its OUT."""


def earlier_run(out: Path) -> bool:
    """Whether an unmarked OUT is a run an older posfreq wrote: only the names a run writes (and folders other posfreq
    commands claimed in it, such as a probe's), with checkpoints/ holding only checkpoints and csv/ only Lightning's
    version folders, so that a user's folder that merely has a `csv` or `checkpoints` is never taken for one. A
    folder holding only claimed folders counts as claimed (the demo's table1/ of per-scheme probes)."""

    def claimed(entry: Path) -> bool:
        if not entry.is_dir() or entry.is_symlink():
            return False
        if owner_of(entry) is not None:
            return True
        inner = list(entry.iterdir())
        return bool(inner) and all(e.is_dir() and owner_of(e) is not None for e in inner)

    for entry in out.iterdir():
        if not (
            is_record(entry.name)
            or entry.name.endswith(".tmp")
            or claimed(entry)
            or entry.name in RUN_ENTRIES
        ):
            return False
    inside = {
        ckpt.CHECKPOINTS: lambda name: (
            name.startswith(ckpt.MILESTONE_PREFIX) or name.split(".")[0] == ckpt.LATEST
        ),
        "csv": lambda name: name.startswith("version_"),
    }
    for folder, expected in inside.items():
        if (out / folder).is_dir() and not all(expected(e.name) for e in (out / folder).iterdir()):
            return False
    return True


def check_run_dir(cfg: TrainConfig) -> None:
    """OutputDirError unless OUT is new, empty or a run's (a user's files are never mixed with a run's, nor deleted by
    --overwrite); changes nothing except marking an older posfreq's run as the run it is."""
    check_output_dir(cfg.out, PRETRAIN, written_before=earlier_run)


def claim_run_dir(cfg: TrainConfig) -> None:
    """Rank 0, before the run lock: mark OUT as a run's and journal the logger folder the run will write (Lightning
    creates it without telling the journal), so a rerun finds every entry of OUT accounted for."""
    out = claim_output_dir(cfg.out, PRETRAIN, written_before=earlier_run, shared=True)
    if cfg.logging.logger != "none":
        record_written(out / cfg.logging.logger)


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
    # what the run's journal names: never a user's file, never through a link
    for path in run_files(out):
        for removed in remove_recorded(out, under=path.name):
            LOG.info(f"--overwrite: deleted {removed}")

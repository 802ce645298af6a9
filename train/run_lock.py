"""One trainer per run directory: ``OUT/run.lock`` names the job that holds it.

The lock file is JSON: {"job": SLURM_JOB_ID or null, "pid", "host", "started"}. A second job on
the same out_dir would delete the first one's ``*.tmp`` checkpoint writes and interleave saves;
it is refused. A lock whose owner is gone is taken over: one left by this same SLURM job (it
was requeued, perhaps onto other nodes), one from this host whose pid no longer runs, or one of a
SLURM job the scheduler says has ended (`squeue`, then `sacct`). A lock from another host that no
scheduler can judge is refused; the error says how to remove it if it is stale.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from posfreq.train.journal import record_written

LOCK_FILE = "run.lock"


class RunLockError(RuntimeError):
    """The run directory is locked by another job; the message names the lock, its owner and the fix."""


def this_process() -> dict:
    """The owner record of this process: SLURM job id (if any), pid, host and start time."""
    return {
        "job": os.environ.get("SLURM_JOB_ID"),
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid runs on this host (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _read(lock: Path) -> dict | None:
    """The owner record in `lock`, or None if it is gone or unreadable."""
    try:
        owner = json.loads(lock.read_text())
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) else None


def _create(lock: Path, owner: dict) -> bool:
    """Create `lock` holding `owner` unless it exists (O_EXCL: of two jobs, one wins); False if it did."""
    record_written(lock)
    try:
        fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(owner) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return True


ALIVE_STATES = frozenset(
    {
        "PENDING",
        "RUNNING",
        "CONFIGURING",
        "COMPLETING",
        "SUSPENDED",
        "REQUEUED",
        "REQUEUE_HOLD",
        "REQUEUE_FED",
        "RESIZING",
        "SIGNALING",
        "STAGE_OUT",
        "STOPPED",
    }
)
"""SLURM job states in which a job may still write its run directory (or will again: requeued, suspended)."""


def job_ended(job: str) -> str | None:
    """Why the scheduler says SLURM job `job` has ended (its state, or that it no longer knows the job), or None
    while it runs or waits, or when no scheduler can be asked (squeue and sacct missing or failing)."""
    import subprocess

    for argv in (
        ["squeue", "--noheader", "--jobs", job, "--format", "%T"],
        ["sacct", "--noheader", "--allocations", "--jobs", job, "--format", "State"],
    ):
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        states = {line.split()[0] for line in done.stdout.splitlines() if line.split()}
        if done.returncode == 0 and states:
            ended = states - ALIVE_STATES
            return (
                f"{argv[0]} reports job {job} {', '.join(sorted(ended))}"
                if states <= ended
                else None
            )
        if argv[0] == "squeue" and "Invalid job id" in done.stderr:
            continue  # squeue forgets an ended job after a while: ask sacct
    return None


def stale_reason(holder: dict, me: dict) -> str | None:
    """Why the lock's owner is certainly gone (so its lock may be taken over), or None if it may still run."""
    if holder.get("job") and holder.get("job") == me["job"]:
        return f"it was taken by this SLURM job {me['job']} before it was requeued"
    if holder.get("job") and holder.get("host") != me["host"]:
        ended = job_ended(str(holder["job"]))
        if ended:
            return ended
    if (
        holder.get("host") == me["host"]
        and isinstance(holder.get("pid"), int)
        and not pid_alive(holder["pid"])
    ):
        return f"pid {holder['pid']} no longer runs on {me['host']}"
    return None


def _refusal(lock: Path, holder: dict | None, me: dict) -> str:
    """The error for a lock held by someone who may still run: who, and what to do."""
    out = lock.parent
    if holder is None:
        return (
            f"{lock} exists but cannot be read, so another job may be using {out}. Fix: if no job is "
            f"running on {out}, delete the lock (rm {lock}); otherwise pass another --out."
        )
    who = (
        f"job {holder.get('job') or '(not SLURM)'}, pid {holder.get('pid')} on host {holder.get('host')}, "
        f"started {holder.get('started')}"
    )
    if holder.get("host") == me["host"]:
        return (
            f"{out} is in use by {who} ({lock}); that process is still running. Fix: wait for it to end, "
            "or pass another --out."
        )
    return (
        f"{out} is locked by {who} ({lock}); from this host ({me['host']}) it cannot be told whether that "
        f"process still runs. Fix: if it has ended (check squeue / ps on {holder.get('host')}), delete the "
        f"stale lock (rm {lock}) and start again; otherwise pass another --out."
    )


@dataclass(frozen=True)
class RunLock:
    """A held lock on a run directory; `release` removes it if it is still this owner's."""

    path: Path
    owner: dict

    @classmethod
    def acquire(cls, out_dir: str | Path) -> "RunLock":
        """Lock `out_dir` for this process, taking over a stale lock; raise RunLockError if another job holds it."""
        lock, me = Path(out_dir) / LOCK_FILE, this_process()
        lock.parent.mkdir(parents=True, exist_ok=True)
        if _create(lock, me):
            return cls(lock, me)
        holder = _read(lock)
        reason = stale_reason(holder, me) if holder is not None else None
        if reason is None:
            raise RunLockError(_refusal(lock, holder, me))
        print(f"{lock}: taking over a stale lock ({reason})", file=sys.stderr)
        lock.unlink(missing_ok=True)
        if not _create(lock, me):  # another job took it over in between
            raise RunLockError(_refusal(lock, _read(lock), me))
        return cls(lock, me)

    def release(self) -> None:
        """Remove the lock file, unless another job has taken it over since."""
        if _read(self.path) == self.owner:
            self.path.unlink(missing_ok=True)

"""Run control on CPU: signals save and requeue (or say why not), the run lock refuses a second job, --overwrite
deletes only the run's own files."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest
from helpers.trainer import (
    run,
    run_trainer_process,
    sigusr1_in_a_slurm_job,
    tiny,
)

from posfreq.scripts.commands import pretrain
from posfreq.train.checkpoint import layout as ckpt
from posfreq.train.run.config import ConfigError
from posfreq.train.run.control import EXIT_NOT_REQUEUED, StopSignals
from posfreq.train.run.pretrain import RunStopped
from posfreq.train.run.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.mark.slow
def test_signal_saves_latest_and_requeues(data_dir, tmp_path, monkeypatch):
    calls = sigusr1_in_a_slurm_job(monkeypatch, "4242", at_step=1)
    history = run(tiny(data_dir, tmp_path, **{"checkpoint.latest_every_steps": 0}))
    assert [r["step"] for r in history] == [
        1,
        2,
        3,
    ]  # seen at the next step's all-reduce, then saved
    assert ckpt.read_trainer_state(tmp_path / "checkpoints/latest")["step"] == 3
    assert calls == [["scontrol", "requeue", "4242"]]
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # train() puts the handlers back


def test_second_job_on_a_locked_out_dir_is_refused_and_a_stale_lock_taken_over(
    data_dir, tmp_path, capsys, monkeypatch
):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    out = tmp_path / "run"
    in_flight = out / "checkpoints" / "latest.tmp"  # the first job's save in progress
    in_flight.mkdir(parents=True)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(tiny(data_dir, out, total_tokens=2048)))
    lock = out / "run.lock"
    owner = {"job": None, "host": socket.gethostname(), "started": "2026-01-01T00:00:00"}
    first_job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        lock.write_text(json.dumps({**owner, "pid": first_job.pid}))
        with pytest.raises(SystemExit) as same_host:
            pretrain.main(["--config", str(config)])
        assert str(same_host.value.code).startswith(
            f"error: {out} is in use by job (not SLURM), pid {first_job.pid} on host {owner['host']}"
        )
        assert "still running. Fix: wait for it to end, or pass another --out" in str(
            same_host.value.code
        )
        assert in_flight.is_dir()  # untouched
        lock.write_text(json.dumps({**owner, "host": "node-elsewhere", "pid": first_job.pid}))
        with pytest.raises(SystemExit) as other_host:
            pretrain.main(["--config", str(config)])
        assert "from this host" in str(other_host.value.code) and f"(rm {lock})" in str(
            other_host.value.code
        )
        assert in_flight.is_dir()
    finally:
        first_job.kill()
        first_job.wait()
    lock.write_text(json.dumps({**owner, "pid": first_job.pid}))  # its owner has ended
    capsys.readouterr()
    pretrain.main(["--config", str(config)])
    assert (
        f"{lock}: taking over a stale lock (pid {first_job.pid} no longer runs"
        in capsys.readouterr().err
    )
    assert (
        not lock.exists() and not in_flight.exists()
    )  # released at exit; the dead job's write cleared
    # A SLURM job that was requeued (perhaps onto another node) takes over its own lock.
    lock.write_text(json.dumps({**owner, "job": "4242", "host": "node-elsewhere", "pid": 1}))
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    from posfreq.train.run_lock import RunLock

    RunLock.acquire(out).release()
    assert not lock.exists()


SIGNAL_DURING_STARTUP = """
import os, signal
from posfreq.scripts.commands import pretrain
from posfreq.train.run.resolved import ResolvedRun

real_plan_init = ResolvedRun.__init__


def plan_init(self, *args, **kwargs):
    os.kill(os.getpid(), signal.SIGUSR1)  # arrives while the run starts up, before the training loop
    real_plan_init(self, *args, **kwargs)


ResolvedRun.__init__ = plan_init
raise SystemExit(pretrain.main())
"""


@pytest.mark.slow  # a child process, a notebook kernel or a deliberate timeout
def test_signal_during_startup_saves_and_exits_not_requeued(data_dir, tmp_path):
    config, out = tmp_path / "config.json", tmp_path / "run"
    config.write_text(json.dumps(tiny(data_dir, out)))
    proc = run_trainer_process(SIGNAL_DURING_STARTUP, config)
    assert proc.returncode == EXIT_NOT_REQUEUED == 3, proc.stderr[-3000:]
    latest = out / "checkpoints" / ckpt.LATEST
    assert (
        f"signal received: saved {latest} at step 1; the job was NOT requeued (no SLURM job (SLURM_JOB_ID "
        "unset)): exiting with code 3. Continue with --resume auto."
    ) in proc.stdout
    assert (
        ckpt.find_resume_checkpoint(out) == latest and ckpt.read_trainer_state(latest)["step"] == 1
    )
    assert not (out / "run.lock").exists()


def test_a_fresh_start_into_a_run_directory_is_refused_and_changes_nothing(data_dir, tmp_path):
    run(tiny(data_dir, tmp_path, stop_at_step=2))
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(
        ConfigError, match="holds a run .*checkpoints.*--resume auto to continue it"
    ):
        run(tiny(data_dir, tmp_path, resume=None))
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


@pytest.fixture
def terminal_sigint():
    """SIGINT handled as in a terminal's Python (pytest-xdist's workers ignore it), restored afterwards."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_ctrl_c_saves_latest_like_sigterm_and_a_second_one_stops_at_once(
    data_dir, tmp_path, monkeypatch, terminal_sigint
):
    real_step = Trainer._train_step

    def step_then_ctrl_c(self, batches, n):
        out = real_step(self, batches, n)
        if self.step == 1:
            os.kill(os.getpid(), signal.SIGINT)
        return out

    monkeypatch.setattr(Trainer, "_train_step", step_then_ctrl_c)
    with pytest.raises(RunStopped) as stop:
        run(tiny(data_dir, tmp_path, **{"checkpoint.latest_every_steps": 0}))
    assert stop.value.exit_code == EXIT_NOT_REQUEUED
    assert ckpt.read_trainer_state(tmp_path / "checkpoints/latest")["step"] == 3
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    signals = StopSignals()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert signals.received == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        signals.restore()


def test_overwrite_starts_afresh_deleting_only_the_runs_own_files(data_dir, tmp_path):
    run(tiny(data_dir, tmp_path, stop_at_step=2))
    with pytest.raises(ConfigError, match="--overwrite starts afresh, --resume auto continues"):
        run(tiny(data_dir, tmp_path, overwrite=True))
    (tmp_path / "checkpoints" / "mine.txt").write_text(
        "mine"
    )  # a user's file in the run's own folder
    history = run(tiny(data_dir, tmp_path, resume=None, overwrite=True, stop_at_step=1))
    assert [r["step"] for r in history] == [1]
    logged = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert logged == [1] and (tmp_path / "checkpoints" / "mine.txt").read_text() == "mine"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "mine.txt"]
    assert ckpt.read_trainer_state(tmp_path / "checkpoints/latest")["step"] == 1


def test_a_users_folder_is_never_taken_for_a_run(data_dir, tmp_path):
    """A folder that is not a run's, even one with a `csv` and a `checkpoints` of its own, is refused before
    anything is written; --overwrite deletes nothing in it."""
    user = tmp_path / "mine"
    for name, text in (("csv/results.csv", "x"), ("checkpoints/model.pt", "w"), ("notes.md", "n")):
        (user / name).parent.mkdir(parents=True, exist_ok=True)
        (user / name).write_text(text)
    before = sorted(str(p.relative_to(user)) for p in user.rglob("*"))
    for overwrite in (False, True):
        with pytest.raises(ConfigError, match="did not write"):
            run(tiny(data_dir, user, resume=None, overwrite=overwrite))
    (user / "notes.md").unlink()  # left: only names a run also writes, holding the user's files
    with pytest.raises(ConfigError, match="did not write"):
        run(tiny(data_dir, user, resume=None, overwrite=True))
    assert sorted(str(p.relative_to(user)) for p in user.rglob("*")) == [
        n for n in before if n != "notes.md"
    ]
    assert (user / "csv/results.csv").read_text() == "x"


@pytest.mark.slow
def test_a_run_an_older_posfreq_wrote_continues_and_becomes_the_runs(data_dir, tmp_path):
    """A run directory from before runs recorded their owner (and a probe's folder in it) is resumed, marked as
    the run's and journaled whole, so the next invocation finds nothing unaccounted for."""
    from posfreq.train.journal import JOURNAL_FILE, OWNER_FILE
    from posfreq.train.outdir import claim_output_dir, owner_of

    run(tiny(data_dir, tmp_path, stop_at_step=1, **{"logging.logger": "csv"}))
    for record in (OWNER_FILE, JOURNAL_FILE):
        (tmp_path / record).unlink()
    (tmp_path / "probe-rope").mkdir()
    (tmp_path / "probe-rope" / OWNER_FILE).write_text('{"command": "probe"}')
    (tmp_path / "table1" / "string").mkdir(
        parents=True
    )  # the demo's per-scheme probes, in a plain folder
    (tmp_path / "table1" / "string" / OWNER_FILE).write_text('{"command": "probe"}')
    run(tiny(data_dir, tmp_path, stop_at_step=2, **{"logging.logger": "csv"}))
    assert owner_of(tmp_path) == "pretrain"
    journaled = {line.split("/")[0] for line in (tmp_path / JOURNAL_FILE).read_text().split()}
    assert {"checkpoints", "metrics.jsonl", "csv", "probe-rope", "table1"} <= journaled
    claim_output_dir(tmp_path / "probe-string", "probe", shared=True)  # a later probe of the run
    history = run(tiny(data_dir, tmp_path, **{"logging.logger": "csv"}))
    assert history[-1]["step"] == 8


def test_overwrite_never_requeues_and_never_deletes_its_own_starting_weights(
    data_dir, tmp_path, monkeypatch
):
    first = tmp_path / "first"
    run(tiny(data_dir, first, total_tokens=2048))
    start = first / "checkpoints" / ckpt.milestone_name(2048)
    with pytest.raises(ConfigError, match="lies in the run files --overwrite would delete"):
        run(tiny(data_dir, first, resume=None, overwrite=True, **{"model.init_from": str(start)}))
    assert start.is_dir()
    calls = sigusr1_in_a_slurm_job(monkeypatch, "99", at_step=1)
    with pytest.raises(
        RunStopped
    ) as stop:  # a requeued job would run --overwrite again and delete this run
        run(
            tiny(
                data_dir, first, resume=None, overwrite=True, **{"checkpoint.latest_every_steps": 0}
            )
        )
    assert stop.value.exit_code == EXIT_NOT_REQUEUED and calls == []
    assert ckpt.read_trainer_state(first / "checkpoints/latest")["step"] == 3


@pytest.mark.slow
def test_a_run_whose_checkpoints_live_behind_a_link_resumes_and_is_never_deleted_through_it(
    data_dir, tmp_path
):
    """checkpoints/ linked to scratch storage: the journal records the link (never a path through it), so the run
    resumes, and --overwrite, which never deletes through a link, is refused with nothing changed."""
    from posfreq.train.journal import JOURNAL_FILE

    scratch, out = tmp_path / "scratch", tmp_path / "run"
    scratch.mkdir()
    out.mkdir()
    (out / "checkpoints").symlink_to(scratch)
    run(tiny(data_dir, out, stop_at_step=2))
    assert (scratch / "latest").is_dir()
    journal = (out / JOURNAL_FILE).read_text().split()
    assert "checkpoints" in journal and not any(n.startswith("checkpoints/") for n in journal)
    assert run(tiny(data_dir, out, stop_at_step=3))[-1]["step"] == 3  # resumed
    with pytest.raises(ConfigError, match="is a link, and posfreq never deletes through a link"):
        run(tiny(data_dir, out, resume=None, overwrite=True))
    assert (out / "checkpoints").is_symlink() and (scratch / "latest").is_dir()


FAKE_SLURM = """#!/bin/sh
# a fake {name}: answers from $FAKE_SLURM_STATE ("" = unknown job, as squeue says once it forgets it)
if [ -z "$FAKE_SLURM_STATE" ]; then
  echo "slurm_load_jobs error: Invalid job id specified" >&2
  exit 1
fi
echo "$FAKE_SLURM_STATE"
"""


@pytest.mark.parametrize(
    "squeue, sacct, taken",
    [
        ("RUNNING", "RUNNING", False),  # the old job still runs on another node: refused
        ("PENDING", "PENDING", False),
        ("", "CANCELLED", True),  # squeue forgot it, sacct says it was cancelled: taken over
        ("", "COMPLETED", True),
        ("COMPLETED", "COMPLETED", True),
        ("", "", False),  # no scheduler knows it: cannot be judged, refused
    ],
)
def test_a_lock_of_a_job_the_scheduler_says_has_ended_is_taken_over(
    tmp_path, monkeypatch, squeue, sacct, taken
):
    """A fresh sbatch whose rank 0 landed on another node than the crashed job's was refused until the lock was
    deleted by hand: the scheduler (fake squeue and sacct on PATH) decides now, and only an ended job's lock goes."""
    import os

    from posfreq.train.run_lock import RunLock, RunLockError

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, state in (("squeue", squeue), ("sacct", sacct)):
        script = bin_dir / name
        script.write_text(
            FAKE_SLURM.format(name=name).replace("$FAKE_SLURM_STATE", f"${name.upper()}_STATE")
        )
        script.chmod(0o755)
        monkeypatch.setenv(f"{name.upper()}_STATE", state)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "5000")  # the new job
    out = tmp_path / "run"
    out.mkdir()
    lock = out / "run.lock"
    lock.write_text(
        json.dumps({"job": "4242", "host": "node-elsewhere", "pid": 1, "started": "then"})
    )
    if taken:
        RunLock.acquire(out).release()
        assert not lock.exists()
    else:
        with pytest.raises(RunLockError, match="locked by job 4242"):
            RunLock.acquire(out)
        assert json.loads(lock.read_text())["job"] == "4242"

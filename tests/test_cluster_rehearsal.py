"""The cluster rehearsed on one machine (#48, item 4): `sbatch slurm/pretrain_2k.sh`, the script itself, through a
fake SLURM on PATH (tests/helpers/fake_slurm.py), as 2 nodes x 2 tasks of gloo processes on CPU.

Why: the SLURM scripts had only been dry-run (tests/test_slurm.py prints their srun line) and the trainer's
multi-node paths run only from Python (tests/train/run/test_parallel_fsdp.py starts its processes itself). Here
nothing between the two is skipped: sbatch reads the script's #SBATCH header (with the command-line overrides a user
types: 2 GPUs per node instead of 8, one core per task, a log folder); the script builds its srun line from SLURM's
variables; srun starts the tasks with SLURM's per-task variables; Lightning's SLURMEnvironment and the trainer's
own checks (`--devices` against SLURM_NTASKS_PER_NODE, `--num-nodes` against SLURM_NNODES, SLURM_NTASKS against
the world) take them; FSDP2 builds its hybrid (2, 2) mesh; `#SBATCH --signal=USR1@300` arrives, the trainer saves
and runs `scontrol requeue`, and the requeued job (same SLURM_JOB_ID, SLURM_RESTART_COUNT=1) resumes by itself; a
job whose nodes are lost leaves its run lock, which a fresh sbatch on other nodes may take over only once
squeue / sacct say the old job has ended. A run interrupted either way trains exactly the uninterrupted run's
losses.

The config is the tiniest that trains (tests/helpers/trainer.py's model, 8 steps of 8 rows of 128 tokens: 2
micro-batches of 1 row per rank and step, milestones every 3 steps); the CPU knobs are the config's
(`accelerator: cpu`, gloo follows) and sbatch's `--cpus-per-task=1` (OMP_NUM_THREADS=1 in each task). The cost is
start-up: each of the 6 jobs takes about 60 s of CPU, 4 processes each spending ~12 s importing torch and Lightning
(which pulls in torchmetrics and transformers); about 3 minutes on an idle 2-core machine.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest
from helpers.fake_slurm import FakeSlurm

from posfreq.train.checkpoint import layout as ckpt
from posfreq.train.checkpoint.safe_load import read_dcp_metadata
from posfreq.train.run.parallel import local_launch_env
from posfreq.train.run_lock import LOCK_FILE

pytestmark = [pytest.mark.slow, pytest.mark.e2e]  # several jobs of 4 trainer processes each

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = "slurm/pretrain_2k.sh"
STEPS = 8
MILESTONE_STEPS = 3
CONFIG = {
    "seed": 1,
    "total_tokens": STEPS * 1024,
    "global_batch_tokens": 1024,  # 8 rows of 128: 2 micro-batches of 1 row on each of 4 ranks
    "micro_batch_rows": 1,
    "accelerator": "cpu",
    "precision": "32-true",
    "model": {
        "preset": "tiny-2l-128",
        "overrides": {"d_model": 64, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128},
        "attention_backend": "sdpa",
    },
    "data": {"train_len": 128},
    "optim": {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2},
    "checkpoint": {
        "every_tokens": MILESTONE_STEPS * 1024,
        "latest_every_steps": 0,  # a resume point only from milestones and the signal's save
        "latest_every_minutes": 0,
        "sharded": True,
    },
    "logging": {"progress_bar": False, "every_steps": 1, "logger": "none"},
}
# What a user types: the script, with the header's 8 GPUs per node and 12 cores per task overridden for the
# fake nodes (2 GPUs each) and the log kept out of the repository's logs/.
OVERRIDES = ("--ntasks-per-node=2", "--gpus-per-node=2", "--cpus-per-task=1")


class Rehearsal:
    """A fake cluster of 4 nodes with 2 GPUs each, and the environment a user submits from."""

    def __init__(self, root: Path, data_dir: Path) -> None:
        self.root, self.data = root, data_dir
        self.cluster = FakeSlurm(root / "slurm")
        self.config = root / "tiny.yaml"
        self.config.write_text(json.dumps(CONFIG))  # JSON is YAML
        (root / "tmp").mkdir()

    def submit(self, out: Path) -> str:
        # no SLURM_*, MASTER_* or ranks of the test's own environment, nor what the script sets itself
        env = local_launch_env(os.environ)
        for name in ("OMP_NUM_THREADS", "POSFREQ_SETUP", "DRY_RUN", "TRITON_CACHE_DIR"):
            env.pop(name, None)
        env.update(
            CONFIG=str(self.config),
            DATA_DIR=str(self.data),
            OUT_DIR=str(out),
            PYTHON=sys.executable,
            TMPDIR=str(self.root / "tmp"),  # the jobs' TRITON_CACHE_DIR goes there
            PYTHONUNBUFFERED="1",
            SLURM_DISTRIBUTION="cyclic",  # a site default the script's --distribution=block must override
        )
        output = f"--output={self.root}/logs/%x_%j.out"
        return self.cluster.sbatch([*OVERRIDES, output, SCRIPT], self.cluster.env(env), ROOT)

    def finished(self, job: str) -> str:
        """Wait for the job to end; its final state."""
        return self.cluster.wait(job, timeout=600)

    def wait_for_step(self, job: str, out: Path, step: int) -> int:
        """Wait until the run has logged `step` (or a later one); the last step logged."""
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            done = [row["step"] for row in metrics(out) if "loss" in row]
            if done and done[-1] >= step:
                return done[-1]
            assert self.cluster.state.state(job) in ("PENDING", "RUNNING"), self.cluster.output(job)
            time.sleep(0.05)
        raise TimeoutError(self.cluster.output(job))


@pytest.fixture
def rehearsal(data_dir, tmp_path):
    r = Rehearsal(tmp_path, data_dir)
    yield r
    r.cluster.shutdown()


@pytest.fixture(scope="module")
def uninterrupted(data_dir, tmp_path_factory):
    """Job 1001 of its own cluster: the whole run, uninterrupted."""
    r = Rehearsal(tmp_path_factory.mktemp("uninterrupted"), data_dir)
    try:
        out = r.root / "run"
        job = r.submit(out)
        state = r.finished(job)
        yield r, job, out, state
    finally:
        r.cluster.shutdown()


def metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:  # a line still being written
            break
    return rows


def losses(out: Path) -> dict[int, float]:
    """The logged loss of every step (metrics.jsonl keeps each float's exact repr), by step."""
    rows = [row for row in metrics(out) if "loss" in row]
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1)), rows
    return {row["step"]: row["loss"] for row in rows}


def expected_srun(r: Rehearsal, out: Path) -> list[str]:
    """The srun line of slurm/pretrain_common.sh in this allocation (tests/test_slurm.py checks its dry run)."""
    return [
        "srun",
        "--kill-on-bad-exit=1",
        "--ntasks-per-node=2",
        "--distribution=block",
        "--gpu-bind=none",
        "--export=ALL,POSFREQ_SRUN_TASK=1",
        "--cpus-per-task=1",
        sys.executable,
        "train/pretrain.py",
        "--config",
        str(r.config),
        "--data.dir",
        str(r.data),
        "--out",
        str(out),
        "--num-nodes",
        "2",
        "--devices",
        "2",
        "--resume",
        "auto",
    ]


def checkpoint_at(out: Path, step: int) -> Path:
    return ckpt.checkpoint_root(out) / ckpt.milestone_name(step * CONFIG["global_batch_tokens"])


def test_sbatch_runs_the_script_s_srun_line_as_2_nodes_x_2_ranks_under_hybrid_sharding(
    uninterrupted,
):
    r, job, out, state = uninterrupted
    log = r.cluster.output(job)
    assert state == "COMPLETED" and r.cluster.runs(job)[0]["exit"] == 0, log
    assert f"job {job} (restart 0) on 2 nodes x 2 GPUs" in log

    # The script's srun line, exactly, started once; its tasks numbered node by node (block, against the site's
    # cyclic default), each seeing its node's 2 GPUs and marked as a task of our srun line.
    (step,) = r.cluster.steps(job)
    assert step["argv"] == expected_srun(r, out)
    layout = [(t["rank"], t["host"], t["local"]) for t in step["tasks"]]
    assert layout == [(0, "node0", 0), (1, "node0", 1), (2, "node1", 0), (3, "node1", 1)]
    for task in step["tasks"]:
        assert task["env"]["POSFREQ_SRUN_TASK"] == "1"
        assert task["env"]["CUDA_VISIBLE_DEVICES"] == "0,1"  # --gpu-bind=none

    # The trainer saw 4 processes: Lightning took SLURM's ranks (no process started more of its own).
    assert "Starting with 4 processes" in log
    assert "4 processes x 2 micro-batches x 1 rows x 128 tokens = 1,024 tokens/step" in log
    final = checkpoint_at(out, STEPS)
    meta = ckpt.read_trainer_state(final)
    assert meta["world_size"] == 4 and meta["step"] == STEPS
    assert (meta["config"]["num_nodes"], meta["config"]["devices"]) == (2, 2)
    assert sorted(p.name for p in (final / ckpt.RNG_DIR).iterdir()) == [
        f"rank-{rank:05d}.pt" for rank in range(4)
    ]
    # HSDP's (2, 2) mesh: every tensor is saved as 2 shards (halves of dim 0), each written once for its 2 replicas;
    # fully sharded over the 4 ranks it would be 4 shards.
    saved = read_dcp_metadata(final / ckpt.STATE_DIR).state_dict_metadata
    model = {k: v for k, v in saved.items() if k.startswith("model.")}
    assert len(model) == 21  # embedding, 2 x (2 norms + 7 projections), final norm, head
    for name, tensor in model.items():
        rows = tensor.size[0]
        chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in tensor.chunks)
        rest = tuple(tensor.size[1:])
        assert chunks == [
            ((0,) + (0,) * len(rest), (rows // 2, *rest)),
            ((rows // 2,) + (0,) * len(rest), (rows // 2, *rest)),
        ], name

    trained = losses(out)
    assert trained[STEPS] < trained[1]  # it learns
    assert not (out / LOCK_FILE).exists()  # released at the end
    assert r.cluster.calls("scontrol") == []  # nothing asked for a requeue


def test_sigusr1_saves_and_requeues_and_the_requeued_job_resumes_with_the_uninterrupted_losses(
    rehearsal, uninterrupted
):
    r, out = rehearsal, rehearsal.root / "run"
    job = r.submit(out)
    r.wait_for_step(job, out, 2)
    assert r.cluster.near_time_limit(job) == "USR1@300"  # the header's --signal, to every task
    assert r.finished(job) == "COMPLETED"
    log = r.cluster.output(job)

    # The trainer asked for the requeue, from rank 0 on node0; SLURM ran the job again, same id, restart 1.
    requeues = r.cluster.calls("scontrol")
    assert [c["argv"] for c in requeues] == [["scontrol", "requeue", job]], log
    assert (requeues[0]["job"], requeues[0]["host"]) == (job, "node0")
    assert [run["restart"] for run in r.cluster.runs(job)] == [0, 1]
    assert r.cluster.runs(job)[1]["exit"] == 0, log
    assert f"job {job} (restart 0) on 2 nodes x 2 GPUs" in log  # --open-mode=append keeps both
    assert f"job {job} (restart 1) on 2 nodes x 2 GPUs" in log
    assert [s["argv"] for s in r.cluster.steps(job)] == [expected_srun(r, out)] * 2

    # It saved after the step the signal arrived in, and the requeued job resumed from that save.
    saved = re.search(rf"signal received: saved (\S+) at step (\d+); requeued SLURM job {job}", log)
    assert saved, log
    path, stopped = saved.group(1), int(saved.group(2))
    assert 2 <= stopped < STEPS
    assert f"resumed from {path} at step {stopped} " in log, log
    assert losses(out) == losses(uninterrupted[2])
    assert not (out / LOCK_FILE).exists()


def test_a_killed_job_s_lock_is_refused_while_squeue_says_it_runs_and_taken_over_once_it_ended(
    rehearsal, uninterrupted
):
    r, out = rehearsal, rehearsal.root / "run"
    old = r.submit(out)
    r.wait_for_step(old, out, MILESTONE_STEPS + 1)  # the first milestone is saved
    r.cluster.lose_nodes(old)  # SIGKILL to every task; the scheduler still says RUNNING
    assert r.finished(old) == "RUNNING"
    assert not re.search(r"summary finished", r.cluster.output(old)), "killed after the run ended"
    lock = json.loads((out / LOCK_FILE).read_text())
    assert (lock["job"], lock["host"]) == (old, "node0")  # left by rank 0 of the killed job

    # A fresh sbatch lands on the other nodes: refused while squeue says the old job runs.
    refused = r.submit(out)
    assert r.finished(refused) == "FAILED"
    log = r.cluster.output(refused)
    assert f"is locked by job {old}" in log and "from this host (node2)" in log, log
    asked = [c for c in r.cluster.calls() if c["job"] == refused and c["argv"][0] != "srun"]
    assert [(c["argv"], c["host"]) for c in asked] == [
        (["squeue", "--noheader", "--jobs", old, "--format", "%T"], "node2")
    ]
    assert json.loads((out / LOCK_FILE).read_text()) == lock

    # Once the scheduler has ended the job (squeue forgot it, sacct says CANCELLED) the next sbatch takes over.
    r.cluster.end(old, "CANCELLED", forget=True)
    fresh = r.submit(out)
    assert r.finished(fresh) == "COMPLETED"
    log = r.cluster.output(fresh)
    assert f"taking over a stale lock (sacct reports job {old} CANCELLED)" in log, log
    asked = [c["argv"][0] for c in r.cluster.calls() if c["job"] == fresh]
    assert asked == ["srun", "squeue", "sacct"]
    resumed = re.search(r"resumed from (\S+) at step (\d+) ", log)
    assert resumed and int(resumed.group(2)) % MILESTONE_STEPS == 0, log
    assert [s["argv"] for s in r.cluster.steps(fresh)] == [expected_srun(r, out)]
    assert losses(out) == losses(uninterrupted[2])
    assert not (out / LOCK_FILE).exists()

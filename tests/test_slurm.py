"""The SLURM launch scripts: syntax, shellcheck, and the exact srun command of a dry run."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from posfreq.train.run_config import parse_args

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = [ROOT / "slurm/pretrain_2k.sh", ROOT / "slurm/pretrain_4k.sh"]
ALL_SCRIPTS = sorted((ROOT / "slurm").glob("*.sh"))
JOBS = [
    p for p in ALL_SCRIPTS if "\n#SBATCH " in p.read_text()
]  # the scripts sbatch runs (common.sh is sourced)


def dry_run_process(script: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    clean = {
        k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "POSFREQ_SETUP"
    }
    return subprocess.run(
        ["bash", str(script), *args],
        env={**clean, "DRY_RUN": "1", **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )


def dry_run(script: Path, *args: str, **env: str) -> list[str]:
    return shlex.split(dry_run_process(script, *args, **env).stdout)


@pytest.mark.parametrize("script", ALL_SCRIPTS, ids=lambda p: p.name)
def test_bash_syntax(script):
    subprocess.run(["bash", "-n", str(script)], check=True)


@pytest.mark.skipif(
    shutil.which("shellcheck") is None,
    reason="shellcheck is not installed (apt-get install shellcheck)",
)
@pytest.mark.parametrize("script", ALL_SCRIPTS, ids=lambda p: p.name)
def test_shellcheck(script):
    proc = subprocess.run(
        ["shellcheck", "-x", str(script.relative_to(ROOT))],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout


@pytest.mark.parametrize(
    "script,length", [(SCRIPTS[0], 2048), (SCRIPTS[1], 4096)], ids=["2k", "4k"]
)
def test_dry_run_prints_the_srun_command(script, length):
    cmd = dry_run(
        script,
        "--optim.lr",
        "3e-4",
        DATA_DIR="/data/sp",
        OUT_DIR="/runs/x",
        PYTHON=".venv/bin/python",
    )
    i = cmd.index("train/pretrain.py")
    assert cmd[:i] == [
        "srun",
        "--kill-on-bad-exit=1",
        "--ntasks-per-node=8",
        "--cpus-per-task=12",
        ".venv/bin/python",
    ]
    assert cmd[i + 1 :] == [
        "--config",
        f"configs/pretrain_{length // 1024}k.yaml",
        "--data.dir",
        "/data/sp",
        "--out",
        "/runs/x",
        "--num-nodes",
        "2",
        "--devices",
        "8",
        "--resume",
        "auto",
        "--optim.lr",
        "3e-4",
    ]
    cfg = parse_args(cmd[i + 1 :])  # every flag the script passes exists
    assert (cfg.data.train_len, cfg.num_nodes, cfg.devices, cfg.resume, cfg.optim.lr) == (
        length,
        2,
        8,
        "auto",
        3e-4,
    )
    # Inside an allocation the node and task counts come from SLURM.
    cmd = dry_run(
        script,
        SLURM_NNODES="4",
        SLURM_NTASKS_PER_NODE="4",
        SLURM_CPUS_PER_TASK="6",
        SLURM_JOB_ID="1",
        SLURM_SUBMIT_DIR=str(ROOT),
    )
    assert "--ntasks-per-node=4" in cmd and cmd[cmd.index("--num-nodes") + 1] == "4"
    assert (
        "--cpus-per-task=6" in cmd
    )  # srun gets it explicitly: Slurm >= 22.05 does not pass sbatch's on


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_headers_request_signal_and_requeue(script):
    text = script.read_text()
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=8",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --signal=USR1@300",
        "#SBATCH --requeue",
    ):
        assert line in text


@pytest.mark.parametrize("script", JOBS, ids=lambda p: p.name)
def test_every_job_logs_to_the_committed_logs_folder_and_shares_the_variable_names(script):
    text = script.read_text()
    assert "#SBATCH --output=logs/" in text
    assert "--gpus=0" not in text  # refused by some GPU partitions
    for old in ("PY=", "TOKENS_DIR", "${OUT}", "$OUT/", '"$OUT"'):
        assert old not in text, (
            f"{script.name} uses {old}; the shared names are PYTHON, DATA_DIR, OUT_DIR"
        )
    assert "source slurm/common.sh" in text or "source slurm/pretrain_common.sh" in text
    tracked = subprocess.run(
        ["git", "ls-files", "logs/.gitkeep"], cwd=ROOT, capture_output=True, text=True
    ).stdout
    assert (
        tracked.strip() == "logs/.gitkeep"
    )  # sbatch opens logs/... before the script could create it


@pytest.mark.parametrize(
    "script, args",
    [(ROOT / "slurm/pretrain_2k.sh", []), (ROOT / "slurm/prepare_data.sh", [])],
    ids=["pretrain", "prepare"],
)
def test_dry_run_warns_on_placeholder_paths_and_runs_the_setup_line(script, args):
    proc = dry_run_process(script, *args, POSFREQ_SETUP="echo setup-line-ran >&2", PYTHON="py")
    assert "setup-line-ran" in proc.stderr
    assert (
        "is the placeholder /path/to/" in proc.stderr
    )  # DATA_DIR / SLIMPAJAMA_DIR left at their defaults
    assert shlex.split(proc.stdout)  # a dry run still prints the command


def test_real_run_refuses_a_placeholder_before_starting():
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run(
        ["bash", "slurm/pretrain_2k.sh"],
        env={**clean, "PYTHON": "false"},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert (
        proc.returncode == 1
        and "error: DATA_DIR is the placeholder /path/to/slimpajama-llama3" in proc.stderr
    )


def test_probe_submits_a_gpu_array_and_a_cpu_merge(tmp_path):
    (tmp_path / "checkpoints/tokens-000000001024").mkdir(parents=True)
    (tmp_path / "checkpoints/tokens-000000002048.tmp").mkdir(parents=True)
    array, merge = dry_run_process(
        ROOT / "slurm/probe.sh", str(tmp_path), "--lengths", "1024"
    ).stdout.splitlines()
    assert shlex.split(array)[:4] == [
        "sbatch",
        "--parsable",
        "--array=0-0",
        "--export=ALL,PROBE_STEP=task",
    ]
    merge = shlex.split(merge)
    assert merge[:3] == ["sbatch", "--parsable", "--dependency=afterany:ARRAY_JOB_ID"]
    assert merge[3:] == ["slurm/probe_merge.sh", str(tmp_path), "--lengths", "1024"]
    assert "--gpus" not in (ROOT / "slurm/probe_merge.sh").read_text()


def test_ruler_submits_one_gpu_task_per_ruler_task_and_a_table_after_them(tmp_path):
    model = tmp_path / "smol"
    model.mkdir()
    array, table = dry_run_process(
        ROOT / "slurm/ruler.sh", f"hf:{model}", "--positions", "string"
    ).stdout.splitlines()
    assert shlex.split(array)[:4] == [
        "sbatch",
        "--parsable",
        "--array=0-10",
        "--export=ALL,RULER_STEP=task",
    ]
    script = str(ROOT / "slurm/ruler.sh")  # as submitted: "$0"
    assert shlex.split(array)[4:] == [script, str(model), "--positions", "string"]
    assert shlex.split(table)[2:6] == [
        "--dependency=afterany:ARRAY_JOB_ID",
        "--output=logs/%x_%j.out",
        "--export=ALL,RULER_STEP=table",
        script,
    ]
    subset = dry_run(ROOT / "slurm/ruler.sh", str(model), RULER_TASKS="vt,cwe")
    assert "--array=0-1" in subset

    def step(name: str, **env: str) -> list[str]:
        """The command a job of the array (or the table) runs, echoed instead of run."""
        return dry_run(
            ROOT / "slurm/ruler.sh",
            str(model),
            "--positions",
            "string",
            RULER_STEP=name,
            PYTHON="echo",
            OUT_DIR="runs/r",
            **env,
        )

    common = ["--model", f"hf:{model}"]
    assert step("task", SLURM_ARRAY_TASK_ID="9") == [
        "analysis/ruler.py",
        *common,
        "--tasks",
        "cwe",
        "--out",
        "runs/r",
        "--positions",
        "string",
    ]
    from posfreq.analysis.ruler import TASKS

    assert step("table") == [
        "analysis/ruler.py",
        *common,
        "--tasks",
        ",".join(TASKS),
        "--out",
        "runs/r",
        "--positions",
        "string",
    ]


def test_doctor_job_runs_the_doctor_on_one_node_as_one_task():
    text = (ROOT / "slurm/doctor.sh").read_text()
    for line in ("#SBATCH --nodes=1", "#SBATCH --ntasks=1", "#SBATCH --gpus-per-node=8"):
        assert line in text
    cmd = dry_run(ROOT / "slurm/doctor.sh", PYTHON=".venv/bin/python", OUT_DIR="/runs/doc")
    assert cmd == [
        ".venv/bin/python",
        "-m",
        "posfreq.train.doctor",
        "--out",
        "/runs/doc",
        "--device",
        "cuda",
    ]

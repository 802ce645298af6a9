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


def dry_run(script: Path, *args: str, **env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run(["bash", str(script), *args], env={**clean, "DRY_RUN": "1", **env}, cwd=ROOT,
                          capture_output=True, text=True, timeout=30, check=True)
    return shlex.split(proc.stdout)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bash_syntax(script):
    subprocess.run(["bash", "-n", str(script)], check=True)


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed (apt-get install shellcheck)")
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shellcheck(script):
    proc = subprocess.run(["shellcheck", "-x", str(script.relative_to(ROOT))], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


@pytest.mark.parametrize("script,length", [(SCRIPTS[0], 2048), (SCRIPTS[1], 4096)], ids=["2k", "4k"])
def test_dry_run_prints_the_srun_command(script, length):
    cmd = dry_run(script, "--optim.lr", "3e-4", DATA_DIR="/data/sp", OUT_DIR="/runs/x", PYTHON=".venv/bin/python")
    i = cmd.index("train/pretrain.py")
    assert cmd[:i] == ["srun", "--kill-on-bad-exit=1", "--ntasks-per-node=8", ".venv/bin/python"]
    assert cmd[i + 1:] == ["--config", f"configs/pretrain_{length // 1024}k.yaml", "--data.dir", "/data/sp",
                           "--out", "/runs/x", "--num-nodes", "2", "--devices", "8", "--resume", "auto",
                           "--optim.lr", "3e-4"]
    cfg = parse_args(cmd[i + 1:])  # every flag the script passes exists
    assert (cfg.data.train_len, cfg.num_nodes, cfg.devices, cfg.resume, cfg.optim.lr) == (length, 2, 8, "auto", 3e-4)
    # Inside an allocation the node and task counts come from SLURM.
    cmd = dry_run(script, SLURM_NNODES="4", SLURM_NTASKS_PER_NODE="4", SLURM_JOB_ID="1",
                  SLURM_SUBMIT_DIR=str(ROOT))
    assert "--ntasks-per-node=4" in cmd and cmd[cmd.index("--num-nodes") + 1] == "4"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_headers_request_signal_and_requeue(script):
    text = script.read_text()
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --signal=USR1@120", "#SBATCH --requeue"):
        assert line in text

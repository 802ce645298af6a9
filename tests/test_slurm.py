"""The SLURM launch scripts: syntax, shellcheck, and the exact srun command of a dry run."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from posfreq.train.run.config import parse_args

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = [ROOT / "slurm/pretrain_2k.sh", ROOT / "slurm/pretrain_4k.sh"]
ALL_SCRIPTS = sorted((ROOT / "slurm").glob("*.sh"))
JOBS = [
    p for p in ALL_SCRIPTS if "\n#SBATCH " in p.read_text()
]  # the scripts sbatch runs (common.sh is sourced)


# What the scripts set themselves, so that the caller's environment does not decide a test.
SCRIPT_VARIABLES = (
    "POSFREQ_SETUP",
    "DRY_RUN",
    "OMP_NUM_THREADS",
    "TRITON_CACHE_DIR",
    "SLURM_TMPDIR",
)


def run_script(script: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """Run a slurm/ script from the repository root, outside any SLURM job unless env says so."""
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("SLURM_") and k not in SCRIPT_VARIABLES
    }
    return subprocess.run(
        ["bash", str(script), *args],
        env={**clean, **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )


def dry_run_process(script: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    proc = run_script(script, *args, **{"DRY_RUN": "1", **env})
    assert proc.returncode == 0, proc.stderr
    return proc


def dry_run(script: Path, *args: str, **env: str) -> list[str]:
    return shlex.split(dry_run_process(script, *args, **env).stdout)


@pytest.mark.parametrize("script", ALL_SCRIPTS, ids=lambda p: p.name)
def test_bash_syntax(script):
    subprocess.run(["bash", "-n", str(script)], check=True)


@pytest.mark.slow
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
        "--distribution=block",
        "--gpu-bind=none",
        "--export=ALL,POSFREQ_SRUN_TASK=1",
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


def test_table_submits_one_gpu_task_per_share_of_schemes_and_the_tables_after_them(tmp_path):
    model = tmp_path / "smol"
    model.mkdir()
    script = str(ROOT / "slurm/table.sh")  # as submitted: "$0"
    array, tables = dry_run_process(
        ROOT / "slurm/table.sh", f"hf:{model}", "--tests", "500", TABLE_SHARDS="3"
    ).stdout.splitlines()
    assert shlex.split(array) == [
        "sbatch",
        "--parsable",
        "--array=0-2",
        "--export=ALL,TABLE_STEP=task,TABLE_SHARDS=3",
        script,
        f"hf:{model}",
        "--tests",
        "500",
    ]
    assert shlex.split(tables)[2:6] == [
        "--dependency=afterany:ARRAY_JOB_ID",
        "--output=logs/%x_%j.out",
        "--export=ALL,TABLE_STEP=tables",
        script,
    ]
    task = dry_run(
        ROOT / "slurm/table.sh",
        f"hf:{model}",
        TABLE_STEP="task",
        TABLE_SHARDS="3",
        SLURM_ARRAY_TASK_ID="2",
        PYTHON="py",
        OUT_DIR="runs/t",
    )
    assert task == [
        "py",
        "-m",
        "posfreq.scripts.cli",
        "table",
        "--model",
        f"hf:{model}",
        "--shard",
        "2/3",
        "--out",
        "runs/t",
    ]


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
        """The command a job of the array (or the table) runs, printed by the dry run."""
        return dry_run(
            ROOT / "slurm/ruler.sh",
            str(model),
            "--positions",
            "string",
            RULER_STEP=name,
            PYTHON="py",
            OUT_DIR="runs/r",
            **env,
        )

    common = ["--model", f"hf:{model}"]
    assert step("task", SLURM_ARRAY_TASK_ID="9") == [
        "py",
        "analysis/ruler.py",
        *common,
        "--tasks",
        "cwe",
        "--out",
        "runs/r",
        "--positions",
        "string",
    ]
    from posfreq.analysis.ruler_task.runner import TASKS

    assert step("table") == [
        "py",
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
        "posfreq.scripts.commands.doctor",
        "--out",
        "/runs/doc",
        "--device",
        "cuda",
    ]


def fake_command(bin_dir: Path, name: str, record: Path, rc: int) -> None:
    """An executable NAME in bin_dir that appends "NAME ARGS..." to record and exits rc."""
    bin_dir.mkdir(exist_ok=True)
    path = bin_dir / name
    path.write_text(f'#!/bin/sh\necho "{name} $*" >> "{record}"\nexit {rc}\n')
    path.chmod(0o755)


@pytest.fixture
def fakes(tmp_path):
    """sbatch and srun that record their arguments and refuse, first on PATH, and a recording PYTHON;
    plus the inputs each script checks (a run with a checkpoint, a model folder, a corpus folder)."""
    record = tmp_path / "calls.txt"
    bin_dir = tmp_path / "bin"
    fake_command(bin_dir, "sbatch", record, 1)
    fake_command(bin_dir, "srun", record, 1)
    fake_command(bin_dir, "python", record, 0)
    (tmp_path / "run/checkpoints/tokens-000000001024").mkdir(parents=True)
    (tmp_path / "model").mkdir()
    (tmp_path / "corpus").mkdir()
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHON": str(bin_dir / "python"),
        "SLIMPAJAMA_DIR": str(tmp_path / "corpus"),
        "DATA_DIR": str(tmp_path / "corpus"),
        "OUT_DIR": str(tmp_path / "out"),
        "SHARDS": "4",
    }
    return tmp_path, record, env


ARRAY_TASK = {"SLURM_JOB_ID": "5", "SLURM_SUBMIT_DIR": str(ROOT), "SLURM_ARRAY_TASK_ID": "0"}
# Every step of every job script: (script, arguments, environment); {tmp} is the fakes' folder.
STEPS = {
    "doctor": ("doctor.sh", [], {}),
    "position_freq-submit": ("position_freq.sh", ["submit", "--exclude-sources", "github"], {}),
    "position_freq-count": ("position_freq.sh", ["count"], ARRAY_TASK),
    "position_freq-merge": ("position_freq.sh", ["merge"], {"SLURM_JOB_ID": "6"}),
    "prepare_data": ("prepare_data.sh", [], ARRAY_TASK),
    "pretrain_2k": ("pretrain_2k.sh", [], {}),
    "pretrain_4k": ("pretrain_4k.sh", ["--optim.lr", "3e-4"], {}),
    "probe-submit": ("probe.sh", ["{tmp}/run"], {}),
    "probe-task": (
        "probe.sh",
        ["{tmp}/run"],
        {**ARRAY_TASK, "PROBE_STEP": "task", "SLURM_ARRAY_TASK_COUNT": "1"},
    ),
    "probe_merge": ("probe_merge.sh", ["{tmp}/run"], {"SLURM_JOB_ID": "7"}),
    "ruler-submit": ("ruler.sh", ["{tmp}/model"], {}),
    "ruler-task": ("ruler.sh", ["{tmp}/model"], {**ARRAY_TASK, "RULER_STEP": "task"}),
    "ruler-table": ("ruler.sh", ["{tmp}/model"], {"SLURM_JOB_ID": "8", "RULER_STEP": "table"}),
    "table-submit": ("table.sh", ["hf:{tmp}/model"], {}),
    "table-task": ("table.sh", ["hf:{tmp}/model"], {**ARRAY_TASK, "TABLE_STEP": "task"}),
    "table-tables": ("table.sh", ["hf:{tmp}/model"], {"SLURM_JOB_ID": "9", "TABLE_STEP": "tables"}),
}


def test_the_dry_run_steps_cover_every_job_script():
    assert {script for script, _, _ in STEPS.values()} == {p.name for p in JOBS}


@pytest.mark.parametrize("step", STEPS, ids=str)
def test_a_dry_run_calls_no_sbatch_srun_or_python(step, fakes):
    tmp, record, env = fakes
    script, args, extra = STEPS[step]
    proc = run_script(
        ROOT / "slurm" / script,
        *(a.format(tmp=tmp) for a in args),
        **{**env, **extra, "DRY_RUN": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    assert not record.exists(), record.read_text()
    assert shlex.split(proc.stdout)  # it printed what it would submit or run


@pytest.mark.parametrize(
    "step, first_call",
    [
        ("position_freq-submit", "sbatch --parsable --array=0-3 "),
        ("probe-submit", "sbatch --parsable --array=0-0 "),
        ("ruler-submit", "sbatch --parsable --array=0-10 "),
        ("pretrain_2k", "srun --kill-on-bad-exit=1 "),
    ],
)
def test_without_dry_run_the_same_steps_reach_the_fakes(step, first_call, fakes):
    """The fakes are what the scripts call, so the dry run's empty record above means something."""
    tmp, record, env = fakes
    script, args, extra = STEPS[step]
    proc = run_script(ROOT / "slurm" / script, *(a.format(tmp=tmp) for a in args), **env, **extra)
    assert proc.returncode != 0  # the fake refused
    calls = [c for c in record.read_text().splitlines() if not c.startswith("python ")]
    assert calls[0].startswith(first_call) and len(calls) == 1, calls


UNSET_READ = 'echo "setup saw [${POSFREQ_NEVER_SET_ANYWHERE}]" >&2'


def test_the_setup_line_may_read_unset_variables():
    proc = dry_run_process(ROOT / "slurm/doctor.sh", POSFREQ_SETUP=UNSET_READ)
    assert "setup saw []" in proc.stderr


@pytest.mark.parametrize(
    "flags, setup, expect",
    [
        ("-euo pipefail", UNSET_READ, "u"),  # set -u is back on after the setup line
        ("-e", UNSET_READ, ""),  # and stays off where the script had it off
        ("-euo pipefail", "false", None),  # a failing setup line still stops the script
    ],
)
def test_the_setup_line_runs_without_nounset_and_the_flags_are_restored(flags, setup, expect):
    proc = run_script(
        Path("-c"),  # bash -c SCRIPT
        f'set {flags}; source slurm/common.sh; echo "flags=$-"',
        POSFREQ_SETUP=setup,
    )
    if expect is None:
        assert proc.returncode != 0 and "flags=" not in proc.stdout
        return
    assert proc.returncode == 0, proc.stderr
    flags_after = proc.stdout.strip().removeprefix("flags=")
    assert ("u" in flags_after) == (expect == "u") and "e" in flags_after


def triton_line(proc: subprocess.CompletedProcess) -> str | None:
    for line in proc.stderr.splitlines():
        if line.startswith("dry run: TRITON_CACHE_DIR="):
            return line.removeprefix("dry run: TRITON_CACHE_DIR=")
    return None


def test_a_job_gets_a_node_local_triton_cache_unless_the_user_set_one(tmp_path):
    job = {
        "DATA_DIR": str(tmp_path),
        "SLURM_JOB_ID": "77",
        "SLURM_SUBMIT_DIR": str(ROOT),
        "USER": "alice",
        "TMPDIR": str(tmp_path / "tmp"),
    }
    script = ROOT / "slurm/pretrain_2k.sh"
    assert triton_line(dry_run_process(script, **job)) == f"{tmp_path}/tmp/triton-alice-77"
    assert not (tmp_path / "tmp").exists()  # a dry run creates nothing
    local = dry_run_process(script, **job, SLURM_TMPDIR=str(tmp_path / "local"))
    assert triton_line(local) == f"{tmp_path}/local/triton-alice-77"
    assert triton_line(dry_run_process(script, **job, TRITON_CACHE_DIR="/mine")) == "/mine"
    outside = {k: v for k, v in job.items() if not k.startswith("SLURM_")}
    assert triton_line(dry_run_process(script, **outside)) is None  # ~/.triton outside a job
    # A real run creates it on this node and srun's ranks inherit it.
    seen = tmp_path / "seen.txt"
    srun = tmp_path / "bin/srun"
    srun.parent.mkdir()
    srun.write_text(f'#!/bin/sh\necho "$TRITON_CACHE_DIR $OMP_NUM_THREADS" > "{seen}"\n')
    srun.chmod(0o755)
    proc = run_script(
        script,
        **job,
        SLURM_CPUS_PER_TASK="3",
        PATH=f"{srun.parent}{os.pathsep}{os.environ['PATH']}",
    )
    assert proc.returncode == 0, proc.stderr
    assert seen.read_text().split() == [f"{tmp_path}/tmp/triton-alice-77", "3"]
    assert (tmp_path / "tmp/triton-alice-77").is_dir()


def header_cpus(script: Path) -> int:
    (line,) = [
        x for x in script.read_text().splitlines() if x.startswith("#SBATCH --cpus-per-task=")
    ]
    return int(line.split("=")[1])


def test_cpus_come_from_the_allocation(tmp_path):
    job = {
        "DATA_DIR": str(tmp_path),
        "SLIMPAJAMA_DIR": str(tmp_path),
        "SLURM_JOB_ID": "1",
        "SLURM_SUBMIT_DIR": str(ROOT),
        "SLURM_ARRAY_TASK_ID": "0",
    }
    proc = dry_run_process(ROOT / "slurm/pretrain_2k.sh", **job, SLURM_CPUS_PER_TASK="5")
    assert "--cpus-per-task=5" in shlex.split(proc.stdout)
    assert "dry run: OMP_NUM_THREADS=5" in proc.stderr.splitlines()
    for script, args in (("prepare_data.sh", []), ("position_freq.sh", ["count"])):
        cmd = dry_run(ROOT / "slurm" / script, *args, **job, SLURM_CPUS_PER_TASK="5")
        assert cmd[cmd.index("--workers") + 1] == "5", script
    # An allocation that names no CPU count (salloc without -c): srun and torch keep their defaults.
    proc = dry_run_process(ROOT / "slurm/pretrain_2k.sh", **job)
    assert not any(a.startswith("--cpus-per-task") for a in shlex.split(proc.stdout))
    assert "OMP_NUM_THREADS" not in proc.stderr


@pytest.mark.parametrize(
    "script, args",
    [("pretrain_2k.sh", []), ("prepare_data.sh", []), ("position_freq.sh", ["count"])],
)
def test_outside_a_job_the_dry_run_shows_the_header_cpu_count(script, args, tmp_path):
    """The #SBATCH line is the only place a CPU count is written: a copy with another one prints it."""
    original = ROOT / "slurm" / script
    env = {
        "DATA_DIR": str(tmp_path),
        "SLIMPAJAMA_DIR": str(tmp_path),
        "SLURM_ARRAY_TASK_ID": "0",
        "SLURM_SUBMIT_DIR": str(ROOT),  # no SLURM_JOB_ID: not in a job
    }

    def cpus(path: Path) -> str:
        cmd = dry_run(path, *args, **env)
        if "srun" in cmd:
            return next(a for a in cmd if a.startswith("--cpus-per-task=")).split("=")[1]
        return cmd[cmd.index("--workers") + 1]

    assert cpus(original) == str(header_cpus(original))
    copy = tmp_path / script  # sbatch, too, runs a copy of the script
    copy.write_text(
        original.read_text().replace(
            f"#SBATCH --cpus-per-task={header_cpus(original)}", "#SBATCH --cpus-per-task=7"
        )
    )
    assert cpus(copy) == "7"

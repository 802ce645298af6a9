"""A fake SLURM cluster on one machine: `sbatch`, `srun`, `scontrol`, `squeue` and `sacct` as executables on
PATH, so that tests run the slurm/ scripts themselves, end to end, as a scheduler would.

The fakes keep SLURM's contract, not a shortcut around it:
- `sbatch SCRIPT ARGS` reads the script's `#SBATCH` header (its command-line options win, as in SLURM),
  refuses what the fake nodes cannot give (more nodes or GPUs per node than they have), copies the script (SLURM
  runs a copy) and returns at once with the job id; the job then runs in the background: `bash COPY ARGS` from the
  submission directory with the submission environment (`--export=ALL`) plus the SLURM_* variables sbatch sets,
  its output appended to `--output` (`%x`, `%j` expanded). After `scontrol requeue` it runs again with the same
  SLURM_JOB_ID and SLURM_RESTART_COUNT=1, 2, ...; a job that was not submitted with `--requeue` is refused.
- `srun [OPTIONS] CMD ...` inside a job parses its options (an unknown one is an error, as in srun; task counts not
  given fall back to SLURM_NNODES / SLURM_NTASKS_PER_NODE / SLURM_NTASKS, as srun reads them) and starts one
  process per task with SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID, SLURMD_NODENAME and the step's counts,
  numbering ranks by `--distribution` (else SLURM_DISTRIBUTION, else block). `--export` decides the tasks'
  environment; `--kill-on-bad-exit` ends the other tasks when one fails; signals to srun go on to the tasks;
  srun exits with the highest task exit code. Each task's `socket.gethostname()` is its fake node's name
  (node0, node1, ...: a `sitecustomize` on the tasks' PYTHONPATH), so a run lock names the node as on a cluster.
  The node names do not resolve, so srun sets MASTER_ADDR=127.0.0.1 (what a cluster's DNS gives Lightning's
  SLURMEnvironment for the first node of SLURM_NODELIST) and a free MASTER_PORT per step (Lightning's default,
  15000 + the job id's last four digits, could be held by another process of this machine).
- `scontrol show hostnames [LIST]` expands a node list; `scontrol requeue JOB` marks the job for requeue and
  terminates it as SLURM does (SIGTERM to every process of the job, SIGKILL after KILL_WAIT seconds).
- `squeue --jobs J --format %T` prints the job's state, or "Invalid job id specified" (exit 1) once it forgot the
  job; `sacct --jobs J --format State` prints it from the accounting record, which never forgets.

Every call of a fake is appended to CALLS (JSON lines: argv, the caller's SLURM_JOB_ID and host). The test drives
what SLURM would do on its own through `FakeSlurm`: the signal of `#SBATCH --signal` near the time limit
(`near_time_limit`), nodes lost under a running job (`lose_nodes`), and the scheduler noticing (`end`).

Run as `python fake_slurm.py COMMAND ARGS...` (the executables in BIN do this); stdlib only.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import resource
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

KILL_WAIT = 30.0  # SIGTERM to SIGKILL when a job or step is terminated (SLURM's default KillWait)
ALIVE = ("RUNNING", "PENDING", "REQUEUED", "COMPLETING")
COMMANDS = ("sbatch", "srun", "scontrol", "squeue", "sacct")
CALLS = "calls.jsonl"
SITECUSTOMIZE = """# The fake SLURM's host name for this task: socket.gethostname() as on its node.
import os
import socket

_name = os.environ.get("FAKE_SLURM_HOSTNAME")
if _name:
    socket.gethostname = lambda: _name
"""


# -- node lists --------------------------------------------------------------------------------


def compress(nodes: list[str]) -> str:
    """["node0", "node1", "node3"] -> "node[0-1,3]" (one prefix), as SLURM writes a node list."""
    parts = [re.fullmatch(r"(.*?)(\d+)", n) for n in nodes]
    if len(nodes) == 1 or not all(parts) or len({p.group(1) for p in parts}) != 1:
        return ",".join(nodes)
    numbers = [int(p.group(2)) for p in parts]
    ranges, start = [], numbers[0]
    for prev, cur in zip(numbers, numbers[1:] + [None]):
        if cur != prev + 1:
            ranges.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = cur
    return f"{parts[0].group(1)}[{','.join(ranges)}]"


def expand(nodelist: str) -> list[str]:
    """ "node[0-1,3],gpu7" -> ["node0", "node1", "node3", "gpu7"]."""
    out = []
    for prefix, inner, plain in re.findall(r"([^,\[]*)\[([^\]]*)\]|([^,]+)", nodelist):
        if plain:
            out.append(plain)
            continue
        for item in inner.split(","):
            lo, _, hi = item.partition("-")
            width = len(lo)
            out += [f"{prefix}{i:0{width}d}" for i in range(int(lo), int(hi or lo) + 1)]
    return out


def tasks_per_node(counts: list[int]) -> str:
    """[2, 2] -> "2(x2)", as SLURM_TASKS_PER_NODE."""
    out = []
    for count in counts:
        if out and out[-1][0] == count:
            out[-1][1] += 1
        else:
            out.append([count, 1])
    return ",".join(f"{c}(x{n})" if n > 1 else str(c) for c, n in out)


# -- the cluster's state ----------------------------------------------------------------------


class State:
    """The fake cluster's files under ROOT: cluster.json, the job counter, CALLS and jobs/ID/."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.cluster = json.loads((self.root / "cluster.json").read_text())

    def job_dir(self, job: str) -> Path:
        return self.root / "jobs" / str(job)

    def record(self, argv: list[str]) -> None:
        line = {
            "argv": argv,
            "job": os.environ.get("SLURM_JOB_ID"),
            "host": os.environ.get("FAKE_SLURM_HOSTNAME"),
        }
        with open(self.root / CALLS, "a") as f:
            f.write(json.dumps(line) + "\n")

    def next_job_id(self) -> str:
        with open(self.root / "next_job_id", "r+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            job = int(f.read().strip())
            f.seek(0)
            f.write(f"{job + 1}\n")
            f.truncate()
        return str(job)

    def read(self, job: str, name: str, default: str | None = None) -> str | None:
        try:
            return (self.job_dir(job) / name).read_text().strip()
        except FileNotFoundError:
            return default

    def write(self, job: str, name: str, text: str) -> None:
        path = self.job_dir(job) / name
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text + "\n")
        tmp.replace(path)

    def state(self, job: str) -> str | None:
        return self.read(job, "state")

    def jobs(self) -> list[str]:
        folder = self.root / "jobs"
        return sorted((p.name for p in folder.iterdir()), key=int) if folder.is_dir() else []

    def busy_nodes(self, but: str | None = None) -> set[str]:
        """Nodes down, or held by a running job other than `but`."""
        busy = set(json.loads(self.read_root("down_nodes", "[]")))
        for job in self.jobs():
            if job != but and self.state(job) == "RUNNING":
                busy |= set(json.loads(self.read(job, "nodes", "[]")))
        return busy

    def read_root(self, name: str, default: str) -> str:
        try:
            return (self.root / name).read_text()
        except FileNotFoundError:
            return default


# -- option parsing -----------------------------------------------------------------------------


def parse_options(argv: list[str], spec: dict[str, tuple[str | None, bool]], command: str):
    """Options before the first operand: ({long name: value or True}, the rest). `spec` maps each long name to
    (its short letter or None, whether it takes a value). An unknown option is an error, as in SLURM."""
    shorts = {short: name for name, (short, _) in spec.items() if short}
    options: dict[str, str | bool] = {}
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "-":
        arg = argv[i]
        if arg.startswith("--"):
            name, eq, value = arg[2:].partition("=")
            if name not in spec:
                fail(command, f"unrecognized option '{arg}'")
            takes = spec[name][1]
            if takes and not eq:
                i += 1
                if i == len(argv):
                    fail(command, f"option '--{name}' requires an argument")
                value = argv[i]
            options[name] = value if takes or eq else True
        else:
            name = shorts.get(arg[1:2])
            if name is None:
                fail(command, f"invalid option -- '{arg[1:2]}'")
            value = arg[2:]
            if spec[name][1] and not value:
                i += 1
                if i == len(argv):
                    fail(command, f"option requires an argument -- '{arg[1:2]}'")
                value = argv[i]
            options[name] = value if spec[name][1] or value else True
        i += 1
    return options, argv[i:]


def fail(command: str, message: str, code: int = 1):
    print(f"{command}: error: {message}", file=sys.stderr)
    sys.exit(code)


SBATCH = {
    "nodes": ("N", True),
    "ntasks-per-node": (None, True),
    "ntasks": ("n", True),
    "gpus-per-node": (None, True),
    "cpus-per-task": ("c", True),
    "mem": (None, True),
    "time": ("t", True),
    "signal": (None, True),
    "requeue": (None, False),
    "no-requeue": (None, False),
    "open-mode": (None, True),
    "output": ("o", True),
    "error": ("e", True),
    "job-name": ("J", True),
    "account": ("A", True),
    "partition": ("p", True),
    "nodelist": ("w", True),
    "exclude": ("x", True),
    "export": (None, True),
    "parsable": (None, False),
    "array": ("a", True),
    "dependency": ("d", True),
}

SRUN = {
    "kill-on-bad-exit": ("K", False),
    "ntasks-per-node": (None, True),
    "nodes": ("N", True),
    "ntasks": ("n", True),
    "distribution": ("m", True),
    "gpu-bind": (None, True),
    "cpu-bind": (None, True),
    "export": (None, True),
    "cpus-per-task": ("c", True),
    "gpus-per-node": (None, True),
    "label": ("l", False),
    "unbuffered": ("u", False),
}


def header_options(script: Path) -> list[str]:
    """The script's #SBATCH options, up to its first command (sbatch stops reading there)."""
    argv = []
    for line in script.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("#SBATCH"):
            argv += shlex.split(stripped[len("#SBATCH") :], comments=True)
        elif stripped and not stripped.startswith("#"):
            break
    return argv


def exported_env(spec: str, env: dict[str, str], base: dict[str, str]) -> dict[str, str]:
    """--export=ALL,NAME=value,NAME / NONE / NAME,...: the environment it gives (SLURM_* always pass)."""
    items = [x for x in spec.split(",") if x]
    everything = bool(items) and items[0] == "ALL"
    out = dict(env) if everything else {k: v for k, v in env.items() if k.startswith("SLURM")}
    out.update(base)
    for item in items:
        if item in ("ALL", "NONE"):
            continue
        name, eq, value = item.partition("=")
        if eq:
            out[name] = value
        elif name in env:
            out[name] = env[name]
    return out


# -- sbatch and the job it runs ------------------------------------------------------------------


def sbatch(state: State, argv: list[str]) -> int:
    cli, rest = parse_options(argv, SBATCH, "sbatch")
    if not rest:
        fail("sbatch", "no batch script given")
    script, args = Path(rest[0]), rest[1:]
    if not script.is_file():
        fail("sbatch", f"Unable to open file {script}")
    header, _ = parse_options(header_options(script), SBATCH, "sbatch")
    options = {**header, **cli}
    cluster = state.cluster
    nodes = int(options.get("nodes", 1))
    gpus = int(str(options.get("gpus-per-node", 0)).split(":")[-1])
    if nodes > len(cluster["nodes"]) or gpus > cluster["gpus_per_node"]:
        fail(
            "sbatch",
            "Batch job submission failed: Requested node configuration is not available",
        )
    if "array" in options or "dependency" in options or options.get("export", "ALL") != "ALL":
        fail("sbatch", "the fake runs no arrays or dependencies, and exports the whole environment")
    job = state.next_job_id()
    folder = state.job_dir(job)
    folder.mkdir(parents=True)
    shutil.copy(script, folder / "slurm_script")  # sbatch runs a copy of the script
    record = {
        "id": job,
        "options": options,
        "script": str(script),
        "args": args,
        "submit_dir": os.getcwd(),
        "env": dict(os.environ),
    }
    state.write(job, "job.json", json.dumps(record))
    state.write(job, "state", "PENDING")
    with open(folder / "runner.log", "w") as log:
        runner = subprocess.Popen(
            [sys.executable, __file__, "_job", job],
            env={**os.environ, "FAKE_SLURM_STATE": str(state.root)},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
    state.write(job, "runner_pid", str(runner.pid))
    print(job if options.get("parsable") else f"Submitted batch job {job}")
    return 0


def allocate(state: State, job: str, options: dict) -> list[str]:
    """The job's nodes: --nodelist, else the first idle ones not excluded (waits while too few are idle)."""
    count = int(options.get("nodes", 1))
    exclude = set(expand(options["exclude"])) if "exclude" in options else set()
    while True:
        busy = state.busy_nodes(but=job)
        if "nodelist" in options:
            wanted = expand(options["nodelist"])
            if not busy & set(wanted):
                return wanted
        else:
            idle = [n for n in state.cluster["nodes"] if n not in busy and n not in exclude]
            if len(idle) >= count:
                return idle[:count]
        time.sleep(0.2)


def batch_env(job: dict, nodes: list[str], restarts: int, state: State) -> dict[str, str]:
    """The submission environment plus what sbatch sets in a batch job."""
    o = job["options"]
    env = dict(
        job["env"]
    )  # --export=ALL: SLURM_* input variables of the submission too (SLURM_DISTRIBUTION)
    per_node = int(o["ntasks-per-node"]) if "ntasks-per-node" in o else None
    ntasks = int(o.get("ntasks", (per_node or 1) * len(nodes)))
    cpus = int(o.get("cpus-per-task", 1))
    slurm = {
        "SLURM_JOB_ID": job["id"],
        "SLURM_JOBID": job["id"],
        "SLURM_JOB_NAME": o.get("job-name", Path(job["script"]).name),
        "SLURM_JOB_NODELIST": compress(nodes),
        "SLURM_NODELIST": compress(nodes),
        "SLURM_JOB_NUM_NODES": str(len(nodes)),
        "SLURM_NNODES": str(len(nodes)),
        "SLURM_NTASKS": str(ntasks),
        "SLURM_NPROCS": str(ntasks),
        "SLURM_TASKS_PER_NODE": tasks_per_node([ntasks // len(nodes)] * len(nodes)),
        "SLURM_JOB_CPUS_PER_NODE": tasks_per_node([cpus * (ntasks // len(nodes))] * len(nodes)),
        "SLURM_SUBMIT_DIR": job["submit_dir"],
        "SLURM_SUBMIT_HOST": socket.gethostname(),
        "SLURM_JOB_PARTITION": o.get("partition", "fake"),
        "SLURM_CLUSTER_NAME": "fake",
        "SLURMD_NODENAME": nodes[0],
        "SLURM_NODEID": "0",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_GTIDS": "0",
        "ENVIRONMENT": "BATCH",
    }
    if per_node is not None:
        slurm["SLURM_NTASKS_PER_NODE"] = str(per_node)
    if "cpus-per-task" in o:
        slurm["SLURM_CPUS_PER_TASK"] = str(cpus)
    if "gpus-per-node" in o:
        slurm["SLURM_GPUS_PER_NODE"] = str(o["gpus-per-node"])
        slurm["SLURM_GPUS_ON_NODE"] = str(o["gpus-per-node"]).split(":")[-1]
    if restarts:
        slurm["SLURM_RESTART_COUNT"] = str(restarts)
    env.update(slurm)
    env["FAKE_SLURM_STATE"] = str(state.root)
    return env


def output_path(job: dict, nodes: list[str]) -> Path:
    pattern = str(job["options"].get("output", "slurm-%j.out"))
    name = job["options"].get("job-name", Path(job["script"]).name)
    path = (
        pattern.replace("%%", "\0")
        .replace("%j", job["id"])
        .replace("%x", name)
        .replace("%N", nodes[0])
        .replace("\0", "%")
    )
    return Path(job["submit_dir"]) / path


def run_job(state: State, job_id: str) -> int:
    """The job's life: allocate, run the batch script, and again after each `scontrol requeue`."""
    job = json.loads(state.read(job_id, "job.json"))
    append = job["options"].get("open-mode") == "append"
    restarts = 0
    while True:
        nodes = allocate(state, job_id, job["options"])
        state.write(job_id, "nodes", json.dumps(nodes))
        state.write(job_id, "state", "RUNNING")
        out = output_path(job, nodes)
        out.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with open(out, "a" if append or restarts else "w") as f:
            batch = subprocess.Popen(
                ["bash", str(state.job_dir(job_id) / "slurm_script"), *job["args"]],
                cwd=job["submit_dir"],
                env=batch_env(job, nodes, restarts, state),
                stdin=subprocess.DEVNULL,
                stdout=f,
                stderr=f,
                start_new_session=True,  # the job's process group: every process of the job
            )
            state.write(job_id, "batch_pid", str(batch.pid))
            rc = wait_terminating(state, job_id, batch)
        with open(state.job_dir(job_id) / "runs.jsonl", "a") as f:
            # CPU time of every process of the job, all its runs so far
            used = resource.getrusage(resource.RUSAGE_CHILDREN)
            row = {
                "restart": restarts,
                "exit": rc,
                "nodes": nodes,
                "wall_s": time.monotonic() - started,
                "cpu_s": used.ru_utime + used.ru_stime,
            }
            f.write(json.dumps(row) + "\n")
        if (state.job_dir(job_id) / "requeue").exists():
            (state.job_dir(job_id) / "requeue").unlink()
            (state.job_dir(job_id) / "terminate_at").unlink(missing_ok=True)
            restarts += 1
            state.write(job_id, "state", "PENDING")
            continue
        if (state.job_dir(job_id) / "hold").exists():  # nodes lost: the scheduler has not noticed
            return 0
        state.write(job_id, "state", "COMPLETED" if rc == 0 else "FAILED")
        return 0


def wait_terminating(state: State, job_id: str, batch: subprocess.Popen) -> int:
    """The batch's exit code; once the job is being terminated (`terminate_at`), SIGKILL after KILL_WAIT."""
    while True:
        try:
            return batch.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            pass
        since = state.read(job_id, "terminate_at")
        if since and time.time() - float(since) > KILL_WAIT:
            signal_group(batch.pid, signal.SIGKILL)


def signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        pass


# -- srun ------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def srun(state: State, argv: list[str]) -> int:
    options, command = parse_options(argv, SRUN, "srun")
    job = os.environ.get("SLURM_JOB_ID")
    if not job or not state.job_dir(job).is_dir():
        fail("srun", "the fake srun runs only inside a job of the fake sbatch")
    if not command:
        fail("srun", "no command given")
    env = dict(os.environ)
    allocated = expand(env["SLURM_JOB_NODELIST"])
    nnodes = int(options.get("nodes", env.get("SLURM_NNODES", len(allocated))))
    per_node = options.get("ntasks-per-node", env.get("SLURM_NTASKS_PER_NODE"))
    ntasks = int(
        options.get(
            "ntasks",
            nnodes * int(per_node) if per_node is not None else env.get("SLURM_NTASKS", nnodes),
        )
    )
    per_node = int(per_node) if per_node is not None else -(-ntasks // nnodes)
    if nnodes > len(allocated) or ntasks > nnodes * per_node:
        fail("srun", "Requested node configuration is not available")
    nodes = allocated[:nnodes]
    distribution = str(options.get("distribution", env.get("SLURM_DISTRIBUTION", "block")))
    cyclic = distribution.split(":")[0].split(",")[0] == "cyclic"
    node_of = [(r % nnodes) if cyclic else (r // per_node) for r in range(ntasks)]
    counts = [node_of.count(n) for n in range(nnodes)]
    step = int(state.read(job, "next_step", "0"))
    state.write(job, "next_step", str(step + 1))
    base = {
        "SLURM_STEP_ID": str(step),
        "SLURM_STEPID": str(step),
        "SLURM_NTASKS": str(ntasks),
        "SLURM_NPROCS": str(ntasks),
        "SLURM_STEP_NUM_TASKS": str(ntasks),
        "SLURM_NNODES": str(nnodes),
        "SLURM_STEP_NUM_NODES": str(nnodes),
        "SLURM_NODELIST": compress(nodes),
        "SLURM_STEP_NODELIST": compress(nodes),
        "SLURM_TASKS_PER_NODE": tasks_per_node(counts),
        "SLURM_STEP_TASKS_PER_NODE": tasks_per_node(counts),
        "SLURM_DISTRIBUTION": "cyclic" if cyclic else "block",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    if "ntasks-per-node" in options:
        base["SLURM_NTASKS_PER_NODE"] = str(options["ntasks-per-node"])
    if "cpus-per-task" in options:
        base["SLURM_CPUS_PER_TASK"] = str(options["cpus-per-task"])
    task_env = exported_env(str(options.get("export", "ALL")), env, base)
    gpus = int(env.get("SLURM_GPUS_ON_NODE", "0"))
    shim = state.root / "shim"
    tasks, layout = [], []
    local_seen = [0] * nnodes
    for rank in range(ntasks):
        node = node_of[rank]
        local = local_seen[node]
        local_seen[node] += 1
        mine = {
            **task_env,
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(local),
            "SLURM_NODEID": str(node),
            "SLURMD_NODENAME": nodes[node],
            "SLURM_TOPOLOGY_ADDR": nodes[node],
            "FAKE_SLURM_HOSTNAME": nodes[node],
            "PYTHONPATH": os.pathsep.join(
                x for x in (str(shim), task_env.get("PYTHONPATH", "")) if x
            ),
        }
        if (
            gpus
        ):  # --gpu-bind=none: every GPU of the node; else one per task, as a site default may bind
            bound = options.get("gpu-bind") == "none"
            mine["CUDA_VISIBLE_DEVICES"] = (
                ",".join(map(str, range(gpus))) if bound else str(local % gpus)
            )
        layout.append(
            {
                "rank": rank,
                "local": local,
                "node": node,
                "host": nodes[node],
                "env": {k: v for k, v in mine.items() if k not in env or env[k] != v},
            }
        )
        tasks.append(subprocess.Popen(command, env=mine))
    state.write(job, "tasks", "\n".join(str(t.pid) for t in tasks))
    with open(state.job_dir(job) / "steps.jsonl", "a") as f:
        f.write(json.dumps({"argv": ["srun", *argv], "step": step, "tasks": layout}) + "\n")

    def forward(signum, frame):
        for t in tasks:
            if t.poll() is None:
                t.send_signal(signum)

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
        signal.signal(signum, forward)
    kill_on_bad_exit = options.get("kill-on-bad-exit", env.get("SLURM_KILL_BAD_EXIT", "0"))
    kill_on_bad_exit = kill_on_bad_exit is True or str(kill_on_bad_exit) not in ("0", "")
    terminated_at = None
    while any(t.poll() is None for t in tasks):
        bad = [t for t in tasks if t.returncode not in (None, 0)]
        if bad and kill_on_bad_exit and terminated_at is None:
            rank = tasks.index(bad[0])
            print(
                f"srun: error: task {rank}: Exited with exit code {bad[0].returncode}; "
                f"srun: Terminating StepId={job}.{step}",
                file=sys.stderr,
            )
            terminated_at = time.time()
            forward(signal.SIGTERM, None)
        if terminated_at is not None and time.time() - terminated_at > KILL_WAIT:
            forward(signal.SIGKILL, None)
        time.sleep(0.05)
    codes = [t.returncode if t.returncode >= 0 else 128 - t.returncode for t in tasks]
    with open(state.job_dir(job) / "steps.jsonl", "a") as f:
        f.write(json.dumps({"step": step, "exit": codes}) + "\n")
    return max(codes)


# -- scontrol, squeue, sacct ------------------------------------------------------------------


def scontrol(state: State, argv: list[str]) -> int:
    if argv[:2] == ["show", "hostnames"]:
        nodelist = argv[2] if len(argv) > 2 else os.environ.get("SLURM_JOB_NODELIST", "")
        print("\n".join(expand(nodelist)))
        return 0
    if len(argv) == 2 and argv[0] == "requeue":
        for job in argv[1].split(","):
            if state.state(job) is None:
                fail("scontrol", f"Invalid job id specified for job {job}")
            options = json.loads(state.read(job, "job.json"))["options"]
            if state.state(job) != "RUNNING" or "no-requeue" in options or "requeue" not in options:
                fail("scontrol", f"Requested operation is presently disabled for job {job}")
            state.write(job, "requeue", "1")
            state.write(job, "state", "REQUEUED")
            state.write(job, "terminate_at", str(time.time()))
            # the caller is a task of that job: its scontrol has answered before the job's processes go
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal_group(int(state.read(job, "batch_pid")), signal.SIGTERM)
        return 0
    fail("scontrol", f"the fake knows no 'scontrol {' '.join(argv)}'")


SQUEUE = {
    "noheader": ("h", False),
    "jobs": ("j", True),
    "format": ("o", True),
}
SACCT = {
    "noheader": ("n", False),
    "allocations": ("X", False),
    "jobs": ("j", True),
    "format": ("o", True),
    "parsable2": ("P", False),
}


def squeue(state: State, argv: list[str]) -> int:
    options, rest = parse_options(argv, SQUEUE, "squeue")
    if rest:
        fail("squeue", f"unrecognized argument {rest[0]}")
    fmt = str(options.get("format", "%i %j %T %N"))
    wanted = str(options["jobs"]).split(",") if "jobs" in options else None
    known = [
        j for j in state.jobs() if not (state.job_dir(j) / "forgotten").exists() and state.state(j)
    ]
    if wanted is not None and not set(wanted) & set(known):
        print("slurm_load_jobs error: Invalid job id specified", file=sys.stderr)
        return 1
    lines = [] if options.get("noheader") else [fmt.replace("%", "")]
    for job in known:
        if wanted is None or job in wanted:
            name = json.loads(state.read(job, "job.json"))["options"].get("job-name", "")
            fields = {
                "i": job,
                "j": name,
                "T": state.state(job),
                "N": compress(json.loads(state.read(job, "nodes", "[]"))),
            }
            lines.append(re.sub(r"%\.?\d*([ijTN])", lambda m, f=fields: f[m.group(1)], fmt))
    print("\n".join(lines))
    return 0


def sacct(state: State, argv: list[str]) -> int:
    options, rest = parse_options(argv, SACCT, "sacct")
    if rest:
        fail("sacct", f"unrecognized argument {rest[0]}")
    fields = str(options.get("format", "JobID,JobName,State")).split(",")
    known = {"JobID", "JobName", "State"}
    if not set(fields) <= known:
        fail("sacct", f"the fake knows only the fields {sorted(known)}")
    wanted = str(options["jobs"]).split(",") if "jobs" in options else state.jobs()
    lines = [] if options.get("noheader") else [" ".join(fields)]
    for job in wanted:
        current = state.state(job)
        if current is None:
            continue  # sacct prints nothing for a job it never knew
        name = json.loads(state.read(job, "job.json"))["options"].get("job-name", "")
        values = {
            "JobID": job,
            "JobName": name,
            "State": f"{current} by {os.getuid()}" if current == "CANCELLED" else current,
        }
        lines.append(" ".join(values[f] for f in fields))
    print("\n".join(lines))
    return 0


# -- the test's side: build the cluster, submit, wait, and what SLURM does on its own ------------


class FakeSlurm:
    """A fake cluster of `nodes` nodes with `gpus_per_node` GPUs each, in `root`; its executables in `bin`."""

    def __init__(self, root: Path, nodes: int = 4, gpus_per_node: int = 2, first_job: int = 1001):
        self.root = Path(root)
        self.bin = self.root / "bin"
        self.bin.mkdir(parents=True)
        (self.root / "jobs").mkdir()
        (self.root / "shim").mkdir()
        (self.root / "shim/sitecustomize.py").write_text(SITECUSTOMIZE)
        cluster = {"nodes": [f"node{i}" for i in range(nodes)], "gpus_per_node": gpus_per_node}
        (self.root / "cluster.json").write_text(json.dumps(cluster))
        (self.root / "next_job_id").write_text(f"{first_job}\n")
        (self.root / CALLS).touch()
        for name in COMMANDS:
            path = self.bin / name
            path.write_text(
                "#!/bin/sh\n"
                f"FAKE_SLURM_STATE={shlex.quote(str(self.root))} "
                f'exec {shlex.quote(sys.executable)} {shlex.quote(__file__)} {name} "$@"\n'
            )
            path.chmod(0o755)
        self.state = State(self.root)

    def env(self, base: dict[str, str]) -> dict[str, str]:
        """`base` with the fakes first on PATH."""
        return {**base, "PATH": f"{self.bin}{os.pathsep}{base.get('PATH', os.defpath)}"}

    def sbatch(self, args: list[str], env: dict[str, str], cwd: Path) -> str:
        """`sbatch ARGS` as a user types it; returns the job id."""
        proc = subprocess.run(
            ["sbatch", *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.split()[-1]

    def wait(self, job: str, timeout: float = 300) -> str:
        """Wait until the job has ended (its runner is gone); returns its final state."""
        pid = int(self.state.read(job, "runner_pid"))
        deadline = time.monotonic() + timeout
        while runner_alive(pid):
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job} still runs after {timeout} s: {self.output(job)}")
            time.sleep(0.1)
        return self.state.state(job)

    def runs(self, job: str) -> list[dict]:
        """Each run of the batch script (a requeued job runs again): restart count, exit code, nodes."""
        path = self.state.job_dir(job) / "runs.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    def steps(self, job: str) -> list[dict]:
        """Each srun step started: its argv and the tasks' layout (ranks, nodes, the variables they got)."""
        path = self.state.job_dir(job) / "steps.jsonl"
        rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
        return [r for r in rows if "argv" in r]

    def calls(self, name: str | None = None) -> list[dict]:
        rows = [json.loads(x) for x in (self.root / CALLS).read_text().splitlines()]
        return [r for r in rows if name is None or r["argv"][0] == name]

    def output(self, job: str) -> str:
        """The job's output file (stdout and stderr of every run)."""
        record = json.loads(self.state.read(job, "job.json"))
        nodes = json.loads(self.state.read(job, "nodes", '["node0"]'))
        path = output_path(record, nodes)
        return path.read_text() if path.exists() else ""

    def task_pids(self, job: str) -> list[int]:
        return [int(x) for x in (self.state.read(job, "tasks", "") or "").split()]

    def near_time_limit(self, job: str) -> str:
        """What SLURM does --signal=SIG@SECONDS before the time limit: SIG to every task of the job's steps (to the
        batch shell only with the B: prefix). Uses the job's own #SBATCH --signal; returns it."""
        spec = json.loads(self.state.read(job, "job.json"))["options"].get("signal")
        assert spec, f"job {job} asked for no signal before its time limit (#SBATCH --signal)"
        name = str(spec).split("@")[0]
        batch_only = name.startswith("B:")
        signum = getattr(signal, "SIG" + name.removeprefix("B:").removeprefix("SIG"))
        if batch_only:
            os.kill(int(self.state.read(job, "batch_pid")), signum)
        else:
            for pid in self.task_pids(job):
                os.kill(pid, signum)
        return str(spec)

    def lose_nodes(self, job: str) -> None:
        """The job's nodes are lost under it: SIGKILL to every task, the nodes down; the scheduler has not noticed
        yet, so squeue and sacct still say RUNNING until `end`."""
        self.state.write(job, "hold", "1")
        nodes = json.loads(self.state.read(job, "nodes"))
        down = json.loads(self.state.read_root("down_nodes", "[]"))
        (self.root / "down_nodes").write_text(json.dumps(sorted(set(down) | set(nodes))))
        for pid in self.task_pids(job):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def end(self, job: str, state: str, forget: bool = False) -> None:
        """The scheduler records the job as ended in `state`; with `forget`, squeue no longer knows it."""
        self.state.write(job, "state", state)
        if forget:
            self.state.write(job, "forgotten", "1")

    def shutdown(self) -> None:
        """Kill whatever of the cluster's jobs still runs (a failed test leaves no trainer behind)."""
        for job in self.state.jobs():
            for name in ("runner_pid", "batch_pid"):
                pid = self.state.read(job, name)
                if pid:
                    signal_group(int(pid), signal.SIGKILL)


def runner_alive(pid: int) -> bool:
    """Whether the job runner `pid` (a child of sbatch, reparented) still runs: not gone and not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def main(argv: list[str]) -> int:
    state = State(os.environ["FAKE_SLURM_STATE"])
    command, args = argv[0], argv[1:]
    if command == "_job":
        return run_job(state, args[0])
    state.record([command, *args])
    return {"sbatch": sbatch, "srun": srun, "scontrol": scontrol, "squeue": squeue, "sacct": sacct}[
        command
    ](state, args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

#!/bin/bash
# Sourced by every slurm/*.sh from the repository root: the environment, the Python to run, the log
# directory, and checks of the paths a job needs. The variables every script shares:
#   POSFREQ_SETUP  one shell line run first, e.g. "module load cuda/12.4; source ~/venvs/posfreq/bin/activate"
#                  (run with `set +u`: site module and conda scripts read unset variables)
#   PYTHON         the project's Python (default: .venv/bin/python when it exists, else python)
#   DATA_DIR       token shards (written by `posfreq prepare`, read by the trainer)
#   OUT_DIR        the job's output directory
#   SLIMPAJAMA_DIR the raw SlimPajama-627B copy (train/chunk1..chunk10/*.jsonl.zst)
#   DRY_RUN=1      print each sbatch / srun / python command instead of running it; the variables the
#                  job would export (TRITON_CACHE_DIR, OMP_NUM_THREADS) go to stderr
# Inside a job, TRITON_CACHE_DIR defaults to a node-local folder, $SLURM_TMPDIR (else $TMPDIR, else
# /tmp)/triton-$USER-$SLURM_JOB_ID, so the ranks do not JIT-compile into one shared home directory.
# CPU cores come from the allocation (SLURM_CPUS_PER_TASK): a script's #SBATCH --cpus-per-task is a
# default that `sbatch -c N` overrides.
# Logs go to logs/ (committed with a .gitkeep, so `sbatch` can open its --output file there).

if [[ -n "${POSFREQ_SETUP:-}" ]]; then
    case $- in *u*) _posfreq_nounset=1 ;; *) _posfreq_nounset=0 ;; esac
    set +u
    eval "$POSFREQ_SETUP"
    if [[ "$_posfreq_nounset" == 1 ]]; then set -u; fi
    unset _posfreq_nounset
fi
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python; fi
fi
export PYTHON
mkdir -p logs

if [[ -n "${SLURM_JOB_ID:-}" && -z "${TRITON_CACHE_DIR:-}" ]]; then
    TRITON_CACHE_DIR="${SLURM_TMPDIR:-${TMPDIR:-/tmp}}/triton-${USER:-$(id -un)}-${SLURM_JOB_ID}"
fi
if [[ -n "${TRITON_CACHE_DIR:-}" ]]; then
    export TRITON_CACHE_DIR
    # This node's; triton creates it on the others (srun passes the variable on).
    if [[ "${DRY_RUN:-0}" != "1" ]]; then mkdir -p "$TRITON_CACHE_DIR"; fi
fi

# cpus_per_task: the CPU cores of one task. In a job, the allocation's (SLURM_CPUS_PER_TASK, from
# #SBATCH --cpus-per-task or `sbatch -c N`; empty when the allocation names none); outside one (a dry
# run on a login node), the #SBATCH --cpus-per-task default of the script, as a job would get it.
cpus_per_task() {
    if [[ -n "${SLURM_CPUS_PER_TASK:-}" ]]; then
        echo "$SLURM_CPUS_PER_TASK"
    elif [[ -z "${SLURM_JOB_ID:-}" ]]; then
        local line re='^#SBATCH[[:space:]]+(--cpus-per-task[=[:space:]]+|-c[[:space:]]*)([0-9]+)'
        [[ -r "$0" ]] || return 0
        while IFS= read -r line; do
            if [[ "$line" =~ $re ]]; then
                echo "${BASH_REMATCH[2]}"
                return 0
            fi
        done < "$0"
    fi
    return 0
}

# print_cmd CMD...: CMD shell-quoted on one line of stdout (what a dry run shows).
print_cmd() {
    printf '%q ' "$@"
    printf '\n'
}

# exec_or_print CMD...: exec CMD; under DRY_RUN=1 print it (and the variables the job exports, on stderr)
# and exit 0 instead.
exec_or_print() {
    if [[ "${DRY_RUN:-0}" == "1" ]]; then
        local name
        for name in TRITON_CACHE_DIR OMP_NUM_THREADS; do
            if [[ -n "${!name:-}" ]]; then printf 'dry run: %s=%q\n' "$name" "${!name}" >&2; fi
        done
        print_cmd "$@"
        exit 0
    fi
    exec "$@"
}

# require_path NAME: the path in variable NAME must be set, not a /path/to placeholder, and exist.
# A dry run warns on stderr and goes on; a real run stops before anything is submitted or started.
require_path() {
    local name=$1
    local value=${!name:-}
    local problem=""
    if [[ -z "$value" ]]; then
        problem="is not set"
    elif [[ "$value" == /path/to/* ]]; then
        problem="is the placeholder $value"
    elif [[ ! -e "$value" ]]; then
        problem="=$value does not exist"
    fi
    [[ -z "$problem" ]] && return 0
    if [[ "${DRY_RUN:-0}" == "1" ]]; then
        echo "warning: $name $problem; export $name=... before submitting" >&2
    else
        echo "error: $name $problem. Fix: export $name=... (see the header of $0)" >&2
        exit 1
    fi
}

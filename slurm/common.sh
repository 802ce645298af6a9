#!/bin/bash
# Sourced by every slurm/*.sh from the repository root: the environment, the Python to run, the log
# directory, and checks of the paths a job needs. The variables every script shares:
#   POSFREQ_SETUP  one shell line run first, e.g. "module load cuda/12.4; source ~/venvs/posfreq/bin/activate"
#   PYTHON         the project's Python (default: .venv/bin/python when it exists, else python)
#   DATA_DIR       token shards (written by `posfreq prepare`, read by the trainer)
#   OUT_DIR        the job's output directory
#   SLIMPAJAMA_DIR the raw SlimPajama-627B copy (train/chunk1..chunk10/*.jsonl.zst)
# Logs go to logs/ (committed with a .gitkeep, so `sbatch` can open its --output file there).

if [[ -n "${POSFREQ_SETUP:-}" ]]; then
    eval "$POSFREQ_SETUP"
fi
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python; fi
fi
export PYTHON
mkdir -p logs

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

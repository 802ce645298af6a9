#!/bin/bash
# The CPU merge after slurm/probe.sh's array: the run tables and figures of RUN_DIR (effective_length.csv,
# position_frequency.csv, Fig. 2a/2b) from the probe records the array wrote. slurm/probe.sh submits it with
# --dependency=afterany on the array; by hand: sbatch slurm/probe_merge.sh RUN_DIR [the array's probe options].
# DRY_RUN=1 bash slurm/probe_merge.sh RUN_DIR prints the command instead of running it.
#SBATCH --job-name=posfreq-probe-merge
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=2
#SBATCH --mem=16G
#SBATCH --time=01:00:00
#SBATCH --output=logs/%x_%j.out
##SBATCH --account=YOUR_ACCOUNT
##SBATCH --partition=YOUR_CPU_PARTITION

set -euo pipefail

if [[ $# -lt 1 ]]; then
    echo "usage: sbatch slurm/probe_merge.sh RUN_DIR [analysis/probe.py options, as given to the array]" >&2
    exit 2
fi
RUN_DIR="$1"
shift
if [[ -n "${SLURM_JOB_ID:-}" ]]; then
    cd "${SLURM_SUBMIT_DIR:-.}"
fi
# shellcheck source=slurm/common.sh
source slurm/common.sh

exec_or_print "$PYTHON" analysis/probe.py --run "$RUN_DIR" --merge-only --quiet "$@"

#!/bin/bash
# NIAH probe of every milestone checkpoint of a training run: a SLURM job array (one GPU per task;
# task i of n probes checkpoints i, i+n, ...) plus a merge job that writes the run tables and
# figures (effective_length.csv, position_frequency.csv, Fig. 2a/2b) once the array has finished.
# Everything is resumable: resubmitting skips checkpoints and lengths already probed with the
# same settings, so after a failure (or when training has written new checkpoints) just rerun.
#
#   bash slurm/probe.sh RUN_DIR [probe options]      # from the repository root: submits the array
#                                                    # (one task per checkpoint) and the merge
#   bash slurm/probe.sh runs/L2048 --positions string --tests-per-length 500
#   DRY_RUN=1 bash slurm/probe.sh RUN_DIR            # print the sbatch commands, submit nothing
#
# Probe options are those of analysis/probe.py (--lengths, --tests-per-length, --batch-size,
# --threshold, --positions, --position-options.KEY, --haystack, --seed, --out, ...); they are passed to
# every task and to the merge, which must see the same settings. Edit the #SBATCH lines (account,
# partition) for your cluster, or export MAX_TASKS to cap the array size (default: one task per
# checkpoint). The merge is slurm/probe_merge.sh, a CPU job (no GPU request at all: some GPU partitions
# refuse a zero GPU request); MERGE_PARTITION names a CPU partition for it. PYTHON and POSFREQ_SETUP as in
# slurm/common.sh. Logs: logs/posfreq-probe_<array id>_<task>.out and logs/posfreq-probe-merge_<id>.out.
#SBATCH --job-name=posfreq-probe
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --gpus=1
#SBATCH --cpus-per-task=8
#SBATCH --mem=64G
#SBATCH --time=24:00:00
#SBATCH --output=logs/%x_%A_%a.out
##SBATCH --account=YOUR_ACCOUNT
##SBATCH --partition=YOUR_GPU_PARTITION

set -euo pipefail

if [[ $# -lt 1 ]]; then
    echo "usage: bash slurm/probe.sh RUN_DIR [analysis/probe.py options]" >&2
    exit 2
fi
RUN_DIR="$1"
shift

if [[ -n "${SLURM_JOB_ID:-}" ]]; then
    cd "${SLURM_SUBMIT_DIR:-.}"
fi
# shellcheck source=slurm/common.sh
source slurm/common.sh

if [[ "${PROBE_STEP:-submit}" == "task" ]]; then
    exec_or_print "$PYTHON" analysis/probe.py --run "$RUN_DIR" --quiet \
        --shard "${SLURM_ARRAY_TASK_ID}/${SLURM_ARRAY_TASK_COUNT}" "$@"
fi

# Submit: one array task per complete milestone checkpoint (never a *.tmp directory).
require_path RUN_DIR
shopt -s nullglob
checkpoints=()
for dir in "$RUN_DIR"/checkpoints/tokens-*/; do
    [[ "$dir" == *.tmp/ ]] || checkpoints+=("$dir")
done
count=${#checkpoints[@]}
if [[ "$count" -eq 0 ]]; then
    echo "error: no checkpoints under $RUN_DIR/checkpoints/tokens-*/" >&2
    exit 1
fi
tasks=$(( count < ${MAX_TASKS:-$count} ? count : ${MAX_TASKS:-$count} ))

array=(sbatch --parsable --array="0-$((tasks - 1))" --export="ALL,PROBE_STEP=task" "$0" "$RUN_DIR" "$@")
merge=(sbatch --parsable ${MERGE_PARTITION:+--partition="$MERGE_PARTITION"} slurm/probe_merge.sh "$RUN_DIR" "$@")

if [[ "${DRY_RUN:-0}" == "1" ]]; then
    print_cmd "${array[@]}"
    print_cmd "${merge[@]:0:2}" "--dependency=afterany:ARRAY_JOB_ID" "${merge[@]:2}"
    exit 0
fi

array_id=$("${array[@]}")
merge_id=$("${merge[@]:0:2}" --dependency="afterany:${array_id}" "${merge[@]:2}")
echo "submitted probe array ${array_id} (${tasks} tasks, ${count} checkpoints) and merge ${merge_id}"

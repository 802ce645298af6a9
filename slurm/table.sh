#!/bin/bash
# The paper's Table 1 and Table 2 for one model (posfreq table, docs/real_model.md): a SLURM job array with one
# GPU per share of the position schemes, then a dependent job that writes the tables from what the array probed.
# Every scheme's probe and RULER results are kept under OUT_DIR by key, so a rerun (after a failure, a
# preemption, or with more tests) does only what is missing; the final job also runs any share whose task failed.
#
#   bash slurm/table.sh hf:MODEL_DIR [posfreq table options]   # from the repository root: submits both
#   OUT_DIR=runs/table/llama3 bash slurm/table.sh hf:models/llama3 --niah-lengths 4096,8192 --tests 500 \
#       --ruler-lengths 8192
#   DRY_RUN=1 bash slurm/table.sh hf:MODEL_DIR                  # print the sbatch commands, submit nothing
#
# Options are those of `posfreq table` but --model, --shard and --out, which this script sets; every job gets the
# same ones, since they are part of each result's key. TABLE_SHARDS (default 7: one scheme per task with the
# default --schemes) sets the array's size. The final job needs a GPU too: the keys name the device, so it must
# run where the array ran (it loads no model when every result is there). Edit the ##SBATCH account/partition
# lines for your cluster; PYTHON and POSFREQ_SETUP as in slurm/common.sh.
# Logs: logs/posfreq-table_<array id>_<task>.out and logs/posfreq-table_<job id>.out.
#SBATCH --job-name=posfreq-table
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --gpus=1
#SBATCH --cpus-per-task=8
#SBATCH --mem=64G
#SBATCH --time=24:00:00
#SBATCH --output=logs/%x_%A_%a.out
#SBATCH --requeue
##SBATCH --account=YOUR_ACCOUNT
##SBATCH --partition=YOUR_GPU_PARTITION

set -euo pipefail

if [[ $# -lt 1 ]]; then
    echo "usage: bash slurm/table.sh hf:MODEL_DIR|CHECKPOINT [posfreq table options]" >&2
    exit 2
fi
MODEL="$1"
shift

if [[ -n "${SLURM_JOB_ID:-}" ]]; then
    cd "${SLURM_SUBMIT_DIR:-.}"
fi
# shellcheck source=slurm/common.sh
source slurm/common.sh

out=()  # without OUT_DIR, posfreq table's default: runs/table/<model>
if [[ -n "${OUT_DIR:-}" ]]; then out=(--out "$OUT_DIR"); fi
TABLE_SHARDS="${TABLE_SHARDS:-7}"

case "${TABLE_STEP:-submit}" in
    task)
        exec_or_print "$PYTHON" -m posfreq.scripts.cli table --model "$MODEL" \
            --shard "${SLURM_ARRAY_TASK_ID}/${TABLE_SHARDS}" ${out[@]+"${out[@]}"} "$@"
        ;;
    tables)
        exec_or_print "$PYTHON" -m posfreq.scripts.cli table --model "$MODEL" ${out[@]+"${out[@]}"} "$@"
        ;;
esac

# shellcheck disable=SC2034 # read by require_path through its name
MODEL_PATH="${MODEL#hf:}"
require_path MODEL_PATH
array=(sbatch --parsable --array="0-$((TABLE_SHARDS - 1))" --export="ALL,TABLE_STEP=task,TABLE_SHARDS=$TABLE_SHARDS" "$0" "$MODEL" "$@")
tables=(sbatch --parsable --output="logs/%x_%j.out" --export="ALL,TABLE_STEP=tables" "$0" "$MODEL" "$@")

if [[ "${DRY_RUN:-0}" == "1" ]]; then
    print_cmd "${array[@]}"
    print_cmd "${tables[@]:0:2}" "--dependency=afterany:ARRAY_JOB_ID" "${tables[@]:2}"
    exit 0
fi

array_id=$("${array[@]}")
tables_id=$("${tables[@]:0:2}" --dependency="afterany:${array_id}" "${tables[@]:2}")
echo "submitted table array ${array_id} (${TABLE_SHARDS} shares) and tables ${tables_id}"

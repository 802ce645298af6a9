#!/usr/bin/env bash
# Document-length histogram of SlimPajama and f(i) (Eq. 2) as a SLURM job array plus a merge.
#
#   bash slurm/position_freq.sh submit [extra args]   # array of $SHARDS counts, then a dependent merge
#   sbatch --array=0-63 slurm/position_freq.sh count  # the counting array alone
#   sbatch slurm/position_freq.sh merge               # the merge alone (after every shard finished)
#   DRY_RUN=1 SHARDS=4 bash slurm/position_freq.sh submit   # print the sbatch commands, submit nothing
#
# Extra args go to analysis/position_freq.py in both steps, e.g. `--exclude-sources github` (as
# TinyLlama did), `--tokenizer hf:/path/to/tokenizer`, or the merge's `--packing best_fit --seed 1`. Settings come from the environment:
#   SLIMPAJAMA_DIR (required)  the dataset root holding train/chunk1..chunk10/*.jsonl.zst
#   SHARDS=64                   number of array tasks (each counts files i, i+SHARDS, ...)
#   OUT_DIR=runs/position_freq/slimpajama   output directory (partials in $OUT_DIR/shard_<i>)
#   TRAIN_LENS="2048 4096"      training lengths for the merged outputs
#   PYTHON, POSFREQ_SETUP       as in slurm/common.sh (DRY_RUN=1 prints each step's command instead)
# A count task runs one worker per core of its allocation (#SBATCH --cpus-per-task below, or sbatch -c N).
# Logs: logs/posfreq-freq_<array id>_<task>.out.
#SBATCH --job-name=posfreq-freq
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=32
#SBATCH --mem=64G
#SBATCH --time=06:00:00
#SBATCH --output=logs/%x_%A_%a.out

set -euo pipefail

cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
# shellcheck source=slurm/common.sh
source slurm/common.sh
SHARDS=${SHARDS:-64}
OUT_DIR=${OUT_DIR:-runs/position_freq/slimpajama}
TRAIN_LENS=${TRAIN_LENS:-"2048 4096"}
read -r -a train_lens <<< "$TRAIN_LENS"
export SHARDS OUT_DIR TRAIN_LENS

mode=${1:-count}
shift || true

case "$mode" in
  submit)
    require_path SLIMPAJAMA_DIR
    export SLIMPAJAMA_DIR
    array=(sbatch --parsable --array="0-$((SHARDS - 1))" "$0" count "$@")
    merge=(sbatch --parsable "$0" merge "$@")
    if [[ "${DRY_RUN:-0}" == "1" ]]; then
      print_cmd "${array[@]}"
      print_cmd "${merge[@]:0:2}" "--dependency=afterok:ARRAY_JOB_ID" "${merge[@]:2}"
      exit 0
    fi
    array_id=$("${array[@]}")
    merge_id=$("${merge[@]:0:2}" --dependency="afterok:${array_id}" "${merge[@]:2}")
    echo "submitted counting array ${array_id} (${SHARDS} shards) and merge ${merge_id}; outputs in ${OUT_DIR}"
    ;;
  count)
    require_path SLIMPAJAMA_DIR
    : "${SLURM_ARRAY_TASK_ID:?run the count step as a job array: sbatch --array=0-$((SHARDS - 1))}"
    workers="$(cpus_per_task)"
    exec_or_print "$PYTHON" analysis/position_freq.py --corpus slimpajama --data-dir "$SLIMPAJAMA_DIR" \
      --shard "${SLURM_ARRAY_TASK_ID}/${SHARDS}" --workers "${workers:-$(nproc)}" \
      --out "${OUT_DIR}/shard_${SLURM_ARRAY_TASK_ID}" "$@"
    ;;
  merge)
    parts=()
    for ((i = 0; i < SHARDS; i++)); do parts+=("${OUT_DIR}/shard_${i}"); done
    exec_or_print "$PYTHON" analysis/position_freq.py --merge "${parts[@]}" --out "$OUT_DIR" --train-len "${train_lens[@]}" "$@"
    ;;
  *)
    echo "usage: $0 submit|count|merge [extra args for analysis/position_freq.py]" >&2
    exit 2
    ;;
esac

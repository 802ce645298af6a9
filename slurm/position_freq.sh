#!/usr/bin/env bash
# Document-length histogram of SlimPajama and f(i) (Eq. 2) as a SLURM job array plus a merge.
#
#   bash slurm/position_freq.sh submit [extra args]   # array of $SHARDS counts, then a dependent merge
#   sbatch --array=0-63 slurm/position_freq.sh count  # the counting array alone
#   sbatch slurm/position_freq.sh merge               # the merge alone (after every shard finished)
#
# Extra args go to analysis/position_freq.py, e.g. `--exclude-sources github` (as TinyLlama did)
# or `--tokenizer hf:/path/to/tokenizer`. Settings come from the environment:
#   SLIMPAJAMA_DIR (required)  the dataset root holding train/chunk1..chunk10/*.jsonl.zst
#   SHARDS=64                   number of array tasks (each counts files i, i+SHARDS, ...)
#   OUT=runs/position_freq/slimpajama   output directory (partials in $OUT/shard_<i>)
#   TRAIN_LENS="2048 4096"      training lengths for the merged outputs
#   PY=.venv/bin/python         the project's Python
#SBATCH --job-name=posfreq
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=32
#SBATCH --mem=64G
#SBATCH --time=06:00:00
#SBATCH --output=logs/%x_%A_%a.out

set -euo pipefail

cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
SHARDS=${SHARDS:-64}
OUT=${OUT:-runs/position_freq/slimpajama}
TRAIN_LENS=${TRAIN_LENS:-"2048 4096"}
PY=${PY:-.venv/bin/python}
read -r -a train_lens <<< "$TRAIN_LENS"
export SHARDS OUT TRAIN_LENS PY

mode=${1:-count}
shift || true

case "$mode" in
  submit)
    : "${SLIMPAJAMA_DIR:?set SLIMPAJAMA_DIR to the SlimPajama-627B root}"
    export SLIMPAJAMA_DIR
    mkdir -p logs
    array_id=$(sbatch --parsable --array="0-$((SHARDS - 1))" "$0" count "$@")
    merge_id=$(sbatch --parsable --dependency="afterok:${array_id}" "$0" merge)
    echo "submitted counting array ${array_id} (${SHARDS} shards) and merge ${merge_id}; outputs in ${OUT}"
    ;;
  count)
    : "${SLIMPAJAMA_DIR:?set SLIMPAJAMA_DIR to the SlimPajama-627B root}"
    : "${SLURM_ARRAY_TASK_ID:?run the count step as a job array: sbatch --array=0-$((SHARDS - 1))}"
    "$PY" analysis/position_freq.py --corpus slimpajama --data-dir "$SLIMPAJAMA_DIR" \
      --shard "${SLURM_ARRAY_TASK_ID}/${SHARDS}" --workers "${SLURM_CPUS_PER_TASK:-$(nproc)}" \
      --out "${OUT}/shard_${SLURM_ARRAY_TASK_ID}" "$@"
    ;;
  merge)
    parts=()
    for ((i = 0; i < SHARDS; i++)); do parts+=("${OUT}/shard_${i}"); done
    "$PY" analysis/position_freq.py --merge "${parts[@]}" --out "$OUT" --train-len "${train_lens[@]}" "$@"
    ;;
  *)
    echo "usage: $0 submit|count|merge [extra args for analysis/position_freq.py]" >&2
    exit 2
    ;;
esac

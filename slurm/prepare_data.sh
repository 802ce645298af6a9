#!/bin/bash
# Tokenize SlimPajama into token shards as a SLURM job array: task i of n takes input files
# i, i+n, i+2n, ... Each task is restartable file by file (complete shards are skipped), so
# after a failure just resubmit the whole array (finished files cost only a check), or one task
# with the array's size fixed:  NUM_TASKS=64 sbatch --array=7 slurm/prepare_data.sh
#
#   sbatch slurm/prepare_data.sh                      # 64 tasks (see --array below); submit from
#                                                     # the repository root
#   DRY_RUN=1 bash slurm/prepare_data.sh              # print the command instead of running it
#
# Edit these (or export them before sbatch):
#   SLIMPAJAMA_DIR  a copy of cerebras/SlimPajama-627B (holds train/chunk1..chunk10/*.jsonl.zst)
#   DATA_DIR        output directory of token shards (the trainer's --data.dir)
#   TOKENIZER       llama3 (the paper's) or hf:<dir>
#   PYTHON, POSFREQ_SETUP as in slurm/common.sh, and the #SBATCH --account / --partition lines.
# Logs: logs/posfreq-prepare_<array id>_<task>.out.
#SBATCH --job-name=posfreq-prepare
#SBATCH --array=0-63
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=16
#SBATCH --mem=64G
#SBATCH --time=12:00:00
#SBATCH --output=logs/%x_%A_%a.out
##SBATCH --account=YOUR_ACCOUNT
##SBATCH --partition=YOUR_CPU_PARTITION

set -euo pipefail

if [[ -n "${SLURM_JOB_ID:-}" ]]; then
    cd "${SLURM_SUBMIT_DIR:-.}"   # sbatch runs a copy of this script; the repository is where it was submitted
fi
# shellcheck source=slurm/common.sh
source slurm/common.sh

SLIMPAJAMA_DIR="${SLIMPAJAMA_DIR:-/path/to/SlimPajama-627B}"
DATA_DIR="${DATA_DIR:-/path/to/tokens/slimpajama-llama3}"
TOKENIZER="${TOKENIZER:-llama3}"
SPLIT="${SPLIT:-train}"
require_path SLIMPAJAMA_DIR
[[ "$DATA_DIR" == /path/to/* ]] && require_path DATA_DIR  # the output may not exist yet, but not a placeholder

TASK_ID="${SLURM_ARRAY_TASK_ID:-0}"
TASK_COUNT="${NUM_TASKS:-${SLURM_ARRAY_TASK_COUNT:-1}}"
WORKERS="$(cpus_per_task)"  # the allocation's cores (#SBATCH --cpus-per-task below, or sbatch -c N)
WORKERS="${WORKERS:-$(nproc)}"

cmd=("$PYTHON" scripts/prepare_data.py
     --corpus slimpajama --data-dir "$SLIMPAJAMA_DIR" --split "$SPLIT"
     --out "$DATA_DIR" --tokenizer "$TOKENIZER"
     --workers "$WORKERS" --shard "$TASK_ID/$TASK_COUNT")

exec_or_print "${cmd[@]}"

#!/bin/bash
# The body shared by slurm/pretrain_2k.sh and slurm/pretrain_4k.sh: they set the #SBATCH
# headers and the CONFIG / OUT_DIR defaults, then source this file from the repository root.
set -euo pipefail
: "${CONFIG:?set CONFIG (the trainer YAML)}" "${OUT_DIR:?set OUT_DIR (the run directory)}"

DATA_DIR="${DATA_DIR:-/path/to/slimpajama-llama3}"
PYTHON="${PYTHON:-python}"
NODES="${SLURM_NNODES:-2}"
GPUS_PER_NODE="${SLURM_NTASKS_PER_NODE:-8}"

export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"

cmd=(srun --kill-on-bad-exit=1 --ntasks-per-node="$GPUS_PER_NODE"
     "$PYTHON" train/pretrain.py --config "$CONFIG" --data.dir "$DATA_DIR" --out "$OUT_DIR"
     --num-nodes "$NODES" --devices "$GPUS_PER_NODE" --resume auto "$@")

if [[ "${DRY_RUN:-0}" == "1" ]]; then
    printf '%q ' "${cmd[@]}"
    printf '\n'
    exit 0
fi

echo "job ${SLURM_JOB_ID:-none} (restart ${SLURM_RESTART_COUNT:-0}) on ${NODES} nodes x ${GPUS_PER_NODE} GPUs"
exec "${cmd[@]}"

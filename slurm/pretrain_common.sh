#!/bin/bash
# The body shared by slurm/pretrain_2k.sh and slurm/pretrain_4k.sh: they set the #SBATCH
# headers and the CONFIG / OUT_DIR defaults, then source this file from the repository root.
set -euo pipefail
: "${CONFIG:?set CONFIG (the trainer YAML)}" "${OUT_DIR:?set OUT_DIR (the run directory)}"
# shellcheck source=slurm/common.sh
source slurm/common.sh

DATA_DIR="${DATA_DIR:-/path/to/slimpajama-llama3}"
require_path DATA_DIR
NODES="${SLURM_NNODES:-2}"
GPUS_PER_NODE="${SLURM_NTASKS_PER_NODE:-8}"
# CPU cores per rank: the allocation's (#SBATCH --cpus-per-task in pretrain_2k.sh / pretrain_4k.sh is a
# default; `sbatch -c N` overrides it). Empty inside an allocation that names none (salloc without -c):
# srun and torch then keep their own defaults.
CPUS_PER_TASK="$(cpus_per_task)"

# --cpus-per-task again on srun: since Slurm 22.05 srun does not inherit it from sbatch, and each rank
# would get one core while OMP_NUM_THREADS asks for more.
cpus=()
if [[ -n "$CPUS_PER_TASK" ]]; then
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$CPUS_PER_TASK}"
    cpus=(--cpus-per-task="$CPUS_PER_TASK")
fi
# --gpu-bind=none: every task sees the node's GPUs and Lightning takes cuda:SLURM_LOCALID (a site default that
# binds one GPU per task would leave cuda:1-7 out of reach). POSFREQ_SRUN_TASK=1 tells the trainer it runs in
# a task of this srun, which Lightning would not see in an allocation named bash or interactive (salloc).
# --distribution=block: ranks numbered node by node (whatever a site's SLURM_DISTRIBUTION says), which hybrid
# sharding's groups of consecutive ranks take for one node each.
cmd=(srun --kill-on-bad-exit=1 --ntasks-per-node="$GPUS_PER_NODE" --distribution=block --gpu-bind=none
     "--export=ALL,POSFREQ_SRUN_TASK=1" ${cpus[@]+"${cpus[@]}"}
     "$PYTHON" train/pretrain.py --config "$CONFIG" --data.dir "$DATA_DIR" --out "$OUT_DIR"
     --num-nodes "$NODES" --devices "$GPUS_PER_NODE" --resume auto "$@")

if [[ "${DRY_RUN:-0}" != "1" ]]; then
    echo "job ${SLURM_JOB_ID:-none} (restart ${SLURM_RESTART_COUNT:-0}) on ${NODES} nodes x ${GPUS_PER_NODE} GPUs"
fi
exec_or_print "${cmd[@]}"

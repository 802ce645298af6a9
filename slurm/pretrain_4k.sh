#!/bin/bash
# The paper's 4K pretraining run (TinyLlama-1.3B, L = 4096, 1T tokens) on 2 nodes x 8 A100:
#
#   sbatch slurm/pretrain_4k.sh                       # from the repository root
#   sbatch slurm/pretrain_4k.sh --optim.lr 3e-4       # extra arguments go to train/pretrain.py
#   DRY_RUN=1 bash slurm/pretrain_4k.sh               # print the exact srun command, run nothing
#
# Edit for your cluster: the ##SBATCH account/partition lines below (remove one '#'), and export
# (or edit the defaults of) DATA_DIR (token shards from `posfreq prepare`), OUT_DIR (run
# directory: checkpoints/, metrics.jsonl), CONFIG, PYTHON (default .venv/bin/python) and
# POSFREQ_SETUP (one line run first, e.g. "module load cuda; source ~/venvs/posfreq/bin/activate").
# The log is logs/posfreq-4k_<job id>.out.
# CPU cores per rank come from the allocation: the #SBATCH --cpus-per-task below is a default
# (`sbatch -c 16 slurm/pretrain_4k.sh` overrides it) that srun and OMP_NUM_THREADS follow.
# srun starts one task per GPU; Lightning Fabric reads SLURM's variables for the rendezvous.
# 300 s before the time limit SLURM sends SIGUSR1 (the step in flight, a ~18 GB save and its checksums
# need minutes on a shared filesystem): the trainer saves OUT_DIR/checkpoints/latest,
# runs `scontrol requeue`, and exits; the requeued job resumes (--resume auto) by itself.
#SBATCH --job-name=posfreq-4k
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --mem=0
#SBATCH --time=48:00:00
#SBATCH --signal=USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=logs/%x_%j.out
##SBATCH --account=YOUR_ACCOUNT
##SBATCH --partition=YOUR_GPU_PARTITION

set -euo pipefail

CONFIG="${CONFIG:-configs/pretrain_4k.yaml}"
OUT_DIR="${OUT_DIR:-runs/pretrain_4k}"
if [[ -n "${SLURM_JOB_ID:-}" ]]; then
    cd "${SLURM_SUBMIT_DIR:-.}"   # sbatch runs a copy of this script; the repository is where it was submitted
fi
# shellcheck source=slurm/pretrain_common.sh
source slurm/pretrain_common.sh "$@"

#!/bin/bash
# posfreq doctor on one GPU node: run it before the first sbatch of a pretraining (about 5 minutes).
#
#   sbatch slurm/doctor.sh                      # from the repository root
#   DRY_RUN=1 bash slurm/doctor.sh              # print the exact command, run nothing
#
# One task: the doctor starts its tiny pretraining on every GPU of the node itself (Fabric, NCCL),
# checks each attention backend, the probe's model paths and the loss, and writes a table to the
# log (logs/posfreq-doctor_<job id>.out) and OUT_DIR/doctor.json (default runs/doctor; a rerun
# replaces only what an earlier doctor wrote there). Exit code 1 when a check failed.
# Edit the ##SBATCH account/partition lines for your cluster (remove one '#'); POSFREQ_SETUP and
# PYTHON as for every slurm/*.sh (see slurm/common.sh).
#SBATCH --job-name=posfreq-doctor
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --mem=0
#SBATCH --time=00:30:00
#SBATCH --output=logs/%x_%j.out
##SBATCH --account=YOUR_ACCOUNT
##SBATCH --partition=YOUR_GPU_PARTITION

set -euo pipefail

if [[ -n "${SLURM_JOB_ID:-}" ]]; then
    cd "${SLURM_SUBMIT_DIR:-.}"
fi
OUT_DIR="${OUT_DIR:-runs/doctor}"
# shellcheck source=slurm/common.sh
source slurm/common.sh

exec_or_print "$PYTHON" -m posfreq.scripts.commands.doctor --out "$OUT_DIR" --device cuda "$@"

#!/usr/bin/env bash
# Run one gigatron process per Slurm task: the torchrun environment (RANK, WORLD_SIZE,
# LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) from Slurm's SLURM_* variables, then
# the command. Use it when srun starts every process itself (one task per GPU):
#
#   srun --ntasks-per-node=8 examples/slurm/slurm_env.sh python -m gigatron.cli pretrain gpt ...
#
# MASTER_ADDR is the first node of the allocation; MASTER_PORT defaults to 29500 (set it to use
# another one). Without torchrun there are no automatic restarts: use pretrain_gpt.sbatch for
# those.
set -euo pipefail
: "${SLURM_PROCID:?run this under srun (SLURM_PROCID is not set)}"
export RANK="$SLURM_PROCID"
export WORLD_SIZE="${SLURM_NTASKS:?SLURM_NTASKS is not set}"
export LOCAL_RANK="${SLURM_LOCALID:-0}"
export LOCAL_WORLD_SIZE="${SLURM_NTASKS_PER_NODE:-1}"
LOCAL_WORLD_SIZE="${LOCAL_WORLD_SIZE%%(*}"  # "8(x2)" -> 8
export LOCAL_WORLD_SIZE
if [[ -z "${MASTER_ADDR:-}" ]]; then
  # sed reads every line: head would exit early and, under pipefail, scontrol's SIGPIPE
  # would end this script (exit 141)
  MASTER_ADDR="$(scontrol show hostnames "${SLURM_JOB_NODELIST:?SLURM_JOB_NODELIST is not set}" | sed -n 1p)"
fi
export MASTER_ADDR
export MASTER_PORT="${MASTER_PORT:-29500}"
exec "$@"

#!/bin/bash
# All-reduce bus bandwidth across nodes, through torch.distributed + NCCL, as training runs it.
#
# Under Slurm (one task per node; torchrun starts one process per GPU):
#   sbatch --nodes 4 --ntasks-per-node 1 --gpus-per-node 8 scripts/healthcheck_multinode/allreduce.sh
# By hand, on every node:
#   HEAD=node001 NNODES=4 scripts/healthcheck_multinode/allreduce.sh
#
# Rank 0 prints one JSON line (schema dynprof.healthcheck.allreduce) with busbw_gbps and the
# nodes; the exit code is 0 (passed), 2 (wrong sum or below MIN_BUSBW_GBPS), 3 (could not run).
#SBATCH --job-name=dynprof-allreduce
#SBATCH --time=00:10:00

set -u
PYTHON=${PYTHON:-python3}
NNODES=${NNODES:-${SLURM_NNODES:-1}}
NPROC=${NPROC:-$($PYTHON -c 'import torch; print(torch.cuda.device_count())')}
HEAD=${HEAD:-$(scontrol show hostnames "${SLURM_JOB_NODELIST:-$(hostname)}" 2>/dev/null | head -n1)}
HEAD=${HEAD:-$(hostname)}
PORT=${PORT:-29531}
SIZE_MB=${SIZE_MB:-1024}
MIN=${MIN_BUSBW_GBPS:+--min-busbw-gbps $MIN_BUSBW_GBPS}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}

launch=(torchrun --nnodes "$NNODES" --nproc-per-node "$NPROC" --rdzv-backend c10d
        --rdzv-endpoint "$HEAD:$PORT" --rdzv-id "dynprof-allreduce-${SLURM_JOB_ID:-$$}"
        -m healthcheck.allreduce --size-mb "$SIZE_MB" $MIN)
if [ -n "${SLURM_JOB_ID:-}" ] && [ -z "${SLURM_STEP_ID:-}" ]; then
  exec srun --ntasks-per-node 1 "${launch[@]}"
fi
exec "${launch[@]}"

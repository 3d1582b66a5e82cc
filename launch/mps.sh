#!/usr/bin/env bash
# Run a command under the CUDA Multi-Process Service (MPS), so that the colocated LLM judge and the
# actor share each GPU's SMs concurrently (paper §4.3). One daemon per node: wrap the per-node
# command.
#   ROLLPACKER_MPS=1 launch/mps.sh torchrun --nproc_per_node=8 -m rollpacker.run ...
#   srun launch/mps.sh torchrun ... -m rollpacker.run "$@"      # in an sbatch script, with ROLLPACKER_MPS=1 exported
# ROLLPACKER_MPS unset or 0: runs the command as it is. ROLLPACKER_MPS=1: starts
# nvidia-cuda-mps-control -d with its pipe and log directories in a job-local directory
# (ROLLPACKER_MPS_DIR, default $TMPDIR/rollpacker-mps-<job id or pid>-<host>), exports
# CUDA_MPS_PIPE_DIRECTORY and CUDA_MPS_LOG_DIRECTORY so the command's CUDA processes use it, and
# when the command exits, however it exits, stops the daemon and removes the directory. The exit
# status is the command's (143 or 130 after a SIGTERM or SIGINT). SIGUSR1 (Slurm's time-limit warning)
# leaves this shell waiting for the command. Without nvidia-cuda-mps-control it says so and runs without MPS.
# MPS needs the GPUs in the DEFAULT or EXCLUSIVE_PROCESS compute mode (nvidia-smi -q -d COMPUTE).
set -euo pipefail
if [[ $# -eq 0 ]]; then
  echo "usage: [ROLLPACKER_MPS=1] $0 COMMAND [ARGS...]" >&2
  exit 2
fi
if [[ "${ROLLPACKER_MPS:-0}" != 1 ]]; then
  exec "$@"
fi
if ! command -v nvidia-cuda-mps-control >/dev/null; then
  echo "mps.sh: nvidia-cuda-mps-control not found; running without MPS" >&2
  exec "$@"
fi
dir=${ROLLPACKER_MPS_DIR:-${TMPDIR:-/tmp}/rollpacker-mps-${SLURM_JOB_ID:-$$}-$HOSTNAME}
export CUDA_MPS_PIPE_DIRECTORY=$dir/pipe CUDA_MPS_LOG_DIRECTORY=$dir/log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
stop_mps() {
  echo quit | nvidia-cuda-mps-control || echo "mps.sh: could not stop the MPS daemon (logs: $CUDA_MPS_LOG_DIRECTORY)" >&2
  rm -rf "$dir"
}
nvidia-cuda-mps-control -d
trap stop_mps EXIT
trap 'exit 143' TERM
trap 'exit 130' INT
# Slurm's time-limit warning: srun passes it to every process of the step, the command saves and exits.
# Trapped, it waits for the command; untrapped, it would kill this shell, leaving the daemon running and
# ending the step (its other processes killed) while the ranks save.
trap : USR1
echo "mps.sh: MPS daemon started (pipe: $CUDA_MPS_PIPE_DIRECTORY)" >&2
"$@"

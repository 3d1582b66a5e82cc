#!/usr/bin/env bash
# The GPU check in one command, on a machine with one NVIDIA GPU and its own torch and Triton:
#   bash launch/gpu_check.sh [--out DIR] [--stages toy train ...]     (python -m rollpacker.gpu_check --help)
# Our pure-Python dependencies come from pip (pip install -r launch/gpu-check-requirements.txt) or, on a machine
# without a registry, from the wheels in .whl/ (see that file), installed into a private folder first.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -d .whl ]]; then
  site="${TMPDIR:-/tmp}/rollpacker-gpu-check-site"
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" .whl/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
exec python3 -m rollpacker.gpu_check --device cuda "$@"

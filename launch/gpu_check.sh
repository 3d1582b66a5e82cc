#!/usr/bin/env bash
# The GPU check in one command, on a machine with one NVIDIA GPU and its own torch, Triton and transformers
# (docs/gpu-check.md):   bash launch/gpu_check.sh [python -m rollpacker.gpu_check's flags, e.g. --stages engine]
# Our pure-Python dependencies come from the wheels in .whl/ (made by launch/gpu_check_wheels.sh where a registry
# is reached), installed into a private folder. Results (small) go to $OUT when it is set, else runs/gpu_check;
# models and checkpoints to a temporary folder.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-runs/gpu_check}"
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  site="$(mktemp -d "${TMPDIR:-/tmp}/rollpacker-gpu-check-site.XXXXXX")"
  if ! python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl; then
    echo "launch/gpu_check.sh: pip could not install .whl/: unpacking the wheels (pure Python) instead" >&2
    for wheel in .whl/*.whl; do python3 -m zipfile -e "$wheel" "$site"; done
  fi
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "launch/gpu_check.sh: no .whl/ (bash launch/gpu_check_wheels.sh makes it): using what python3 finds" >&2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec python3 -m rollpacker.gpu_check --device cuda --out "$out" "$@"

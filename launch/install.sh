#!/usr/bin/env bash
# Install rollpacker for CPU (the embedded default, tests, benchmarks) into the active Python.
# torch is pinned first: a CPU build on our machines, so nothing later pulls a CUDA build.
# Usage: bash launch/install.sh [extras]      e.g. bash launch/install.sh dev
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".${1:+[$1]}"

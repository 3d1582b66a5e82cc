#!/usr/bin/env bash
# The wheels of launch/gpu-check-requirements.txt, fetched where a registry is reached, for a GPU machine that
# reaches none:   bash launch/gpu_check_wheels.sh [DIR]      (default .whl, git-ignored: carry it to the machine)
# Pure-Python wheels only (they install on any Python 3 there); DIR/COMMIT records the commit they go with,
# which the check reports where the GPU machine has no git.
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${1:-.whl}"
mkdir -p "$dest"
rm -f "$dest"/*.whl  # a changed pin leaves no second version behind
python3 -m pip download -q --no-deps --only-binary=:all: --dest "$dest" -r launch/gpu-check-requirements.txt
for wheel in "$dest"/*.whl; do
  [[ $wheel == *-none-any.whl ]] || { echo "$wheel is not pure Python: pin a version with a py3-none-any wheel" >&2; exit 1; }
done
if ! git describe --always --dirty --abbrev=7 >"$dest/COMMIT" 2>/dev/null; then rm -f "$dest/COMMIT"; fi
ls "$dest"
